"""The idioms of issue 45 against one process in fp64, forward and backward (outputs, input gradients, every parameter
gradient summed over the domain), on 2 and 3 uneven slabs with an empty shard and on a 2x2 grid of uneven blocks:
attention with mixed operands (cross-attention to a plain conditioning, latent queries over sharded keys, operands
sharded along a batch-like dim), cat of several sharded pieces (periodic padding, swapped halves), repeat/tile/expand,
index tensors along the sharded dim, bicubic/area/antialiased interpolation, cdist on strided rows, roll on blocks;
and what the zoo's new models needed: patches unfolded across ranks (MobileViT), Tensor.unfold and movedim, a conv over
sharded channels (MLP-Mixer), F.normalize, a codebook lookup (cdist, argmin, embedding) on strided rows and on a token
grid, a plain table converted by .to(x), var/std on blocks; and on a 2x2x2 grid of volumes with empty blocks."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from domain_cases import compare_to_one_process, grads_err, max_err

D64 = torch.float64


class Attend(torch.nn.Module):
    """x (B, 3, S, 4) -> heads (B, 3, S, 4): cross-attention to a plain conditioning, latent queries, a batch-like dim."""

    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind
        self.proj = torch.nn.Linear(4, 4, dtype=D64)
        self.cond = torch.nn.Parameter(torch.randn(2, 3, 5, 4, dtype=D64))
        self.latent = torch.nn.Parameter(torch.randn(2, 3, 3, 4, dtype=D64))
        self.bias = torch.nn.Parameter(torch.randn(2, 1, 3, 9, dtype=D64))
        self.rows = torch.nn.Parameter(torch.randn(2, 9, 5, 4, dtype=D64))

    def forward(self, x):
        h = self.proj(x)
        if self.kind == "cross":
            return F.scaled_dot_product_attention(h, self.cond, self.cond * 2) * h
        if self.kind == "cross_causal":
            return F.scaled_dot_product_attention(h, self.cond, self.cond, is_causal=True)
        if self.kind == "latent":  # replicated result, then back onto the shards
            return x * F.scaled_dot_product_attention(self.latent, h, h * 2, attn_mask=self.bias).mean((2, 3), True)
        if self.kind == "latent_causal":
            return F.scaled_dot_product_attention(self.latent, h, x, is_causal=True).sum() * x
        if self.kind == "batch_whole_kv":
            return F.scaled_dot_product_attention(h.transpose(1, 2), self.rows, self.rows).transpose(1, 2)
        # latent queries (broadcast over the batch-like dim) over keys sharded along it
        q = self.latent[:1, :1].expand(2, 1, 3, 4)
        return F.scaled_dot_product_attention(q, h.transpose(1, 2), x.transpose(1, 2)).sum((2, 3))


class Rows(torch.nn.Module):
    """Rows of the sharded dim (dim 2 of (B, 3, 9, 4)) put together anew, then a conv across them."""

    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind
        self.conv = torch.nn.Conv2d(3, 2, 3, padding=1, dtype=D64)
        self.code = torch.nn.Parameter(torch.randn(5, 3, dtype=D64))

    def forward(self, x):
        k = self.kind
        if k == "periodic":  # the rows padded periodically by cat, then a conv without padding along them
            return F.conv2d(torch.cat([x[:, :, -2:], x, x[:, :, :2]], 2), self.conv.weight, self.conv.bias, padding=(0, 1))
        if k == "swap":
            y = torch.cat([x[:, :, 4:], x[:, :, :4]], 2)
        elif k == "repeat":
            y = x.repeat(1, 1, 2, 1).tile((1, 1, 2))
        elif k == "index":
            y = x[:, :, torch.tensor([0, 2, 2, 5, 8])] + x[:, :, torch.tensor([8, 0, -3, 1, 4])]
        elif k == "index_bool":
            y = x[:, :, torch.arange(9) % 2 == 0] * torch.index_select(x, 2, torch.tensor([1, 3, 5, 6, 7]))
        elif k == "cdist":
            d = torch.cdist(x.permute(0, 2, 3, 1).reshape(-1, 3), self.code)        # strided rows vs a codebook
            y = d.view(2, 9, 4, 5).permute(0, 3, 1, 2)[:, :3]
        else:
            y = torch.cdist(self.code.expand(2, -1, -1), x.permute(0, 2, 3, 1).reshape(2, -1, 3))  # codes vs rows
            y = y.view(2, 5, 9, 4)[:, :3]
        return self.conv(y)


class Zoo(torch.nn.Module):
    """What the zoo's issue-45 models do to x (B, 3, 9, 4) sharded along dim 2, as those models write it."""

    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind
        self.conv = torch.nn.Conv2d(3, 2, 3, padding=1, dtype=D64)
        self.mix = torch.nn.Conv2d(9, 2, 1, dtype=D64)
        self.code = torch.nn.Parameter(torch.randn(5, 3, dtype=D64))
        self.table = torch.nn.Parameter(torch.randn(9, 4, dtype=D64))

    def forward(self, x):
        k = self.kind
        if k == "mobilevit":  # MobileViT's unfolding into (3 x 2) patches, attention over the patches, folding back
            p = x.reshape(2 * 3 * 3, 3, 2, 2).transpose(1, 2).reshape(2, 3, 6, 6).transpose(1, 3).reshape(12, 6, 3)
            p = F.scaled_dot_product_attention(p, p, p * 2)
            y = p.contiguous().view(2, 6, 6, 3).transpose(1, 3).reshape(18, 2, 3, 2).transpose(1, 2).reshape(2, 3, 9, 4)
        elif k == "batch_matmul":  # rows merged under the batch (strided), attention by matmul within each entry
            z = x.transpose(1, 2).reshape(18, 3, 4)
            y = torch.matmul(torch.matmul(z, z.transpose(-1, -2)).softmax(-1), z * 2).view(2, 9, 3, 4).transpose(1, 2)
        elif k == "unfold":  # windows of 3 rows along the sharded dim (local-attention's look-around)
            y = x.unfold(2, 3, 1).movedim(-1, 3).sum(3) * 2
        elif k == "channels":  # token mixing: the sharded dim as the conv's channels, a replicated result
            return self.mix(x.transpose(1, 2))
        elif k == "normalize":
            y = F.normalize(x, dim=2) * F.normalize(x, p=1, dim=1)
        elif k == "codebook":  # VQModel's lookup: nearest code of each strided row, its vector
            z = x.permute(0, 2, 3, 1).reshape(-1, 3)
            q = F.embedding(torch.argmin(torch.cdist(z, self.code), dim=1), self.code)
            far = torch.cdist(z, self.code).argmax(1, keepdim=True).to(z.dtype)
            y = (z * q + far).view(2, 9, 4, 3).permute(0, 3, 1, 2)
        else:  # "convert": a plain table of the sharded dim's global length converted, not sliced
            y = x + self.table.to(x).sum(0)
        return self.conv(y)


