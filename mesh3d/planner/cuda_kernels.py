"""Transient memory CUDA kernels take beside their inputs and outputs, which op-level tracking cannot see.

Modeled for torch 2.11-2.13 with cuDNN 9 and cuBLAS 12 (Hopper), torch's defaults
(``torch.backends.cudnn.benchmark=False``, TF32 allowed for convolutions), from torch's allocation code and
the measurements of issue 49 (one H200, torch 2.11):

* **Convolutions** (1-, 2-, 3-D, transposed, grouped, strided, dilated: all reach cuDNN). torch asks cuDNN's
  heuristics for an engine and allocates that engine's workspace through the caching allocator for the
  call (``Conv_v8.cpp``: ``run_conv_plan``). Which engine runs is decided at run time, so the plan takes
  the larger case: an engine that transposes its operands to channels-last for the tensor cores, whose
  workspace holds the transformed input and output of the call (forward: input + output; backward: the
  larger of data (output gradient + input gradient) and filter (input + output gradient)). The U-Net of
  issue 49 measured exactly that beside its activations (forward 3233 MiB against 2208 + 1024, backward
  3941 against 2913 + 1024 at the 96-to-32-channel 3-D convolution). Operands that are not contiguous
  (an expanded loss gradient) are copied first. Assumes cuDNN enabled: without it the 3-D convolutions
  unfold their input (23.6 GB for that U-Net instead of 3.9).
* **Matmuls** (``mm``, ``addmm``, ``bmm``, ``baddbmm``): cuBLAS takes row- or column-major operands; any other
  (a stride-0 gradient of ``sum``, a non-dense view) is copied to a contiguous tensor for the call
  (``Blas.cpp``: ``prepare_matrix_for_cublas``). cuBLAS's own workspace is allocated once per stream and
  stays: it is part of the margin, not of the step.
* **Attention** (``fused_sdpa``): flash attention's backward accumulates ``dq`` in fp32
  (batch x queries rounded to 128 x heads x head dim rounded to 32) beside its ``softmax_d``; the
  memory-efficient kernel's backward may split keys and then accumulates ``dq`` in fp32 too (run-time
  choice: planned); its forward accumulates the output in fp32 for half types. The log-sum-exp is O(L).
* **Norms**: GroupNorm's backward holds per-(sample, channel) sums in fp32. LayerNorm and BatchNorm kernels
  hold what their aten ops return; ``F.rms_norm`` is planned in its decomposed form (an upper bound of the
  fused kernel CUDA may run).
* **Embedding** backward sorts the indices (a few int64 copies of them).

Usage::

    tracker = MemoryTracker(workspace=cuda_kernel_workspace, block_bytes=cuda_block_bytes)
"""

from __future__ import annotations

import math
from typing import Any

import torch

from mesh3d._torch_private import cuda_attention_ops

__all__ = ["CUDA_ASSUMPTIONS", "cuda_kernel_workspace", "is_dense"]

aten = torch.ops.aten

#: What the CUDA model assumes, for the report (the module docstring has the details).
CUDA_ASSUMPTIONS = (
    "cuDNN enabled, benchmark off; convolutions planned with the larger of cuDNN's run-time choices (an engine "
    "that transposes input and output to channels-last: their bytes as workspace)",
    "cuBLAS copies of operands that are neither row- nor column-major; flash/memory-efficient attention with "
    "their fp32 dq accumulators; the caching allocator's 512 B and 2 MiB rounding",
)

_FLASH_ROWS, _FLASH_HEAD = 128, 32  # flash attention's rounding of query rows and head dim (mha_bwd)


