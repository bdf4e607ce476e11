"""Model idioms on uneven shards (2 and 3 ranks, empty shards drawn) vs one process in fp64, forward and backward:
global pooling then a head, tokens back to a grid, class token + position embedding + x[:, 0], slicing,
embeddings on sharded ids, domain.positions, torch.fft along the sharded dim, einops, redistribute(dim=), cumsum and
cumprod along the sharded dim and another, prod along it (exact zeros), another and everything; order statistics
(sort, topk, median, quantile, cummax, ...) along it, another and everything."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings

from domain_cases import compare_to_one_process, domain_sum, edge_examples, layout_case, max_err, on_each_layout
from profiles import examples

TOL = 1e-10
H = 7
D64 = torch.float64


class PoolHead(torch.nn.Module):
    """AdaptiveAvgPool2d(1) then view/flatten then a classifier head (ResNet style)."""

    def __init__(self, view: bool):
        super().__init__()
        self.conv, self.view = torch.nn.Conv2d(3, 4, 3, padding=1, dtype=D64), view
        self.head = torch.nn.Linear(4, 5, dtype=D64)

    def forward(self, x):
        y = torch.nn.AdaptiveAvgPool2d(1)(torch.relu(self.conv(x)))
        return self.head(y.view(y.shape[0], -1) if self.view else torch.flatten(y, 1))


class TokensToGrid(torch.nn.Module):
    """flatten(2).transpose(1, 2) -> Linear -> back to (B, C, h, W) with the local h (SegFormer/Swin style)."""

    def __init__(self):
        super().__init__()
        self.mix = torch.nn.Linear(3, 4, dtype=D64)
        self.conv = torch.nn.Conv2d(4, 2, 3, padding=1, dtype=D64)

    def forward(self, x):
        b, _, h, w = x.shape
        t = self.mix(x.flatten(2).transpose(1, 2))                 # (B, L, C)
        grid = t.transpose(1, 2).reshape(b, 4, h, w)               # the inverse of flatten(2)
        swin = t.view(b, h, w, 4).permute(0, 3, 1, 2)              # (B, h, W, C) view, as Swin does
        return self.conv(grid + swin * 0.5)


class ClsPos(torch.nn.Module):
    """ViT: cat a class token along the token dim, add a position embedding of the global length, read x[:, 0]."""

    def __init__(self, tokens: int):
        super().__init__()
        self.cls = torch.nn.Parameter(torch.randn(1, 1, 4, dtype=D64))
        self.pos = torch.nn.Parameter(torch.randn(1, tokens + 1, 4, dtype=D64))
        self.norm = torch.nn.LayerNorm(4, dtype=D64)
        self.head = torch.nn.Linear(4, 3, dtype=D64)

    def forward(self, x):                                          # (B, L, 4)
        x = torch.cat([self.cls.expand(x.shape[0], -1, -1), x], dim=1) + self.pos
        x = self.norm(x)
        return self.head(x[:, 0]) + x[:, 1:].mean(dim=1)[:, :3] + x[:, -1, :3]


class PatchMerge(torch.nn.Module):
    """Swin patch merging: strided slices along the sharded dim, cat along channels (layouts differ)."""

    def forward(self, x):                                          # (B, H, W, C)
        return torch.cat([x[:, 0::2, 0::2], x[:, 1::2, 0::2], x[:, 0::2, 1::2], x[:, 1::2, 1::2]], -1) * 2


class Spectral(torch.nn.Module):
    """FNO-style: rfftn over the sharded and another dim, a complex weight, irfftn back; plus fft/ifft 1-D and
    fftshift/ifftshift (neuraloperator's spectral convolution) along the sharded dim (H odd: the halves differ) and not."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(3, H, 4, dtype=torch.complex128))

    def forward(self, x):                                          # (B, 3, H, 6)
        f = torch.fft.rfftn(x, dim=(-2, -1), norm="ortho")
        y = torch.fft.irfftn(f * self.w, s=(x.shape[-2], 6), dim=(-2, -1), norm="ortho")
        g = torch.fft.ifft(torch.fft.fft(x, dim=2) * 1.5, dim=2).real
        shifted = torch.fft.ifftshift(torch.fft.fftshift(f, dim=(-2,)) * self.w, dim=-2)
        s = torch.fft.fftshift(x, dim=(2, 3)) + torch.fft.ifftshift(x, dim=2) * 0.5 + torch.fft.fftshift(x, dim=3)
        return y + g + torch.fft.fft2(x).abs() + torch.fft.irfftn(shifted, s=(H, 6), dim=(-2, -1)) + s


class Positions(torch.nn.Module):
    def __init__(self, tokens: int):
        super().__init__()
        self.emb = torch.nn.Embedding(tokens, 4, dtype=D64)

    def forward(self, x):                                          # (B, L, 4)
        from mesh3d import domain
        from mesh3d.domain import DomainTensor

        pos = domain.positions(x) if isinstance(x, DomainTensor) else torch.arange(x.shape[1])
        return x * self.emb(pos)


class Einops(torch.nn.Module):
    def forward(self, x):                                          # (B, C, H, W)
        from einops import rearrange, reduce, repeat

        t = rearrange(x, "b c h w -> b (h w) c")
        g = rearrange(t, "b (h w) c -> b c h w", w=x.shape[3])  # name the whole axis: h may be 0 on a rank
        m = reduce(x, "b c h w -> b c", "mean")
        r = repeat(x, "b c h w -> b c h w k", k=2).sum(-1)
        return g + r + m[:, :, None, None]


def _embedding_case(sizes):
    ids = torch.randint(0, 6, (2, H))
    weight = torch.randn(6, 3, dtype=D64, requires_grad=True)
    from mesh3d import domain
    from domain_cases import domain_sum, max_err

    ref = F.embedding(ids, weight)
    cot = torch.randn_like(ref)
    (ref * cot).sum().backward()
    gw, weight.grad = weight.grad, None
    got = F.embedding(domain.shard(ids, dim=1, sizes=sizes), weight).full_tensor()
    (got * cot).sum().backward()
    return max(max_err(got.to_local(), ref), max_err(domain_sum(weight.grad), gw))


def _redistribute_case(sizes):
    from mesh3d import domain
    from domain_cases import domain_sum, max_err

    x = torch.randn(3, 5, H, dtype=D64, requires_grad=True)
    xs = domain.shard(x, dim=2, sizes=sizes)
    moved = domain.redistribute(xs, dim=1)
    back = domain.redistribute(moved * torch.arange(1.0, 6.0, dtype=D64)[:, None], dim=2, sizes=sizes)
    ref = x * torch.arange(1.0, 6.0, dtype=D64)[:, None]
    err = max(max_err(moved.full_tensor().to_local(), x), max_err(back.full_tensor().to_local(), ref))
    (back.full_tensor() ** 2).sum().backward()
    gx = torch.autograd.grad((ref ** 2).sum(), x)[0]
    return max(err, max_err(domain_sum(x.grad), gx))


class Scans(torch.nn.Module):
    """Prefix sums and products along the sharded dim (position ids from a mask, cumulative integrals) and along
    another dim."""

    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 3, 3, padding=1, dtype=D64)

    def forward(self, x):
        y = self.conv(x)
        along = torch.cumsum(y, 2) + y.cumsum(dim=-1) * 0.5 + torch.cumsum(y, 2, dtype=D64)
        return along * torch.cumprod(1 + 0.1 * torch.tanh(y), dim=2) + y.cumprod(1)


