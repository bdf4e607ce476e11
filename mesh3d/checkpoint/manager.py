"""``CheckpointManager``: ``root/step-NNNNNNNN`` directories, a ``latest`` pointer, keep-last-N.

``latest`` is updated (tmp + fsync + rename) only after a checkpoint is committed, and a
step directory counts only if its ``index.json`` exists, so a crash at any point leaves
the previous checkpoint as the one to resume from. Pruning removes the oldest complete
checkpoints beyond ``keep_last`` and this manager's stale staging directories, never the staging
directory of a save still being written (``async_save`` commits, points ``latest`` and prunes on
its writer thread, and a process has at most one save in flight: every save waits for the last).

Usage::

    manager = CheckpointManager("runs/exp1/ckpt", keep_last=3)
    info = manager.load(model, optimizer, data=loader)     # None on a fresh run
    manager.save(model, optimizer, step=100, data=loader)  # all ranks
    manager.async_save(model, optimizer, step=200)         # returns once staged; manager.wait() to finish
    manager.maybe_save(model, optimizer, step=step, every=100, data=loader)  # every step: periodic + preemption
"""

from __future__ import annotations

import os
import re
import shutil
from typing import Any

import torch
from torch import nn

from mesh3d.checkpoint.background import async_save
from mesh3d.checkpoint.comm import raise_if_any_failed, world
from mesh3d.checkpoint.inflight import IN_FLIGHT, AsyncSave
from mesh3d.checkpoint.index import INDEX_NAME
from mesh3d.checkpoint.load import LoadInfo, load
from mesh3d.checkpoint.save import StageHook, save, write_file_atomic
from mesh3d.manager import DistributedManager
from mesh3d.preempt import PREEMPTED_EXIT_CODE, agree_to_stop

__all__ = ["CheckpointManager"]

_STEP_DIR = re.compile(r"^step-(\d+)$")
_STAGING = re.compile(r"^\.step-\d+\.tmp-[0-9a-f]+$")