_RESAMPLE = {
    "bicubic_up": dict(scale_factor=2, mode="bicubic"),
    "bicubic_1": dict(scale_factor=1, mode="bicubic"),
    "bicubic_corners": dict(size=(13, 7), mode="bicubic", align_corners=True),
    "bicubic_down": dict(scale_factor=0.6, mode="bicubic"),
    "antialias_bilinear": dict(size=(4, 5), mode="bilinear", antialias=True),
    "antialias_bicubic": dict(scale_factor=(0.45, 0.7), mode="bicubic", antialias=True),
    "area": dict(size=(4, 6), mode="area"),
}


class Resample(torch.nn.Module):
    def __init__(self, kind: str):
        super().__init__()
        self.kwargs = _RESAMPLE[kind]
        self.conv = torch.nn.Conv2d(3, 2, 3, padding=1, dtype=D64)

    def forward(self, x):
        return self.conv(F.interpolate(x, **self.kwargs))


_SLAB_CASES = [(Attend, k) for k in ("cross", "cross_causal", "latent", "latent_causal", "batch_whole_kv", "batch_q")] + \
    [(Rows, k) for k in ("periodic", "swap", "repeat", "index", "index_bool", "cdist", "cdist_columns")] + \
    [(Resample, k) for k in _RESAMPLE] + \
    [(Zoo, k) for k in ("mobilevit", "batch_matmul", "unfold", "channels", "normalize", "codebook", "convert")]


def _slab_body(sizes):
    from mesh3d import DistributedManager

    DistributedManager.initialize(batch=1, domain=len(sizes))
    torch.manual_seed(0)
    x = torch.randn(2, 3, 9, 4 if len(sizes) else 4, dtype=D64)
    errors = {}
    for cls, kind in _SLAB_CASES:
        torch.manual_seed(1)
        xin = torch.randn(2, 3, 9, 10, dtype=D64) if cls is Resample else x
        errors[kind] = compare_to_one_process(lambda cls=cls, kind=kind: cls(kind), xin, 2, sizes)
    return errors


