"""Strided layouts and window partitions against one process (fp64, 2 and 3 uneven ranks, empty shards included):
GPT-2's Conv1D (``x.view(-1, c)`` of a sequence sharded along T, with B > 1: B blocks of each rank's rows), Swin's
window partition with B > 1 (windows of several samples in one batch of windows), shifted windows with their mask,
and shard boundaries that cut a window (moved to whole windows first). Forward, input and weight gradients."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from domain_cases import compare_to_one_process

TOL = 1e-12
D64 = torch.float64


class Conv1DMLP(nn.Module):
    """GPT-2's MLP: HF Conv1D is ``addmm(bias, x.view(-1, c), w).view(*x.shape[:-1], nf)``."""

    def __init__(self, c: int = 6) -> None:
        super().__init__()
        self.w1, self.b1 = nn.Parameter(torch.randn(c, 2 * c, dtype=D64)), nn.Parameter(torch.randn(2 * c, dtype=D64))
        self.w2, self.b2 = nn.Parameter(torch.randn(2 * c, c, dtype=D64)), nn.Parameter(torch.randn(c, dtype=D64))
        self.norm = nn.LayerNorm(c, dtype=D64)

    @staticmethod
    def conv1d(x, w, b):
        return torch.addmm(b, x.view(-1, x.size(-1)), w).view(x.size()[:-1] + (w.shape[1],))

    def forward(self, x):                                    # (B, T, c) sharded along T
        h = F.gelu(self.conv1d(self.norm(x), self.w1, self.b1))
        return x + self.conv1d(h, self.w2, self.b2)


def window_partition(x, ws):
    b, h, w, c = x.shape
    x = x.view(b, h // ws, ws, w // ws, ws, c)
    return x.permute(0, 1, 3, 2, 4, 5).contiguous().view(-1, ws, ws, c)


def window_reverse(windows, ws, h, w):
    c = windows.shape[-1]
    x = windows.view(-1, h // ws, w // ws, ws, ws, c)
    return x.permute(0, 1, 3, 2, 4, 5).contiguous().view(-1, h, w, c)


class WindowAttention(nn.Module):
    """Swin's (shifted) window attention on (B, H, W, C), H sharded: partition, SDPA within windows, reverse."""

    def __init__(self, c: int = 4, ws: int = 2, shift: int = 0) -> None:
        super().__init__()
        self.ws, self.shift = ws, shift
        self.qkv, self.proj = nn.Linear(c, 3 * c, dtype=D64), nn.Linear(c, c, dtype=D64)

    def mask(self, h, w):
        img = torch.zeros(1, h, w, 1, dtype=D64)
        cuts = (slice(0, -self.ws), slice(-self.ws, -self.shift), slice(-self.shift, None))
        for i, hs in enumerate(cuts):
            for j, wsl in enumerate(cuts):
                img[:, hs, wsl, :] = 3 * i + j
        windows = window_partition(img, self.ws).view(-1, self.ws * self.ws)
        diff = windows.unsqueeze(1) - windows.unsqueeze(2)
        return diff.masked_fill(diff != 0, -100.0).masked_fill(diff == 0, 0.0)        # (nW, N, N)

    def forward(self, x):
        b, h, w, c = x.shape
        if self.shift:
            x = torch.roll(x, shifts=(-self.shift, -self.shift), dims=(1, 2))
        win = window_partition(x, self.ws).view(-1, self.ws * self.ws, c)              # (B*nW, N, c)
        q, k, v = self.qkv(win).view(win.shape[0], win.shape[1], 3, 1, c).permute(2, 0, 3, 1, 4).unbind(0)
        mask = self.mask(h, w) if self.shift else None
        if mask is not None:                                                           # per window, as Swin adds it
            n_w = mask.shape[0]
            mask = mask.unsqueeze(1).unsqueeze(0).expand(b, -1, -1, -1, -1).reshape(b * n_w, 1, *mask.shape[1:])
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)                  # windows: batch-like
        out = self.proj(out.transpose(1, 2).reshape(win.shape))
        y = window_reverse(out.view(-1, self.ws, self.ws, c), self.ws, h, w)
        if self.shift:
            y = torch.roll(y, shifts=(self.shift, self.shift), dims=(1, 2))
        return y


def _body(sizes_t, sizes_h):
    from mesh3d import DistributedManager

    DistributedManager.initialize(batch=1, domain=len(sizes_t), model=1)
    torch.manual_seed(0)
    errs = {"conv1d mlp, B=3": compare_to_one_process(lambda: Conv1DMLP(), torch.randn(3, sum(sizes_t), 6, dtype=D64),
                                                      1, sizes_t)}
    for shift in (0, 1):
        x = torch.randn(2, sum(sizes_h), 6, 4, dtype=D64)
        errs[f"windows B=2, shift {shift}"] = compare_to_one_process(lambda s=shift: WindowAttention(shift=s), x, 1,
                                                                     sizes_h)
    return errs


@pytest.mark.parametrize("sizes_t, sizes_h", [((5, 6), (2, 6)), ((0, 11), (3, 5)), ((4, 0, 7), (1, 4, 3))],
                         ids=["2 ranks", "2 ranks, empty", "3 ranks, windows cut"])
def test_strided_layouts_and_windows_equal_one_process(ranks, sizes_t, sizes_h):
    for errs in ranks.run(len(sizes_t), _body, sizes_t, sizes_h, timeout=180):
        assert max(errs.values()) < TOL, errs


def _refusal_body():
    from mesh3d import DistributedManager, domain

    DistributedManager.initialize(batch=1, domain=2, model=1)
    h = domain.shard(torch.randn(2, 5, 3), dim=1, sizes=(2, 3)).view(-1, 3)
    try:
        torch.cumsum(h, 0)
    except NotImplementedError as err:
        return str(err)
    return "ran"


def test_an_op_without_a_strided_rule_names_it_and_the_way_back(ranks):
    for message in ranks.run(2, _refusal_body):
        assert "torch.cumsum" in message and "strided layout" in message and "reshape it back" in message, message
