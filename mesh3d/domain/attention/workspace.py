"""What one attention block kernel call holds at its peak, measured once per shape on meta tensors.

A dry run (``mesh3d.planner``) does not compute ring attention's blocks one by one: per pass it allocates, for
a moment, the most any of its kernel calls would. That figure comes from running the real block kernel once per
shape on the meta device and counting the storages it creates, its outputs and the merge into the running result
included, plus what the kernel holds inside (``BlockKernels.internal_workspace``). Which kernel runs is the block
kernels' choice (``attention.backends``): a plan for CUDA (``PlannedCudaKernels``) runs the fused kernel CUDA would
(its log-sum-exp and workspace O(rows), the calls around it: expanded K/V heads, a bias); otherwise, and for
``kernel="math"``, the math kernel (explicit scores: an upper bound of the CPU's fused kernel).

Usage::

    nbytes = block_workspace(BlockShape(batch=1, q_heads=8, kv_heads=2, q_rows=512, k_rows=512, width=64,
                                        value_width=64, dtype=torch.bfloat16, causal=True), backward=False,
                             kernels=PlannedCudaKernels())
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from mesh3d.domain.attention.backends import BLOCK_KERNELS, BlockKernels
from mesh3d.domain.attention.kernels import accumulation_dtype, block_backward, block_forward, merge_into
from mesh3d._torch_private import TorchDispatchMode, outside_dispatch_modes, storage_key

__all__ = ["BlockShape", "block_workspace"]


@dataclass(frozen=True)
class BlockShape:
    """One kernel call: queries (batch, q_heads, q_rows, width) against keys (batch, kv_heads, k_rows, width) and
    values (..., value_width); ``causal``: the kernel's causal flag; ``banded``: a (q_rows, k_rows) mask built
    for the call (``score_tiles.tile_mask``)."""

    batch: int
    q_heads: int
    kv_heads: int
    q_rows: int
    k_rows: int
    width: int
    value_width: int
    dtype: torch.dtype
    causal: bool = False
    banded: bool = False


class _PeakBytes(TorchDispatchMode):
    """Bytes of the storages created inside the block that are alive at once, at their most, with what each op
    holds inside for a moment (``inside``)."""

    def __init__(self, inside: Callable[[Any, tuple, dict, Any], int]) -> None:
        super().__init__()
        self.current = self.peak = 0
        self.inside = inside

    def _release(self, nbytes: int) -> None:
        self.current -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        inputs = {storage_key(t.untyped_storage()) for t in _tensors((args, kwargs))}
        out = func(*args, **kwargs)
        for t in _tensors(out):
            storage = t.untyped_storage()
            if storage_key(storage) not in inputs:
                inputs.add(storage_key(storage))
                self.current += storage.nbytes()
                self.peak = max(self.peak, self.current)
                weakref.finalize(storage, self._release, storage.nbytes())
        self.peak = max(self.peak, self.current + self.inside(func, args, kwargs, out))
        return out


def _tensors(obj: object) -> list[torch.Tensor]:
    out, stack = [], [obj]
    while stack:
        x = stack.pop()
        if isinstance(x, torch.Tensor):
            out.append(x)
        elif isinstance(x, (list, tuple)):
            stack.extend(x)
        elif isinstance(x, dict):
            stack.extend(x.values())
    return out


def block_workspace(shape: BlockShape, backward: bool, kernels: BlockKernels | None = None, math: bool = False) -> int:
    """The most bytes one forward (with its merge) or backward kernel call of ``shape`` holds beside its inputs, on
    ``kernels`` (default: those in force) or the math kernel (``math``)."""
    return _block_workspace(shape, backward, kernels if kernels is not None else BLOCK_KERNELS.value, math)


@functools.lru_cache(maxsize=1024)
def _block_workspace(shape: BlockShape, backward: bool, kernels: BlockKernels, math: bool) -> int:
    # NOTE: outside the modes in force: a planner's memory tracker around the step would count this measurement's
    # storages (only on the first call of a shape: the figures would depend on what the process planned before)
    with outside_dispatch_modes():
        return _measured(shape, backward, kernels, math)


def _measured(s: BlockShape, backward: bool, kernels: BlockKernels, math: bool) -> int:
    def meta(*size: int, dtype: torch.dtype = s.dtype) -> torch.Tensor:
        return torch.empty(size, dtype=dtype, device="meta")

    acc = accumulation_dtype(s.dtype)
    q, k, v = meta(s.batch, s.q_heads, s.q_rows, s.width), meta(s.batch, s.kv_heads, s.k_rows, s.width), \
        meta(s.batch, s.kv_heads, s.k_rows, s.value_width)
    # the merged output the backward reads is the forward's, cast back to the inputs' dtype (``ring._forward``)
    out = meta(s.batch, s.q_heads, s.q_rows, s.value_width, dtype=s.dtype if backward else acc)
    lse = meta(s.batch, s.q_heads, s.q_rows, dtype=acc)
    dout = meta(s.batch, s.q_heads, s.q_rows, s.value_width) if backward else None
    with _PeakBytes(kernels.internal_workspace) as peak:
        mask = torch.ones(s.q_rows, s.k_rows, dtype=torch.bool, device="meta") if s.banded else None
        if backward:
            kept = block_backward(dout, q, k, v, out, lse, mask, s.causal, 1.0, math=math, kernels=kernels)
        else:
            kept = block_forward(q, k, v, mask, s.causal, 1.0, math=math, kernels=kernels)
            merge_into(out, lse, *kept)
        del kept, mask
    return peak.peak
