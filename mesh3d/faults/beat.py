"""One rank's heartbeat: a counter that moves while the process lives, what it is doing, and where its main thread is.

Usage::

    beat = Beat(seq=3, status=ALIVE, doing="checkpoint save", where=main_thread_where())
    Beat.decode(beat.encode()) == beat

A watcher never compares clocks across hosts: a peer is silent when its ``seq`` has not moved for some time by
the watcher's own clock.
"""

from __future__ import annotations

import json
import os
import sys
import threading
from dataclasses import asdict, dataclass

import torch.distributed

__all__ = ["ALIVE", "DONE", "FAILED", "WAITING", "Beat", "WaitingPlaces", "main_thread_where"]

#: Statuses: running; ended with an error (``detail`` says which); shut down cleanly.
ALIVE, FAILED, DONE = "alive", "failed", "done"

#: Frames in these paths are machinery; the line a user recognises is the innermost frame outside them.
_MACHINERY = ("/torch/", "/mesh3d/", "/threading.py", "/contextlib.py", "/runpy.py", "/rankpool/")


def _normal(path: str) -> str:
    return os.path.normcase(os.path.abspath(path))


class WaitingPlaces:
    """The source files (and folders) whose frames wait on other ranks: a main thread with such a frame on its stack is
    waiting in a collective or an exchange. Each module that waits adds its own ``__file__`` when it is imported
    (``WAITING.add(__file__)``), so a module that moves takes its place with it; torch.distributed's folder is here
    from the start.

    Usage: ``WAITING.add(__file__)`` at the top of a module whose functions wait on peers; ``path in WAITING``
    """

    def __init__(self, *folders: str) -> None:
        self._files: set[str] = set()
        self._folders = tuple(_normal(f) + os.sep for f in folders)

    def add(self, module_file: str) -> None:
        self._files.add(_normal(module_file))

    def __contains__(self, path: str) -> bool:
        path = _normal(path)
        return path in self._files or path.startswith(self._folders)


#: Where a main thread waits on other ranks: torch.distributed's package, and mesh3d's modules that add themselves (the
#: domain exchange and its stop protocol, the checkpointer's collective steps, the preemption agreement).
WAITING = WaitingPlaces(os.path.dirname(torch.distributed.__file__))


@dataclass(frozen=True)
class Beat:
    """A heartbeat as stored: ``seq`` moves every interval; ``waiting`` is True inside a collective."""

    seq: int
    status: str = ALIVE
    doing: str = ""
    where: str = ""
    waiting: bool = False
    detail: str = ""

    def encode(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))

    @classmethod
    def decode(cls, raw: bytes | str) -> Beat:
        return cls(**json.loads(raw))

    def describe(self) -> str:
        """``doing X, at train.py:40 in step (waiting in a collective)``."""
        parts = [self.doing or "between steps"]
        if self.where:
            parts.append(f"at {self.where}")
        text = ", ".join(parts)
        return text + (" (waiting in a collective)" if self.waiting else "")


def main_thread_where() -> tuple[str, bool]:
    """The main thread's innermost line outside torch and mesh3d, and whether it is waiting in a collective."""
    frame = sys._current_frames().get(threading.main_thread().ident)  # documented, CPython and PyPy
    user, innermost, waiting = "", "", False
    while frame is not None:
        path = frame.f_code.co_filename.replace("\\", "/")
        here = f"{path.rsplit('/', 1)[-1]}:{frame.f_lineno} in {frame.f_code.co_name}"
        innermost = innermost or here
        waiting = waiting or frame.f_code.co_filename in WAITING
        if not user and not any(part in path for part in _MACHINERY):
            user = here
        frame = frame.f_back
    if user and innermost and user != innermost:
        return f"{user} (inside {innermost})", waiting
    return user or innermost, waiting
