"""``save``: every rank writes the chunks it owns as plain safetensors; rank 0 commits.

Protocol (crash-safe at every step), three collective steps (``comm.collective_step``: run a
phase here, agree on failure everywhere):
1. every rank computes its boxes; one JSON all-gather shares them with rank 0's staging
   directory name and any local error (so bad input raises on every rank, before writes);
   a repeat save of an unchanged structure reuses the agreed boxes after an all-gather of
   five int64 per rank (``agree.py``);
2. ranks holding the same box (replicas) split it by rows, so each element is written once
   and writes stay balanced; each rank streams its shard files into the staging directory
   and fsyncs them;
3. a second all-gather brings every chunk's byte range and checksums to rank 0, which
   writes ``index.json`` LAST (tmp + fsync + rename), fsyncs the directories and renames
   the staging directory to ``path``. A killed save leaves only ``.<name>.tmp-*`` garbage.

``save`` reads as the list of phases: ``agree`` (step 1), ``write_and_commit`` (steps 2 and 3; the
background writer of ``async_save`` runs the same function on its thread).

Usage::

    checkpoint.save("ckpt/step-100", model, optimizer, step=100, extra={"lr": 0.1}, data=loader)
"""

from __future__ import annotations

import json
import os
import shutil
import time
import uuid
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from mesh3d.checkpoint.agree import Plan, agree
from mesh3d.checkpoint.checksum import WRITE_ALGORITHM, block_checksums
from mesh3d.checkpoint.chunks import Box, local_data, replica_part
from mesh3d.checkpoint.comm import StepFailure, collective_step
from mesh3d.checkpoint.inflight import IN_FLIGHT
from mesh3d.checkpoint.index import FORMAT, INDEX_NAME, VERSION, encode_index, validate_index
from mesh3d.checkpoint.st_format import TORCH_TO_ST, plan_header
from mesh3d.checkpoint.staging import HostStaging
from mesh3d.checkpoint.state import Entry

__all__ = ["save", "DEFAULT_CHECKSUM_BLOCK_BYTES", "fsync_dir", "write_file_atomic"]

#: Checksums (xxh3_64) cover 256 KiB blocks: a reader verifies exactly the blocks it reads, so
#: a resharded load reads at most one extra block at each end of a needed range.
DEFAULT_CHECKSUM_BLOCK_BYTES = 256 * 1024

#: Called with each stage name as a save passes it (``save``/``async_save(..., stage_hook=)``):
#: progress reports, and fault injection in tests (tests/test_checkpoint_faults.py).
StageHook = Callable[[str], None]


def _stage(stage: str, hook: StageHook | None) -> None:
    if hook is not None:
        hook(stage)


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


def _write_shard(path: str, parts: dict[str, torch.Tensor], block: int, rank: int,
                 hook: StageHook | None = None) -> tuple[int, dict[str, Any]]:
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
                _stage("mid_shard", hook)
            data = staging.to_host(parts[key].detach()).reshape(-1)
            view = memoryview(data.view(torch.uint8).numpy()) if data.numel() else memoryview(b"")
            f.write(view)
            records[key] = {"data_offsets": list(ranges[key]), "checksums": block_checksums(view, block)}
        f.flush()
        os.fsync(f.fileno())
        size = f.tell()
    return size, records