class CheckpointManager:
    """Numbered checkpoints under ``root`` with a ``latest`` pointer and retention.

    Usage: ``manager = CheckpointManager("runs/exp/ckpt", keep_last=3); info = manager.load(model, opt)``
    """

    def __init__(self, root: str | os.PathLike, keep_last: int = 3) -> None:
        if not isinstance(keep_last, int) or keep_last < 1:
            raise ValueError(f"keep_last={keep_last!r} must be an int >= 1")
        self.root, self.keep_last = os.path.abspath(os.fspath(root)), keep_last

    def path_for(self, step: int) -> str:
        return os.path.join(self.root, f"step-{step:08d}")

    def steps(self) -> list[int]:
        """Steps of the complete checkpoints under root, ascending."""
        if not os.path.isdir(self.root):
            return []
        found = []
        for name in os.listdir(self.root):
            m = _STEP_DIR.match(name)
            if m and os.path.isfile(os.path.join(self.root, name, INDEX_NAME)):
                found.append(int(m.group(1)))
        return sorted(found)

    def latest(self) -> str | None:
        """The newest complete checkpoint: the ``latest`` pointer if it is valid, else a scan."""
        pointer = os.path.join(self.root, "latest")
        try:
            name = open(pointer).read().strip()
            if _STEP_DIR.match(name) and os.path.isfile(os.path.join(self.root, name, INDEX_NAME)):
                return os.path.join(self.root, name)
        except OSError:
            pass
        steps = self.steps()
        return self.path_for(steps[-1]) if steps else None

    def save(self, model: nn.Module, optimizer: torch.optim.Optimizer | None = None, *, step: int,
             extra: Any = None, data: Any = None, stage_hook: StageHook | None = None) -> str:
        """Save ``root/step-<step>`` (all ranks), then point ``latest`` at it and prune (rank 0).
        ``stage_hook`` is ``checkpoint.save``'s (progress, fault injection)."""
        IN_FLIGHT.wait()  # before touching root: a pending save's failure is raised first, on every rank
        rank, _ = world()
        if rank == 0:
            os.makedirs(self.root, exist_ok=True)
        path = save(self.path_for(step), model, optimizer, step=step, extra=extra, data=data, stage_hook=stage_hook)
        error = None
        if rank == 0:
            try:
                self._publish(path)
            except OSError as err:
                error = f"{type(err).__name__}: {err}"
        raise_if_any_failed(error, f"updating {self.root}/latest")
        return path

    def async_save(self, model: nn.Module, optimizer: torch.optim.Optimizer | None = None, *, step: int,
                   extra: Any = None, data: Any = None, stage_hook: StageHook | None = None) -> AsyncSave:
        """Like ``save`` but returns once the state is staged; the writer commits, updates ``latest`` and prunes.

        Usage: ``manager.async_save(model, opt, step=step)`` every N steps, ``manager.wait()`` at the end.
        ``stage_hook`` is ``checkpoint.async_save``'s.
        """
        IN_FLIGHT.wait()
        rank, _ = world()
        if rank == 0:
            os.makedirs(self.root, exist_ok=True)
        return async_save(self.path_for(step), model, optimizer, step=step, extra=extra, data=data,
                          stage_hook=stage_hook, on_commit=self._publish)

    def wait(self) -> None:
        """Finish the save still being written, if any (raises its failure on every rank)."""
        IN_FLIGHT.wait()

    def maybe_save(self, model: nn.Module, optimizer: torch.optim.Optimizer | None = None, *, step: int,
                   every: int | None = None, data: Any = None, extra: Any = None, exit: bool = True) -> bool:
        """Call at every step boundary, on every rank: a background save every ``every`` steps, and preemption.

        Usage: ``manager.maybe_save(model, opt, step=step, every=100, data=loader)`` after each optimizer step.

        ``step`` counts the steps done (a resumed run starts from ``info.step``). One small all-reduce agrees on
        the stop flag (``DistributedManager.initialize(stop_signals=...)``): when any rank got a stop signal,
        every rank saves ``step`` (with ``data``'s cursor), waits until it is committed and ``latest`` points at
        it, and then, with ``exit=True``, shuts down and exits with status 75 (``PREEMPTED_EXIT_CODE``, which a
        job script requeues: docs/recipes.md). Returns whether it started a save.
        """
        if DistributedManager.is_initialized():
            stop = DistributedManager().should_stop()
        else:
            stop = agree_to_stop(None)
        if not (stop or (every is not None and step % every == 0)):
            return False
        self.async_save(model, optimizer, step=step, extra=extra, data=data)
        if stop:
            self.wait()
            if exit:
                DistributedManager.shutdown()
                raise SystemExit(PREEMPTED_EXIT_CODE)
        return True

    def _publish(self, path: str) -> None:
        """Rank 0, after ``path`` is committed: point ``latest`` at it, then apply retention."""
        write_file_atomic(os.path.join(self.root, "latest"), f"{os.path.basename(path)}\n".encode())
        self._prune(int(_STEP_DIR.match(os.path.basename(path)).group(1)))

    def _prune(self, newest: int) -> None:
        for step in self.steps()[: -self.keep_last]:
            if step != newest:
                shutil.rmtree(self.path_for(step), ignore_errors=True)
        writing = IN_FLIGHT.staging_dirs()
        for name in os.listdir(self.root):
            path = os.path.join(self.root, name)
            if _STAGING.match(name) and path not in writing:  # left by a killed save; ours has committed
                shutil.rmtree(path, ignore_errors=True)

    def load(self, model: nn.Module, optimizer: torch.optim.Optimizer | None = None, *,
             strict: bool = True, data: Any = None) -> LoadInfo | None:
        """Load the newest complete checkpoint (and ``data``'s state, see ``load``), or return None when there is
        none (a pending save is finished first)."""
        IN_FLIGHT.wait()
        path = self.latest()
        if path is None:
            return None
        return load(path, model, optimizer, strict=strict, data=data)
