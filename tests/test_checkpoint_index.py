"""Hypothesis fuzzing of the index validator (pure, so thousands of cases run in seconds).

Properties, for both format versions (2: xxh3_64 hex strings, 1: crc32 integers):
(1) every well-formed index is accepted; (2) any random edit of any field either raises
CheckpointFormatError (never another exception) or leaves an index that is still safe to read
(checked independently: paths, byte ranges, tiling of the chunks, checksums); (3) each kind of corruption the issue
names (escaping paths, overlapping / missing chunks, absurd sizes or offsets, unknown
version, unknown dtype, a stale self-checksum; unknown checksum algorithm, bad block size,
checksums of the wrong count or form) is always refused.
"""

from __future__ import annotations

import copy
import json
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mesh3d.checkpoint.errors import CheckpointFormatError
from mesh3d.checkpoint.index import FORMAT, SUPPORTED_VERSIONS, encode_index, validate_index
from mesh3d.checkpoint.st_format import ITEMSIZE
from profiles import examples

BLOCK = 512


def _sums_field(doc: dict) -> str:
    return "crc32" if doc["version"] == 1 else "checksums"


def _block_field(doc: dict) -> str:
    return "crc_block_bytes" if doc["version"] == 1 else "checksum_block_bytes"


@st.composite
def indexes(draw) -> dict:
    version = draw(st.sampled_from(SUPPORTED_VERSIONS))
    value = st.integers(0, 2**32 - 1) if version == 1 else st.integers(0, 2**64 - 1).map(lambda v: f"{v:016x}")
    n_files = draw(st.integers(1, 3))
    files = [f"model/r{i:05d}-of-{n_files:05d}.safetensors" for i in range(n_files)]
    cursor = {f: 4096 for f in files}
    tensors = {}
    for t in range(draw(st.integers(1, 4))):
        dtype = draw(st.sampled_from(sorted(ITEMSIZE)))
        shape = draw(st.lists(st.integers(1, 7), min_size=0, max_size=3))
        cuts = sorted(set(draw(st.lists(st.integers(1, shape[0] - 1), max_size=3)))) if shape and shape[0] > 1 else []
        bounds = [0, *cuts, shape[0]] if shape else [None]
        chunks = []
        for lo, hi in zip(bounds, bounds[1:]) if shape else [(0, 1)]:
            cshape = [hi - lo, *shape[1:]] if shape else []
            offsets = [lo] + [0] * (len(shape) - 1) if shape else []
            nbytes = math.prod(cshape) * ITEMSIZE[dtype]
            file = draw(st.sampled_from(files))
            rng = [cursor[file], cursor[file] + nbytes]
            cursor[file] += nbytes
            sums = draw(st.lists(value, min_size=-(-nbytes // BLOCK), max_size=-(-nbytes // BLOCK)))
            chunks.append({"offsets": offsets, "shape": cshape, "file": file, "key": f"t{t}",
                           "data_offsets": rng, "crc32" if version == 1 else "checksums": sums})
        tensors[f"t{t}"] = {"role": "model", "dtype": dtype, "shape": shape, "chunks": chunks}
    doc = {"format": FORMAT, "version": version, "step": draw(st.none() | st.integers(0, 10**6)), "extra": None,
           "world_size": n_files, "mesh": None,
           "files": {f: {"bytes": max(cursor[f], 8), "rank": i} for i, f in enumerate(files)},
           "tensors": tensors, "optimizer": None}
    doc.update({"crc_block_bytes": BLOCK} if version == 1 else {"checksum": "xxh3_64", "checksum_block_bytes": BLOCK})
    return json.loads(encode_index(doc))


def _reseal(doc: dict) -> dict:
    """Recompute the self-checksum so the deeper checks (not just the checksum) see the edit."""
    return json.loads(encode_index({k: v for k, v in doc.items() if k != "index_crc32"}))


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=6,
)


def _paths(node, prefix=()):
    yield prefix
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _paths(v, (*prefix, k))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _paths(v, (*prefix, i))


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _disjoint(a: tuple[list[int], list[int]], b: tuple[list[int], list[int]]) -> bool:
    return any(ao + an <= bo or bo + bn <= ao for ao, an, bo, bn in zip(a[0], a[1], b[0], b[1]))


def assert_safe_to_read(doc: dict) -> None:
    """What a reader relies on in an index the validator accepted, checked here independently (by brute force):
    shard paths stay inside the checkpoint, every chunk's bytes lie inside its file and hold exactly its box,
    the boxes tile the tensor, no two chunks share a byte, and there is one well-formed checksum per block."""
    assert doc["format"] == FORMAT and _is_int(doc["version"]) and doc["version"] in SUPPORTED_VERSIONS
    if doc["version"] == 2:
        assert doc["checksum"] == "xxh3_64"
    block = doc[_block_field(doc)]
    assert _is_int(block) and 512 <= block <= 2**30
    assert doc.get("step") is None or _is_int(doc["step"])
    for rel, info in doc["files"].items():
        parts = rel.split("/")
        assert not rel.startswith("/") and not {"", ".", ".."} & set(parts) and rel.endswith(".safetensors"), rel
        assert _is_int(info["bytes"]) and info["bytes"] >= 8
    ranges: dict[str, list[tuple[int, int]]] = {}
    for name, entry in doc["tensors"].items():
        shape, itemsize = entry["shape"], ITEMSIZE[entry["dtype"]]
        assert entry["role"] in ("model", "optimizer") and all(_is_int(n) and n >= 0 for n in shape), name
        boxes = []
        for chunk in entry["chunks"]:
            offsets, cshape = chunk["offsets"], chunk["shape"]
            assert len(offsets) == len(cshape) == len(shape) and all(_is_int(v) for v in offsets + cshape), chunk
            assert all(0 <= o and 0 < n and o + n <= g for o, n, g in zip(offsets, cshape, shape)), chunk
            nbytes = math.prod(cshape) * itemsize
            begin, end = chunk["data_offsets"]
            assert _is_int(begin) and _is_int(end) and 0 <= begin and end - begin == nbytes, chunk
            assert end <= doc["files"][chunk["file"]]["bytes"], chunk
            assert isinstance(chunk["key"], str) and chunk["key"], chunk
            sums = chunk[_sums_field(doc)]
            assert len(sums) == -(-nbytes // block), chunk
            if doc["version"] == 1:
                assert all(_is_int(v) and 0 <= v < 2**32 for v in sums), chunk
            else:
                assert all(isinstance(v, str) and len(v) == 16 and set(v) <= set("0123456789abcdef") for v in sums), chunk
            boxes.append((offsets, cshape))
            ranges.setdefault(chunk["file"], []).append((begin, end))
        assert sum(math.prod(c) for _, c in boxes) == math.prod(shape), name
        assert all(_disjoint(a, b) for i, a in enumerate(boxes) for b in boxes[:i]), name
    for rel, spans in ranges.items():
        assert all(e0 <= b1 or e1 <= b0 for i, (b0, e0) in enumerate(spans) for b1, e1 in spans[:i]), rel


@settings(max_examples=examples(300), deadline=None)
@given(indexes())
def test_well_formed_indexes_are_accepted(doc):
    assert validate_index(doc) is doc
    assert_safe_to_read(doc)


@settings(max_examples=examples(1000), deadline=None)
@given(indexes(), st.data())
def test_random_edits_are_refused_or_leave_an_index_safe_to_read(doc, data):
    """Any edit of any field: CheckpointFormatError (never another exception), or an index a reader can follow."""
    paths = [p for p in _paths(doc) if p and p[0] != "index_crc32"]
    path = data.draw(st.sampled_from(paths))
    value = data.draw(json_values)
    node = doc
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    try:
        accepted = validate_index(_reseal(doc))
    except CheckpointFormatError:
        return
    assert_safe_to_read(accepted)


def _first_chunk(doc):
    return next(iter(doc["tensors"].values()))["chunks"][0]


def _first_sums(doc):
    return _first_chunk(doc)[_sums_field(doc)]


def _bad_value(doc, v, kind):
    """A checksum of the right type for the other version, or of a wrong form for this one."""
    if doc["version"] == 1:
        return {"short": 2**32 + v, "non-hex": f"{v:08x}", "upper": -1 - v, "int": float(v)}[kind]
    return {"short": f"{v:015x}", "non-hex": f"{v:015x}g", "upper": f"{0xA000000000000000 + v:016X}", "int": v}[kind]


CORRUPTIONS = {
    "escaping path": lambda d, v: d["files"].update({f"../{v}.safetensors": {"bytes": 10}}),
    "absolute path": lambda d, v: _first_chunk(d).update(file=f"/etc/{v}.safetensors"),
    "dotdot component": lambda d, v: d["files"].update({f"model/../../{v}.safetensors": {"bytes": 10}}),
    "missing chunk": lambda d, v: next(iter(d["tensors"].values()))["chunks"].pop(),
    "duplicated chunk": lambda d, v: next(iter(d["tensors"].values()))["chunks"].append(copy.deepcopy(_first_chunk(d))),
    "absurd offset": lambda d, v: _first_chunk(d)["offsets"].__setitem__(0, 2**60 + v) if _first_chunk(d)["offsets"]
    else d["tensors"].clear() or d.update(version=99),
    "absurd byte range": lambda d, v: _first_chunk(d).update(data_offsets=[2**59 + v, 2**59 + v + 1]),
    "absurd shape": lambda d, v: next(iter(d["tensors"].values())).update(shape=[2**49 + v]),
    "unknown version": lambda d, v: d.update(version=max(SUPPORTED_VERSIONS) + 1 + v),
    "version as a bool or float": lambda d, v: d.update(version=[True, 2.0, "2", None][v % 4]),
    "other version's fields": lambda d, v: d.update(version=3 - d["version"]),
    "unknown dtype": lambda d, v: next(iter(d["tensors"].values())).update(dtype=f"F{v + 100}"),
    "file too short": lambda d, v: [f.update(bytes=8) for f in d["files"].values()],
    "wrong checksum count": lambda d, v: _first_sums(d).extend(_first_sums(d)[:1] * (1 + v % 2)),
    "missing a checksum": lambda d, v: _first_sums(d).pop(),
    "no checksum list": lambda d, v: _first_chunk(d).pop(_sums_field(d)),
    "short checksum": lambda d, v: _first_sums(d).__setitem__(0, _bad_value(d, v, "short")),
    "non-hex checksum": lambda d, v: _first_sums(d).__setitem__(-1, _bad_value(d, v, "non-hex")),
    "uppercase or negative checksum": lambda d, v: _first_sums(d).__setitem__(0, _bad_value(d, v, "upper")),
    "checksum of the wrong type": lambda d, v: _first_sums(d).__setitem__(0, _bad_value(d, v, "int")),
    "unknown checksum algorithm": lambda d, v: d.update(checksum=["crc32", "xxh3_128", "XXH3_64", None][v % 4])
    if d["version"] == 2 else d.update(version=2),
    "block size out of range": lambda d, v: d.update({_block_field(d): [511, 2**30 + 1, 0, -v, True, "512"][v % 6]}),
    "no block size": lambda d, v: d.pop(_block_field(d)),
}


@settings(max_examples=examples(1000), deadline=None)
@given(indexes(), st.sampled_from(sorted(CORRUPTIONS)), st.integers(0, 1000), st.booleans())
def test_corruptions_are_always_refused(doc, kind, value, reseal):
    CORRUPTIONS[kind](doc, value)
    # Unsealed, the self-checksum alone must catch it; resealed, the structural checks must.
    with pytest.raises(CheckpointFormatError):
        validate_index(_reseal(doc) if reseal else doc)


@settings(max_examples=examples(300), deadline=None)
@given(indexes(), st.sampled_from(sorted(CORRUPTIONS)), st.integers(0, 1000))
def test_the_independent_check_sees_every_corruption_too(doc, kind, value):
    """assert_safe_to_read is no rubber stamp: each corruption, resealed, fails it (a missing field as a KeyError)."""
    CORRUPTIONS[kind](doc, value)
    with pytest.raises((AssertionError, KeyError, TypeError)):
        assert_safe_to_read(_reseal(doc))


def test_error_messages_say_what_and_where():
    doc = {"format": FORMAT, "version": 7}
    with pytest.raises(CheckpointFormatError, match=r"unknown format version 7 \(written by a newer mesh3d\?\); "
                       r"this mesh3d reads versions 1 \(crc32 block checksums\) and 2 \(xxh3_64 block checksums\)"):
        validate_index(doc)
    with pytest.raises(CheckpointFormatError, match="must be a JSON object"):
        validate_index([1, 2])
    # A version-2 index with one tensor of 4 float64 (32 bytes: one block).
    chunk = {"offsets": [0], "shape": [4], "file": "model/r0.safetensors", "key": "w", "data_offsets": [4096, 4128],
             "checksums": ["0123456789abcdef"]}
    good = {"format": FORMAT, "version": 2, "checksum": "xxh3_64", "checksum_block_bytes": 512, "step": None,
            "files": {"model/r0.safetensors": {"bytes": 4128}},
            "tensors": {"w": {"role": "model", "dtype": "F64", "shape": [4], "chunks": [chunk]}}}
    assert validate_index(_reseal(good))

    def refused(edit, match):
        doc = copy.deepcopy(good)
        edit(doc)
        with pytest.raises(CheckpointFormatError, match=match):
            validate_index(_reseal(doc))

    refused(lambda d: d.update(checksum="crc32"), r"checksum: unknown block checksum algorithm 'crc32'; version 2 knows xxh3_64")
    refused(lambda d: d.update(checksum_block_bytes=100), r"checksum_block_bytes: must be an integer in \[512, 2\*\*30\], got 100")
    first = lambda d: d["tensors"]["w"]["chunks"][0]  # noqa: E731
    refused(lambda d: first(d)["checksums"].append("0123456789abcdef"),
            r"tensor 'w' chunk 0: 'checksums' must have 1 entries \(one per 512-byte block of the chunk's 32 bytes\), got 2")
    refused(lambda d: first(d).update(checksums=["0123456789ABCDEF"]),
            r"tensor 'w' chunk 0: checksums\[0\] must be a 64-bit xxh3_64 value written as 16 lowercase hex digits, "
            r"got '0123456789ABCDEF'")
    refused(lambda d: first(d).update(checksums=[81985529216486895]), r"checksums\[0\] must be a 64-bit xxh3_64 value")
    refused(lambda d: first(d).pop("checksums"), r"'checksums' must be a list of xxh3_64 values, one per 512-byte block")
    refused(lambda d: d.update(version=1), r"crc_block_bytes: must be an integer in \[512, 2\*\*30\], got None")


def test_a_missing_checkpoint_directory_names_the_checkpoints_beside_it(tmp_path):
    from mesh3d.checkpoint.index import read_index

    for name in ("step-00000002", "step-00000004"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "index.json").write_text("{}")
    (tmp_path / "not-a-checkpoint").mkdir()
    with pytest.raises(CheckpointFormatError) as info:
        read_index(str(tmp_path / "step-00000003"))
    message = str(info.value)
    assert "does not exist" in message and "pass the directory checkpoint.save wrote (it holds index.json)" in message
    assert message.endswith(f"checkpoints in {tmp_path}: step-00000002, step-00000004"), message
