"""The host buffers of the staged gloo transport: taken per collective, given back after it, reused by size and dtype.

Usage::

    pool = HostBuffers(copies)
    buf = pool.take(device_tensor)      # a 1-D host buffer of its numel and dtype (a free one if any)
    pool.give_back([buf], fence)        # reusable once ``copies.done(fence)``
    pool.stats.allocated, pool.stats.reused
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from mesh3d.staged_gloo.copies import DeviceCopies

__all__ = ["HostBuffers", "StagingStats"]

#: Free buffers kept per (dtype, numel); more are dropped (a burst of one size does not pin memory forever).
KEEP_PER_SIZE = 8


@dataclass
class StagingStats:
    """What the transport did in this process, since it was made or ``reset()``."""

    staged_ops: int = 0        #: collectives and point-to-point ops that moved at least one tensor through the host
    plain_ops: int = 0         #: ops whose tensors gloo could take as they were (CPU tensors)
    bytes_to_host: int = 0
    bytes_to_device: int = 0
    allocated: int = 0         #: host buffers made
    reused: int = 0            #: host buffers taken from the free list

    def reset(self) -> None:
        for name in self.__dataclass_fields__:
            setattr(self, name, 0)


class HostBuffers:
    """Host buffers by (dtype, numel); a buffer goes back with the fence of the copy still reading it."""

    def __init__(self, copies: DeviceCopies, stats: StagingStats | None = None) -> None:
        self.copies = copies
        self.stats = stats if stats is not None else StagingStats()
        self._free: dict[tuple[torch.dtype, int], list[tuple[torch.Tensor, Any]]] = {}
        self._lock = threading.Lock()  # NOTE: collectives may be posted from more than one thread

    def take(self, like: torch.Tensor) -> torch.Tensor:
        """A 1-D host buffer for ``like``'s elements: a free one whose copies have finished, else a new one."""
        key = (like.dtype, like.numel())
        with self._lock:
            free = self._free.get(key, [])
            for i, (buf, fence) in enumerate(free):
                if self.copies.done(fence):
                    del free[i]
                    self.stats.reused += 1
                    return buf
            self.stats.allocated += 1
        return self.copies.host_buffer(like.numel(), like.dtype)

    def give_back(self, buffers: Iterable[torch.Tensor], fence: Any) -> None:
        """``buffers`` may be taken again once ``copies.done(fence)`` (gloo has finished with them already)."""
        with self._lock:
            for buf in buffers:
                free = self._free.setdefault((buf.dtype, buf.numel()), [])
                if len(free) < KEEP_PER_SIZE:
                    free.append((buf, fence))

    def clear(self) -> None:
        """Drop every free buffer (they are freed once no copy holds them)."""
        with self._lock:
            self._free.clear()
