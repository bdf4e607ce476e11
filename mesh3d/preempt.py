"""Preemption: a signal sets a flag, every rank agrees on it at a step boundary, one checkpoint, exit for requeue.

Usage::

    dm = DistributedManager.initialize(batch=-1, stop_signals=("SIGUSR1",))   # or MESH3D_STOP_SIGNALS=SIGUSR1
    manager = CheckpointManager("ckpt")
    step = manager.load(model, opt, data=loader).step if manager.latest() else 0
    for batch in loader:
        train_step(batch); step += 1
        manager.maybe_save(model, opt, step=step, every=1000, data=loader)   # on a stop: save, exit with 75

The handler only sets a flag: saving inside a signal handler would run collectives at an arbitrary point of
the loop, on whichever rank got the signal (Lightning#21407). ``agree_to_stop`` ORs the flag over every rank
(one all-reduce of one int), so a signal delivered to one rank stops all of them at the same step. A second
signal of the same kind restores the default action and re-sends it: a scheduler that insists, or Ctrl-C
pressed twice, still ends the process. Exit status 75 (``PREEMPTED_EXIT_CODE``, EX_TEMPFAIL) tells a job
script to requeue (docs/recipes.md).
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Iterable
from types import FrameType

import torch
import torch.distributed as dist

from mesh3d.faults.beat import WAITING

__all__ = ["PREEMPTED_EXIT_CODE", "STOP", "StopSignals", "agree_to_stop", "parse_signals"]

WAITING.add(__file__)  # NOTE: its frames wait on other ranks (the heartbeat says so: mesh3d/faults/beat.py)

#: The exit status after a preemption checkpoint: EX_TEMPFAIL ("try again"), for the job script to requeue on.
PREEMPTED_EXIT_CODE = 75

_ENV = "MESH3D_STOP_SIGNALS"


def parse_signals(signals: Iterable[int | str] | None) -> tuple[signal.Signals, ...]:
    """``("SIGUSR1", "TERM", 15)`` as signals; None reads ``MESH3D_STOP_SIGNALS`` (comma separated, may be unset).

    Usage: ``parse_signals(["SIGUSR1"])  # (<Signals.SIGUSR1: 10>,)``
    """
    if signals is None:
        signals = [s.strip() for s in os.environ.get(_ENV, "").split(",") if s.strip()]
    elif isinstance(signals, (str, int)):
        signals = [signals]
    out = []
    for s in signals:
        try:
            if isinstance(s, str):
                out.append(signal.Signals[s.upper() if s.upper().startswith("SIG") else f"SIG{s.upper()}"])
            else:
                out.append(signal.Signals(s))
        except (KeyError, ValueError):
            raise ValueError(f"stop signal {s!r} is not a signal name or number; use e.g. 'SIGUSR1' or 'SIGTERM' "
                             f"(or set {_ENV}=SIGUSR1)") from None
    if any(s in (signal.SIGKILL, signal.SIGSTOP) for s in out):
        raise ValueError("SIGKILL and SIGSTOP cannot be caught; choose SIGTERM or SIGUSR1 (sbatch --signal=B:USR1@120)")
    return tuple(dict.fromkeys(out))


class StopSignals:
    """The flag the stop signals set, and the handlers that set it (one per process: ``STOP``).

    Usage: ``STOP.install(("SIGUSR1",))``; ``STOP.requested``; ``STOP.uninstall()``
    """

    def __init__(self) -> None:
        self.requested = False
        self.received: signal.Signals | None = None
        self._previous: dict[signal.Signals, object] = {}

    def install(self, signals: Iterable[int | str] | None) -> tuple[signal.Signals, ...]:
        """Handle ``signals`` from now on (a fresh flag: a new mesh is a new run); returns them."""
        chosen = parse_signals(signals)
        if chosen and threading.current_thread() is not threading.main_thread():
            raise ValueError("stop signals can only be installed from the main thread (Python runs signal handlers "
                             "there); call DistributedManager.initialize(stop_signals=...) from the main thread")
        self.requested, self.received = False, None
        for sig in chosen:
            if sig not in self._previous:
                self._previous[sig] = signal.signal(sig, self._handle)
        return chosen

    def uninstall(self) -> None:
        """Put back the handlers that were there before (at shutdown); the flag is kept."""
        for sig, previous in self._previous.items():
            if signal.getsignal(sig) == self._handle:
                # NOTE: None means a handler installed outside Python (faulthandler.register): it cannot be put back.
                signal.signal(sig, signal.SIG_DFL if previous is None else previous)
        self._previous.clear()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.requested and self.received == signum:  # the second one: do what it would have done
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        self.requested, self.received = True, signal.Signals(signum)


#: The process's stop flag.
STOP = StopSignals()


def agree_to_stop(group: dist.ProcessGroup | None, device: torch.device | None = None) -> bool:
    """True on every rank of ``group`` iff any of them has the stop flag (one all-reduce of one int).

    Usage: ``if agree_to_stop(dm.group("world")): ...`` (``DistributedManager.should_stop`` calls it)
    """
    flag = torch.tensor([int(STOP.requested)], dtype=torch.int32, device=device)  # nccl: the rank's GPU
    if dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    return bool(flag.item())
