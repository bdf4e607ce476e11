"""Hypothesis fuzzing of the index validator (pure, so thousands of cases run in seconds).

Properties: (1) every well-formed index is accepted; (2) any random edit of any field
either passes or raises CheckpointFormatError, never another exception; (3) each kind of
corruption the issue names (escaping paths, overlapping / missing chunks, absurd sizes or
offsets, unknown version, unknown dtype, a stale self-checksum) is always refused.
"""

from __future__ import annotations

import copy
import json
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mesh3d.checkpoint.errors import CheckpointFormatError
from mesh3d.checkpoint.index import FORMAT, VERSION, encode_index, validate_index
from mesh3d.checkpoint.st_format import ITEMSIZE

BLOCK = 512


@st.composite
def indexes(draw) -> dict:
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
            crcs = draw(st.lists(st.integers(0, 2**32 - 1), min_size=-(-nbytes // BLOCK), max_size=-(-nbytes // BLOCK)))
            chunks.append({"offsets": offsets, "shape": cshape, "file": file, "key": f"t{t}",
                           "data_offsets": rng, "crc32": crcs})
        tensors[f"t{t}"] = {"role": "model", "dtype": dtype, "shape": shape, "chunks": chunks}
    doc = {"format": FORMAT, "version": VERSION, "step": draw(st.none() | st.integers(0, 10**6)), "extra": None,
           "crc_block_bytes": BLOCK, "world_size": n_files, "mesh": None,
           "files": {f: {"bytes": max(cursor[f], 8), "rank": i} for i, f in enumerate(files)},
           "tensors": tensors, "optimizer": None}
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


@settings(max_examples=300, deadline=None)
@given(indexes())
def test_well_formed_indexes_are_accepted(doc):
    assert validate_index(doc) is doc


@settings(max_examples=1000, deadline=None)
@given(indexes(), st.data())
def test_random_edits_pass_or_raise_format_error(doc, data):
    paths = [p for p in _paths(doc) if p and p[0] != "index_crc32"]
    path = data.draw(st.sampled_from(paths))
    value = data.draw(json_values)
    node = doc
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    try:
        validate_index(_reseal(doc))
    except CheckpointFormatError:
        pass


def _first_chunk(doc):
    return next(iter(doc["tensors"].values()))["chunks"][0]


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
    "unknown version": lambda d, v: d.update(version=VERSION + 1 + v),
    "unknown dtype": lambda d, v: next(iter(d["tensors"].values())).update(dtype=f"F{v + 100}"),
    "file too short": lambda d, v: [f.update(bytes=8) for f in d["files"].values()],
    "wrong crc count": lambda d, v: _first_chunk(d)["crc32"].extend([1, 2]),
}


@settings(max_examples=1000, deadline=None)
@given(indexes(), st.sampled_from(sorted(CORRUPTIONS)), st.integers(0, 1000), st.booleans())
def test_corruptions_are_always_refused(doc, kind, value, reseal):
    CORRUPTIONS[kind](doc, value)
    # Unsealed, the self-checksum alone must catch it; resealed, the structural checks must.
    with pytest.raises(CheckpointFormatError):
        validate_index(_reseal(doc) if reseal else doc)


def test_error_messages_say_what_and_where():
    doc = {"format": FORMAT, "version": 7}
    with pytest.raises(CheckpointFormatError, match="unknown format version 7; this mesh3d reads version 1"):
        validate_index(doc)
    with pytest.raises(CheckpointFormatError, match="must be a JSON object"):
        validate_index([1, 2])