class Products(torch.nn.Module):
    """torch.prod along the sharded dim (with exact zeros: one in a slice, two, none), along another dim, over
    everything, and of a boolean mask (an int64 product)."""

    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 3, 3, padding=1, dtype=D64)

    def forward(self, x):
        y = self.conv(x)
        f = (1 + 0.1 * torch.tanh(y)) * (y > -1.2).to(D64)
        along = torch.prod(f, 2, keepdim=True) * y + f.prod(dim=1, keepdim=True) * y
        kept = (y > -1.5).prod(2, keepdim=True).to(D64)
        return along * kept + y * torch.prod(1 + 0.01 * torch.tanh(y)) + f.prod(-2).unsqueeze(2)


class OrderStats(torch.nn.Module):
    """Order statistics along the sharded dim (sort, argsort's global indices, topk, median, kthvalue, mode,
    quantile, cummax, logcumsumexp), along another dim, and over everything (median)."""

    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 3, 3, padding=1, dtype=D64)

    def forward(self, x):
        y = self.conv(x)
        ordered = torch.sort(y, 2).values + y.sort(dim=-1, descending=True)[0] * 0.5 + torch.argsort(y, 2).to(D64) * 0.01
        top = torch.topk(y, 2, dim=2).values.sum(2, keepdim=True) + y.topk(2, dim=-1)[0].sum(-1, keepdim=True)
        mid = torch.median(y, 2, keepdim=True).values + y.median(dim=-1, keepdim=True).values + y.median()
        picked = torch.kthvalue(y, 2, dim=2, keepdim=True).values + torch.quantile(y, 0.3, dim=2, keepdim=True)
        counted = torch.mode(y.round(), 2, keepdim=True).values + y.nanmedian(1).values.unsqueeze(1)
        scans = torch.cummax(y, 2).values + torch.logcumsumexp(y, 2) + y.cummin(-1)[0]
        return ordered + top * mid + picked + counted + scans


