"""Private attention kernels: torch's fused attention kernels with their log-sum-exp (CPU flash; CUDA flash,
memory-efficient, cuDNN) and torch's own choice among them.

Each function says which private name it touches and why no public API serves. Shapes are SDPA's: q (B, H, Lq, E),
k/v (B, Hk, Lk, E/Ev). What each CUDA kernel takes and returns (torch 2.11-2.13, its meta kernels and
``torch/distributed/tensor/experimental/_context_parallel/_attention.py``, which calls the same ops per ring step):

* flash: fp16/bf16, no mask, GQA native, head dims padded to 8 by the caller; ``is_causal`` with Lq != Lk is
  aligned bottom-right (FlashAttention 2), so torch's SDPA never passes it (callers keep causal calls square).
  Log-sum-exp (B, H, Lq) fp32; its backward reads it contiguous.
* memory-efficient: fp16/bf16/fp32, an additive bias (B, H, Lq, Lk) of the queries' dtype whose strides are
  multiples of 16 (broadcast dims stride 0), K/V heads equal to the queries', ``is_causal`` aligned top-left.
  Log-sum-exp (B, H, Lq rounded up to 32) fp32 (ROCm: Lq); its backward reads that padded, contiguous layout.
* cuDNN: fp16/bf16; log-sum-exp (B, H, Lq, 1) fp32.

With dropout 0 the philox seed and offset the backward ops take are not read; they are passed empty, in the dtypes
the forward ops return.
"""

from __future__ import annotations


import torch

__all__ = ["cpu_flash_attention", "cpu_flash_attention_backward", "cuda_attention_ops", "cuda_cudnn_backward",
           "cuda_cudnn_forward", "cuda_efficient_attention", "cuda_efficient_backward", "cuda_efficient_forward",
           "cuda_flash_attention", "cuda_flash_backward", "cuda_flash_forward", "cuda_sdpa_choice",
           "efficient_lse_rows"]

aten = torch.ops.aten

#: ``torch.nn.attention.SDPBackend`` values as ``aten._fused_sdp_choice`` returns them, by mesh3d's kernel names.
_BACKENDS = {0: "math", 1: "flash", 2: "efficient", 3: "cudnn"}


def cpu_flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                        causal: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(output, logsumexp) of softmax attention on CPU, without materializing the scores.

    Why private: ring attention merges partial results by their log-sum-exp, and the public
    ``F.scaled_dot_product_attention`` does not return it. ``aten._scaled_dot_product_flash_attention_for_cpu``
    is the fused kernel that public call dispatches to on CPU (fp32/fp64/bf16/fp16, GQA, an additive mask
    of 2 or 4 dims, causal masking aligned top-left). NOTE: it crashes on an empty query or key (callers
    skip those) and returns logsumexp 0 for a row whose keys are all masked (callers set -inf there).
    """
    return aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, attn_mask=mask, scale=scale)


def cpu_flash_attention_backward(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                 out: torch.Tensor, lse: torch.Tensor, mask: torch.Tensor | None, causal: bool,
                                 scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) of :func:`cpu_flash_attention`, given the output and logsumexp to differentiate against.

    Why private: the ring's backward runs the kernel's backward per block against the *merged* (global)
    output and logsumexp, which autograd of the public call cannot do.
    """
    return aten._scaled_dot_product_flash_attention_for_cpu_backward(
        grad_out, q, k, v, out, lse, 0.0, causal, attn_mask=mask, scale=scale)


def cuda_flash_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                       scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(output, logsumexp) of torch's CUDA flash attention kernel (module docstring: what it takes).

    Why private: ``aten._scaled_dot_product_flash_attention`` is the kernel the public SDPA dispatches to; only it
    returns the log-sum-exp the ring merges blocks by.
    """
    out = aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)
    return out[0], out[1]


def cuda_flash_backward(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                        lse: torch.Tensor, causal: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) of :func:`cuda_flash_forward` against a given (merged) output and logsumexp.

    Why private: the ring differentiates each block against the merged output and log-sum-exp, which autograd of
    the public call cannot; ``aten._scaled_dot_product_flash_attention_backward`` is that kernel's backward.
    """
    seed = torch.empty(2, dtype=torch.uint64, device=q.device)
    offset = torch.empty((), dtype=torch.uint64, device=q.device)
    return aten._scaled_dot_product_flash_attention_backward(
        grad_out, q, k, v, out, lse, None, None, q.shape[-2], k.shape[-2], 0.0, causal, seed, offset, scale=scale)


