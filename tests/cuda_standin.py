"""Torch's CUDA attention kernels stood in for on the CPU: the same contract, computed explicitly, misuse refused.

``StandInCudaKernels`` is a ``BlockKernels`` whose CPU tensors stand for CUDA ones: the kernel is chosen by
``kernel_rules`` (torch 2.11-2.13's constraints and priority order), and each op checks what the real one needs and
returns what it returns (``mesh3d/_torch_private/kernels.py``), the awkward parts included, so a wrong call shows:

* flash: half types (or any, ``exact``), no mask, head dims equal and multiples of 8, unit last strides and 8-element
  aligned offsets and strides; a causal flag with Lq != Lk is aligned **bottom-right**; log-sum-exp (B, H, Lq), read
  back contiguous;
* memory-efficient: K/V heads equal to the queries'; a bias of the queries' dtype, (B, H, Lq, Lk), strides multiples
  of 16; causal top-left; log-sum-exp padded to 32 rows with NaN after Lq, read back padded and contiguous; a row
  the bias masks whole comes out NaN (the correction is the caller's);
* cuDNN: no mask here; causal bottom-right; log-sum-exp (B, H, Lq, 1).

``exact=True`` lets fp64 through every kernel (computed in fp64, log-sum-exp fp64) and makes the rules see it as
bf16, so the calls around each kernel are checked exactly against SDPA. ``calls`` lists (kernel, direction).

Usage::

    kernels = StandInCudaKernels(exact=True, order=("efficient", "math"))
    with use_block_kernels(kernels):
        out = ring_attention(plan, q, k, v)
    assert kernels.calls[0] == ("efficient", "forward")
"""

from __future__ import annotations

import torch

from mesh3d.domain.attention.backends import BlockKernels
from mesh3d.domain.attention.kernel_rules import KERNEL_NAMES, SDPA_ORDER, SdpaCall, kernel_accepts, sdpa_choice

_HALF = (torch.float16, torch.bfloat16)


