"""One rank's heartbeat: a counter that moves while the process lives, what it is doing, and where its main thread is.

Usage::

    beat = Beat(seq=3, status=ALIVE, doing="checkpoint save", where=main_thread_where())
    Beat.decode(beat.encode()) == beat

A watcher never compares clocks across hosts: a peer is silent when its ``seq`` has not moved for some time by
the watcher's own clock.
"""

from __future__ import annotations

import json
import sys
import threading
from dataclasses import asdict, dataclass

__all__ = ["ALIVE", "DONE", "FAILED", "Beat", "main_thread_where"]

#: Statuses: running; ended with an error (``detail`` says which); shut down cleanly.
ALIVE, FAILED, DONE = "alive", "failed", "done"

#: Frames in these paths are machinery; the line a user recognises is the innermost frame outside them.
_MACHINERY = ("/torch/", "/mesh3d/", "/threading.py", "/contextlib.py", "/runpy.py", "/rankpool/")
#: A main thread inside one of these waits on other ranks (a collective or an exchange).
_WAITING_IN = ("/torch/distributed/", "/mesh3d/domain/exchange", "/mesh3d/checkpoint/comm.py", "/mesh3d/preempt.py")


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
        waiting = waiting or any(part in path for part in _WAITING_IN)
        if not user and not any(part in path for part in _MACHINERY):
            user = here
        frame = frame.f_back
    if user and innermost and user != innermost:
        return f"{user} (inside {innermost})", waiting
    return user or innermost, waiting
