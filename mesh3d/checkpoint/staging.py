"""Host staging for accelerator tensors: one reusable pinned buffer instead of a pageable copy per tensor.

Saving a CUDA tensor through ``.cpu()`` copies into freshly allocated pageable memory, at a fraction of
the bus speed (measured on an H100: 1 GB took 0.70 s, more than the file writes and fsync together);
into pinned memory the same copy runs at bus speed. Pinned allocation is slow itself, so save and load
keep one pinned buffer, grown to the largest tensor they move, and reuse it for every tensor.

Usage::

    staging = HostStaging()
    host = staging.to_host(cuda_tensor)        # a CPU view, valid until the next call
    host = staging.buffer_like(cuda_tensor)    # fill it (e.g. from a file), then cuda_tensor.copy_(host)
"""

from __future__ import annotations

import torch

__all__ = ["HostStaging"]


class HostStaging:
    """One growing host buffer (pinned when CUDA is present) shared by every tensor of a save or load."""

    def __init__(self) -> None:
        self._buffer: torch.Tensor | None = None

    def buffer_like(self, t: torch.Tensor) -> torch.Tensor:
        """A contiguous CPU tensor of ``t``'s shape and dtype in the shared buffer (overwritten by the next call)."""
        nbytes = t.numel() * t.element_size()
        if self._buffer is None or self._buffer.numel() < nbytes:
            self._buffer = None  # free the smaller one first
            self._buffer = torch.empty(max(nbytes, 1), dtype=torch.uint8, pin_memory=t.device.type == "cuda")
        return self._buffer[:nbytes].view(t.dtype).view(t.shape)

    def to_host(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` as a contiguous CPU tensor: itself when it already is one, else a copy in the shared buffer."""
        if t.device.type == "cpu":
            return t.contiguous()
        host = self.buffer_like(t)
        host.copy_(t)  # synchronous: the caller reads it right away
        return host
