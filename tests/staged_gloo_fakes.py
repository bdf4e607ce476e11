"""A stand-in device for the staged gloo transport on CPU ranks (imported on every rank by the tests).

``FakeDeviceCopies`` implements ``mesh3d.staged_gloo.DeviceCopies``: the tensors it ``stages`` (by default float64,
the "device" tensors of a test; other dtypes stay "host" tensors and go to gloo as they are) move through host
buffers exactly as CUDA tensors would, with CPU copies in place of the device copies, and every step is logged so a
test can check the order. ``hold_fences`` keeps each copy back "in flight" until ``finish_copies()``.

Usage::

    fake = FakeDeviceCopies()
    with STAGED.using(fake):
        group = dist.new_group(backend=STAGED_BACKEND)   # or DistributedManager.initialize(backend="gloo_staged")
    fake.log       # [("mark", 1), ("to_host", 1), ("post", "allreduce"), ("wait", "allreduce"), ("to_device", 1)]
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

__all__ = ["FakeDeviceCopies"]


class FakeDeviceCopies:
    """Copies between CPU tensors standing in for a device's; a log of every step; fences a test can hold open."""

    def __init__(self, stage: Callable[[torch.Tensor], bool] = lambda t: t.dtype == torch.float64) -> None:
        self._stage = stage
        self.log: list[tuple[str, Any]] = []
        self.made = 0                       # host buffers made
        self.marks = 0
        self.hold_fences = False
        self.open_fences: set[int] = set()  # copies back still "in flight"

    def stages(self, t: torch.Tensor) -> bool:
        return self._stage(t)

    def mark(self, tensors: Sequence[torch.Tensor]) -> int:
        self.marks += 1
        self.log.append(("mark", self.marks))
        return self.marks

    def to_host(self, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]], after: int) -> None:
        self.log.append(("to_host", after))
        for dev, host in pairs:  # NOTE: as CudaCopies, outside autograd (the data of tensors that require grad)
            assert host.data_ptr() != dev.data_ptr(), "the transport handed a device tensor as its own host buffer"
            with torch.no_grad():
                host.copy_(dev)

    def to_device(self, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]], after: int) -> int:
        self.log.append(("to_device", after))
        for host, dev in pairs:
            with torch.no_grad():
                dev.copy_(host)
        if self.hold_fences:
            self.open_fences.add(after)
        return after

    def done(self, fence: Any) -> bool:
        return fence not in self.open_fences

    def finish_copies(self) -> None:
        self.open_fences.clear()

    def host_buffer(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        self.made += 1
        return torch.full((numel,), float("nan")).to(dtype) if dtype.is_floating_point else torch.empty(numel, dtype=dtype)

    def note(self, step: str, op: str) -> None:
        self.log.append((step, op))
