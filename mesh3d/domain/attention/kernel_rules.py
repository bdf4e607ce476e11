"""Which of torch's CUDA attention kernels takes a call, as rules: what runs where no GPU can be asked.

On a GPU the block kernels ask torch itself (``_torch_private.cuda_sdpa_choice``: the enabled backends, torch's
priority order, this GPU's limits). Where there is none (a plan on meta tensors, the CPU tests of the choice) these
rules stand in for it: torch 2.11-2.13's constraints (``aten/src/ATen/native/transformers/cuda/sdp_utils.cpp``) on
an sm80-sm90 GPU with torch's default order, flash, then memory-efficient, then math, then cuDNN:

* flash: fp16/bf16; no mask; q, k, v head dims equal, at most 256; causal only with as many keys as queries
  (its causal flag is aligned bottom-right); GQA native;
* memory-efficient: fp16/bf16/fp32; an additive mask (bool ones converted); head dims multiples of 8 (half types)
  or 4 (fp32); as many K/V heads as query heads;
* cuDNN: fp16/bf16; head dims multiples of 8, at most 128; more than one key;
* math: anything (fp64 only here).

Usage::

    call = SdpaCall.of(q, k, v, mask, causal)
    sdpa_choice(call)                      # "flash" for bf16 without a mask
    sdpa_choice(call, order=("cudnn", "flash", "efficient", "math"))
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["KERNEL_NAMES", "SDPA_ORDER", "SdpaCall", "kernel_accepts", "sdpa_choice"]

#: torch's default priority order on CUDA (``torch._C._get_sdp_priority_order()`` before any cuDNN preference).
SDPA_ORDER = ("flash", "efficient", "math", "cudnn")
KERNEL_NAMES = ("flash", "efficient", "cudnn", "math")

_HALF = (torch.float16, torch.bfloat16)
_FLASH_MAX_HEAD, _CUDNN_MAX_HEAD = 256, 128


@dataclass(frozen=True)
class SdpaCall:
    """What decides the kernel of one attention call: dtype, heads, rows, head dims, the mask's kind
    (None, ``"bool"`` or ``"float"``), the causal flag, and whether every last dim has stride 1."""

    dtype: torch.dtype
    q_heads: int
    kv_heads: int
    q_rows: int
    k_rows: int
    width: int
    value_width: int
    mask: str | None = None
    causal: bool = False
    dense_last_dim: bool = True

    @staticmethod
    def of(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, causal: bool) -> SdpaCall:
        """The call of these (B, H, L, E) tensors."""
        kind = None if mask is None else "bool" if mask.dtype == torch.bool else "float"
        dense = all(t.stride(-1) == 1 or t.shape[-1] <= 1 for t in (q, k, v))
        return SdpaCall(q.dtype, q.shape[-3], k.shape[-3], q.shape[-2], k.shape[-2], q.shape[-1], v.shape[-1], kind,
                        causal, dense)


def _flash(c: SdpaCall) -> bool:
    return (c.dtype in _HALF and c.mask is None and c.width == c.value_width <= _FLASH_MAX_HEAD
            and (not c.causal or c.q_rows == c.k_rows) and c.q_heads % c.kv_heads == 0)


def _efficient(c: SdpaCall) -> bool:
    align = 8 if c.dtype in _HALF else 4
    return (c.dtype in (*_HALF, torch.float32) and c.width % align == 0 and c.value_width % align == 0
            and c.q_heads == c.kv_heads)


def _cudnn(c: SdpaCall) -> bool:
    return (c.dtype in _HALF and c.width % 8 == 0 and c.value_width % 8 == 0
            and max(c.width, c.value_width) <= _CUDNN_MAX_HEAD and c.k_rows > 1 and c.q_heads % c.kv_heads == 0)


_RULES = {"flash": _flash, "efficient": _efficient, "cudnn": _cudnn, "math": lambda c: True}


def kernel_accepts(kernel: str, call: SdpaCall) -> bool:
    """Whether ``kernel`` takes ``call`` (the table in the module docstring); every kernel needs rows and dense last dims.

    Usage: ``kernel_accepts("flash", SdpaCall.of(q, k, v, None, True))``
    """
    if kernel not in _RULES:
        raise ValueError(f"kernel {kernel!r} is not one of {KERNEL_NAMES}")
    if kernel != "math" and (not call.q_rows or not call.k_rows or not call.dense_last_dim):
        return False
    return _RULES[kernel](call)


def sdpa_choice(call: SdpaCall, order: tuple[str, ...] = SDPA_ORDER, enabled: tuple[str, ...] = KERNEL_NAMES) -> str:
    """The first kernel of ``order`` that is ``enabled`` and takes ``call``, as torch's SDPA picks; ``"math"``
    when none does (torch would refuse the call if math were disabled too).

    Usage: ``sdpa_choice(SdpaCall.of(q, k, v, mask, False))  # "efficient" for a masked fp32 call``
    """
    for kernel in order:
        if kernel in enabled and kernel_accepts(kernel, call):
            return kernel
    return "math"
