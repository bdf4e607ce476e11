"""The device side of host staging: which tensors a staged group moves through the host, and the copies that do it.

Usage (the transport calls these; a test swaps in its own ``DeviceCopies`` to run the logic on CPU ranks)::

    copies = CudaCopies()
    after = copies.mark(tensors)                   # an event on the caller's current stream
    copies.to_host([(device_t, host_buf)], after)  # on the staging stream, after ``after``; returns when done
    fence = copies.to_device([(host_buf, device_t)], after)  # on the staging stream; the current stream waits on it
    copies.done(fence)                             # may the host buffer be written again?
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import torch

__all__ = ["CudaCopies", "DeviceCopies"]


class DeviceCopies(Protocol):
    """What the staging transport needs from a device: the staging decision, ordering marks, the two copies."""

    def stages(self, t: torch.Tensor) -> bool:
        """Whether ``t`` goes through a host buffer (gloo cannot read or write it where it is)."""
        ...

    def mark(self, tensors: Sequence[torch.Tensor]) -> Any:
        """An ordering mark on the stream the caller's work on ``tensors`` runs on (a CUDA event), at the post."""
        ...

    def to_host(self, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]], after: Any) -> None:
        """Copy each (device tensor, host buffer) pair after ``after``; return once the host buffers hold the data."""
        ...

    def to_device(self, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]], after: Any) -> Any:
        """Copy each (host buffer, device tensor) pair after ``after``, order the caller's current stream after the
        copies, and return a fence: the host buffers may be written again once ``done(fence)``."""
        ...

    def done(self, fence: Any) -> bool:
        """Whether the copies behind ``fence`` (from ``to_device``; None: nothing in flight) have finished."""
        ...

    def host_buffer(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A new 1-D host buffer (page-locked where the device copies from it asynchronously)."""
        ...

    def note(self, step: str, op: str) -> None:
        """The transport reached ``step`` ("to_host", "post", "wait", "to_device") of collective ``op``."""
        ...


class CudaCopies:
    """Host staging of CUDA tensors: copies on one side stream per device, ordered by CUDA events.

    NOTE: the order a real CUDA exchange needs. Device to host: the side stream waits on an event recorded on the
    caller's current stream at the post (so the kernels that produced the data finish first), and the host waits
    for the copy before gloo reads the buffer. Host to device (at ``wait()``): the side stream waits on the same
    post event (earlier uses of the output buffer come first), copies, and the caller's current stream waits on
    the copy; ``record_stream`` tells the caching allocator the output was used on the side stream.
    """

    def __init__(self) -> None:
        self._streams: dict[int, torch.cuda.Stream] = {}

    def stages(self, t: torch.Tensor) -> bool:
        return t.is_cuda

    def _stream(self, device: torch.device) -> torch.cuda.Stream:
        index = device.index if device.index is not None else torch.cuda.current_device()
        stream = self._streams.get(index)
        if stream is None:
            stream = self._streams[index] = torch.cuda.Stream(device=index)
        return stream

    @staticmethod
    def _device(tensors: Sequence[torch.Tensor]) -> torch.device:
        devices = {t.device for t in tensors}
        if len(devices) != 1:
            raise ValueError(f"one collective on the host-staged gloo transport takes tensors of one CUDA device, "
                             f"got {sorted(str(d) for d in devices)}; post one collective per device")
        return devices.pop()

    def mark(self, tensors: Sequence[torch.Tensor]) -> Any:
        device = self._device(tensors)
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(device))
        return event

    def to_host(self, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]], after: Any) -> None:
        side = self._stream(self._device([d for d, _ in pairs]))
        side.wait_event(after)
        with torch.cuda.stream(side), torch.no_grad():  # NOTE: gloo would bypass autograd too
            for dev, host in pairs:
                host.view(dev.shape).copy_(dev, non_blocking=True)
        done = torch.cuda.Event()
        done.record(side)
        done.synchronize()  # NOTE: gloo reads the buffer from its own thread as soon as the op is posted

    def to_device(self, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]], after: Any) -> Any:
        device = self._device([d for _, d in pairs])
        side = self._stream(device)
        side.wait_event(after)
        with torch.cuda.stream(side), torch.no_grad():
            for host, dev in pairs:
                dev.copy_(host.view(dev.shape), non_blocking=True)
                dev.record_stream(side)
        done = torch.cuda.Event()
        done.record(side)
        torch.cuda.current_stream(device).wait_event(done)
        return done

    def done(self, fence: Any) -> bool:
        return fence is None or bool(fence.query())

    def host_buffer(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(numel, dtype=dtype, pin_memory=numel > 0)

    def note(self, step: str, op: str) -> None:
        pass
