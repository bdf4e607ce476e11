"""The checkpointer's few collectives: JSON all-gather and agreeing on failure.

Metadata travels as UTF-8 JSON in uint8 tensors (not ``all_gather_object``, which pickles),
and every collective is bounded by the process group's timeout. Without an initialized
process group everything degenerates to a world of one, so a plain process needs no launcher.

Usage::

    docs = allgather_json({"boxes": ...})      # one entry per rank, in rank order
    raise_if_any_failed(error_or_none, "load") # raises the same CheckpointError on every rank
"""

from __future__ import annotations

import json
from typing import Any

import torch
import torch.distributed as dist

from mesh3d.checkpoint.errors import CheckpointError
from mesh3d.manager import refuse_if_launched_uninitialized

__all__ = ["world", "allgather_json", "raise_if_any_failed", "barrier"]


def world() -> tuple[int, int]:
    """(rank, world size) of the default group, or (0, 1) without one."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    refuse_if_launched_uninitialized("mesh3d.checkpoint")  # else every rank would write the same files
    return 0, 1


def _device(group: dist.ProcessGroup | None) -> torch.device:
    backend = str(dist.get_backend(group))
    if "nccl" in backend:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def allgather_json(obj: Any, group: dist.ProcessGroup | None = None) -> list[Any]:
    """Every rank's ``obj`` (JSON-serializable), in rank order (over ``group``, default: the default group)."""
    _, size = world()
    payload = json.dumps(obj, separators=(",", ":")).encode()
    if size == 1:
        return [json.loads(payload)]
    device = _device(group)
    length = torch.tensor([len(payload)], dtype=torch.int64, device=device)
    lengths = [torch.zeros_like(length) for _ in range(size)]
    dist.all_gather(lengths, length, group=group)
    longest = max(int(n.item()) for n in lengths)
    buf = torch.zeros(longest, dtype=torch.uint8, device=device)
    if payload:
        buf[: len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    bufs = [torch.empty_like(buf) for _ in range(size)]
    dist.all_gather(bufs, buf, group=group)
    return [json.loads(bytes(b[: int(n.item())].cpu().numpy())) for b, n in zip(bufs, lengths)]


def raise_if_any_failed(error: str | None, what: str, note: str = "", group: dist.ProcessGroup | None = None) -> None:
    """Raise on every rank if any rank reports an error (each rank's message, then ``note``)."""
    rank, size = world()
    errors = allgather_json(error, group) if size > 1 else [error]
    failed = [(r, e) for r, e in enumerate(errors) if e]
    if failed:
        detail = "; ".join(f"rank {r}: {e}" for r, e in failed[:4])
        more = f" (and {len(failed) - 4} more ranks)" if len(failed) > 4 else ""
        raise CheckpointError(f"{what} failed: {detail}{more}" + (f". {note}" if note else ""))


def barrier() -> None:
    if world()[1] > 1:
        dist.barrier()
