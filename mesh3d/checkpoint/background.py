"""``async_save``: stage the state in host memory, return, and let a background thread write and commit it.

The on-disk result is the synchronous ``save``'s, byte for byte (same files, same index but for its
``created_unix``): the same shard writer, checksums, fsyncs and rank-0 atomic commit run, on a thread.

NOTE: torch process groups are not safe to drive from two threads at once (a background all-gather
interleaved with the training loop's collectives on the same group can mismatch or deadlock:
KempnerForge#104 is exactly this). So:

1. everything that needs the default group runs on the calling thread, before ``async_save``
   returns: the request check and box agreement (``agree``, one JSON all-gather) and, the first
   time, making the checkpoint group;
2. the state this rank writes is copied into one reused host buffer (``HostStaging.snapshot``) so
   training may change parameters and optimizer state at once; on a repeat save the copy runs while the
   small all-gather that confirms the kept boxes is in flight (``agree_and_stage``);
3. the writer thread writes and fsyncs this rank's shards (file I/O only), then gathers the chunk
   records and agrees on the outcome over a **separate gloo group made for checkpoint traffic**
   (its own timeout: the manager's, else torch's default), so the commit happens as soon as every
   rank has written, without waiting for the training loop to call anything. The main thread never
   uses that group while a writer is alive: every save waits for the previous one first.

Deferring the commit to the next ``wait()``/``save()`` on the main thread (the other option) would
leave a finished checkpoint uncommitted, and so lost on a crash, for as long as training runs on.

Usage::

    handle = checkpoint.async_save("ckpt/step-100", model, opt, step=100)
    train_more()              # the copy staged at the call is what lands
    handle.wait()             # the path, once committed; raises on every rank if writing failed
"""

from __future__ import annotations

import json
import os
import threading
from typing import Any, Callable

import torch
from torch import nn

from mesh3d.checkpoint.comm import StepFailure
from mesh3d.checkpoint.errors import CheckpointError
from mesh3d.checkpoint.inflight import IN_FLIGHT, AsyncSave
from mesh3d.checkpoint.agree import Plan, agree_and_stage
from mesh3d.checkpoint.save import DEFAULT_CHECKSUM_BLOCK_BYTES, StageHook, my_parts, write_and_commit, write_my_shards

__all__ = ["async_save", "AsyncSave"]


def async_save(
    path: str | os.PathLike,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    step: int | None = None,
    extra: Any = None,
    data: Any = None,
    checksum_block_bytes: int = DEFAULT_CHECKSUM_BLOCK_BYTES,
    stage_hook: StageHook | None = None,
    on_commit: Callable[[str], None] | None = None,
) -> AsyncSave:
    """Start saving like ``save`` (all ranks call it) and return once the state is staged in host memory.

    Usage: ``handle = checkpoint.async_save("ckpt/step-100", model, opt, step=100); ...; handle.wait()``

    Bad input raises here, on every rank, as in ``save``. A save still being written is finished
    first (a process writes one checkpoint at a time), and its failure is raised here. The returned
    handle has ``path``, ``done()`` and ``wait()``; a failed write raises ``CheckpointError`` on every
    rank at ``wait()`` or at the next ``save``/``async_save``, whichever comes first. Until it is
    committed, ``path`` does not exist: a crash at any point leaves at most a hidden ``.<name>.tmp-*``
    staging directory. A process that exits normally finishes the write first (its writer thread is joined
    at exit). Memory: one host copy of the bytes this rank writes, reused by the next save.

    ``stage_hook(stage)`` is called on the writer thread at each stage of the protocol (``"staged"``,
    ``"mid_shard"``, ``"shards_written"``, then on rank 0 ``"before_index"``, ``"index_written"``,
    ``"committed"``): for progress reports and fault-injection tests; an exception from it fails the
    save like a write error. ``on_commit(path)`` runs on rank 0's writer right after the commit (the
    CheckpointManager updates ``latest`` there); its failure fails the save on every rank.
    """
    IN_FLIGHT.wait()
    try:  # the writer must not see later changes to ``extra``; agree() reports it if it is not JSON
        extra = json.loads(json.dumps(extra, allow_nan=False))
    except (TypeError, ValueError):
        pass
    plan, _, (staged, ready, failure) = agree_and_stage(path, model, optimizer, step, extra, checksum_block_bytes,
                                                        data, plans=IN_FLIGHT.plans, meanwhile=_stage_in_host_memory)
    group = IN_FLIGHT.group()
    handle = AsyncSave(plan.path, plan.staging)
    IN_FLIGHT.handle = handle
    # NOTE: last before returning: the writer needs the GIL to start, and CPython hands it over only after the
    # switch interval (5 ms) of the caller running on, by when async_save has returned.
    IN_FLIGHT.start_writer(lambda: _write(handle, plan, staged, ready, failure, group, stage_hook, on_commit))
    return handle


def _stage_in_host_memory(entries: dict[str, Any], boxes: list[dict[str, list]], rank: int) -> tuple[dict, Any, str | None]:
    """(name: (box, host copy) of what this rank writes, the copies' ready event, a failure or None); never raises:
    a failure (e.g. no memory for the buffer) goes to the writer, which reports it to every rank's commit."""
    try:
        with torch.no_grad():  # DTensor.to_local without its autograd function
            mine = my_parts(entries, boxes, rank)
            copies, ready = IN_FLIGHT.host.snapshot({name: data for name, (_, data) in mine.items()})
        return {name: (box, copies[name]) for name, (box, _) in mine.items()}, ready, None
    except Exception as err:
        return {}, None, f"{type(err).__name__} while staging the state in host memory: {err}"


def _write(handle: AsyncSave, plan: Plan, staged: dict[str, Any], ready: Any, failure: str | None, group: Any,
           hook: StageHook | None, on_commit: Callable[[str], None] | None) -> None:
    """The writer thread: file I/O, then the commit's two collectives on the checkpoint group only.

    A rank that failed to stage still takes part in the commit's collectives (with its error), so
    every rank fails together instead of the others waiting for it until the group's timeout."""
    threading.current_thread().name = f"mesh3d-checkpoint-writer:{os.path.basename(plan.path)}"  # in stack dumps

    def write() -> tuple[dict[str, Any], dict[str, Any]]:
        if failure is not None:
            raise StepFailure(failure)
        try:
            if ready is not None:
                ready.synchronize()  # the device-to-host copies have landed
            if hook is not None:
                hook("staged")
        except Exception as err:
            raise StepFailure(f"{type(err).__name__} while writing shards: {err}") from err
        return write_my_shards(plan, staged, hook)

    try:
        write_and_commit(plan, write, group, hook, on_commit)
        handle._finish(None)
    except CheckpointError as err:
        handle._finish(str(err))
    except BaseException as err:  # a collective that timed out, or anything else: still report it
        handle._finish(f"saving {plan.path} failed: {type(err).__name__}: {err}")
