"""Transient memory CPU kernels take beside their inputs and outputs, which op-level tracking cannot see.

PyTorch picks a CPU convolution's backend per call (``ConvParams::use_mkldnn`` in ATen's ``Convolution.cpp``):
float32 goes to oneDNN unless the kernel is 1x1 and unstrided on a single thread with a batch under 16 (the
"native is faster" rule), or the batch is 1, groups 1, the kernel at most 3 wide and ``N*C*D*H`` (the first four
sizes) at most 20480; bfloat16/float16 go to oneDNN only where the CPU has AVX-512 (``mkldnn_bf16_device_check``);
float64, and everything oneDNN does not take, goes to the native "slow" kernels, which unfold the input (im2col).
How much each path takes depends on the CPU's vector width, so the model is chosen by
``torch.backends.cpu.get_cpu_capability()``. Measured with peak RSS over one call (one thread, torch 2.13; 2-D and
3-D convolutions of 1 to 64 channels, strides 1 and 2, batches 1 and 2, transposed; see docs/plan.md):

* **AVX-512** (fitted first, on the project's Xeon): float32/bf16 forward: the larger of the input padded to
  16-channel blocks and the output; backward: the padded input plus the larger of the input and the output
  gradient; 1x1, stride-1 convolutions: nothing; float64: the unfolded input forward and backward.
* **AVX-512 with native bf16** (``avx512_bf16``: an AMD EPYC of that generation, where oneDNN runs bfloat16
  natively): as AVX-512, and a bf16/fp16 backward that computes the input's gradient holds one more copy of the
  input (measured: a 16-to-16-channel 3x3 convolution's step, 1.4 MiB more than AVX-512's model, within 0.2 MiB after).
* **AVX2** (an AMD EPYC): oneDNN forward: the larger of input and output; backward: the input plus the larger of
  input and output gradient when strided, else the larger of the two (3-D) or their sum, the gradient padded to
  8-channel blocks (2-D); transposed: twice the output forward, input plus output gradient
  backward. Native kernels: the unfolded input forward, and backward once more (float32/float64), 1.5 times
  (bfloat16, 2-D) or twice (bfloat16, 3-D); a native 1x1 unstrided convolution: nothing forward, the input
  backward (3-D) or one sample's input (2-D); native transposed: the columns plus the input.

Other ops allocate what they return. CUDA kernels' workspaces: ``mesh3d.planner.cuda_kernels``.

Usage::

    tracker = MemoryTracker(workspace=cpu_kernel_workspace)
"""

from __future__ import annotations

import functools
import math
from typing import Any

import torch

__all__ = ["cpu_kernel_workspace", "cpu_kernels_fitted"]

_CONV = torch.ops.aten.convolution.default
_CONV_BACKWARD = torch.ops.aten.convolution_backward.default
_WIDE = ("AVX512",)  # capabilities whose oneDNN takes bf16/fp16 and blocks channels by 16


# NOTE: cached: asked once per convolution of every simulated rank, and the capability is fixed when torch loads.
@functools.cache
def cpu_kernels_fitted() -> str:
    """Which CPU model ``cpu_kernel_workspace`` uses on this machine: ``"AVX512_BF16"``, ``"AVX512"`` or ``"AVX2"``
    (the narrower vector units, and CPUs of other architectures, are planned as AVX2).

    Usage: ``cpu_kernels_fitted()``
    """
    if torch.backends.cpu.get_cpu_capability() not in _WIDE:
        return "AVX2"
    return "AVX512_BF16" if _native_bf16() else "AVX512"


@functools.cache
def _native_bf16() -> bool:
    """Whether the CPU has AVX512_BF16 (oneDNN's native bf16 kernels). NOTE: torch's capability says "AVX512" either
    way, so the flag is read from /proc/cpuinfo; elsewhere (not Linux) the CPU is planned as without it."""
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                if line.startswith("flags"):
                    return "avx512_bf16" in line.split()
    except OSError:
        pass
    return False


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _padded_channels(t: torch.Tensor, block: int = 16) -> int:
    channels = t.shape[1]
    return t.numel() // max(channels, 1) * (-(-channels // block) * block) * t.element_size()


def _pointwise_kernel(weight: torch.Tensor, stride: list[int]) -> bool:
    return all(k == 1 for k in weight.shape[2:]) and all(s == 1 for s in stride)


def _unfolded(x: torch.Tensor, weight: torch.Tensor, out_spatial: tuple[int, ...]) -> int:
    return x.shape[0] * x.shape[1] * math.prod(weight.shape[2:]) * math.prod(out_spatial) * x.element_size()


