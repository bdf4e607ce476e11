"""Describe and verify a checkpoint without torch.distributed (what ``mesh3d ckpt`` prints).

``verify`` reads every byte of every chunk and checks the checksum of each block (xxh3_64;
crc32 in version-1 checkpoints); the index validator has already proven coverage (every
element of every tensor saved exactly once).

Usage::

    print(describe("ckpt/step-100"))
    report = verify("ckpt/step-100")     # raises CheckpointError on the first bad byte
"""

from __future__ import annotations

import math
import os
from typing import Any

import torch

from mesh3d.checkpoint.chunks import Box
from mesh3d.checkpoint.index import checksum_scheme, read_index
from mesh3d.checkpoint.progress import Progress
from mesh3d.checkpoint.reader import ShardReader
from mesh3d.checkpoint.st_format import DTYPES, ITEMSIZE

__all__ = ["describe", "verify"]


#: ``extra`` longer than this (as text) is summarized by its keys; Lightning's trainer state runs to kilobytes.
_EXTRA_SHOWN_CHARS = 200


def _summary(extra: Any) -> str:
    text = repr(extra)
    if len(text) <= _EXTRA_SHOWN_CHARS or not isinstance(extra, dict):
        return text if len(text) <= _EXTRA_SHOWN_CHARS else text[:_EXTRA_SHOWN_CHARS] + "..."
    lightning = extra.get("lightning")
    if isinstance(lightning, dict) and "global_step" in lightning:  # written by mesh3d.lightning.MeshStrategy
        keys = ", ".join(k for k in lightning if k not in ("epoch", "global_step"))
        return (f"Lightning trainer state (epoch {lightning.get('epoch')}, global step {lightning['global_step']}; "
                f"{keys})")
    return f"keys {', '.join(map(str, extra))} ({len(text)} characters of JSON)"


def describe(path: str | os.PathLike) -> str:
    """A human-readable summary: step, mesh, files, and every tensor's dtype, shape, chunks and layout.

    Usage: ``print(checkpoint.describe("ckpt/step-100"))  # or: mesh3d ckpt inspect ckpt/step-100``
    """
    path = os.fspath(path)
    index = read_index(path)
    mesh = index.get("mesh")
    mesh_text = "none (no DistributedManager)" if not mesh else " x ".join(
        f"{a}={s}" for a, s in zip(mesh["axes"], mesh["shape"]))
    total = sum(f["bytes"] for f in index["files"].values())
    algorithm, block, _ = checksum_scheme(index)
    block_text = f"{block // 1024} KiB" if block % 1024 == 0 else f"{block} B"
    lines = [f"checkpoint {path}", f"  format version {index['version']} ({algorithm.name} per {block_text} block), "
             f"step {index['step']}, saved on {index['world_size']} rank(s), mesh {mesh_text}",
             f"  {len(index['files'])} shard files, {total / 1e6:.2f} MB; extra: {_summary(index.get('extra'))}"]
    if index.get("optimizer"):
        lines.append(f"  optimizer {index['optimizer'].get('type')} with {len(index['optimizer']['param_groups'])} param group(s)")
    width = max((len(n) for n in index["tensors"]), default=4)
    lines.append(f"  {'tensor':<{width}}  role       dtype  shape              chunks  MB      layout")
    for name, e in sorted(index["tensors"].items()):
        mb = math.prod(e["shape"]) * ITEMSIZE[e["dtype"]] / 1e6
        lines.append(f"  {name:<{width}}  {e['role']:<9}  {e['dtype']:<5}  {str(e['shape']):<17}  "
                     f"{len(e['chunks']):>6}  {mb:<6.3f}  {e.get('layout', '')}")
    return "\n".join(lines)


def verify(path: str | os.PathLike, progress: bool = False) -> dict[str, Any]:
    """Read every chunk, checking headers and checksums; return counts. Raises on any problem.

    Usage: ``counts = checkpoint.verify("ckpt/step-100")  # or: mesh3d ckpt verify ckpt/step-100``
    """
    path = os.fspath(path)
    index = read_index(path)
    total = sum(math.prod(c["shape"]) * ITEMSIZE[e["dtype"]] for e in index["tensors"].values() for c in e["chunks"])
    bar = Progress(total, "verify", enabled=progress)
    try:
        with ShardReader(path, index) as reader:
            for name, entry in index["tensors"].items():
                for chunk in entry["chunks"]:
                    box = Box(tuple(chunk["offsets"]), tuple(chunk["shape"]))
                    reader.read_into(name, box, torch.empty(box.shape, dtype=DTYPES[entry["dtype"]]))
                    bar.update(box.numel * ITEMSIZE[entry["dtype"]])
            stats = dict(reader.stats)
    finally:
        bar.close()
    return {"tensors": len(index["tensors"]), "files": len(index["files"]), "bytes_verified": stats["bytes_read"]}
