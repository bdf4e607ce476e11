"""Softmax attention on one block of queries and keys, returning the log-sum-exp; merging partial results.

Usage::

    out, lse = block_forward(q, k, v, mask, causal, scale)          # q (B, H, Lq, E), k/v (B, Hkv, Lk, E)
    merge_into(acc_out, acc_lse, out, lse)                          # acc += this block's share, exactly
    dq, dk, dv, dmask = block_backward(dout, q, k, v, out, lse, mask, causal, scale, want_dmask=True)

A ring of blocks is exact because softmax attention over the union of key blocks is the log-sum-exp
weighted mean of the blocks' results: with ``lse = logaddexp(lse_1, lse_2)``,
``out = exp(lse_1 - lse) * out_1 + exp(lse_2 - lse) * out_2``. The backward of each block uses the *merged*
output and log-sum-exp (``P = exp(S - lse)`` is then the global softmax restricted to the block), so the
blocks' gradients add up to the one-process gradient.

The kernel of a block (``block_kernel``), the same contract for each (docs/domain.md has the table):

* math: for ``math=True`` (``attention_mode(kernel="math")``) and a float mask whose gradient is wanted (the only
  kernel returning it: ``dmask`` is the scores' gradient); explicit scores, any device and dtype; on devices other
  than CPU and CUDA (meta: a plan's upper bound);
* on the CPU (a float dtype, values as wide as the queries): torch's fused CPU kernel
  (``_torch_private.cpu_flash_attention``: no ``Lq x Lk`` scores in memory, GQA native);
* on CUDA: torch's own choice for the call (``attention.fused``): flash (fp16/bf16, no mask), memory-efficient
  (fp32 too; a bool or float mask as a bias; K/V heads expanded), cuDNN where torch picks it (no mask), and math
  where torch itself would run it (fp64, head dims no fused kernel takes) and for a masked fp16/bf16 call torch
  gives cuDNN (``fused.cuda_block_kernel`` says why).

``mask`` is None, bool (True: attend) or additive float, broadcastable to ``(B, H, Lq, Lk)``. ``causal`` masks
top-left aligned (query ``i`` sees keys ``j <= i``). A row that sees no key gets output 0 and lse -inf,
as one-process SDPA gives 0 for a fully masked row. ``kernels``: where blocks run and with which CUDA ops
(``attention.backends``; default ``BLOCK_KERNELS.value``).
"""

from __future__ import annotations

import torch

from mesh3d._torch_private import cpu_flash_attention, cpu_flash_attention_backward
from mesh3d.domain.attention.backends import BLOCK_KERNELS, BlockKernels
from mesh3d.domain.attention.fused import additive_mask, cuda_block_kernel, fused_backward, fused_forward, seen_rows

__all__ = ["accumulation_dtype", "block_backward", "block_forward", "block_kernel", "merge_into", "unit_stride"]

_CPU_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


