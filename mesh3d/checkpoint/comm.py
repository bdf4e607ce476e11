"""The checkpointer's few collectives: JSON all-gather and agreeing on failure.

Metadata travels as UTF-8 JSON in uint8 tensors (not ``all_gather_object``, which pickles),
and every collective is bounded by the process group's timeout. Without an initialized
process group everything degenerates to a world of one, so a plain process needs no launcher.

Save and load are short lists of *collective steps*: each runs one phase on this rank, then one
all-gather tells every rank whether any rank failed; if one did, every rank raises the same
``CheckpointError`` (one line per distinct cause, naming its ranks; the tracebacks in ``rank_tracebacks``, not in
the message), chained to this rank's own exception when it was one of them, so each rank prints its own traceback
once and its peers' causes in a line each. A failure on one rank never leaves the others waiting in the next
collective.

Usage::

    boxes, shared = collective_step("saving ckpt", compute_boxes, share=lambda boxes: boxes)
    raise_if_any_failed(error_or_none, "load") # raises the same CheckpointError on every rank
"""

from __future__ import annotations

import json
import threading
import traceback
from collections.abc import Callable
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from mesh3d.checkpoint.errors import CheckpointError
from mesh3d.faults.attach import WATCH
from mesh3d.launcher import refuse_if_launched_uninitialized
from mesh3d.manager import DistributedManager
from mesh3d.faults.beat import WAITING
from mesh3d.faults.summary import mark_shared, ranks_text

__all__ = ["world", "allgather_json", "allgather_int64", "collective_step", "raise_if_any_failed", "start_allgather_int64",
           "StepFailure"]

WAITING.add(__file__)  # NOTE: its frames wait on other ranks (the heartbeat says so: mesh3d/faults/beat.py)

T = TypeVar("T")

#: How many failed ranks an error message lists by name.
_LISTED = 4


def world() -> tuple[int, int]:
    """(rank, world size) of the default group, or (0, 1) without one."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    refuse_if_launched_uninitialized("mesh3d.checkpoint")  # else every rank would write the same files
    return 0, 1


def _mesh_world(group: dist.ProcessGroup | None) -> dist.ProcessGroup | None:
    """``group``, or for None on the main thread the manager's world group: it carries the manager's timeout, which a
    default group made outside mesh3d may not (background writers keep their own group: mesh3d/checkpoint/background.py)."""
    if group is None and DistributedManager.is_initialized() and threading.current_thread() is threading.main_thread():
        return DistributedManager().group("world")
    return group


def _device(group: dist.ProcessGroup | None) -> torch.device:
    backend = str(dist.get_backend(group))
    if "nccl" in backend:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


#: ``allgather_json`` sends each rank's first this many bytes in its first all-gather, with the length: a small
#: payload (an outcome, a repeat save's boxes) takes one collective, a larger one a second for the rest.
_FIRST_BYTES = 16 * 1024


def allgather_json(obj: Any, group: dist.ProcessGroup | None = None) -> list[Any]:
    """Every rank's ``obj`` (JSON-serializable), in rank order (over ``group``, default: the default group)."""
    _, size = world()
    payload = json.dumps(obj, separators=(",", ":")).encode()
    if size == 1:
        return [json.loads(payload)]
    group = _mesh_world(group)
    device = _device(group)
    head = torch.zeros(8 + _FIRST_BYTES, dtype=torch.uint8)
    head[:8] = torch.tensor([len(payload)], dtype=torch.int64).view(torch.uint8)
    first = payload[:_FIRST_BYTES]
    if first:
        head[8 : 8 + len(first)] = torch.frombuffer(bytearray(first), dtype=torch.uint8)
    head = head.to(device)
    heads = [torch.empty_like(head) for _ in range(size)]
    dist.all_gather(heads, head, group=group)
    heads = [h.cpu() for h in heads]
    lengths = [int(h[:8].view(torch.int64).item()) for h in heads]
    texts = [bytes(h[8 : 8 + min(n, _FIRST_BYTES)].numpy()) for h, n in zip(heads, lengths)]
    rest = max(lengths) - _FIRST_BYTES
    if rest > 0:  # NOTE: every rank sees the same lengths, so all take this second all-gather or none does
        tail = torch.zeros(rest, dtype=torch.uint8)
        if len(payload) > _FIRST_BYTES:
            tail[: len(payload) - _FIRST_BYTES] = torch.frombuffer(bytearray(payload[_FIRST_BYTES:]), dtype=torch.uint8)
        tail = tail.to(device)
        tails = [torch.empty_like(tail) for _ in range(size)]
        dist.all_gather(tails, tail, group=group)
        texts = [t + bytes(tl.cpu()[: max(n - _FIRST_BYTES, 0)].numpy()) for t, tl, n in zip(texts, tails, lengths)]
    return [json.loads(t) for t in texts]


def allgather_int64(values: list[int], group: dist.ProcessGroup | None = None) -> list[list[int]]:
    """Every rank's ``values`` (the same count of int64 on every rank), in rank order: one small all-gather."""
    return start_allgather_int64(values, group)()