class MixedCats(torch.nn.Module):
    """torch.cat of pieces sharded along different dims: a square crop turned by rot90 joined to the rows (a
    cube-sphere face's halo), and the crop beside its own transpose along the channels."""

    def forward(self, x):                                          # (B, 3, H, 6)
        square = x[:, :, :6]
        rows = torch.cat([x, torch.rot90(square, 1, (2, 3)) * 2], 2)
        channels = torch.cat([square, square.transpose(2, 3)], 1)
        return rows + channels.mean(1, keepdim=True).sum(2, keepdim=True)


def _idioms_body(sizes):
    from mesh3d import DistributedManager

    DistributedManager.initialize(batch=1, domain=-1)
    torch.manual_seed(0)
    grid, tokens = torch.randn(2, 3, H, 6, dtype=D64), torch.randn(2, H, 4, dtype=D64)
    cases = {
        "pool_view_head": (lambda: PoolHead(True), grid, 2),
        "pool_flatten_head": (lambda: PoolHead(False), grid, 2),
        "tokens_to_grid": (TokensToGrid, grid, 2),
        "cls_pos_index": (lambda: ClsPos(H), tokens, 1),
        "patch_merge": (PatchMerge, torch.randn(2, H + 1, 4, 3, dtype=D64), 1),
        "spectral": (Spectral, grid, 2),
        "positions": (lambda: Positions(H), tokens, 1),
        "einops": (Einops, grid, 2),
        "scans": (Scans, grid, 2),
        "products": (Products, grid, 2),
        "order_stats": (OrderStats, grid, 2),
        "mixed_cats": (MixedCats, grid, 2),
    }
    errors = {}
    for i, (name, (make, x, dim)) in enumerate(cases.items()):
        local_sizes = sizes if x.shape[dim] == H else None
        errors[name] = compare_to_one_process(make, x, dim, local_sizes, seed=i)
    errors["embedding"] = _embedding_case(sizes)
    errors["redistribute_dim"] = _redistribute_case(sizes)
    return errors


@settings(max_examples=examples(6), deadline=None, suppress_health_check=list(HealthCheck))
@given(case=layout_case(H, (2, 3)))
@edge_examples(H, (2, 3))
def test_idioms_match_one_process(ranks, case):
    world, layouts = case
    for rank_errors in ranks.run(world, on_each_layout, _idioms_body, layouts, timeout=90 * len(layouts)):
        for sizes, errors in zip(layouts, rank_errors):
            bad = {k: v for k, v in errors.items() if not v < TOL}
            assert not bad, (sizes, bad)


def _idiom_refusals_body():
    from mesh3d import DistributedManager, domain

    DistributedManager.initialize(batch=1, domain=-1)
    x = torch.randn(2, 3, 4, 5, dtype=D64)
    xs = domain.shard(x, dim=2)
    attempts = {
        "fft_all_dims": lambda: torch.fft.fftn(xs),
        "tensor_index_sharded": lambda: xs[:, :, torch.tensor([[0, 1]])],  # 1-D index tensors run (ops/pieces.py)
        "embedding_max_norm": lambda: F.embedding(domain.shard(torch.zeros(2, 4, dtype=torch.long), dim=1),
                                                  torch.randn(3, 2), max_norm=1.0),
        "setitem": lambda: xs.__setitem__((slice(None), slice(None), torch.tensor([0, 1])), 1.0),
        "unknown_op": lambda: torch.renorm(xs, 2, 1, 1.0),
    }
    messages = {}
    for name, attempt in attempts.items():
        try:
            attempt()
            messages[name] = None
        except (NotImplementedError, ValueError) as e:
            messages[name] = str(e)
    return messages


