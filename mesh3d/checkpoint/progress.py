"""A dependency-free progress line on stderr for long checkpoint work (coalesce, verify).

Usage::

    bar = Progress(total_bytes, "coalesce")
    bar.update(n)        # redraws at most twice a second
    bar.close()
"""

from __future__ import annotations

import sys
import time
from typing import TextIO

__all__ = ["Progress"]


class Progress:
    """``label  42% 1.2/2.9 GB  350 MB/s`` on one refreshed stderr line; silent when disabled."""

    def __init__(self, total: int, label: str, enabled: bool = True, stream: TextIO | None = None) -> None:
        self.total, self.label, self.enabled = max(total, 1), label, enabled
        self.stream = stream or sys.stderr
        self.done, self.start, self._last = 0, time.perf_counter(), 0.0

    def update(self, n: int) -> None:
        self.done += n
        now = time.perf_counter()
        if self.enabled and (now - self._last >= 0.5 or self.done >= self.total):
            self._last = now
            rate = self.done / max(now - self.start, 1e-9)
            self.stream.write(f"\r{self.label} {100 * self.done / self.total:5.1f}% "
                              f"{self.done / 1e9:.2f}/{self.total / 1e9:.2f} GB {rate / 1e6:8.1f} MB/s")
            self.stream.flush()

    def close(self) -> None:
        if self.enabled:
            self.stream.write("\n")
            self.stream.flush()
