"""Host staging for accelerator tensors: one reusable pinned buffer instead of a pageable copy per tensor.

Saving a CUDA tensor through ``.cpu()`` copies into freshly allocated pageable memory, at a fraction of
the bus speed (measured on an H100: 1 GB took 0.70 s, more than the file writes and fsync together);
into pinned memory the same copy runs at bus speed. Pinned allocation is slow itself, so save and load
keep one pinned buffer, grown to the largest tensor they move, and reuse it for every tensor.

Background saves copy host tensors with whichever of two copy kernels has been faster on this machine:
``Tensor.copy_`` (torch's vectorised loop, in the tensor's own dtype) or the C library's ``memmove`` (for large
copies glibc writes whole cache lines without reading them first: ``rep movsb`` or non-temporal stores). Neither
wins everywhere. On the 2-core VM, 4 ranks each copying 16 x 16 MB: ``copy_`` 46-73 ms against ``memmove``
53-83 ms in one session, and the other way round under heavy load from other jobs in another (0.150 s against
0.104 s). So the first two copies into a warm buffer time one kernel each, every later copy uses the faster per
byte (its time refreshed by each use), and every ``_REPROBE_EVERY``-th copy times the other again, to follow a
change of load. Large copies are split over ``torch.get_num_threads()`` threads (both kernels release the GIL).

Usage::

    staging = HostStaging()
    host = staging.to_host(cuda_tensor)        # a CPU view, valid until the next call
    host = staging.buffer_like(cuda_tensor)    # fill it (e.g. from a file), then cuda_tensor.copy_(host)
    copies, ready = staging.snapshot({"w": w})  # copies of many tensors at once (background saves)
"""

from __future__ import annotations

import ctypes
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import torch
from torch import nn

#: Each snapshot copy starts at a multiple of this many bytes, so every dtype's view is aligned.
_ALIGN = 64

#: Host copies at least this large are split over ``torch.get_num_threads()`` threads (as ``copy_`` would be).
_PARALLEL_BYTES = 64 * 2**20

#: Every this many timed copies, the kernel not in use is timed again.
_REPROBE_EVERY = 8

#: One host copy: (destination, source), flat, contiguous, of one dtype and length.
_Piece = tuple[torch.Tensor, torch.Tensor]

__all__ = ["HostStaging"]


def _plain_host_bytes(t: torch.Tensor) -> bool:
    """True when ``t``'s bytes are its values, contiguous in host memory (a byte copy copies it exactly)."""
    return (type(t) in (torch.Tensor, nn.Parameter) and t.device.type == "cpu" and t.is_contiguous()
            and not t.is_conj() and not t.is_neg() and t.numel() > 0)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _copy_all(pieces: list[_Piece]) -> None:
    for dst, src in pieces:
        dst.copy_(src)  # torch releases the GIL for the copy


def _memmove_all(pieces: list[_Piece]) -> None:
    for dst, src in pieces:
        ctypes.memmove(dst.data_ptr(), src.data_ptr(), _nbytes(src))  # a foreign call: releases the GIL


#: The copy kernels a snapshot chooses between (see the module docstring).
_KERNELS: dict[str, Callable[[list[_Piece]], None]] = {"copy_": _copy_all, "memmove": _memmove_all}


