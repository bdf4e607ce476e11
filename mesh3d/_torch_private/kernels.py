"""Private attention kernels: torch's fused attention kernels with their log-sum-exp (CPU flash; CUDA flash, efficient).

Each function says which private name it touches and why no public API serves.
"""

from __future__ import annotations


import torch

__all__ = ["cpu_flash_attention", "cpu_flash_attention_backward", "cuda_attention_ops", "cuda_efficient_attention",
           "cuda_flash_attention"]


def cpu_flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                        causal: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(output, logsumexp) of softmax attention on CPU, without materializing the scores.

    Why private: ring attention merges partial results by their log-sum-exp, and the public
    ``F.scaled_dot_product_attention`` does not return it. ``aten._scaled_dot_product_flash_attention_for_cpu``
    is the fused kernel that public call dispatches to on CPU (fp32/fp64/bf16/fp16, GQA, an additive mask
    of 2 or 4 dims, causal masking aligned top-left). NOTE: it crashes on an empty query or key (callers
    skip those) and returns logsumexp 0 for a row whose keys are all masked (callers set -inf there).
    """
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, attn_mask=mask,
                                                                       scale=scale)


def cpu_flash_attention_backward(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                 out: torch.Tensor, lse: torch.Tensor, mask: torch.Tensor | None, causal: bool,
                                 scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) of :func:`cpu_flash_attention`, given the output and logsumexp to differentiate against.

    Why private: the ring's backward runs the kernel's backward per block against the *merged* (global)
    output and logsumexp, which autograd of the public call cannot do.
    """
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        grad_out, q, k, v, out, lse, 0.0, causal, attn_mask=mask, scale=scale)


def cuda_flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                         scale: float | None) -> torch.Tensor:
    """The output of torch's CUDA flash attention kernel (fp16/bf16, no mask), the kernel SDPA would pick.

    Why private: ``aten._scaled_dot_product_flash_attention`` is that kernel; the planner runs it on meta tensors
    to count exactly what it allocates (its log-sum-exp included), where the public call might pick another.
    """
    return torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, scale=scale)[0]


def cuda_efficient_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor | None,
                             causal: bool, scale: float | None) -> torch.Tensor:
    """The output of torch's CUDA memory-efficient attention kernel (fp32 too, an additive bias), with log-sum-exp.

    Why private: as :func:`cuda_flash_attention`, for ``aten._scaled_dot_product_efficient_attention``.
    """
    return torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, bias, True, 0.0, causal, scale=scale)[0]


def cuda_attention_ops() -> dict[str, torch._ops.OpOverload]:
    """The ATen operators of torch's CUDA fused attention, by role: ``flash_backward``, ``efficient``,
    ``efficient_backward`` (what the planner's CUDA model attaches kernel workspaces to).

    Why private: those kernels are ``aten._scaled_dot_product_*`` operators; a dry run on meta tensors meets them by
    these names (the public call decomposes on meta).
    """
    aten = torch.ops.aten
    return {"flash_backward": aten._scaled_dot_product_flash_attention_backward.default,
            "efficient": aten._scaled_dot_product_efficient_attention.default,
            "efficient_backward": aten._scaled_dot_product_efficient_attention_backward.default}
