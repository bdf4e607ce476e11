"""One attention block on torch's fused CUDA kernels, with its log-sum-exp in one layout: (B, H, Lq), -inf for a row
that sees no key.

Usage::

    kernel = cuda_block_kernel(kernels, q, k, v, mask, causal)            # "flash", "efficient", "cudnn" or "math"
    out, lse = fused_forward(kernels, kernel, q, k, v, mask, causal, scale)
    dq, dk, dv = fused_backward(kernels, kernel, dout, q, k, v, out, lse, mask, causal, scale)   # merged out, lse

The kernel is torch's own choice for the call (``BlockKernels.choose``), with three of mesh3d's: K/V heads are
expanded for the kernels that do not group query heads (memory-efficient, cuDNN: an O(rows) copy per block; flash
groups them itself), a masked call torch would give cuDNN runs memory-efficient in fp32 (cuDNN's masks are not exact for
rows a block masks whole in torch 2.11-2.13) and math in fp16/bf16 (memory-efficient with a half-precision bias was
measured wrong there on an H200), and the causal flag only ever sees as many keys as queries: a block cut by
the diagonal with more queries than keys (uneven shards) runs as a square causal call and a full one, since flash
(and torch's SDPA with it) aligns a non-square causal mask bottom-right where the ring's is top-left.

Around each call, what torch's SDPA does before its own (``aten/src/ATen/native/transformers/attention.cpp``): head
dims padded to 8 for flash (the scale kept), an additive bias of the queries' dtype whose rows are padded to 16
elements, inputs with a unit last stride and aligned offsets (else a copy). Each kernel's log-sum-exp comes back
in its own layout (flash (B, H, Lq); memory-efficient padded to 32 rows; cuDNN (B, H, Lq, 1)) and goes into its
backward in that layout, contiguous, made from the *merged* log-sum-exp. The memory-efficient kernel's rows that
see no key are set to output 0 and log-sum-exp -inf, so they weigh nothing in the merge.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mesh3d.domain.attention.backends import BlockKernels

__all__ = ["additive_mask", "cuda_block_kernel", "fused_backward", "fused_forward", "heads_view", "seen_rows"]

_ALIGN = 8  # elements: flash's and the memory-efficient kernel's vector loads (16 bytes of a half type)
_BIAS_ALIGN = 16  # the memory-efficient kernel's bias row alignment (torch's pad_bias<16>)


def additive_mask(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """An additive float mask of ``dtype`` (0 / -inf for a bool one).

    Usage: ``additive_mask(torch.ones(4, 4, dtype=torch.bool).tril(), torch.float32)``
    """
    if mask.dtype == torch.bool:
        return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))
    return mask if mask.dtype == dtype else mask.to(dtype)


def seen_rows(mask: torch.Tensor | None, causal: bool, lse_shape: torch.Size) -> torch.Tensor | None:
    """Rows that see at least one key (broadcast to the log-sum-exp's shape), or None when every row does.

    Usage: ``seen = seen_rows(mask, False, lse.shape)``
    """
    if mask is None:
        return None
    visible = mask if mask.dtype == torch.bool else mask > float("-inf")
    if causal:
        rows, cols = lse_shape[-1], visible.shape[-1]
        visible = visible & torch.ones(rows, cols, dtype=torch.bool, device=visible.device).tril()
    return visible.any(-1).expand(lse_shape)


def heads_view(k: torch.Tensor, heads: int) -> torch.Tensor:
    """A view of ``k`` with ``heads`` heads (stride 0): what a kernel sees of K/V heads once expanded, for asking
    which kernel takes the call without copying them.

    Usage: ``kernels.choose(q, heads_view(k, 8), heads_view(v, 8), None, True, False)``
    """
    return k[:, :1].expand(k.shape[0], heads, *k.shape[2:])


def cuda_block_kernel(kernels: BlockKernels, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      mask: torch.Tensor | None, causal: bool) -> str:
    """The kernel a CUDA block runs (module docstring): torch's choice for the call as it will be made.

    Usage: ``cuda_block_kernel(BLOCK_KERNELS.value, q, k, v, None, True)  # "flash" for bf16``
    """
    square = causal and q.shape[-2] == k.shape[-2]
    heads = q.shape[-3]
    grouped = k.shape[-3] != heads
    kernel = kernels.choose(q, k, v, mask, square, grouped)
    if grouped and kernel != "flash":  # asked again as it would run: K/V heads expanded
        k, v = heads_view(k, heads), heads_view(v, heads)
        kernel = kernels.choose(q, k, v, mask, square, False)
    if kernel == "cudnn" and mask is not None:
        # NOTE: torch runs this call on cuDNN with its mask; a block's cuDNN op takes none. In fp16/bf16 the
        # memory-efficient kernel with the block's bias was measured wrong where torch had picked cuDNN (H200, torch
        # 2.11: band, bias and window rings off by 0.6-1.4 in bf16, docs/benchmarks.md "On a GPU"; fp32 exact), so
        # half types take the math kernel there until that is diagnosed on a GPU
        half = q.dtype in (torch.float16, torch.bfloat16)
        kernel = "efficient" if not half and kernels.can_use("efficient", q, k, v, mask, square) else "math"
    return kernel


def _ready(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a fused kernel reads it: unit last stride, offset and strides multiples of 8 elements (else a copy)."""
    aligned = t.stride(-1) == 1 and t.storage_offset() % _ALIGN == 0 and \
        all(s % _ALIGN == 0 for s, n in zip(t.stride()[:-1], t.shape[:-1]) if n > 1)
    return t if aligned else t.contiguous()


def _pad_heads(t: torch.Tensor) -> torch.Tensor:
    pad = -t.shape[-1] % _ALIGN
    return _ready(F.pad(t, (0, pad)) if pad else t)


def _expand_heads(t: torch.Tensor, heads: int) -> torch.Tensor:
    return t if t.shape[-3] == heads else t.repeat_interleave(heads // t.shape[-3], dim=-3)


def _bias(mask: torch.Tensor, dtype: torch.dtype, shape: tuple[int, int, int, int]) -> torch.Tensor:
    """The memory-efficient kernel's bias: additive, of ``dtype``, rows padded to 16 elements, expanded to ``shape``."""
    m = mask.reshape((1,) * (4 - mask.ndim) + tuple(mask.shape))
    keys = shape[-1]
    lead = tuple(m.shape[:-1])
    buf = torch.empty((*lead, -(-keys // _BIAS_ALIGN) * _BIAS_ALIGN), dtype=dtype, device=mask.device)[..., :keys]
    if m.dtype == torch.bool:
        buf.zero_().masked_fill_(~m.expand(*lead, keys), float("-inf"))
    else:
        buf.copy_(m.expand(*lead, keys))
    return buf.expand(shape)


def _causal_parts(q_rows: int, k_rows: int) -> list[tuple[slice, slice, bool]]:
    """A top-left causal (q_rows x k_rows) block as calls with a square causal flag or none: (rows, keys, causal)."""
    n = min(q_rows, k_rows)
    parts = [(slice(0, n), slice(0, n), True)]
    if q_rows > n:  # the rows after the diagonal see every key
        parts.append((slice(n, q_rows), slice(0, k_rows), False))
    return parts


def _part_mask(mask: torch.Tensor | None, rows: slice, keys: slice) -> torch.Tensor | None:
    if mask is None:
        return mask
    if mask.shape[-2] != 1:
        mask = mask[..., rows, :]
    return mask[..., keys] if mask.shape[-1] != 1 else mask


def _forward_call(kernels: BlockKernels, kernel: str, q, k, v, mask, causal: bool, scale: float):
    heads, rows, value_width = q.shape[-3], q.shape[-2], v.shape[-1]
    if kernel == "flash":
        out, lse = kernels.flash_forward(_pad_heads(q), _pad_heads(k), _pad_heads(v), causal, scale)
        return out[..., :value_width], lse
    k, v = _expand_heads(k, heads), _expand_heads(v, heads)
    if kernel == "cudnn":
        out, lse = kernels.cudnn_forward(q.contiguous(), k.contiguous(), v.contiguous(), causal, scale)
        return out, lse[..., 0]
    bias = None if mask is None else _bias(mask, q.dtype, (q.shape[0], heads, rows, k.shape[-2]))
    out, lse = kernels.efficient_forward(_ready(q), _ready(k), _ready(v), bias, causal, scale)
    lse = lse[..., :rows]
    seen = seen_rows(mask, causal, lse.shape)
    if seen is not None:  # rows this block masks whole: output 0, and no weight in the merge
        out = out.masked_fill(~seen.unsqueeze(-1), 0.0)
        lse = lse.masked_fill(~seen, float("-inf"))
    return out, lse


def fused_forward(kernels: BlockKernels, kernel: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  mask: torch.Tensor | None, causal: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of one block on ``kernel`` (q (B, H, Lq, E), k/v (B, Hk, Lk, E), both non-empty).

    Usage: ``out, lse = fused_forward(kernels, "flash", q, k, v, None, True, scale)``
    """
    if not causal or q.shape[-2] == k.shape[-2]:
        return _forward_call(kernels, kernel, q, k, v, mask, causal, scale)
    parts = [_forward_call(kernels, kernel, q[..., rows, :], k[..., keys, :], v[..., keys, :],
                           _part_mask(mask, rows, keys), square, scale)
             for rows, keys, square in _causal_parts(q.shape[-2], k.shape[-2])]
    return torch.cat([o for o, _ in parts], -2), torch.cat([lz for _, lz in parts], -1)


def _backward_call(kernels: BlockKernels, kernel: str, dout, q, k, v, out, lse, mask, causal: bool, scale: float):
    heads, kv_heads, width, value_width = q.shape[-3], k.shape[-3], q.shape[-1], v.shape[-1]
    safe = lse.masked_fill(lse == float("-inf"), 0.0)  # rows no block saw (masks only): their P is 0 anyway
    if kernel == "flash":
        dq, dk, dv = kernels.flash_backward(_pad_heads(dout), _pad_heads(q), _pad_heads(k), _pad_heads(v),
                                            _pad_heads(out), safe.contiguous(), causal, scale)
        return dq[..., :width], dk[..., :width], dv[..., :value_width]
    k, v = _expand_heads(k, heads), _expand_heads(v, heads)
    if kernel == "cudnn":
        dq, dk, dv = kernels.cudnn_backward(dout.contiguous(), q.contiguous(), k.contiguous(), v.contiguous(),
                                            out.contiguous(), safe.unsqueeze(-1).contiguous(), causal, scale)
    else:
        rows = q.shape[-2]
        padded = safe.new_zeros((*safe.shape[:-1], kernels.lse_rows(rows)))
        padded[..., :rows] = safe
        bias = None if mask is None else _bias(mask, q.dtype, (q.shape[0], heads, rows, k.shape[-2]))
        dq, dk, dv = kernels.efficient_backward(_ready(dout), _ready(q), _ready(k), _ready(v), bias, _ready(out),
                                                padded, causal, scale)
    if kv_heads != heads:  # the expanded heads' gradients, summed per K/V head (in fp32 for half types)
        acc = torch.float32 if dk.dtype in (torch.float16, torch.bfloat16) else dk.dtype
        dk = dk.unflatten(-3, (kv_heads, heads // kv_heads)).sum(-3, dtype=acc)
        dv = dv.unflatten(-3, (kv_heads, heads // kv_heads)).sum(-3, dtype=acc)
    return dq, dk, dv


def fused_backward(kernels: BlockKernels, kernel: str, dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                   v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, mask: torch.Tensor | None, causal: bool,
                   scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) of one block on ``kernel``, against the merged ``out`` (q's dtype) and ``lse`` (B, H, Lq).

    Usage: ``dq, dk, dv = fused_backward(kernels, "efficient", dout, q, k, v, out, lse, bias, False, scale)``
    """
    if not causal or q.shape[-2] == k.shape[-2]:
        return _backward_call(kernels, kernel, dout, q, k, v, out, lse, mask, causal, scale)
    dq, dk, dv = [], None, None
    for rows, keys, square in _causal_parts(q.shape[-2], k.shape[-2]):
        gq, gk, gv = _backward_call(kernels, kernel, dout[..., rows, :], q[..., rows, :], k[..., keys, :],
                                    v[..., keys, :], out[..., rows, :], lse[..., rows], _part_mask(mask, rows, keys),
                                    square, scale)
        if dk is None:  # the parts' key gradients add up: in fp32 for half types
            acc = torch.float32 if gk.dtype in (torch.float16, torch.bfloat16) else gk.dtype
            dk = gk.new_zeros((*gk.shape[:-2], k.shape[-2], gk.shape[-1]), dtype=acc)
            dv = gv.new_zeros((*gv.shape[:-2], v.shape[-2], gv.shape[-1]), dtype=acc)
        dq.append(gq)
        dk[..., keys, :] += gk
        dv[..., keys, :] += gv
    assert dk is not None and dv is not None
    return torch.cat(dq, -2), dk, dv
