"""Models shared by the domain tests (imported on every rank): a small U-Net and a small ViT."""

from __future__ import annotations

import torch
from torch import nn

H, W = 14, 10


class TinyUNet(nn.Module):
    """Strided, dilated+circular, transposed convs, GroupNorm, max pooling, bilinear upsampling, a skip."""

    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Sequential(nn.Conv2d(2, 8, 3, padding=1), nn.GroupNorm(2, 8), nn.ReLU(inplace=True))
        self.down = nn.Conv2d(8, 8, 3, stride=2, padding=1)
        self.pool = nn.MaxPool2d(2)
        self.mid = nn.Sequential(nn.Conv2d(8, 8, 3, padding=2, dilation=2, padding_mode="circular"),
                                 nn.GroupNorm(4, 8), nn.SiLU())
        self.up = nn.Upsample(scale_factor=2, mode="bilinear")
        self.up_t = nn.ConvTranspose2d(8, 8, 2, stride=2)
        self.dec = nn.Conv2d(16, 2, (4, 3), padding="same")

    def forward(self, x):
        e = self.enc(x)
        m = self.mid(self.down(e) + self.pool(e))
        u = self.up(m) + self.up_t(m)
        return self.dec(torch.cat([e, u], dim=1))


class TinyViT(nn.Module):
    """Patch embedding (strided conv), token flatten, LayerNorm, global SDPA, MLP, mean-pooled head."""

    def __init__(self, dim: int = 12) -> None:
        super().__init__()
        self.embed = nn.Conv2d(2, dim, 2, stride=2)
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        # No key bias: its gradient is analytically zero (softmax ignores a per-query constant), so it is
        # pure rounding noise that Adam would blow up to +-lr, differently in each process.
        self.q, self.k, self.v = nn.Linear(dim, dim), nn.Linear(dim, dim, bias=False), nn.Linear(dim, dim)
        # The head runs on a replicated value (after global pooling): its gradient must still come out
        # right after the domain sum (each rank keeps 1/D of it).
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))
        self.head = nn.Sequential(nn.Linear(dim, 2 * dim), nn.Tanh(), nn.Linear(2 * dim, 3))

    def forward(self, x):
        t = self.embed(x).flatten(2).transpose(1, 2)  # (B, tokens, dim), tokens sharded over the domain
        h = self.norm1(t)
        t = t + torch.nn.functional.scaled_dot_product_attention(self.q(h), self.k(h), self.v(h))
        t = t + self.mlp(self.norm2(t))
        return self.head(t.mean(dim=1))  # replicated (B, 3)


class GridAttention(nn.Module):
    """A grid flattened into tokens, multi-head SDPA over every token of the grid, reshaped back to the grid: on
    blocks, the query, key and value are token grids (no class token)."""

    def __init__(self, dim: int = 8, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.embed = nn.Conv2d(2, dim, 3, padding=1)
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)  # no key bias: its gradient is rounding noise (see TinyViT)
        self.decode = nn.Conv2d(dim, 2, 1)

    def forward(self, x):
        e = self.embed(x)
        b, c, grid = e.shape[0], e.shape[1], e.shape[2:]
        t = e.flatten(2).transpose(1, 2)
        q, k, v = self.qkv(t).reshape(b, -1, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4).unbind(0)
        t = t + torch.nn.functional.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, -1, c)
        return self.decode(t.transpose(1, 2).reshape(b, c, *grid))


class GridViT(nn.Module):
    """A ViT on a token grid (2-D or 3-D patches): class token, learned position embedding, a global-attention
    block (timm-style fused qkv), a neighbourhood-attention block on the grid, the tokens reshaped back to the
    grid for a conv decoder, and a head on the class token plus the mean token."""

    def __init__(self, tokens: int, nd: int = 2, dim: int = 8, heads: int = 2) -> None:
        super().__init__()
        conv = getattr(nn, f"Conv{nd}d")
        self.heads = heads
        self.embed = conv(2, dim, 2, stride=2)
        self.cls = nn.Parameter(torch.randn(1, 1, dim) * 0.5)
        self.pos = nn.Parameter(torch.randn(1, 1 + tokens, dim) * 0.5)
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.near_q, self.near_kv = nn.Linear(dim, dim), nn.Linear(dim, 2 * dim)
        self.mlp = nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))
        self.decode = conv(dim, 1, 3, padding=1)
        self.head = nn.Linear(dim, 3)

    def forward(self, x):
        from mesh3d.domain import neighbourhood_attention

        e = self.embed(x)
        b, c, grid = e.shape[0], e.shape[1], e.shape[2:]  # on blocks, grid is this rank's block (global known)
        hd = c // self.heads
        t = e.flatten(2).transpose(1, 2)
        t = torch.cat([self.cls.expand(b, -1, -1), t], dim=1) + self.pos
        q, k, v = self.qkv(self.norm1(t)).reshape(b, -1, 3, self.heads, hd).permute(2, 0, 3, 1, 4).unbind(0)
        t = t + self.proj(torch.nn.functional.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, -1, c))
        cls, g = t[:, 0], t[:, 1:]
        h = self.norm2(g)
        q = self.near_q(h).view(b, -1, self.heads, hd).transpose(1, 2)
        k, v = self.near_kv(h).view(b, -1, 2 * self.heads, hd).transpose(1, 2).chunk(2, dim=1)
        g = g + neighbourhood_attention(q, k, v, radius=1, grid=grid).transpose(1, 2).reshape(b, -1, c)
        g = g + self.mlp(g)
        return self.decode(g.transpose(1, 2).reshape(b, c, *grid)), self.head(cls + g.mean(dim=1))