@pytest.mark.parametrize("sizes", [(2, 7), (4, 0, 5)])
def test_unseen_idioms_equal_one_process_on_uneven_slabs(ranks, sizes):
    for errors in ranks.run(len(sizes), _slab_body, sizes, timeout=240):
        assert all(e < 1e-10 for e in errors.values()), errors


class Grid(torch.nn.Module):
    """On a (lat, lon) grid of blocks: periodic longitude padding, roll, latitude resampling by index, repeat and
    expand, bicubic/antialiased resampling, cross-attention of the token grid to a plain conditioning and latents."""

    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind
        self.conv = torch.nn.Conv2d(3, 3, 3, padding=(1, 0), dtype=D64)
        self.cond = torch.nn.Parameter(torch.randn(2, 5, 3, dtype=D64))
        self.latent = torch.nn.Parameter(torch.randn(2, 4, 3, dtype=D64))

    def forward(self, x):
        k = self.kind
        if k == "periodic_lon":
            return self.conv(torch.cat([x[..., -1:], x, x[..., :1]], -1))
        if k == "periodic_lat":
            return torch.cat([x[:, :, -2:], x, x[:, :, :1]], 2) * 2
        if k == "roll":
            return self.conv(torch.roll(x, (4, -3, 1), (3, 2, 1)))[..., 1:]
        if k == "index_lat":
            return x[:, :, torch.tensor([0, 1, 3, 3, 6])] * 3 + torch.index_select(x, 2, torch.tensor([6, 5, 1, 0, 2]))
        if k == "repeat":
            return x.repeat(1, 2, 1, 2)[:, 1:4] + x.unsqueeze(0).expand(2, -1, -1, -1, -1).tile((1, 1, 1, 1, 2))[1]
        if k in _RESAMPLE:
            return self.conv(F.interpolate(x, **_RESAMPLE[k]))
        if k == "var":  # x-unet's channel LayerNorm (local), a std over the whole grid (replicated)
            return (x - x.mean(1, keepdim=True)) / torch.var(x, 1, unbiased=False, keepdim=True).add(1e-3).sqrt() + \
                x * x.std(dim=(2, 3), keepdim=True) + torch.var(x, (1, 2, 3), correction=0)[:, None, None, None]
        if k == "normalize":  # along the channels (local), a norm over every block dim (replicated)
            return F.normalize(x, dim=1) * torch.linalg.vector_norm(x, 3, dim=(2, 3), keepdim=True)
        t = x.flatten(2).transpose(1, 2)                                  # a token grid (B, H*W, 3)
        if k == "cross_tokens":
            a = F.scaled_dot_product_attention(t, self.cond, self.cond)
            return (a + t).transpose(1, 2).reshape(x.shape)
        if k == "codebook_tokens":  # diffusers' VectorQuantizer on blocks: a token grid's nearest codes
            z = x.permute(0, 2, 3, 1).reshape(x.shape[0], -1, 3)       # (B, tokens, C); with B = 1 view(-1, C)
            q = F.embedding(torch.cdist(z, self.cond[0]).argmin(-1), self.cond[0])
            return (z * q).view(x.shape[0], x.shape[2], x.shape[3], 3).permute(0, 3, 1, 2) + x
        latent = F.scaled_dot_product_attention(self.latent, t, t)        # replicated (B, 4, 3)
        return x * latent.mean(1)[:, :, None, None]


_GRID_CASES = ("periodic_lon", "periodic_lat", "roll", "index_lat", "repeat", "bicubic_up", "bicubic_corners",
               "antialias_bicubic", "area", "cross_tokens", "latent_tokens", "var", "normalize", "codebook_tokens")


def _on_blocks(make, x: torch.Tensor, dims: tuple[int, ...], sizes) -> float:
    """Largest error of ``make()`` on ``x`` in blocks vs one process: output, input gradient, parameter gradients."""
    from mesh3d import domain

    ref, mod = make(), make()
    mod.load_state_dict(ref.state_dict())
    xr = x.clone().requires_grad_()
    y = ref(xr)
    cot = torch.randn_like(y)
    (y * cot).sum().backward()
    xs = domain.shard(x, dims=dims, sizes=sizes).requires_grad_()
    ys = mod(xs)
    replicated = not ys.spec.sharded_dims
    cs = cot if replicated else domain.shard(cot, dims=ys.spec.dims, sizes=ys.spec.sizes)
    (ys * cs).sum().backward()
    out = ys.to_local() if replicated else ys.full_tensor().to_local()
    return max(max_err(out, y), max_err(xs.grad.full_tensor().to_local(), xr.grad), grads_err(ref, mod))