def efficient_lse_rows(rows: int) -> int:
    """The length of the memory-efficient kernel's log-sum-exp rows for ``rows`` queries (padded to 32; ROCm: not)."""
    return rows if torch.version.hip else -(-rows // 32) * 32


def cuda_efficient_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor | None, causal: bool,
                           scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(output, logsumexp) of torch's CUDA memory-efficient attention kernel (module docstring: what it takes).

    Why private: as :func:`cuda_flash_forward`, for ``aten._scaled_dot_product_efficient_attention``.
    """
    out = aten._scaled_dot_product_efficient_attention(q, k, v, bias, True, 0.0, causal, scale=scale)
    return out[0], out[1]


def cuda_efficient_backward(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                            bias: torch.Tensor | None, out: torch.Tensor, lse: torch.Tensor, causal: bool,
                            scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) of :func:`cuda_efficient_forward` against a given output and (padded) logsumexp.

    Why private: as :func:`cuda_flash_backward`, for ``aten._scaled_dot_product_efficient_attention_backward``.
    """
    seed = torch.empty((), dtype=torch.int64, device=q.device)
    offset = torch.empty((), dtype=torch.int64, device=q.device)
    grads = aten._scaled_dot_product_efficient_attention_backward(
        grad_out, q, k, v, bias, out, lse, seed, offset, 0.0, [True, True, True, False], causal, scale=scale)
    return grads[0], grads[1], grads[2]


def cuda_cudnn_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                       scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(output, logsumexp) of torch's cuDNN attention kernel (no mask: see ``mesh3d.domain.attention.fused``).

    Why private: as :func:`cuda_flash_forward`, for ``aten._scaled_dot_product_cudnn_attention``.
    """
    out = aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, causal, False, scale=scale)
    return out[0], out[1]


def cuda_cudnn_backward(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                        lse: torch.Tensor, causal: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) of :func:`cuda_cudnn_forward` against a given output and logsumexp ((B, H, Lq, 1)).

    Why private: as :func:`cuda_flash_backward`, for ``aten._scaled_dot_product_cudnn_attention_backward``.
    """
    seed = torch.empty((), dtype=torch.int64, device=q.device)
    offset = torch.empty((), dtype=torch.int64, device=q.device)
    grads = aten._scaled_dot_product_cudnn_attention_backward(
        grad_out, q, k, v, out, lse, seed, offset, None, None, None, q.shape[-2], k.shape[-2], 0.0, causal, scale=scale)
    return grads[0], grads[1], grads[2]


def cuda_sdpa_choice(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, causal: bool,
                     enable_gqa: bool) -> str:
    """The kernel torch's SDPA picks for these CUDA inputs: ``"flash"``, ``"efficient"``, ``"cudnn"`` or ``"math"``.

    Why private: ``aten._fused_sdp_choice`` is the choice the public SDPA makes (the enabled backends of
    ``torch.nn.attention.sdpa_kernel``, torch's priority order, every kernel's constraints on this GPU); the public
    ``torch.backends.cuda.can_use_*`` answer per kernel but not in torch's order.
    """
    return _BACKENDS.get(aten._fused_sdp_choice(q, k, v, mask, 0.0, causal, enable_gqa=enable_gqa), "math")


def cuda_flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                         scale: float | None) -> torch.Tensor:
    """The output of torch's CUDA flash attention kernel (fp16/bf16, no mask), the kernel SDPA would pick.

    Why private: ``aten._scaled_dot_product_flash_attention`` is that kernel; the planner runs it on meta tensors
    to count exactly what it allocates (its log-sum-exp included), where the public call might pick another.
    """
    return aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, scale=scale)[0]


def cuda_efficient_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor | None,
                             causal: bool, scale: float | None) -> torch.Tensor:
    """The output of torch's CUDA memory-efficient attention kernel (fp32 too, an additive bias), with log-sum-exp.

    Why private: as :func:`cuda_flash_attention`, for ``aten._scaled_dot_product_efficient_attention``.
    """
    return aten._scaled_dot_product_efficient_attention(q, k, v, bias, True, 0.0, causal, scale=scale)[0]


def cuda_attention_ops() -> dict[str, torch._ops.OpOverload]:
    """The ATen operators of torch's CUDA fused attention, by role: ``flash_backward``, ``efficient``,
    ``efficient_backward`` (what the planner's CUDA model attaches kernel workspaces to).

    Why private: those kernels are ``aten._scaled_dot_product_*`` operators; a dry run on meta tensors meets them by
    these names (the public call decomposes on meta).
    """
    return {"flash_backward": aten._scaled_dot_product_flash_attention_backward.default,
            "efficient": aten._scaled_dot_product_efficient_attention.default,
            "efficient_backward": aten._scaled_dot_product_efficient_attention_backward.default}
