"""The handle of a background save, and the one object that tracks the save still being written.

A process writes one checkpoint at a time: ``InFlight`` keeps the save started last (with the host
buffer it was staged into and the checkpoint process group it commits over), and every new save,
synchronous or not, first waits for it. It knows nothing of how a save is written (that is
``save.py`` and ``background.py``), so both can import it.

Usage::

    handle = checkpoint.async_save("ckpt/step-100", model, opt, step=100)
    ...                       # train on; the staged copy is what lands
    path = handle.wait()      # raises CheckpointError on every rank if the write failed
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import torch.distributed as dist

from mesh3d._torch_private import live_process_groups
from mesh3d.checkpoint.agree import AgreedPlans
from mesh3d.checkpoint.errors import CheckpointError
from mesh3d.checkpoint.staging import HostStaging
from mesh3d.manager import DistributedManager

__all__ = ["AsyncSave", "InFlight", "IN_FLIGHT"]


class AsyncSave:
    """A checkpoint being written in the background; ``wait()`` returns its path once committed.

    Usage: ``handle = checkpoint.async_save(path, model, opt, step=s); ...; handle.wait()``

    Every rank's writer learns every rank's outcome (the commit is agreed over a collective), so
    ``wait()`` returns on every rank or raises the same ``CheckpointError`` on every rank.
    """

    def __init__(self, path: str, staging: str) -> None:
        self.path, self.staging = path, staging
        self._finished = threading.Event()
        self._error: str | None = None
        self.observed = False  # wait() has returned or raised once

    def done(self) -> bool:
        """True once this rank's writer has finished (committed or failed); never blocks."""
        return self._finished.is_set()

    def wait(self) -> str:
        """Block until the checkpoint is committed and return its path; raise if the write failed."""
        self._finished.wait()
        self.observed = True
        if self._error is not None:
            raise CheckpointError(self._error)
        return self.path

    def _finish(self, error: str | None) -> None:
        """Called by the writer thread, last."""
        self._error = error
        self._finished.set()

    def __repr__(self) -> str:
        state = "failed" if self._error else "committed" if self.done() else "writing"
        return f"AsyncSave({self.path!r}, {state})"


class InFlight:
    """The save being written in the background, the reused host buffer, the checkpoint group, and the
    boxes agreed at the last save (reused by the next save while the state's structure is unchanged)."""

    def __init__(self) -> None:
        self.handle: AsyncSave | None = None
        self.plans = AgreedPlans()  # shared by save and async_save: every rank saves in the same order
        self.host = HostStaging()  # reused by every background save: the previous one has finished with it
        self._group: dist.ProcessGroup | None = None
        self._made_for: tuple[object, int] | None = None  # (default group, manager epoch) the group was made under
        self._writer: ThreadPoolExecutor | None = None  # the one writer thread, made by the first background save
        self._writer_pid = 0  # the process that made it (a forked child has the object but not the thread)

    def start_writer(self, job: Callable[[], None]) -> None:
        """Run ``job`` on the process's one writer thread; return at once. ``job`` must not raise.

        NOTE: one thread kept for every background save, not a thread started per save: ``Thread.start`` waits until
        the new thread runs. With 2 cores kept busy by other processes it took 0.06 ms (median), 1.2 ms (90th
        percentile) and up to 6 ms of 60 tries, against 0.016, 0.024 and 7 ms (one outlier) to hand a job to the
        kept thread; a profiled 4-rank save at 1 GB spent 6 ms in it. The executor's worker is joined at interpreter
        exit, so a process that exits normally still finishes its write first (as a non-daemon thread would).
        """
        if self._writer is None or self._writer_pid != os.getpid():
            self._writer = ThreadPoolExecutor(1, thread_name_prefix="mesh3d-checkpoint-writer")
            self._writer_pid = os.getpid()
        try:
            self._writer.submit(job)
        except RuntimeError:
            # NOTE: the interpreter is exiting (a save from an ``atexit`` handler, which runs after Python has joined
            # its threads): a thread started now could be cut off mid-write, so the write runs here, to the end.
            job()

    def wait(self) -> None:
        """Finish the pending save; raise its failure here if nobody has seen it yet (every rank alike)."""
        handle, self.handle = self.handle, None
        if handle is not None and not handle.observed:
            handle.wait()

    def staging_dirs(self) -> set[str]:
        """Staging directories of saves still being written (retention must leave them alone)."""
        handle = self.handle
        return {handle.staging} if handle is not None and not handle.done() else set()

    def group(self) -> dist.ProcessGroup | None:
        """The gloo group background writers commit over (None in a world of one); made once per default group and
        manager, with the manager's timeout (else torch's default).

        Every rank must call this at the same point (``async_save`` does, before returning, after the previous save
        has finished): making a group is a collective on the default group.
        """
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return None
        manager = DistributedManager() if DistributedManager.is_initialized() else None
        made_for = (dist.group.WORLD, 0 if manager is None else manager.epoch)
        if self._made_for is None or self._made_for[0] is not made_for[0] or self._made_for[1] != made_for[1]:
            # NOTE: remade for every manager, not only for a new default group: a default group the user made outlives
            # shutdown(), and a group kept from an earlier manager kept that manager's timeout (a background commit
            # then waited out a 30 s hang where the new manager said 6 s: the async-hang fault cell, in rank pools
            # whose worker had saved in the background under another test's manager).
            self.release_group()
            self._group = dist.new_group(backend="gloo", timeout=dist.default_pg_timeout if manager is None
                                         else manager.timeout)
            self._made_for = made_for
        return self._group

    def release_group(self) -> None:
        """Destroy the checkpoint group if it is still live (the manager's ``shutdown`` calls this once the pending save
        has finished; a default group the manager made took it down already)."""
        group, self._group, self._made_for = self._group, None, None
        if group is not None and group in live_process_groups():
            dist.destroy_process_group(group)


#: The process's one in-flight background save (a process writes one checkpoint at a time).
IN_FLIGHT = InFlight()