class StandInCudaKernels(BlockKernels):
    def __init__(self, exact: bool = False, order: tuple[str, ...] = SDPA_ORDER,
                 enabled: tuple[str, ...] = KERNEL_NAMES) -> None:
        self.exact, self.order, self.enabled = exact, order, enabled
        self.calls: list[tuple[str, str]] = []

    # ------------------------------------------------------------------ choice
    def _call(self, q, k, v, mask, causal) -> SdpaCall:
        call = SdpaCall.of(q, k, v, mask, causal)
        if self.exact and call.dtype == torch.float64:
            call = SdpaCall(torch.bfloat16, *[getattr(call, f) for f in ("q_heads", "kv_heads", "q_rows", "k_rows",
                                                                          "width", "value_width", "mask", "causal",
                                                                          "dense_last_dim")])
        return call

    def platform(self, t: torch.Tensor) -> str:
        return "cuda"

    def choose(self, q, k, v, mask, causal, gqa) -> str:
        return sdpa_choice(self._call(q, k, v, mask, causal), self.order, self.enabled)

    def can_use(self, kernel, q, k, v, mask, causal) -> bool:
        return kernel in self.enabled and kernel_accepts(kernel, self._call(q, k, v, mask, causal))

    def lse_rows(self, rows: int) -> int:
        return -(-rows // 32) * 32

    # ------------------------------------------------------------------ contract checks
    def _inputs(self, kernel: str, *ts: torch.Tensor) -> None:
        dtypes = _HALF + ((torch.float32,) if kernel == "efficient" else ()) + ((torch.float64,) if self.exact else ())
        for t in ts:
            assert t.dtype == ts[0].dtype in dtypes, f"{kernel}: dtype {t.dtype}"
            assert t.dim() == 4 and t.stride(-1) == 1, f"{kernel}: needs 4-D inputs with a unit last stride"
            assert t.storage_offset() % 8 == 0 and all(s % 8 == 0 for s, n in zip(t.stride()[:-1], t.shape[:-1])
                                                        if n > 1), f"{kernel}: misaligned {t.stride()}"
        q, k = ts[0], ts[1]
        if kernel == "flash":
            assert q.shape[-1] % 8 == 0 and len({t.shape[-1] for t in ts[:3]}) == 1, "flash: head dims"
            assert q.shape[1] % k.shape[1] == 0, "flash: heads"
        else:
            assert q.shape[1] == k.shape[1], f"{kernel}: K/V heads must equal the query heads"

    def _lse_dtype(self, q: torch.Tensor) -> torch.dtype:
        return torch.float64 if q.dtype == torch.float64 else torch.float32

    # ------------------------------------------------------------------ the math
    def _scores(self, q, k, bias, causal, scale, bottom_right):
        acc = self._lse_dtype(q)
        g = q.shape[1] // k.shape[1]
        kk = k.to(acc).repeat_interleave(g, dim=1)
        s = q.to(acc) @ kk.transpose(-1, -2) * scale
        if bias is not None:
            s = s + bias.to(acc)
        if causal:
            lq, lk = s.shape[-2:]
            shift = lk - lq if bottom_right else 0
            s = s.masked_fill(torch.ones(lq, lk, dtype=torch.bool).triu(1 + shift), float("-inf"))
        return s

    def _forward(self, kernel, q, k, v, bias, causal, scale, bottom_right):
        self.calls.append((kernel, "forward"))
        s = self._scores(q, k, bias, causal, scale, bottom_right)
        lse = torch.logsumexp(s, -1)
        g = q.shape[1] // v.shape[1]
        out = torch.exp(s - lse.unsqueeze(-1)) @ v.to(s.dtype).repeat_interleave(g, dim=1)  # NaN where lse is -inf
        return out.to(q.dtype), lse.to(self._lse_dtype(q))

    def _backward(self, kernel, dout, q, k, v, bias, out, lse, causal, scale, bottom_right):
        self.calls.append((kernel, "backward"))
        assert out.dtype == q.dtype and dout.dtype == q.dtype, f"{kernel}: out and dout must have q's dtype"
        assert lse.dtype == self._lse_dtype(q) and lse.is_contiguous(), f"{kernel}: log-sum-exp layout"
        s = self._scores(q, k, bias, causal, scale, bottom_right)
        acc, g = s.dtype, q.shape[1] // k.shape[1]
        p = torch.exp(s - lse.to(acc).unsqueeze(-1))
        do = dout.to(acc)
        vv = v.to(acc).repeat_interleave(g, dim=1)
        delta = (do * out.to(acc)).sum(-1, keepdim=True)
        ds = p * (do @ vv.transpose(-1, -2) - delta)
        dq = ds @ k.to(acc).repeat_interleave(g, dim=1) * scale
        dk = (ds.transpose(-1, -2) @ q.to(acc) * scale).unflatten(1, (k.shape[1], g)).sum(2)
        dv = (p.transpose(-1, -2) @ do).unflatten(1, (k.shape[1], g)).sum(2)
        return dq.to(q.dtype), dk.to(q.dtype), dv.to(q.dtype)

    # ------------------------------------------------------------------ the ops
    def flash_forward(self, q, k, v, causal, scale):
        self._inputs("flash", q, k, v)
        return self._forward("flash", q, k, v, None, causal, scale, bottom_right=True)

    def flash_backward(self, dout, q, k, v, out, lse, causal, scale):
        self._inputs("flash", q, k, v, dout, out)
        assert lse.shape == q.shape[:-1], "flash: log-sum-exp (B, H, Lq)"
        return self._backward("flash", dout, q, k, v, None, out, lse, causal, scale, bottom_right=True)

    def _bias(self, bias, q, k) -> None:
        if bias is None:
            return
        assert bias.dtype == q.dtype and bias.shape == (*q.shape[:-1], k.shape[-2]), "efficient: bias dtype and shape"
        assert bias.stride(-1) == 1 and all(s % 16 == 0 for s in bias.stride()[:-1]), "efficient: bias alignment"

    def efficient_forward(self, q, k, v, bias, causal, scale):
        self._inputs("efficient", q, k, v)
        self._bias(bias, q, k)
        out, lse = self._forward("efficient", q, k, v, bias, causal, scale, bottom_right=False)
        padded = torch.full((*lse.shape[:-1], self.lse_rows(lse.shape[-1])), float("nan"), dtype=lse.dtype)
        padded[..., :lse.shape[-1]] = lse
        return out, padded

    def efficient_backward(self, dout, q, k, v, bias, out, lse, causal, scale):
        self._inputs("efficient", q, k, v, dout, out)
        self._bias(bias, q, k)
        assert lse.shape == (*q.shape[:-2], self.lse_rows(q.shape[-2])), "efficient: log-sum-exp padded to 32 rows"
        assert lse.is_contiguous()
        return self._backward("efficient", dout, q, k, v, bias, out, lse[..., :q.shape[-2]].contiguous(), causal,
                              scale, bottom_right=False)

    def cudnn_forward(self, q, k, v, causal, scale):
        self._inputs("cudnn", q, k, v)
        out, lse = self._forward("cudnn", q, k, v, None, causal, scale, bottom_right=True)
        return out, lse.unsqueeze(-1)

    def cudnn_backward(self, dout, q, k, v, out, lse, causal, scale):
        self._inputs("cudnn", q, k, v, dout, out)
        assert lse.shape == (*q.shape[:-1], 1) and lse.is_contiguous(), "cudnn: log-sum-exp (B, H, Lq, 1)"
        return self._backward("cudnn", dout, q, k, v, None, out, lse[..., 0], causal, scale, bottom_right=True)