#: What every rank's refusal must say: the op it refuses, and what to do instead.
IDIOM_REFUSALS = {
    "fft_all_dims": ["torch.fft.fftn over every dim", "keep the batch or channel dim out of dim="],
    "tensor_index_sharded": ["an index tensor along the sharded dim 2 must be a 1-D integer tensor",
                             "flatten it and reshape the result"],
    "embedding_max_norm": ["F.embedding with max_norm or scale_grad_by_freq on sharded ids",
                           "use max_norm=None, scale_grad_by_freq=False"],
    "setitem": ["torch.Tensor.__setitem__ with a Tensor index along the sharded dim 2 is not supported",
                "(ints and slices are)"],
    "unknown_op": ["torch.renorm has no domain rule", "Call .full_tensor() first"],
}


def test_idiom_refusals_name_the_op_and_what_to_do_on_every_rank(ranks):
    results = ranks.run(3, _idiom_refusals_body, timeout=60)
    assert set(results[0]) == set(IDIOM_REFUSALS)
    for messages in results:
        assert messages == results[0]                                     # the same error on every rank
        for name, fragments in IDIOM_REFUSALS.items():
            assert messages[name] is not None, f"{name} did not raise"
            missing = [f for f in fragments if f not in messages[name]]
            assert not missing, (name, missing, messages[name])


def _global_size_body():
    """Sizes read from a domain tensor are the whole tensor's; a size argument made from them means the global one."""
    from mesh3d import DistributedManager, domain

    DistributedManager.initialize(batch=1, domain=-1)
    torch.manual_seed(0)
    big = torch.randn(1, 2, 12, 6, dtype=torch.float64)
    small = torch.randn(1, 2, 6, 3, dtype=torch.float64, requires_grad=True)
    bigs = domain.shard(big, dim=2, sizes=(7, 0, 5))
    smalls = domain.shard(small, dim=2, sizes=(2, 3, 1))
    h, w = bigs.shape[2], bigs.shape[3]
    facts = [type(h) is int, h == 12, type(w) is int, bigs.size(2) == 12, bigs.local_shape[2] in (7, 0, 5),
             bigs.to_local().shape[2] == bigs.local_shape[2]]
    want = torch.nn.functional.interpolate(small, size=big.shape[2:], mode="bilinear")
    got = torch.nn.functional.interpolate(smalls, size=bigs.shape[2:], mode="bilinear")
    return facts, float((got.full_tensor().to_local() - want).abs().max())


def test_a_size_read_from_a_domain_tensors_shape_is_the_global_one(ranks):
    for facts, err in ranks.run(3, _global_size_body):
        assert all(facts), facts
        assert err < 1e-12


def _empty_pencil_body():
    """3 ranks, a 2-channel field: parking the sharding on the channels leaves rank 2 an empty pencil."""
    from mesh3d import DistributedManager, domain

    DistributedManager.initialize(batch=1, domain=-1)
    torch.manual_seed(0)
    x = torch.randn(1, 2, 9, 8, dtype=torch.float64, requires_grad=True)
    want = torch.fft.irfftn(torch.fft.rfftn(x, dim=(-2, -1)) * 0.5j, s=(9, 8), dim=(-2, -1))
    cot = torch.randn_like(want)
    (want * cot).sum().backward()
    xi = x.detach().requires_grad_(True)
    xs = domain.shard(xi, dim=2)
    got = torch.fft.irfftn(torch.fft.rfftn(xs, dim=(-2, -1)) * 0.5j, s=xs.shape[-2:], dim=(-2, -1)).full_tensor()
    (got * cot).sum().backward()
    return max(max_err(got.to_local(), want), max_err(domain_sum(xi.grad), x.grad))


def test_an_fft_whose_pencil_is_empty_on_a_rank_equals_one_process(ranks):
    assert max(ranks.run(3, _empty_pencil_body)) < 1e-12