def block_kernel(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, causal: bool,
                 want_dmask: bool = False, math: bool = False, kernels: BlockKernels | None = None) -> str:
    """The kernel one block runs (the table in the module docstring): ``"math"``, ``"cpu_flash"``, ``"flash"``,
    ``"efficient"`` or ``"cudnn"``.

    Usage: ``block_kernel(q, k, v, None, True)  # "flash" for bf16 on CUDA, "cpu_flash" on CPU``
    """
    if math or want_dmask:
        return "math"
    kernels = kernels if kernels is not None else BLOCK_KERNELS.value
    platform = kernels.platform(q)
    if platform == "cpu":
        return "cpu_flash" if q.dtype in _CPU_DTYPES and q.shape[-1] == v.shape[-1] else "math"
    if platform == "cuda":
        return cuda_block_kernel(kernels, q, k, v, mask, causal)
    return "math"


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """Partial outputs and gradients are accumulated in fp32 for half types, else in their own dtype."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def unit_stride(t: torch.Tensor) -> torch.Tensor:
    """``t`` with its last dim densely packed (stride 1), copied only when it is not.

    NOTE: the fused CPU kernel reads the last dim as if its stride were 1; a (B, H, S, E) view of tokens
    laid out (B, E, S) would give wrong results silently (the public SDPA copies such inputs first).
    """
    return t if t.stride(-1) == 1 or t.shape[-1] <= 1 else t.contiguous()


def _as_additive(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """An additive float mask (0 / -inf for a bool one) of ``dtype``, with 2 or 4 dims (the CPU kernel's)."""
    mask = additive_mask(mask, dtype)
    if mask.ndim not in (2, 4):
        mask = mask.reshape((1,) * (4 - mask.ndim) + tuple(mask.shape))
    return mask


def _grouped(q: torch.Tensor, k: torch.Tensor) -> int:
    return q.shape[-3] // k.shape[-3]


def _scores(q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor | None, causal: bool, scale: float) -> torch.Tensor:
    """Scaled scores (B, H, Lq, Lk) in the accumulation dtype, masked entries at -inf (GQA by grouping queries)."""
    acc = accumulation_dtype(q.dtype)
    b, h, lq, e = q.shape
    hk, lk = k.shape[-3], k.shape[-2]
    g = _grouped(q, k)
    s = (q.to(acc).reshape(b, hk, g * lq, e) @ k.to(acc).transpose(-1, -2)).reshape(b, h, lq, lk) * scale
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else s + mask.to(acc)
    if causal:
        s = s.masked_fill(torch.ones(lq, lk, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    return s


def _probabilities(s: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """``exp(s - lse)``: the softmax over every key seen so far; rows with lse -inf (no key) are 0."""
    return torch.exp(s - lse.masked_fill(lse == float("-inf"), 0.0).unsqueeze(-1))


def _math_forward(q, k, v, mask, causal, scale) -> tuple[torch.Tensor, torch.Tensor]:
    s = _scores(q, k, mask, causal, scale)
    lse = torch.logsumexp(s, -1)
    p = _probabilities(s, lse)
    b, h, lq, lk = p.shape
    hk, g = k.shape[-3], _grouped(q, k)
    out = (p.reshape(b, hk, g * lq, lk) @ v.to(p.dtype)).reshape(b, h, lq, v.shape[-1])
    return out, lse


def block_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, causal: bool,
                  scale: float, math: bool = False,
                  kernels: BlockKernels | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of softmax attention of ``q`` over ``k``/``v`` (both non-empty); see the module docstring.

    Usage: ``out, lse = block_forward(q, k, v, None, False, q.shape[-1] ** -0.5)``
    """
    kernels = kernels if kernels is not None else BLOCK_KERNELS.value
    kernel = block_kernel(q, k, v, mask, causal, False, math, kernels)
    if kernel == "math":
        return _math_forward(q, k, v, mask, causal, scale)
    if kernel != "cpu_flash":
        return fused_forward(kernels, kernel, q, k, v, mask, causal, scale)
    q, k, v = unit_stride(q), unit_stride(k), unit_stride(v)
    out, lse = cpu_flash_attention(q, k, v, None if mask is None else _as_additive(mask, q.dtype), causal, scale)
    seen = seen_rows(mask, causal, lse.shape)
    if seen is not None:  # the fused kernel reports lse 0 where a row sees nothing: that must not weigh in a merge
        lse = lse.masked_fill(~seen, float("-inf"))
    return out, lse


def block_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                   lse: torch.Tensor, mask: torch.Tensor | None, causal: bool, scale: float,
                   want_dmask: bool = False, math: bool = False, kernels: BlockKernels | None = None):
    """(dq, dk, dv, dmask) of one block, given the *merged* ``out`` (q's dtype) and ``lse`` of these queries (dmask:
    None unless ``want_dmask``; it has the scores' shape (B, H, Lq, Lk)).

    Usage: ``dq, dk, dv, _ = block_backward(dout, q, k, v, out, lse, None, False, scale)``
    """
    kernels = kernels if kernels is not None else BLOCK_KERNELS.value
    kernel = block_kernel(q, k, v, mask, causal, want_dmask, math, kernels)
    if kernel not in ("math", "cpu_flash"):
        dq, dk, dv = fused_backward(kernels, kernel, dout, q, k, v, out, lse, mask, causal, scale)
        return dq, dk, dv, None
    if kernel == "cpu_flash":
        dout, q, k, v, out = (unit_stride(t) for t in (dout, q, k, v, out))
        safe = lse.masked_fill(lse == float("-inf"), 0.0).to(lse.dtype)  # fully masked rows: their P is 0 anyway
        dq, dk, dv = cpu_flash_attention_backward(dout, q, k, v, out, safe, None if mask is None else
                                                  _as_additive(mask, q.dtype), causal, scale)
        return dq, dk, dv, None
    acc = accumulation_dtype(q.dtype)
    s = _scores(q, k, mask, causal, scale)
    p = _probabilities(s, lse.to(acc))
    b, h, lq, lk = p.shape
    hk, g, e = k.shape[-3], _grouped(q, k), q.shape[-1]
    do = dout.to(acc)
    delta = (do * out.to(acc)).sum(-1, keepdim=True)  # rowsum(dO * O) of the merged output
    dv = p.reshape(b, hk, g * lq, lk).transpose(-1, -2) @ do.reshape(b, hk, g * lq, -1)
    dp = (do.reshape(b, hk, g * lq, -1) @ v.to(acc).transpose(-1, -2)).reshape(b, h, lq, lk)
    ds = p * (dp - delta)
    dq = (ds.reshape(b, hk, g * lq, lk) @ k.to(acc)).reshape(b, h, lq, e) * scale
    dk = ds.reshape(b, hk, g * lq, lk).transpose(-1, -2) @ q.to(acc).reshape(b, hk, g * lq, e) * scale
    return dq, dk, dv, ds if want_dmask else None


def merge_into(out_acc: torch.Tensor, lse_acc: torch.Tensor, out: torch.Tensor, lse: torch.Tensor) -> None:
    """Fold one block's (out, lse) into the running (out_acc, lse_acc), in place (log-sum-exp weights).

    Usage: ``merge_into(acc[..., rows, :], lse_acc[..., rows], out, lse)``
    """
    new = torch.logaddexp(lse_acc, lse)
    safe = new.masked_fill(new == float("-inf"), 0.0)  # rows no block has seen yet: both weights 0
    out_acc.mul_(torch.exp(lse_acc - safe).unsqueeze(-1).to(out_acc.dtype))
    # NOTE: one fused multiply-add, no copy of ``out`` in the accumulator's dtype (a (B, H, rows, E) fp32 temporary)
    out_acc.addcmul_(out, torch.exp(lse.to(safe.dtype) - safe).unsqueeze(-1).to(out_acc.dtype))
    lse_acc.copy_(new)
