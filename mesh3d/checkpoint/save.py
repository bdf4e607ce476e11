"""``save``: every rank writes the chunks it owns as plain safetensors; rank 0 commits.

Protocol (crash-safe at every step):
1. every rank computes its boxes; one JSON all-gather shares them with rank 0's staging
   directory name and any local error (so bad input raises on every rank, before writes);
2. ranks holding the same box (replicas) split it by rows, so each element is written once
   and writes stay balanced; each rank streams its shard files into the staging directory
   and fsyncs them;
3. a second all-gather brings every chunk's byte range and checksums to rank 0, which
   writes ``index.json`` LAST (tmp + fsync + rename), fsyncs the directories and renames
   the staging directory to ``path``. A killed save leaves only ``.<name>.tmp-*`` garbage.

Usage::

    checkpoint.save("ckpt/step-100", model, optimizer, step=100, extra={"lr": 0.1}, data=loader)
"""

from __future__ import annotations

import json
import os
import shutil
import time
import uuid
import zlib
from typing import Any

import torch
from torch import nn

from mesh3d.checkpoint.checksum import WRITE_ALGORITHM, block_checksums
from mesh3d.checkpoint.chunks import Box, local_box, local_data, replica_part
from mesh3d.checkpoint.comm import allgather_json, raise_if_any_failed, world
from mesh3d.checkpoint.errors import CheckpointError
from mesh3d.checkpoint.index import FORMAT, INDEX_NAME, VERSION, encode_index, validate_index
from mesh3d.checkpoint.st_format import TORCH_TO_ST, plan_header
from mesh3d.checkpoint.staging import HostStaging
from mesh3d.checkpoint.state import Entry, flat_state

__all__ = ["save", "DEFAULT_CHECKSUM_BLOCK_BYTES", "fsync_dir", "write_file_atomic"]

#: Checksums (xxh3_64) cover 256 KiB blocks: a reader verifies exactly the blocks it reads, so
#: a resharded load reads at most one extra block at each end of a needed range.
DEFAULT_CHECKSUM_BLOCK_BYTES = 256 * 1024

#: Test hook: the name of a stage at which the saving process calls ``os._exit`` to
#: simulate a crash (tests/test_checkpoint_faults.py). Never set in production.
_CRASH_AT: str | None = None


def _maybe_crash(stage: str) -> None:
    if _CRASH_AT == stage:
        os._exit(17)


