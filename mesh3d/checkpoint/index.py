"""``index.json``: the checkpoint's JSON manifest, its version, and its validator.

The index is the commit marker (written last) and the only thing a reader needs to plan:
every tensor's dtype and global shape, and for each saved chunk its global offsets and
shape, the shard file (a path relative to the checkpoint), the absolute byte range in
that file, and a checksum of each of its fixed-size blocks. Nothing in a checkpoint is pickled.

Block checksums by format version (both are read; ``save`` writes ``VERSION``):

- 2: top-level ``"checksum": "xxh3_64"`` and ``"checksum_block_bytes"``; each chunk has
  ``"checksums"``, one 16-digit lowercase hex string per block (XXH3 64-bit, seed 0).
- 1: top-level ``"crc_block_bytes"``; each chunk has ``"crc32"``, one zlib.crc32 integer per block.

In both, ``index_crc32`` is zlib.crc32 of the canonical JSON of everything else (sorted keys,
no spaces), an integer: the index is a tiny fraction of the data, so the speed of its own
checksum does not matter, and crc32 is in every language's standard library.

Usage::

    index = read_index(path)            # parsed and validated, or CheckpointFormatError
    validate_index(doc)                 # pure: the same checks on an in-memory dict
    algorithm, block, field = checksum_scheme(index)   # how chunk[field][b] checks block b
"""

from __future__ import annotations

import json
import math
import os
import re
import zlib
from typing import Any

from mesh3d.checkpoint.checksum import ALGORITHMS, Algorithm
from mesh3d.checkpoint.errors import CheckpointFormatError
from mesh3d.checkpoint.st_format import ITEMSIZE

__all__ = [
    "FORMAT", "VERSION", "SUPPORTED_VERSIONS", "CHECKSUMS", "INDEX_NAME", "ROLES", "validate_index", "read_index",
    "encode_index", "chunk_numel", "checksum_scheme",
]

FORMAT = "mesh3d-checkpoint"
#: The version ``save`` writes.
VERSION = 2
#: The versions this code reads: 1 (crc32 integers) and 2 (the named algorithm, hex strings).
SUPPORTED_VERSIONS = (1, 2)
#: The block checksum algorithms a version-2 index may name.
CHECKSUMS = ("xxh3_64",)
#: Bounds of the checksum block size, in bytes.
MIN_BLOCK, MAX_BLOCK = 512, 2**30
INDEX_NAME = "index.json"
ROLES = ("model", "optimizer")
#: Sanity bounds: a dimension above 2**48 elements or a tensor above 2**60 bytes is corruption.
MAX_DIM = 2**48
MAX_BYTES = 2**60
_SAFE_PATH = re.compile(r"^[A-Za-z0-9_.-]+(/[A-Za-z0-9_.-]+)*$")
_HEX = re.compile(r"[0-9a-f]*")
_HEX16 = re.compile(r"[0-9a-f]{16}")


def chunk_numel(shape: list[int]) -> int:
    return math.prod(shape)


def checksum_scheme(index: dict[str, Any]) -> tuple[Algorithm, int, str]:
    """(algorithm, block size in bytes, the chunk field listing one checksum per block) of a validated index."""
    if index["version"] == 1:
        return ALGORITHMS["crc32"], index["crc_block_bytes"], "crc32"
    return ALGORITHMS[index["checksum"]], index["checksum_block_bytes"], "checksums"


def _fail(where: str, msg: str) -> CheckpointFormatError:
    return CheckpointFormatError(f"malformed checkpoint index: {where}: {msg}")


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _int_list(value: Any, where: str, length: int | None = None, bound: int = MAX_DIM) -> list[int]:
    if not isinstance(value, list) or not all(_is_int(v) and 0 <= v <= bound for v in value):
        raise _fail(where, f"must be a list of integers in [0, {bound}], got {value!r:.200}")
    if length is not None and len(value) != length:
        raise _fail(where, f"must have {length} entries (the tensor's rank), got {len(value)}")
    return value


