"""Scaled dot-product attention simulated with the fused kernel the target device runs, not the math fallback.

On the meta device ``F.scaled_dot_product_attention`` decomposes into its math form, which materializes the
(queries x keys) score matrix and keeps it for backward; real devices run a fused kernel that keeps only the
output and a log-sum-exp per query row (O(L), not O(L^2)). ``FusedAttention`` calls that kernel's own aten op
(meta kernels and derivatives exist for each), with what torch's SDPA composite does before calling it
(``aten/src/ATen/native/transformers/attention.cpp`` and ``sdp_utils``, torch 2.11-2.13):

* the kernel: on the CPU ``_scaled_dot_product_flash_attention_for_cpu``; on CUDA, torch's default priority
  order (flash, memory-efficient, math, cuDNN) gives flash attention for fp16/bf16 without a mask and
  memory-efficient attention otherwise (fp32, or with a mask);
* a boolean mask becomes an additive one of the queries' dtype (``convert_boolean_attn_mask``: a new tensor
  of the mask's shape, kept for backward);
* on CUDA, a head dim that is not a multiple of 8 is padded (copies of q, k, v) and the output sliced back;
  the memory-efficient kernel's mask is padded to a multiple of 16 keys when its rows are not (a copy).

Grouped-query attention (``enable_gqa``) runs on CUDA's flash kernel, which groups the query heads itself; elsewhere
it keeps the math form, as torch 2.11-2.13 runs it (mesh3d's own calls expand the K/V heads first where that reaches
the memory-efficient kernel: ``mesh3d.domain.attention.collect``). The kernels' own backward buffers (flash's fp32
``dq`` accumulator, the memory-efficient kernel's) are ``mesh3d.planner.cuda_kernels``'. Dropout keeps the math form
(an upper bound).

Usage::

    with FusedAttention("cuda"):          # under the planner's other modes: sees the rules' local calls
        loss = model(x_on_meta).sum()
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from mesh3d._torch_private import cpu_flash_attention, cuda_efficient_attention, cuda_flash_attention

__all__ = ["FusedAttention", "cuda_sdpa_kernel"]

_SDPA = F.scaled_dot_product_attention
_HALF = (torch.float16, torch.bfloat16)
_HEAD_ALIGN = 8  # flash and memory-efficient kernels' head-dim alignment (pad_last_dim<8>)
_MASK_ALIGN = 16  # memory-efficient attention's bias alignment (pad_bias<16>)


def cuda_sdpa_kernel(query: torch.Tensor, attn_mask: torch.Tensor | None) -> str:
    """``"flash"`` or ``"efficient"``: which fused kernel torch's default order picks on CUDA for these inputs.

    Usage: ``cuda_sdpa_kernel(q, None)  # "flash" for bf16``
    """
    return "flash" if attn_mask is None and query.dtype in _HALF else "efficient"


def _padded_heads(t: torch.Tensor) -> torch.Tensor:
    pad = -t.shape[-1] % _HEAD_ALIGN
    return F.pad(t, (0, pad)) if pad else t


class FusedAttention(TorchFunctionMode):
    """Routes ``F.scaled_dot_product_attention`` on plain tensors to ``device``'s fused kernel (module docstring)."""

    def __init__(self, device: str) -> None:
        super().__init__()
        self.device = device

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not _SDPA:
            return func(*args, **kwargs)
        subclass = next((t for t in types if t.__torch_function__ is not torch.Tensor.__torch_function__), None)
        if subclass is None:
            return self._fused(*args, **kwargs)
        # NOTE: torch takes a mode off the stack while it handles a call; the domain rule for attention calls SDPA
        # again on the local tensors, so the subclass's handling runs with this mode pushed back.
        with self:
            return subclass.__torch_function__(func, types, args, kwargs)

    def _fused(self, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        grouped = enable_gqa and key.shape[-3] != query.shape[-3]
        flash_groups = self.device != "cpu" and cuda_sdpa_kernel(query, attn_mask) == "flash"
        if dropout_p or query.dim() != 4 or (grouped and not flash_groups):
            return _SDPA(query, key, value, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)
        if attn_mask is not None and attn_mask.dtype == torch.bool:
            # NOTE: convert_boolean_attn_mask: 0 where attended, -inf elsewhere, in the queries' dtype.
            attn_mask = torch.where(attn_mask, 0.0, torch.full((), float("-inf"), dtype=query.dtype, device=query.device))
        if self.device == "cpu":
            return cpu_flash_attention(query, key, value, attn_mask, is_causal, scale)[0]
        width = query.shape[-1]
        scale = width ** -0.5 if scale is None else scale  # the unpadded head dim's, as the composite keeps it
        q, k, v = (_padded_heads(t) for t in (query, key, value))
        if cuda_sdpa_kernel(query, attn_mask) == "flash":
            out = cuda_flash_attention(q, k, v, is_causal, scale)
        else:
            if attn_mask is not None and attn_mask.shape[-1] % _MASK_ALIGN:
                keys = attn_mask.shape[-1]
                attn_mask = F.pad(attn_mask, (0, -keys % _MASK_ALIGN))[..., :keys]
            if attn_mask is not None:
                attn_mask = attn_mask.expand(*q.shape[:-1], k.shape[-2])
            out = cuda_efficient_attention(q, k, v, attn_mask, is_causal, scale)
        return out[..., :value.shape[-1]] if out.shape[-1] != value.shape[-1] else out