def _grid_body(empty: bool):
    from mesh3d import DistributedManager

    DistributedManager.initialize(batch=1, domain=(2, 2))
    errors = {}
    for kind in _GRID_CASES:
        torch.manual_seed(2)
        x = torch.randn(2, 3, 7, 10 if kind in _RESAMPLE else 9, dtype=D64)
        w = x.shape[3]
        sizes = ((0, 7), (w - 2, 2)) if empty else ((5, 2), (1, w - 1))  # empty: the first grid row holds nothing
        errors[kind] = _on_blocks(lambda kind=kind: Grid(kind), x, (2, 3), sizes)
    return errors


@pytest.mark.parametrize("empty", [False, True])
def test_unseen_idioms_equal_one_process_on_a_2x2_grid_of_uneven_blocks(ranks, empty):
    for errors in ranks.run(4, _grid_body, empty, timeout=240):
        assert all(e < 1e-10 for e in errors.values()), errors


class Volume(torch.nn.Module):
    """On a 2x2x2 grid of blocks of a (B, 2, D, H, W) volume: periodic padding by cat, roll over three block dims, an
    index tensor, repeat/expand, var/std and F.normalize, each followed by a conv across the blocks."""

    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind
        self.conv = torch.nn.Conv3d(2, 2, 3, padding=1, dtype=D64)

    def forward(self, x):
        k = self.kind
        if k == "periodic":
            y = torch.cat([x[..., -2:], x, x[..., :1]], -1)
        elif k == "roll":
            y = torch.roll(x, (2, -1, 3), (2, 3, 4))
        elif k == "index":
            y = x[:, :, :, torch.tensor([4, 0, 2, 2])] + torch.index_select(x, 2, torch.tensor([1, 5, 0, 3, 2, 4]))[:, :, :, :4]
        elif k == "repeat":
            y = x.repeat(1, 1, 1, 2, 1) + x.unsqueeze(0).expand(2, -1, -1, -1, -1, -1).tile((1, 1, 1, 1, 2, 1))[0]
        elif k == "var":
            y = x / torch.var(x, 1, keepdim=True).add(1) + x * torch.std(x, (2, 3, 4), keepdim=True)
        else:
            y = F.normalize(x, dim=1) * torch.linalg.vector_norm(x, dim=(2, 3, 4), keepdim=True)
        return self.conv(y)


_VOLUME_CASES = ("periodic", "roll", "index", "repeat", "var", "normalize")


def _volume_body():
    from mesh3d import DistributedManager

    DistributedManager.initialize(batch=1, domain=(2, 2, 2))
    errors = {}
    for kind in _VOLUME_CASES:
        torch.manual_seed(3)
        x = torch.randn(2, 2, 6, 5, 4, dtype=D64)
        errors[kind] = _on_blocks(lambda kind=kind: Volume(kind), x, (2, 3, 4), ((4, 2), (5, 0), (1, 3)))
    return errors


def test_unseen_idioms_equal_one_process_on_a_2x2x2_grid_of_uneven_blocks_with_empty_ones(ranks):
    for errors in ranks.run(8, _volume_body, timeout=240):
        assert all(e < 1e-10 for e in errors.values()), errors


def _refusal_body():
    from mesh3d import DistributedManager, domain

    DistributedManager.initialize(batch=1, domain=3)
    x = torch.randn(2, 3, 9, 4, dtype=D64)
    xs = domain.shard(x, dim=2, sizes=(4, 0, 5))
    found = {}
    for name, call in (("kv apart", lambda: F.scaled_dot_product_attention(xs, xs, x)),
                       ("two index tensors", lambda: xs[:, torch.tensor([0, 1]), torch.tensor([1, 2])]),
                       ("2-D index", lambda: xs[:, :, torch.tensor([[0, 1], [2, 3]])])):
        try:
            call()
            found[name] = "no error"
        except (ValueError, NotImplementedError, IndexError) as err:
            found[name] = str(err)
    return found


def test_mixes_without_an_exact_form_are_refused_by_name_on_every_rank(ranks):
    for found in ranks.run(3, _refusal_body):
        assert "key and value must be laid out alike" in found["kv apart"], found
        assert "another tensor index" in found["two index tensors"] or "one 1-D" in found["two index tensors"], found
        assert "must be a 1-D integer tensor" in found["2-D index"], found