def _check_path(rel: Any) -> None:
    """Shard paths are relative, normalized, inside the checkpoint, and end in .safetensors."""
    if not isinstance(rel, str) or not _SAFE_PATH.match(rel) or not rel.endswith(".safetensors"):
        raise _fail(f"file {rel!r:.200}", "shard paths must be relative 'dir/name.safetensors' using [A-Za-z0-9_.-]")
    if any(part in ("", ".", "..") for part in rel.split("/")):
        raise _fail(f"file {rel!r}", "shard paths must not contain '.' or '..' components (they would escape the checkpoint)")


def _canonical(doc: dict[str, Any]) -> bytes:
    body = {k: v for k, v in doc.items() if k != "index_crc32"}
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


def encode_index(doc: dict[str, Any]) -> bytes:
    """Serialize ``doc`` with its ``index_crc32`` self-checksum (so a flipped digit is caught)."""
    doc = dict(doc)
    doc["index_crc32"] = zlib.crc32(_canonical(doc))
    return json.dumps(doc, sort_keys=True, indent=1).encode()


def _check_sums(where: str, sums: Any, nbytes: int, block: int, version: int, algorithm: str) -> None:
    """One checksum per ``block``-byte block of the chunk's ``nbytes`` bytes, each of the version's form."""
    blocks = -(-nbytes // block)
    if version == 1:
        if not isinstance(sums, list) or len(sums) != blocks or not all(_is_int(c) and 0 <= c < 2**32 for c in sums):
            raise _fail(where, f"'crc32' must list one 32-bit checksum per {block}-byte block")
        return
    if not isinstance(sums, list):
        raise _fail(where, f"'checksums' must be a list of {algorithm} values, one per {block}-byte block, "
                           f"got {sums!r:.100}")
    if len(sums) != blocks:
        raise _fail(where, f"'checksums' must have {blocks} entries (one per {block}-byte block of the chunk's "
                           f"{nbytes} bytes), got {len(sums)}")
    if not (all(isinstance(c, str) and len(c) == 16 for c in sums) and _HEX.fullmatch("".join(sums))):
        bad = next(i for i, c in enumerate(sums) if not (isinstance(c, str) and _HEX16.fullmatch(c)))
        raise _fail(where, f"checksums[{bad}] must be a 64-bit {algorithm} value written as 16 lowercase hex digits, "
                           f"got {sums[bad]!r:.100}")


def _check_chunks(name: str, entry: dict[str, Any], files: dict[str, Any], block: int, version: int,
                  algorithm: str) -> None:
    shape, itemsize = entry["shape"], ITEMSIZE[entry["dtype"]]
    chunks = entry.get("chunks")
    if not isinstance(chunks, list):
        raise _fail(f"tensor {name!r}", "'chunks' must be a list")
    total = 0
    boxes: list[tuple[list[int], list[int]]] = []
    for i, chunk in enumerate(chunks):
        where = f"tensor {name!r} chunk {i}"
        if not isinstance(chunk, dict):
            raise _fail(where, "must be an object")
        offsets = _int_list(chunk.get("offsets"), f"{where} offsets", len(shape))
        cshape = _int_list(chunk.get("shape"), f"{where} shape", len(shape))
        for d, (o, n, g) in enumerate(zip(offsets, cshape, shape)):
            if o + n > g:
                raise _fail(where, f"offset {o} + size {n} exceeds the global size {g} of dim {d}")
        numel = chunk_numel(cshape)
        if numel == 0:
            raise _fail(where, "empty chunks are never written; this one has a zero-size shape")
        rel = chunk.get("file")
        if not isinstance(rel, str) or rel not in files:
            raise _fail(where, f"names file {rel!r:.200} which is not listed in 'files'")
        key = chunk.get("key")
        if not isinstance(key, str) or not key:
            raise _fail(where, "'key' must be the tensor's non-empty name inside the shard file")
        rng = _int_list(chunk.get("data_offsets"), f"{where} data_offsets", 2, MAX_BYTES)
        if rng[1] - rng[0] != numel * itemsize:
            raise _fail(where, f"byte range {rng} holds {rng[1] - rng[0]} bytes; shape {cshape} of {entry['dtype']} needs {numel * itemsize}")
        if rng[1] > files[rel]["bytes"]:
            raise _fail(where, f"byte range {rng} runs past the end of {rel} ({files[rel]['bytes']} bytes)")
        _check_sums(where, chunk.get("crc32" if version == 1 else "checksums"), numel * itemsize, block, version,
                    algorithm)
        total += numel
        boxes.append((offsets, cshape))
    if total != chunk_numel(shape):
        raise _fail(f"tensor {name!r}", f"chunks hold {total} elements but shape {shape} has {chunk_numel(shape)} (missing or duplicated data)")
    _check_no_overlap(name, boxes)


def _check_no_overlap(name: str, boxes: list[tuple[list[int], list[int]]]) -> None:
    """Chunks must be disjoint; with the volume check above that means exact coverage.

    Sort-and-sweep on dim 0 keeps this near-linear for the usual dim-0 sharding.
    """
    if len(boxes) < 2 or not boxes[0][0]:
        if len(boxes) > 1:
            raise _fail(f"tensor {name!r}", "a 0-dim tensor must have exactly one chunk")
        return
    order = sorted(boxes, key=lambda b: b[0][0])
    active: list[tuple[list[int], list[int]]] = []
    for off, shp in order:
        active = [a for a in active if a[0][0] + a[1][0] > off[0]]
        for a_off, a_shp in active:
            if all(ao < o + s and o < ao + as_ for ao, as_, o, s in zip(a_off, a_shp, off, shp)):
                raise _fail(f"tensor {name!r}", f"chunks at offsets {a_off} and {off} overlap")
        active.append((off, shp))


def _check_file_ranges(tensors: dict[str, Any]) -> None:
    """Byte ranges of different chunks in one file must not overlap (one byte, one element)."""
    per_file: dict[str, list[tuple[int, int, str]]] = {}
    for name, entry in tensors.items():
        for chunk in entry["chunks"]:
            b, e = chunk["data_offsets"]
            per_file.setdefault(chunk["file"], []).append((b, e, name))
    for rel, ranges in per_file.items():
        ranges.sort()
        for (b0, e0, n0), (b1, e1, n1) in zip(ranges, ranges[1:]):
            if b1 < e0:
                raise _fail(f"file {rel}", f"byte ranges of {n0!r} {[b0, e0]} and {n1!r} {[b1, e1]} overlap")


def validate_index(doc: Any) -> dict[str, Any]:
    """Check every field of a parsed index; return it, or raise :class:`CheckpointFormatError`.

    Usage: ``checkpoint.validate_index(json.loads(text))``

    Pure and collective-free, so every rank can run it before any communication.
    """
    if not isinstance(doc, dict):
        raise _fail("top level", "must be a JSON object")
    if doc.get("format") != FORMAT:
        raise _fail("format", f"expected {FORMAT!r}, got {doc.get('format')!r:.100}")
    version = doc.get("version")
    if not _is_int(version) or version not in SUPPORTED_VERSIONS:
        newer = " (written by a newer mesh3d?)" if _is_int(version) and version > max(SUPPORTED_VERSIONS) else ""
        raise _fail("version", f"unknown format version {version!r:.100}{newer}; this mesh3d reads versions "
                               f"1 (crc32 block checksums) and 2 (xxh3_64 block checksums)")
    if doc.get("index_crc32") != zlib.crc32(_canonical(doc)):
        raise _fail("index_crc32", "the index's own checksum does not match its content (the file was altered)")
    algorithm, block_field = "crc32", "crc_block_bytes"
    if version >= 2:
        algorithm, block_field = doc.get("checksum"), "checksum_block_bytes"
        if algorithm is None:
            raise _fail("checksum", f"missing: a version-{version} index names its block checksum algorithm "
                                    f"(one of: {', '.join(CHECKSUMS)})")
        if not isinstance(algorithm, str) or algorithm not in CHECKSUMS:
            raise _fail("checksum", f"unknown block checksum algorithm {algorithm!r:.100}; "
                                    f"version {version} knows {', '.join(CHECKSUMS)}")
    block = doc.get(block_field)
    if not _is_int(block) or not MIN_BLOCK <= block <= MAX_BLOCK:
        raise _fail(block_field, f"must be an integer in [{MIN_BLOCK}, 2**30], got {block!r:.100}")
    if doc.get("step") is not None and not _is_int(doc.get("step")):
        raise _fail("step", f"must be an integer or null, got {doc.get('step')!r:.100}")
    if doc.get("data") is not None and not isinstance(doc.get("data"), dict):
        raise _fail("data", f"must be a JSON object (a data loader's state) or null, got {doc.get('data')!r:.100}")
    files = doc.get("files")
    if not isinstance(files, dict):
        raise _fail("files", "must be an object mapping relative paths to {bytes}")
    for rel, info in files.items():
        _check_path(rel)
        if not isinstance(info, dict) or not _is_int(info.get("bytes")) or not 8 <= info["bytes"] <= MAX_BYTES:
            raise _fail(f"file {rel}", f"'bytes' must be an integer in [8, 2**60], got {info!r:.100}")
    tensors = doc.get("tensors")
    if not isinstance(tensors, dict):
        raise _fail("tensors", "must be an object mapping tensor names to entries")
    for name, entry in tensors.items():
        where = f"tensor {name!r:.200}"
        if not isinstance(entry, dict):
            raise _fail(where, "must be an object")
        if entry.get("role") not in ROLES:
            raise _fail(where, f"role must be one of {ROLES}, got {entry.get('role')!r:.100}")
        if entry["role"] == "optimizer" and not (isinstance(entry.get("param"), str) and isinstance(entry.get("state_key"), str)):
            raise _fail(where, "optimizer tensors need string 'param' and 'state_key'")
        if not isinstance(entry.get("dtype"), str) or entry["dtype"] not in ITEMSIZE:
            raise _fail(where, f"unknown dtype {entry.get('dtype')!r:.100}; known: {sorted(ITEMSIZE)}")
        shape = _int_list(entry.get("shape"), f"{where} shape")
        if chunk_numel(shape) * ITEMSIZE[entry["dtype"]] > MAX_BYTES:
            raise _fail(where, f"shape {shape} is absurdly large")
        _check_chunks(name, entry, files, block, version, algorithm)
    _check_file_ranges(tensors)
    optimizer = doc.get("optimizer")
    if optimizer is not None:
        groups = optimizer.get("param_groups") if isinstance(optimizer, dict) else None
        if not isinstance(groups, list) or not all(
            isinstance(g, dict) and isinstance(g.get("params"), list) and all(isinstance(p, str) for p in g["params"])
            for g in groups
        ):
            raise _fail("optimizer", "'param_groups' must be a list of objects with a 'params' list of names")
        if not isinstance(optimizer.get("scalars"), dict):
            raise _fail("optimizer", "'scalars' must be an object")
    return doc


def _nearby(path: str) -> str:
    """What to pass instead: the checkpoints beside ``path`` (directories holding an index), if any."""
    parent = os.path.dirname(os.path.abspath(path))
    try:
        found = sorted(e.name for e in os.scandir(parent) if e.is_dir() and os.path.isfile(os.path.join(e.path, INDEX_NAME)))
    except OSError:
        found = []
    there = f"; checkpoints in {parent}: {', '.join(found[-5:])}" if found else ""
    return f"pass the directory checkpoint.save wrote (it holds {INDEX_NAME}){there}"


def read_index(path: str) -> dict[str, Any]:
    """Read and validate ``path/index.json``; errors name the file.

    Usage: ``index = checkpoint.read_index("ckpt/step-100"); index["tensors"]["head.weight"]["shape"]``
    """
    file = os.path.join(path, INDEX_NAME)
    if not os.path.isdir(path):
        there = "is a file, not a checkpoint directory" if os.path.exists(path) else "does not exist"
        raise CheckpointFormatError(f"checkpoint directory {path!r} {there} (from {os.getcwd()}); {_nearby(path)}")
    try:
        with open(file, "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        raise CheckpointFormatError(
            f"{file} does not exist: {path!r} is not a complete mesh3d checkpoint (the index is written last)"
        ) from None
    try:
        doc = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CheckpointFormatError(f"{file}: not valid JSON ({err}); the file is truncated or corrupt") from None
    try:
        return validate_index(doc)
    except CheckpointFormatError as err:
        raise CheckpointFormatError(f"{file}: {err}") from None