def start_allgather_int64(values: list[int], group: dist.ProcessGroup | None = None) -> Callable[[], list[list[int]]]:
    """``allgather_int64`` started in the background: returns the function that waits for it and returns the rows
    (bounded by the group's timeout). Every rank must call the returned function."""
    _, size = world()
    if size == 1:
        return lambda: [list(values)]
    group = _mesh_world(group)
    mine = torch.tensor(values, dtype=torch.int64, device=_device(group))
    rows = [torch.empty_like(mine) for _ in range(size)]
    work = dist.all_gather(rows, mine, group=group, async_op=True)

    def finish() -> list[list[int]]:
        work.wait()
        return [row.tolist() for row in rows]

    return finish


class StepFailure(CheckpointError):
    """A failure whose message is already what the other ranks should read (``collective_step`` shows it as is)."""


def _failure_text(err: BaseException) -> str:
    return str(err) if isinstance(err, StepFailure) else f"{type(err).__name__}: {err}"


#: The longest a cause's one line may be in the message.
_CAUSE_CHARS = 400


def _failed_error(what: str, failed: list[tuple[int, str]], note: str, world_size: int | None = None) -> CheckpointError:
    """One line per distinct cause, naming the ranks that gave it; the same message on every rank.

    NOTE: no rank's traceback goes into the message or its notes (each rank's error is chained to its own failure,
    whose traceback Python prints once); at N ranks each rank printed every rank's traceback before, N squared.
    """
    causes: dict[str, list[int]] = {}
    for r, e in failed:
        line = " ".join(str(e).split())
        causes.setdefault(line if len(line) <= _CAUSE_CHARS else line[: _CAUSE_CHARS - 3] + "...", []).append(r)
    of = f" on {len(failed)} of {world_size} ranks" if world_size else ""
    lines = [f"{what} failed{of}" + (f". {note}" if note else "")]
    listed = list(causes.items())
    lines += [f"  {ranks_text(ranks)}: {cause}" for cause, ranks in listed[:_LISTED]]
    if len(listed) > _LISTED:
        lines.append(f"  (and {len(listed) - _LISTED} more causes on {sum(len(r) for _, r in listed[_LISTED:])} ranks)")
    return CheckpointError("\n".join(lines))


def _group_ranks(group: dist.ProcessGroup | None) -> list[int]:
    """The global ranks of ``group`` (default: the world): every one of them raises an agreed error."""
    if not dist.is_initialized():
        return [0]
    return dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))


def collective_step(
    what: str,
    local: Callable[[], T],
    *,
    share: Callable[[T], Any] | None = None,
    note: str = "",
    group: dist.ProcessGroup | None = None,
    on_failure: Callable[[], None] | None = None,
) -> tuple[T, list[Any]]:
    """Run ``local()`` here, then agree with every rank on the outcome (one JSON all-gather over ``group``).

    Returns ``(local's result, [share(result) of every rank, in rank order])`` when every rank
    succeeded (``share`` defaults to sharing nothing). If any rank's ``local`` raised, every rank
    runs ``on_failure()`` (e.g. rank 0 removes its staging directory) and raises the same
    ``CheckpointError("<what> failed on k of n ranks[. note]\\n  rank r: <error>\\n  ranks a-b: <error>")``, chained to
    this rank's own exception if it failed; every failed rank's traceback is in its ``rank_tracebacks`` ({rank: text}).
    """
    result: Any = None
    mine: BaseException | None = None
    payload: dict[str, Any] = {"error": None, "traceback": None, "shared": None}
    try:
        result = local()
        payload["shared"] = share(result) if share is not None else None
    except Exception as err:  # shared with every rank below, so all raise together
        mine = err
        payload.update(error=_failure_text(err), traceback="".join(traceback.format_exception(err)))
    watch = WATCH.current
    with watch.doing(f"checkpoint: {what}"):
        watch.check()  # a peer known lost never arrives: name it now instead of waiting for the timeout
        try:
            gathered = allgather_json(payload, group)
        except RuntimeError as err:
            raise watch.translate(err) from err
    failed = [(r, d["error"]) for r, d in enumerate(gathered) if d["error"] is not None]
    if not failed:
        return result, [d["shared"] for d in gathered]
    if on_failure is not None:
        on_failure()
    error = _failed_error(what, failed, note, len(gathered))
    error.rank_tracebacks = {r: d["traceback"] for r, d in enumerate(gathered) if d["traceback"]}
    raise mark_shared(error, _group_ranks(group)) from mine


def raise_if_any_failed(error: str | None, what: str, note: str = "", group: dist.ProcessGroup | None = None) -> None:
    """Raise on every rank if any rank reports an error (each rank's message, then ``note``)."""
    _, size = world()
    errors = allgather_json(error, group) if size > 1 else [error]
    failed = [(r, e) for r, e in enumerate(errors) if e]
    if failed:
        raise mark_shared(_failed_error(what, failed, note, len(errors)), _group_ranks(group))
