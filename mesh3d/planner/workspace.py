"""Transient memory CPU kernels take beside their inputs and outputs, which op-level tracking cannot see.

On the CPU, PyTorch's float32/bfloat16 convolutions run in oneDNN, which reorders the input into a blocked
layout (channels padded to a multiple of 16) before computing; float64 convolutions take the slow path and
unfold the whole input (im2col). Measured with peak RSS on this project's CPU (torch 2.13, AVX-512) over 2-D
and 3-D convolutions of 1 to 32 channels, strides 1 and 2 (see docs/plan.md):

* float32/bf16 forward: the larger of the padded input and the output; backward: the padded input plus the
  larger of the input and the output gradient. 1x1, stride-1 convolutions: nothing.
* float64: the unfolded input, ``N * C_in * prod(kernel) * prod(output spatial)`` elements, forward and backward.

Other ops allocate what they return. CUDA kernels' workspaces: ``mesh3d.planner.cuda_kernels``.

Usage::

    tracker = MemoryTracker(workspace=cpu_kernel_workspace)
"""

from __future__ import annotations

import math
from typing import Any

import torch

__all__ = ["cpu_kernel_workspace"]

_CONV = torch.ops.aten.convolution.default
_CONV_BACKWARD = torch.ops.aten.convolution_backward.default


def _padded_channels(t: torch.Tensor) -> int:
    channels = t.shape[1]
    return t.numel() // max(channels, 1) * (-(-channels // 16) * 16) * t.element_size()


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _pointwise_kernel(weight: torch.Tensor, stride: list[int]) -> bool:
    return all(k == 1 for k in weight.shape[2:]) and all(s == 1 for s in stride)


def _unfolded(x: torch.Tensor, weight: torch.Tensor, out_spatial: tuple[int, ...]) -> int:
    return x.shape[0] * x.shape[1] * math.prod(weight.shape[2:]) * math.prod(out_spatial) * x.element_size()


def cpu_kernel_workspace(func: object, args: tuple, kwargs: dict, out: Any) -> int:
    """Bytes a CPU convolution (forward or backward) needs transiently; 0 for every other op.

    Usage: ``MemoryTracker(workspace=cpu_kernel_workspace)``
    """
    if func is _CONV:
        x, weight, stride = args[0], args[1], args[3]
        if x.dim() < 3 or x.numel() == 0:
            return 0
        if x.dtype == torch.float64:
            return _unfolded(x, weight, tuple(out.shape[2:]))
        if _pointwise_kernel(weight, stride):
            return 0
        return max(_padded_channels(x), _nbytes(out))
    if func is _CONV_BACKWARD:
        grad_out, x, weight, stride = args[0], args[1], args[2], args[4]
        if x.dim() < 3 or x.numel() == 0:
            return 0
        if x.dtype == torch.float64:
            return _unfolded(x, weight, tuple(grad_out.shape[2:]))
        if _pointwise_kernel(weight, stride):
            return 0
        return _padded_channels(x) + max(_nbytes(x), _nbytes(grad_out))
    return 0
