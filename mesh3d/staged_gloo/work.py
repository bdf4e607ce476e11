"""The work a staged gloo collective returns: ``wait()`` waits for gloo, then copies the received data to the device.

Usage (``StagedGlooGroup`` makes these; callers only ``wait()``)::

    work = StagedWork("allreduce", [gloo_work], back=[(host_buf, cuda_t)], after=event, pool=pool, lent=[host_buf])
    work.wait()        # gloo done; cuda_t holds the result in the caller's current stream order
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from mesh3d.staged_gloo.buffers import HostBuffers

__all__ = ["StagedWork"]


class StagedWork(dist.Work):
    """One collective's gloo works and the host-to-device copies that finish it, done once, at the first ``wait()``."""

    def __init__(self, op: str, inner: Sequence[dist.Work], back: Sequence[tuple[torch.Tensor, torch.Tensor]],
                 after: Any, pool: HostBuffers, lent: Sequence[torch.Tensor]) -> None:
        super().__init__()
        self._op, self._inner, self._back, self._after = op, list(inner), list(back), after
        self._pool, self._lent = pool, list(lent)
        self._finished = False

    def wait(self, timeout: timedelta = timedelta(0)) -> bool:
        """Wait for gloo (each inner wait bounded by ``timeout``, or the group's timeout), then copy back. Raises what
        gloo raised (a closed connection, a timeout); the device tensors are then not written."""
        if self._finished:
            return True
        for work in self._inner:
            work.wait(timeout) if timeout else work.wait()
        copies = self._pool.copies
        copies.note("wait", self._op)
        fence = None
        if self._back:
            copies.note("to_device", self._op)
            fence = copies.to_device(self._back, self._after)
            self._pool.stats.bytes_to_device += sum(d.numel() * d.element_size() for _, d in self._back)
        self._pool.give_back(self._lent, fence)
        self._finished = True
        self._back = self._lent = []
        return True

    def is_completed(self) -> bool:
        """Whether gloo has finished (``wait()`` then returns at once, after the copies back)."""
        return self._finished or all(work.is_completed() for work in self._inner)

    def is_success(self) -> bool:
        return self.is_completed() and self.exception() is None

    def exception(self) -> Any:
        for work in self._inner:
            if work.is_completed() and work.exception() is not None:
                return work.exception()
        return None

    def source_rank(self) -> int:
        """The sender of a ``recv_anysource`` (the one inner work's)."""
        return self._inner[0].source_rank()

    def get_future(self) -> torch.futures.Future:
        raise RuntimeError(
            f"the host-staged gloo transport ({self._op}) supports Work.wait(), not get_future(): its copies back to the "
            "device run at wait(). Call wait(), or use backend='nccl' where a future is needed (DDP comm hooks)")