def _nbytes(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.numel() * t.element_size()


def is_dense(t: torch.Tensor) -> bool:
    """Whether ``t`` covers its memory without gaps or overlap, in any order of dims (``is_non_overlapping_and_dense``).

    Usage: ``is_dense(x.transpose(0, 1))  # True``
    """
    if t.numel() <= 1:
        return True
    expected = 1
    for stride, size in sorted((st, s) for s, st in zip(t.shape, t.stride()) if s != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def _copy_unless_contiguous(t: torch.Tensor) -> int:
    """cuDNN's operands are made contiguous (in their suggested memory format) before the call."""
    contiguous = t.is_contiguous() or t.is_contiguous(memory_format=torch.channels_last) or (
        t.dim() == 5 and t.is_contiguous(memory_format=torch.channels_last_3d))
    return 0 if contiguous else _nbytes(t)


def _blas_copy(t: torch.Tensor) -> int:
    """Bytes cuBLAS's operand preparation copies for a 2-D or batched 3-D matrix (0: used in place)."""
    if t.numel() == 0:
        return 0
    rows, cols = t.shape[-2], t.shape[-1]
    s_rows, s_cols = t.stride(-2), t.stride(-1)
    if (s_cols == 1 and s_rows >= max(1, cols)) or (s_rows == 1 and s_cols >= max(1, rows)):
        return 0
    if t.dim() == 2 and is_dense(t):
        return 0
    if t.dim() == 3 and t.is_contiguous() and s_rows and s_cols:
        return 0
    return _nbytes(t)


def _convolution(args: tuple, out: torch.Tensor) -> int:
    x, weight = args[0], args[1]
    if x.numel() == 0 or out.numel() == 0:
        return 0
    return _copy_unless_contiguous(x) + _copy_unless_contiguous(weight) + _nbytes(x) + _nbytes(out)


def _convolution_backward(args: tuple) -> int:
    grad_out, x, weight, mask = args[0], args[1], args[2], args[10]
    if x.numel() == 0 or grad_out.numel() == 0:
        return 0
    copies = _copy_unless_contiguous(grad_out) + _copy_unless_contiguous(x)
    data = _nbytes(grad_out) + _nbytes(x) if mask[0] else 0  # output gradient + input gradient (x's size)
    weights = _nbytes(x) + _nbytes(grad_out) if mask[1] else 0
    return copies + max(data, weights) + (_copy_unless_contiguous(weight) if mask[0] else 0)


def _flash_backward(args: tuple) -> int:
    grad_out, q, k = args[0], args[1], args[2]
    b, h, lq, d = q.shape
    rows = -(-lq // _FLASH_ROWS) * _FLASH_ROWS
    width = -(-d // _FLASH_HEAD) * _FLASH_HEAD
    dq_accum = b * rows * h * width * 4
    softmax_d = b * h * rows * 4
    expanded = 2 * b * k.shape[2] * h * d * q.element_size() if k.shape[1] != h else 0  # grouped heads: dk, dv per head
    return dq_accum + softmax_d + expanded + (0 if grad_out.stride(-1) == 1 else _nbytes(grad_out))


def _efficient_backward(args: tuple) -> int:
    q = args[1]
    b, h, lq, d = q.shape
    return b * h * lq * d * 4 + b * h * lq * 4  # dq accumulated in fp32 (split keys), and delta = rowsum(dO * O)


def _efficient_forward(args: tuple) -> int:
    q, v = args[0], args[2]
    if q.dtype not in (torch.float16, torch.bfloat16):
        return 0
    return math.prod(q.shape[:-1]) * v.shape[-1] * 4  # the output accumulated in fp32


def _group_norm_backward(args: tuple) -> int:
    x, groups = args[1], args[8]
    n, c = x.shape[0], x.shape[1]
    acc = 8 if x.dtype == torch.float64 else 4
    return (2 * n * c + 2 * n * groups) * acc


def _embedding_backward(args: tuple) -> int:
    indices = args[1]
    return 4 * indices.numel() * 8  # sorted indices, their order, segment offsets, partial sums' offsets


_RULES: dict[Any, Any] = {
    aten.convolution.default: lambda a, o: _convolution(a, o),
    aten.convolution_backward.default: lambda a, o: _convolution_backward(a),
    aten.mm.default: lambda a, o: _blas_copy(a[0]) + _blas_copy(a[1]),
    aten.bmm.default: lambda a, o: _blas_copy(a[0]) + _blas_copy(a[1]),
    aten.addmm.default: lambda a, o: _blas_copy(a[1]) + _blas_copy(a[2]),
    aten.baddbmm.default: lambda a, o: _blas_copy(a[1]) + _blas_copy(a[2]),
    cuda_attention_ops()["flash_backward"]: lambda a, o: _flash_backward(a),
    cuda_attention_ops()["efficient_backward"]: lambda a, o: _efficient_backward(a),
    cuda_attention_ops()["efficient"]: lambda a, o: _efficient_forward(a),
    aten.native_group_norm_backward.default: lambda a, o: _group_norm_backward(a),
    aten.embedding_dense_backward.default: lambda a, o: _embedding_backward(a),
}


def cuda_kernel_workspace(func: object, args: tuple, kwargs: dict, out: Any) -> int:
    """Bytes a CUDA kernel needs for a moment beside its inputs and outputs (module docstring); 0 for others.

    Usage: ``MemoryTracker(workspace=cuda_kernel_workspace)``
    """
    rule = _RULES.get(func)
    return rule(args, out) if rule is not None else 0