def _positions(ids: torch.Tensor) -> torch.Tensor:
    """Global positions of the sequence dim (dim 1): ``domain.positions`` on a domain tensor.

    NOTE: Hugging Face decoders build ``torch.arange(seq_len)`` from ``ids.shape[1]``; on a domain tensor that is
    the local length (positions would restart at 0 on every rank) until domain tensors answer with global sizes.
    """
    from mesh3d.domain import DomainTensor, positions

    if isinstance(ids, DomainTensor):
        return positions(ids, dim=1)
    return torch.arange(ids.shape[1], device=ids.device)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class DecoderAttention(nn.Module):
    """Causal self-attention written as Hugging Face writes it: q/k/v/o projections, (B, T, heads, hd) views
    transposed to heads, rotary embeddings (Llama) when given, grouped K/V heads (``enable_gqa``), and a causal
    sliding ``window`` (Mistral) through ``domain.attention``, which also runs on plain tensors."""

    def __init__(self, dim: int, heads: int, kv_heads: int, window: int | None = None) -> None:
        super().__init__()
        self.hd, self.kv_heads, self.window = dim // heads, kv_heads, window
        self.q_proj, self.o_proj = nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.k_proj, self.v_proj = nn.Linear(dim, kv_heads * self.hd), nn.Linear(dim, kv_heads * self.hd)

    def forward(self, x, rope=None):
        b, t = x.shape[:2]
        q, k, v = (p(x).view(b, t, -1, self.hd).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
        if rope is not None:
            cos, sin = rope
            q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
        if self.window is None:
            y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                                 enable_gqa=k.shape[1] != q.shape[1])
        else:
            from mesh3d.domain import attention

            y = attention(q, k, v, is_causal=True, window=(self.window, 0), enable_gqa=k.shape[1] != q.shape[1])
        return self.o_proj(y.transpose(1, 2).reshape(b, t, -1))


class DecoderBlock(nn.Module):
    def __init__(self, dim: int, heads: int, kv_heads: int, window: int | None = None) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = DecoderAttention(dim, heads, kv_heads, window)
        self.up, self.down = nn.Linear(dim, 2 * dim), nn.Linear(2 * dim, dim)

    def forward(self, x, rope=None):
        x = x + self.attn(self.ln1(x), rope)
        return x + self.down(torch.nn.functional.gelu(self.up(self.ln2(x))))


class TinyDecoder(nn.Module):
    """A small decoder-only LM in the style of GPT-2 (learned positions) or Llama (``rotary=True``, grouped K/V
    heads; ``window``: a causal sliding window, as Mistral): embeddings, pre-norm blocks with causal SDPA, a final
    norm and an LM head. Runs unchanged in one
    process and on a sequence sharded over the domain (``domain.shard(ids, dim=1)``)."""

    def __init__(self, vocab: int = 32, dim: int = 16, heads: int = 4, kv_heads: int | None = None, layers: int = 2,
                 rotary: bool = False, max_len: int = 64, window: int | None = None) -> None:
        super().__init__()
        self.rotary, self.hd = rotary, dim // heads
        self.tok = nn.Embedding(vocab, dim)
        self.wpe = None if rotary else nn.Embedding(max_len, dim)
        self.register_buffer("inv_freq", 1.0 / 10000 ** (torch.arange(0, self.hd, 2, dtype=torch.float64) / self.hd),
                             persistent=False)
        self.blocks = nn.ModuleList(DecoderBlock(dim, heads, kv_heads or heads, window) for _ in range(layers))
        self.norm, self.head = nn.LayerNorm(dim), nn.Linear(dim, vocab)

    def forward(self, ids):
        pos = _positions(ids)
        x = self.tok(ids)
        rope = None
        if self.wpe is not None:
            x = x + self.wpe(pos)
        else:
            freqs = pos.to(self.inv_freq.dtype)[:, None] * self.inv_freq[None, :]
            emb = torch.cat((freqs, freqs), dim=-1)  # (T, hd), broadcast over batch and heads
            rope = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
        for block in self.blocks:
            x = block(x, rope)
        return self.head(self.norm(x))