def fsync_dir(path: str) -> None:
    """Make a directory's entries (new files, renames) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_file_atomic(path: str, data: bytes) -> None:
    """Write ``data`` to ``path`` via a fsynced temporary and a rename."""
    tmp = f"{path}.tmp-{uuid.uuid4().hex[:8]}"
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(os.path.dirname(path) or ".")


def _shard_name(role: str, rank: int, size: int) -> str:
    return f"{role}/r{rank:05d}-of-{size:05d}.safetensors"


def _write_shard(path: str, parts: dict[str, torch.Tensor], block: int, rank: int) -> tuple[int, dict[str, Any]]:
    """Stream ``parts`` into one plain safetensors file; return its size and per-key ranges/checksums."""
    header, ranges = plan_header(
        {k: (TORCH_TO_ST[t.dtype], tuple(t.shape)) for k, t in parts.items()},
        {"format": "pt", "mesh3d_rank": str(rank)},
    )
    records: dict[str, Any] = {}
    staging = HostStaging()
    with open(path, "wb") as f:
        f.write(header)
        for i, key in enumerate(sorted(ranges, key=lambda k: ranges[k][0])):
            if i == len(ranges) // 2:
                _maybe_crash("mid_shard")
            data = staging.to_host(parts[key].detach()).reshape(-1)
            view = memoryview(data.view(torch.uint8).numpy()) if data.numel() else memoryview(b"")
            f.write(view)
            records[key] = {"data_offsets": list(ranges[key]), "checksums": block_checksums(view, block)}
        f.flush()
        os.fsync(f.fileno())
        size = f.tell()
    return size, records


def _signature(entries: dict[str, Entry]) -> int:
    """A checksum of (name, role, dtype, global shape): all ranks must agree on it."""
    text = json.dumps(sorted((n, e.role, str(e.tensor.dtype), list(e.tensor.shape)) for n, e in entries.items()))
    return zlib.crc32(text.encode())


def _data_state(data: Any) -> dict[str, Any] | None:
    """``data.state_dict()``, checked to be a JSON object (nothing is ever pickled)."""
    if data is None:
        return None
    if not callable(getattr(data, "state_dict", None)):
        raise CheckpointError(f"data= takes an object with state_dict() (e.g. mesh3d.data.MeshDataLoader), got "
                              f"{type(data).__name__}")
    state = data.state_dict()
    try:
        if not isinstance(state, dict):
            raise TypeError(f"it is a {type(state).__name__}, not a dict")
        json.dumps(state, allow_nan=False)
    except (TypeError, ValueError) as err:
        raise CheckpointError(f"data.state_dict() must return a JSON object (dicts, lists, str, finite numbers): {err}") from None
    return state


def _mesh_info() -> dict[str, Any] | None:
    from mesh3d.manager import DistributedManager

    if not DistributedManager.is_initialized():
        return None
    dm = DistributedManager()
    return {"axes": list(dm.mesh.mesh_dim_names), "shape": list(dm.mesh.shape)}


def _my_parts(entries: dict[str, Entry], boxes: list[dict[str, list]], rank: int) -> dict[str, tuple[Box, torch.Tensor]]:
    """For each tensor, the box this rank writes and its data (replicas split the rows)."""
    mine: dict[str, tuple[Box, torch.Tensor]] = {}
    for name, entry in entries.items():
        key = boxes[rank][name]
        replicas = [r for r, b in enumerate(boxes) if b[name] == key]
        box = Box(tuple(key[0]), tuple(key[1]))
        part = replica_part(box, replicas, rank)
        if part is None or part.numel == 0:
            continue
        data = local_data(entry.tensor)
        if part.shape and part.shape[0] != box.shape[0]:
            data = data.narrow(0, part.offsets[0] - box.offsets[0], part.shape[0])
        mine[name] = (part, data)
    return mine


def save(
    path: str | os.PathLike,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    step: int | None = None,
    extra: Any = None,
    data: Any = None,
    checksum_block_bytes: int = DEFAULT_CHECKSUM_BLOCK_BYTES,
) -> str:
    """Save ``model`` (and ``optimizer``) state to the directory ``path``; all ranks call it.

    Usage: ``checkpoint.save("ckpt/step-100", model, opt, step=100, extra={"seed": 0})``

    ``path`` must not exist yet; it appears only once the checkpoint is complete. Missing parent
    directories are created.
    Returns the absolute path. ``extra`` must be JSON-serializable. Every block of
    ``checksum_block_bytes`` bytes of every chunk gets an xxh3_64 checksum in the index.
    ``data`` (e.g. a ``mesh3d.data.MeshDataLoader`` or ``MeshSampler``) is anything with a
    ``state_dict()`` returning JSON that is the same on every rank (a global data cursor); it is
    stored in the index and checked to agree across ranks. ``load(..., data=)`` restores it.
    """
    rank, size = world()
    path = os.path.abspath(os.fspath(path))
    parent, base = os.path.split(path)
    staging, error, entries, optim_meta, my_boxes, signature, data_state = None, None, {}, None, {}, 0, None
    try:
        if step is not None and (not isinstance(step, int) or isinstance(step, bool)):
            raise CheckpointError(f"step={step!r} must be an int or None")
        try:
            json.dumps(extra, allow_nan=False)
        except (TypeError, ValueError) as err:
            raise CheckpointError(f"extra must be JSON-serializable (dicts, lists, str, finite numbers): {err}") from None
        data_state = _data_state(data)
        entries, optim_meta = flat_state(model, optimizer)
        for name, entry in entries.items():
            if entry.tensor.dtype not in TORCH_TO_ST:
                raise CheckpointError(f"tensor {name!r} has dtype {entry.tensor.dtype}, which safetensors cannot store")
            box = local_box(name, entry.tensor)
            my_boxes[name] = [list(box.offsets), list(box.shape)]
        signature = _signature(entries)
        if rank == 0:
            if os.path.lexists(path):
                raise CheckpointError(f"{path} already exists; checkpoints are never overwritten (pick a new path)")
            try:  # missing parents are created (like ``mkdir -p``); the checkpoint itself still appears atomically
                os.makedirs(parent, exist_ok=True)
            except OSError as err:
                raise CheckpointError(f"cannot create the parent directory {parent} of the checkpoint: {err} "
                                      "(choose a path under a writable directory)") from None
            staging = os.path.join(parent, f".{base}.tmp-{uuid.uuid4().hex[:12]}")
            os.makedirs(os.path.join(staging, "model"))
            os.makedirs(os.path.join(staging, "optimizer"))
    except Exception as err:  # shared with every rank below, so all raise together
        error = f"{type(err).__name__}: {err}"
    shared = allgather_json({"error": error, "staging": staging, "signature": signature, "boxes": my_boxes,
                             "data": data_state})
    staging = shared[0]["staging"]
    errors = [(r, d["error"]) for r, d in enumerate(shared) if d["error"]]
    if not errors and len({d["signature"] for d in shared}) > 1:
        errors = [(0, "ranks disagree on the state's tensor names, dtypes or global shapes "
                      f"(signatures {[d['signature'] for d in shared]}); every rank must save the same model")]
    if not errors:
        errors = [(r, f"its data state {d['data']} differs from rank 0's {shared[0]['data']}; data= must hold a global "
                      "cursor, the same on every rank (MeshSampler's is)") for r, d in enumerate(shared)
                  if d["data"] != shared[0]["data"]][:1]
    if errors:
        if rank == 0 and staging:
            shutil.rmtree(staging, ignore_errors=True)
        raise CheckpointError(f"saving {path} failed: " + "; ".join(f"rank {r}: {e}" for r, e in errors[:4]))
    _maybe_crash("staged")

    boxes = [d["boxes"] for d in shared]
    records: dict[str, Any] = {}
    files: dict[str, Any] = {}
    try:
        mine = _my_parts(entries, boxes, rank)
        for role in ("model", "optimizer"):
            parts = {n: d for n, (_, d) in mine.items() if entries[n].role == role}
            if not parts:
                continue
            rel = _shard_name(role, rank, size)
            nbytes, written = _write_shard(os.path.join(staging, rel), parts, checksum_block_bytes, rank)
            files[rel] = {"bytes": nbytes, "rank": rank}
            for name, rec in written.items():
                box = mine[name][0]
                records[name] = {"offsets": list(box.offsets), "shape": list(box.shape), "file": rel, "key": name, **rec}
        error = None
    except Exception as err:
        error = f"{type(err).__name__} while writing shards: {err}"
    _maybe_crash("shards_written")
    gathered = allgather_json({"error": error, "files": files, "chunks": records})
    commit_error = None
    if rank == 0:
        try:
            failed = [f"rank {r}: {d['error']}" for r, d in enumerate(gathered) if d["error"]]
            if failed:
                raise CheckpointError("; ".join(failed[:4]))
            _commit(path, staging, entries, gathered, optim_meta, step, extra, checksum_block_bytes, size, data_state)
        except Exception as err:
            shutil.rmtree(staging, ignore_errors=True)
            commit_error = f"{type(err).__name__}: {err}"
    raise_if_any_failed(commit_error, f"saving {path}")
    return path


def _commit(path: str, staging: str, entries: dict[str, Entry], gathered: list[dict[str, Any]],
            optim_meta: dict[str, Any] | None, step: int | None, extra: Any, block: int, size: int,
            data_state: dict[str, Any] | None = None) -> None:
    """Rank 0: build and validate the index, write it last, then rename the staging dir into place."""
    files: dict[str, Any] = {}
    tensors: dict[str, Any] = {}
    for name, entry in entries.items():
        t = entry.tensor
        tensors[name] = {"role": entry.role, "dtype": TORCH_TO_ST[t.dtype], "shape": list(t.shape), "chunks": [],
                         "layout": str(tuple(t.placements)) if hasattr(t, "placements") else "plain"}
        if entry.role == "optimizer":
            tensors[name].update(param=entry.param, state_key=entry.state_key)
    for doc in gathered:
        files.update(doc["files"])
        for name, chunk in doc["chunks"].items():
            tensors[name]["chunks"].append(chunk)
    for entry in tensors.values():
        entry["chunks"].sort(key=lambda c: c["offsets"])
    doc = {"format": FORMAT, "version": VERSION, "step": step, "extra": extra, "data": data_state,
           "checksum": WRITE_ALGORITHM.name,
           "checksum_block_bytes": block, "world_size": size, "mesh": _mesh_info(), "created_unix": time.time(),
           "files": files, "tensors": tensors, "optimizer": optim_meta}
    data = encode_index(doc)
    validate_index(json.loads(data))  # never commit an index this very code would refuse to read
    for sub in ("model", "optimizer"):
        fsync_dir(os.path.join(staging, sub))
    _maybe_crash("before_index")
    write_file_atomic(os.path.join(staging, INDEX_NAME), data)
    _maybe_crash("index_written")
    os.rename(staging, path)
    fsync_dir(os.path.dirname(path))
    _maybe_crash("committed")