def my_parts(entries: dict[str, Entry], boxes: list[dict[str, list]], rank: int) -> dict[str, tuple[Box, torch.Tensor]]:
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
    stage_hook: StageHook | None = None,
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
    A save started with ``async_save`` and still being written is finished first (and its
    failure, if any, raised here on every rank). ``stage_hook(stage)`` is called at each stage, as in
    ``async_save`` (an exception from it fails the save on every rank).
    """
    IN_FLIGHT.wait()
    plan, entries = agree(path, model, optimizer, step, extra, checksum_block_bytes, data, plans=IN_FLIGHT.plans)
    _stage("staged", stage_hook)
    mine = my_parts(entries, plan.boxes, plan.rank)
    write_and_commit(plan, lambda: write_my_shards(plan, mine, stage_hook), hook=stage_hook)
    return plan.path


def write_my_shards(plan: Plan, mine: dict[str, tuple[Box, torch.Tensor]],
                    hook: StageHook | None = None) -> tuple[dict[str, Any], dict[str, Any]]:
    """Write this rank's shard files into the staging directory (no collective): (files, chunk records)."""
    records: dict[str, Any] = {}
    files: dict[str, Any] = {}
    try:
        for role in ("model", "optimizer"):
            parts = {n: d for n, (_, d) in mine.items() if plan.tensors[n]["role"] == role}
            if not parts:
                continue
            rel = _shard_name(role, plan.rank, plan.size)
            nbytes, written = _write_shard(os.path.join(plan.staging, rel), parts, plan.block, plan.rank, hook)
            files[rel] = {"bytes": nbytes, "rank": plan.rank}
            for name, rec in written.items():
                box = mine[name][0]
                records[name] = {"offsets": list(box.offsets), "shape": list(box.shape), "file": rel, "key": name, **rec}
    except Exception as err:
        raise StepFailure(f"{type(err).__name__} while writing shards: {err}") from err
    return files, records


def write_and_commit(plan: Plan, write: Callable[[], tuple[dict[str, Any], dict[str, Any]]],
                     group: dist.ProcessGroup | None = None, hook: StageHook | None = None,
                     on_commit: Callable[[str], None] | None = None) -> None:
    """Run ``write()`` (this rank's shards: files and chunk records), bring every rank's chunks to rank 0,
    which commits (then runs ``on_commit(path)``); raise on every rank if anything failed anywhere.
    Two collective steps on ``group`` (default: the default group)."""
    what = f"saving {plan.path}"

    def remove_staging() -> None:
        if plan.rank == 0:
            shutil.rmtree(plan.staging, ignore_errors=True)

    def written() -> tuple[dict[str, Any], dict[str, Any]]:
        files, records = write()
        try:
            _stage("shards_written", hook)
        except Exception as err:
            raise StepFailure(f"{type(err).__name__} after writing shards: {err}") from err
        return files, records

    _, gathered = collective_step(what, written, share=lambda fr: {"files": fr[0], "chunks": fr[1]}, group=group,
                                  on_failure=remove_staging)
    committed = False

    def commit() -> None:
        nonlocal committed
        if plan.rank == 0:
            _commit(plan, gathered, hook)
            committed = True
            if on_commit is not None:
                on_commit(plan.path)

    collective_step(what, commit, group=group, on_failure=lambda: None if committed else remove_staging())


def _commit(plan: Plan, gathered: list[dict[str, Any]], hook: StageHook | None) -> None:
    """Rank 0: build and validate the index, write it last, then rename the staging dir into place."""
    path, staging = plan.path, plan.staging
    files: dict[str, Any] = {}
    tensors = {name: {**meta, "chunks": []} for name, meta in plan.tensors.items()}
    for doc in gathered:
        files.update(doc["files"])
        for name, chunk in doc["chunks"].items():
            tensors[name]["chunks"].append(chunk)
    for entry in tensors.values():
        entry["chunks"].sort(key=lambda c: c["offsets"])
    doc = {"format": FORMAT, "version": VERSION, "step": plan.step, "extra": plan.extra, "data": plan.data_state,
           "checksum": WRITE_ALGORITHM.name, "checksum_block_bytes": plan.block, "world_size": plan.size,
           "mesh": plan.mesh, "created_unix": time.time(), "files": files, "tensors": tensors,
           "optimizer": plan.optim_meta}
    data = encode_index(doc)
    validate_index(json.loads(data))  # never commit an index this very code would refuse to read
    for sub in ("model", "optimizer"):
        fsync_dir(os.path.join(staging, sub))
    _stage("before_index", hook)
    write_file_atomic(os.path.join(staging, INDEX_NAME), data)
    _stage("index_written", hook)
    os.rename(staging, path)
    fsync_dir(os.path.dirname(path))
    _stage("committed", hook)