def _split(pieces: list[_Piece], parts: int) -> list[list[_Piece]]:
    """``pieces`` cut at element boundaries into at most ``parts`` lists of (nearly) equal byte counts."""
    share = -(-sum(_nbytes(src) for _, src in pieces) // parts)
    out: list[list[_Piece]] = []
    current: list[_Piece] = []
    filled = 0
    for dst, src in pieces:
        size, start = src.element_size(), 0
        while start < src.numel():
            take = min(src.numel() - start, max(1, (share - filled) // size))
            current.append((dst[start : start + take], src[start : start + take]))
            start, filled = start + take, filled + take * size
            if filled >= share:
                out.append(current)
                current, filled = [], 0
    return out + ([current] if current else [])


class _KernelChoice:
    """Which copy kernel to run next, from the seconds per byte each took when last timed."""

    def __init__(self) -> None:
        self.seconds_per_byte: dict[str, float] = {}
        self._timed = 0

    def next(self) -> str:
        untimed = [name for name in _KERNELS if name not in self.seconds_per_byte]
        if untimed:
            return untimed[0]
        best = min(self.seconds_per_byte, key=self.seconds_per_byte.__getitem__)
        if self._timed % _REPROBE_EVERY == 0:
            return next(name for name in _KERNELS if name != best)
        return best

    def record(self, name: str, seconds: float, nbytes: int) -> None:
        self.seconds_per_byte[name] = seconds / nbytes
        self._timed += 1


class HostStaging:
    """One growing host buffer (pinned when CUDA is present) shared by every tensor of a save or load."""

    def __init__(self) -> None:
        self._buffer: torch.Tensor | None = None
        self._pool: ThreadPoolExecutor | None = None  # made by the first large multi-threaded snapshot
        self._pool_threads = 0
        self.kernels = _KernelChoice()  # which host copy kernel is faster here, as timed by earlier snapshots

    def _move(self, pieces: list[_Piece], timed: bool) -> None:
        """Run the copies with the kernel chosen, over ``torch.get_num_threads()`` threads when they are large; when
        ``timed`` (the buffer's pages were already touched: no page faults), time it for the choice."""
        if not pieces:
            return
        name = self.kernels.next()
        kernel, nbytes, begin = _KERNELS[name], sum(_nbytes(src) for _, src in pieces), time.perf_counter()
        threads = torch.get_num_threads()
        if threads < 2 or nbytes < _PARALLEL_BYTES:
            kernel(pieces)
        else:
            if self._pool is None or self._pool_threads != threads - 1:
                if self._pool is not None:
                    self._pool.shutdown(wait=False)
                self._pool = ThreadPoolExecutor(threads - 1, thread_name_prefix="mesh3d-host-copy")
                self._pool_threads = threads - 1
            first, *rest = _split(pieces, threads)
            pending = [self._pool.submit(kernel, part) for part in rest]
            kernel(first)
            for done in pending:
                done.result()
        if timed:
            self.kernels.record(name, time.perf_counter() - begin, nbytes)

    def buffer_like(self, t: torch.Tensor) -> torch.Tensor:
        """A contiguous CPU tensor of ``t``'s shape and dtype in the shared buffer (overwritten by the next call)."""
        nbytes = t.numel() * t.element_size()
        return self._reserve(nbytes, t.device.type == "cuda")[:nbytes].view(t.dtype).view(t.shape)

    def _reserve(self, nbytes: int, pinned: bool) -> torch.Tensor:
        if self._buffer is None or self._buffer.numel() < nbytes or (pinned and not self._buffer.is_pinned()):
            self._buffer = None  # free the smaller one first
            self._buffer = torch.empty(max(nbytes, 1), dtype=torch.uint8, pin_memory=pinned)
        return self._buffer

    def snapshot(self, tensors: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], torch.cuda.Event | None]:
        """Copies of all ``tensors`` packed into the shared buffer (valid until the next call), and an event.

        CPU tensors are copied before this returns. Accelerator tensors are copied with ``non_blocking``
        on the current stream, so later work on that stream (the optimizer step) runs after the copy;
        the returned event is recorded after the copies: synchronize on it before reading them.
        """
        sizes = {k: t.numel() * t.element_size() for k, t in tensors.items()}
        starts, end = {}, 0
        for k, n in sizes.items():
            starts[k], end = end, end + -(-n // _ALIGN) * _ALIGN
        on_device = any(t.device.type == "cuda" for t in tensors.values())
        # NOTE: is_pinned() asked only for device state: on a CUDA machine it may start the CUDA context
        warm = self._buffer is not None and self._buffer.numel() >= end and (not on_device or self._buffer.is_pinned())
        buffer = self._reserve(end, on_device)
        copies, pieces = {}, []
        for k, t in tensors.items():
            copy = buffer[starts[k] : starts[k] + sizes[k]].view(t.dtype).view(t.shape)
            if _plain_host_bytes(t):
                pieces.append((copy.view(-1), t.detach().view(-1)))
            else:
                copy.copy_(t.detach(), non_blocking=t.device.type == "cuda")
            copies[k] = copy
        self._move(pieces, timed=warm)
        event = None
        if on_device:
            event = torch.cuda.Event()
            event.record()
        return copies, event

    def to_host(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` as a contiguous CPU tensor: itself when it already is one, else a copy in the shared buffer."""
        if t.device.type == "cpu":
            return t.contiguous()
        host = self.buffer_like(t)
        host.copy_(t)  # synchronous: the caller reads it right away
        return host
