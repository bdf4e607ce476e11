"""One report per cause when a multi-rank job ends on an error every rank shares.

When a bad request fails on every rank alike (a mesh that does not fit the world, a checkpoint that is not there),
each rank's traceback says the same thing: N copies of it, then the launcher's report of N failures. Errors that
mesh3d knows every rank raised together are marked with the ranks that share them (``mark_shared``); when one ends
the process, the lowest of those ranks prints the cause once (naming the ranks, the line of the user's code it came
from, and how to see every traceback), and the others print nothing. ``MESH3D_TRACEBACK=1`` restores Python's own
report on every rank. An error not marked (a bug, an error of one rank) is reported as Python reports it.

Usage (``DistributedManager.initialize`` installs it for a world of more than one rank)::

    SUMMARY.install(rank=info.rank, world_size=info.world_size)
    raise mark_shared(ValueError("batch=3 does not divide world size 8 ..."), range(world_size))
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import sys
import time
import traceback
from collections.abc import Iterable
from types import TracebackType

from mesh3d.faults.exit_order import QUIET_EXIT_DELAY_S, ExitOrder

__all__ = ["SUMMARY", "TRACEBACK_ENV", "ErrorSummary", "mark_shared", "ranks_text", "shared_ranks"]

#: Set to 1 for Python's full report of every rank's error instead of one summary.
TRACEBACK_ENV = "MESH3D_TRACEBACK"
_ATTR = "_mesh3d_shared_ranks"
_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def mark_shared(err: BaseException, ranks: Iterable[int]) -> BaseException:
    """Mark ``err`` as raised alike on every rank in ``ranks`` (global ranks); returns ``err`` for ``raise``."""
    setattr(err, _ATTR, tuple(sorted(set(ranks))))
    return err


def shared_ranks(err: BaseException | None) -> tuple[int, ...] | None:
    """The ranks ``err`` (or an error it was raised from) is shared by; None when it is this rank's own."""
    seen: set[int] = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        ranks = getattr(err, _ATTR, None)
        if ranks is not None:
            return ranks
        err = err.__cause__ or err.__context__
    return None


def ranks_text(ranks: Iterable[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"ranks 0-2, 5"``; one rank -> ``"rank 3"``."""
    ranks = sorted(ranks)
    runs: list[list[int]] = []
    for r in ranks:
        if runs and r == runs[-1][-1] + 1:
            runs[-1].append(r)
        else:
            runs.append([r])
    parts = [f"{run[0]}-{run[-1]}" if len(run) > 2 else ", ".join(map(str, run)) for run in runs]
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(parts)


def _user_frame(tb: TracebackType | None) -> str:
    """``"at train.py line 12: checkpoint.load(path, model)"``: the innermost frame outside mesh3d, torch and
    site-packages (the line of the user's code the error came from), or ""."""
    where = ""
    for frame in traceback.extract_tb(tb):
        path = os.path.abspath(frame.filename)
        if path.startswith(_PACKAGE_DIR + os.sep) or "site-packages" in path or "<frozen" in path:
            continue
        shown = os.path.relpath(path)
        where = f"at {path if shown.startswith('..') else shown} line {frame.lineno}" + \
            (f": {frame.line.strip()}" if frame.line else "")
    return where


def summary(err: BaseException, ranks: tuple[int, ...], world_size: int, tb: TracebackType | None) -> str:
    """The report: the error's own lines (one per cause), the ranks that share it, where in the user's code."""
    every = "every rank" if len(ranks) == world_size else f"{len(ranks)} of {world_size} ranks"
    lines = f"{type(err).__name__}: {err}".splitlines() or [type(err).__name__]
    where = _user_frame(tb)
    tail = f"({ranks_text(ranks)}: {every}, reported once; {TRACEBACK_ENV}=1 shows each rank's traceback)"
    return "\n".join([f"mesh3d: error on {ranks_text(ranks)}: {lines[0]}", *lines[1:],
                      *([f"  {where}"] if where else []), f"  {tail}"])


def _end_now() -> None:
    """End the process at once with the status of an uncaught error (1), streams flushed.

    NOTE: under torchrun, the moment a rank says it is done (or sees the reporting rank done) is the moment its process
    must end: what is left after this last atexit handler (the handlers registered before mesh3d's, the interpreter's
    own teardown of torch and gloo) took seconds on a busy machine, and torchrun's next poll then ended the reporting
    rank with SIGTERM after a quiet rank had ended (test_launch_integration's reporting-rank-late case). mesh3d's own
    teardown (a pending save landing, the groups) ran before this handler."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(1)


class ErrorSummary:
    """``sys.excepthook`` for an error shared by several ranks: the lowest of them reports it once (and writes it to
    torchrun's error file, so the launcher's report names the cause), the others end quietly."""

    def __init__(self) -> None:
        self.rank = 0
        self.world_size = 1
        self._previous = None
        self._quiet = False
        self._reported = False
        self._order: ExitOrder | None = None

    def install(self, rank: int, world_size: int) -> None:
        """Chain this hook into ``sys.excepthook`` (once per process) for ``rank`` of ``world_size``.

        NOTE: called before the manager registers its teardown with ``atexit`` (last registered, first run), so
        ``_exit_in_order`` runs after the teardown, as the last thing before the process ends (exit_order.py: under
        torchrun the reporting rank ends once every rank sharing the error has got to it, the others after it)."""
        self.rank, self.world_size = rank, world_size
        if self._previous is None and world_size > 1:
            self._previous = sys.excepthook
            sys.excepthook = self
            atexit.register(self._exit_in_order)

    def _exit_in_order(self) -> None:
        order = self._order
        if self._reported and order is not None:
            order.wait_for_arrivals()
            order.done()
            _end_now()
        elif self._quiet and order is not None:
            order.wait_until_done()
            _end_now()
        elif self._quiet:
            time.sleep(QUIET_EXIT_DELAY_S)

    def __call__(self, kind: type[BaseException], value: BaseException, tb: TracebackType | None) -> None:
        ranks = shared_ranks(value)
        previous = self._previous or sys.__excepthook__
        if ranks is None or self.rank not in ranks or os.environ.get(TRACEBACK_ENV, "") not in ("", "0"):
            previous(kind, value, tb)
            return
        self._order = ExitOrder.under_torchrun(ranks)
        if self._order is not None:
            self._order.arrive()
        if self.rank != ranks[0]:
            self._quiet = True  # nothing printed; the process ends after the reporting rank's (_exit_in_order)
            return
        text = summary(value, ranks, self.world_size, tb)
        print(text, file=sys.stderr, flush=True)
        _write_error_file(text.splitlines()[0])
        self._reported = True


def _write_error_file(line: str) -> None:
    """torchrun's per-worker error file (``TORCHELASTIC_ERROR_FILE``), in the form its report reads: the report then
    shows this line instead of a link on how to record tracebacks."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path or os.path.exists(path):
        return
    data = {"message": {"message": line, "extraInfo": {"py_callstack": line, "timestamp": str(int(time.time()))}}}
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            json.dump(data, f)
    except OSError:
        pass  # the report falls back to torchrun's own text


#: The process's hook (installed by ``DistributedManager.initialize``).
SUMMARY = ErrorSummary()