def _onednn(x: torch.Tensor, weight: torch.Tensor, stride: list[int], dilation: list[int], groups: int) -> bool:
    """Whether ATen sends this convolution to oneDNN (``ConvParams::use_mkldnn``, torch 2.13) on a CPU without AVX-512:
    float32 only (bf16/fp16 need AVX-512 there, float64 never goes)."""
    if x.dtype != torch.float32:
        return False
    wide, high = weight.shape[-1], weight.shape[-2] if weight.dim() > 3 else 1
    batch = x.shape[0]
    not_native_1x1 = (any(s != 1 for s in stride) or any(d != 1 for d in dilation) or batch >= 16 or wide != 1
                      or high != 1 or torch.get_num_threads() > 1)
    first_four = math.prod(x.shape[:4])
    big_enough = groups > 1 or (wide > 3 and high > 3) or batch > 1 or first_four > 20480
    return not_native_1x1 and big_enough


def _avx512(func: object, args: tuple, out: Any) -> int:
    if func is _CONV:
        x, weight, stride = args[0], args[1], args[3]
        if x.dtype == torch.float64:
            return _unfolded(x, weight, tuple(out.shape[2:]))
        if _pointwise_kernel(weight, stride):
            return 0
        return max(_padded_channels(x), _nbytes(out))
    grad_out, x, weight, stride = args[0], args[1], args[2], args[4]
    if x.dtype == torch.float64:
        return _unfolded(x, weight, tuple(grad_out.shape[2:]))
    if _pointwise_kernel(weight, stride):
        return 0
    native_copy = _nbytes(x) if x.dtype in (torch.bfloat16, torch.float16) and args[10][0] and _native_bf16() else 0
    return _padded_channels(x) + max(_nbytes(x), _nbytes(grad_out)) + native_copy


def _avx2_native(forward: bool, x: torch.Tensor, weight: torch.Tensor, stride: list[int], padding: list[int],
                 dilation: list[int], transposed: bool, other: torch.Tensor) -> int:
    """``other``: the output (forward) or the output gradient (backward)."""
    if transposed:  # col2im: columns of the output's channels over the input's positions
        columns = x.shape[0] * weight.shape[1] * math.prod(weight.shape[2:]) * math.prod(x.shape[2:])
        return columns * x.element_size() + _nbytes(x)
    if _pointwise_kernel(weight, stride) and not any(padding) and all(d == 1 for d in dilation):
        if forward:
            return 0
        return _nbytes(x) if x.dim() == 5 else _nbytes(x) // max(x.shape[0], 1)
    unfolded = _unfolded(x, weight, tuple(other.shape[2:]))
    if forward or x.dtype not in (torch.bfloat16, torch.float16):
        return unfolded
    return 2 * unfolded if x.dim() == 5 else 3 * unfolded // 2


def _avx2(func: object, args: tuple, out: Any) -> int:
    forward = func is _CONV
    if forward:
        x, weight, stride, padding, dilation, transposed, groups = args[0], args[1], *args[3:7], args[8]
        other = out
    else:
        other, x, weight = args[0], args[1], args[2]
        stride, padding, dilation, transposed, groups = *args[4:8], args[9]
    if not _onednn(x, weight, stride, dilation, groups):
        return _avx2_native(forward, x, weight, stride, padding, dilation, transposed, other)
    if transposed:
        return 2 * _nbytes(other) if forward else _nbytes(x) + _nbytes(other)
    if forward:
        return max(_nbytes(x), _nbytes(other))
    if any(s != 1 for s in stride):
        return _nbytes(x) + max(_nbytes(x), _nbytes(other))
    if x.dim() == 5:
        return max(_nbytes(x), _nbytes(other))
    return _nbytes(x) + _padded_channels(other, 8)


def cpu_kernel_workspace(func: object, args: tuple, kwargs: dict, out: Any) -> int:
    """Bytes a CPU convolution (forward or backward) needs transiently on this machine's CPU; 0 for every other op.

    Usage: ``MemoryTracker(workspace=cpu_kernel_workspace)``
    """
    if func is not _CONV and func is not _CONV_BACKWARD:
        return 0
    x = args[0] if func is _CONV else args[1]
    if x.dim() < 3 or x.numel() == 0:
        return 0
    return _avx2(func, args, out) if cpu_kernels_fitted() == "AVX2" else _avx512(func, args, out)
