"""Scaled dot-product attention simulated with the fused kernel the target device runs, not the math fallback.

On the meta device ``F.scaled_dot_product_attention`` decomposes into its math form, which materializes the
(queries x keys) score matrix and keeps it for backward; real devices run a fused kernel that keeps only the
output and a log-sum-exp per query row. ``FusedAttention`` calls that kernel's own aten op (meta kernels and
derivatives exist for each): on the CPU ``_scaled_dot_product_flash_attention_for_cpu`` (what torch picks for
these inputs), on CUDA flash attention for half precision and memory-efficient attention otherwise (and with a
mask). Dropout and grouped-query attention keep the math form.

Usage::

    with FusedAttention("cuda"):          # under the planner's other modes: sees the rules' local calls
        loss = model(x_on_meta).sum()
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from mesh3d._torch_private import cpu_flash_attention, cuda_efficient_attention, cuda_flash_attention

__all__ = ["FusedAttention"]

_SDPA = F.scaled_dot_product_attention
_HALF = (torch.float16, torch.bfloat16)


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
        if dropout_p or enable_gqa or query.dim() != 4:
            return _SDPA(query, key, value, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)
        if self.device == "cpu":
            return cpu_flash_attention(query, key, value, attn_mask, is_causal, scale)[0]
        if attn_mask is None and query.dtype in _HALF:
            return cuda_flash_attention(query, key, value, is_causal, scale)
        return cuda_efficient_attention(query, key, value, attn_mask, is_causal, scale)
