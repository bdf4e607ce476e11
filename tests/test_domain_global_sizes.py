"""The global-size contract (docs/domain.md, "Sizes are global"): a domain tensor answers every question as the whole
tensor does, so model code that computes with sizes gets the one-process answer.

A hunt for silent wrongness: every metadata query and the size idioms of real models (hand-written means,
positions and rotary tables from the length, masks, coordinate channels, crops, rolls, flips, splits, einsum,
factories, writes) run on uneven shards, empty and one-row ones included, at 2 and 3 ranks, fp64, against one
process: forward and the input/parameter gradients exact (1e-12), or a refusal that names the op.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import example, given, settings
from hypothesis import strategies as st

from domain_cases import compare_to_one_process
from profiles import examples

TOL = 1e-12
D64 = torch.float64
B, C, H, W = 2, 3, 16, 5      # a field, sharded along H (dim 2)
T, E = 16, 4                  # a token sequence (B, T, E), sharded along T (dim 1)


# ----------------------------------------------------------------------------- metadata: equal answers
def _metadata(x):
    return {
        "shape": tuple(x.shape), "size()": tuple(x.size()), "size(2)": x.size(2), "size(-2)": x.size(-2),
        "numel": x.numel(), "nelement": x.nelement(), "torch.numel": torch.numel(x), "len": len(x), "dim": x.dim(),
        "ndim": x.ndim, "stride": tuple(x.stride()), "stride(1)": x.stride(1), "shape[2]*2": x.shape[2] * 2,
        "shape[-2:]": tuple(x.shape[-2:]), "is_contiguous": x.is_contiguous(), "dtype": str(x.dtype),
        "channels_last stride": tuple(x.contiguous(memory_format=torch.channels_last).stride()),
        "split shapes": [tuple(p.shape) for p in x.split([5, 11], dim=2)],
        "chunk shapes": [tuple(p.shape) for p in x.chunk(3, dim=2)],
        "slice shape": tuple(x[:, :, 2:x.shape[2] - 3].shape), "step shape": tuple(x[:, :, ::3].shape),
        "view shape": tuple(x.view(x.shape[0], x.shape[1], -1).shape), "flatten": tuple(x.flatten(2).shape),
        "new_zeros shape": tuple(x.new_zeros(x.shape).shape), "select shape": tuple(x.select(2, -1).shape),
        "unbind count": len(x.unbind(2)), "narrow shape": tuple(x.narrow(2, 3, 7).shape),
        "branch": "odd" if x.shape[2] % 2 else "even", "_is_view never raises": type(x._is_view()).__name__,
        "nbytes": x.nbytes, "element_size": x.element_size(), "itemsize": x.itemsize, "data shape": tuple(x.data.shape),
        "deepcopy shape": tuple(copy.deepcopy(x).shape), "is_inference": x.is_inference(), "_base": x._base is None or 1,
        "unsqueeze shape": tuple(x[None].shape), "permute shape": tuple(x.permute(0, 2, 3, 1).shape),
    }


# ----------------------------------------------------------------------------- values: (name, input kind, fn)
def _positions(x):
    return x * torch.arange(x.shape[2], dtype=x.dtype).view(1, 1, -1, 1)


def _coord_channel(x):
    grid = torch.linspace(0, 1, x.shape[2], dtype=x.dtype).view(1, 1, -1, 1).expand(x.shape[0], 1, -1, x.shape[3])
    return torch.cat([x, grid], dim=1)


def _pad_if_odd(x):
    if x.shape[2] % 2:
        x = F.pad(x, (0, 0, 0, 1))
    return F.avg_pool2d(x, 2)


def _split(x):
    a, b = torch.split(x, [5, x.shape[2] - 5], dim=2)
    return a.sum(dim=2) + 2 * b.mean(dim=2) + a[:, :, -1] * b[:, :, 0]


def _chunk(x):
    parts = x.chunk(3, dim=2)
    return sum((i + 1) * p.sum(dim=(2, 3)) for i, p in enumerate(parts))


def _unbind(x):
    rows = x.unbind(2)
    return rows[0] - 2 * rows[-1] + rows[len(rows) // 2]


def _setitem(x):
    y = x * 1.0
    y[:, :, 0] = 0.5
    y[:, :, -2:] = x[:, :, :2] * 3
    return y


def _poles_written_in_place(x):
    """torch-harmonics' resampling: one row per pole padded on, each written with the mean of its neighbouring ring
    (an int index along the sharded dim; the value broadcasts over the dim it drops)."""
    north, south = x[..., 0, :].mean(dim=-1, keepdim=True), x[..., -1, :].mean(dim=-1, keepdim=True)
    y = F.pad(x, (0, 0, 1, 1))
    y[..., 0, :] = north
    y[..., -1, :] = south * torch.ones(x.shape[1], 1, dtype=x.dtype)
    return y


def _write_domain_into_plain(x):
    out = torch.zeros(x.shape[0], x.shape[1], x.shape[2] + 2, x.shape[3], dtype=x.dtype)
    out[:, :, 1:-1] = x
    return out.sum(dim=2)


def _plain_buffer_of_a_reduction(x):
    """A global statistic written into a plain buffer (as an FNO writes its spectrum), then meeting the shards: the
    buffer's gradient must reach every rank's rows of the statistic (cross terms), not only this rank's."""
    out = torch.zeros(x.shape[0], x.shape[1], 3, x.shape[3], dtype=x.dtype)
    out[:, :, :2] = x.mean(dim=2, keepdim=True) * torch.ones(1, 1, 2, 1, dtype=x.dtype)
    return x * out.sum(dim=2, keepdim=True)


def _rotary(t):                                   # (B, T, E) tokens: a rotary table from the global length
    pos = torch.arange(t.shape[1], dtype=t.dtype)
    inv = 1.0 / (10000 ** (torch.arange(0, t.shape[2], 2, dtype=t.dtype) / t.shape[2]))
    ang = torch.outer(pos, inv)
    cos, sin = torch.cat([ang.cos()] * 2, -1)[None], torch.cat([ang.sin()] * 2, -1)[None]
    half = t.shape[-1] // 2
    rot = torch.cat([-t[..., half:], t[..., :half]], -1)
    return t * cos + rot * sin


def _gpt2_positions(t):
    wpe = torch.arange(64 * t.shape[2], dtype=t.dtype).view(64, t.shape[2]) / 100
    ids = torch.arange(0, t.shape[1], dtype=torch.long).unsqueeze(0)
    return t + F.embedding(ids, wpe)


def _causal_mask(t):
    scores = torch.einsum("btd,bsd->bts", t, t) / math.sqrt(t.shape[-1])
    mask = torch.ones(t.shape[1], t.shape[1], dtype=torch.bool).tril()
    return scores.masked_fill(~mask, float("-inf")).softmax(-1)


VALUES = [
    ("hand-written mean", "field", lambda x: (x ** 2).sum() / x.numel()),
    ("mean over h, w by shape", "field", lambda x: x.sum(dim=(2, 3)) / (x.shape[2] * x.shape[3])),
    ("len()", "field", lambda x: x * len(x)),
    ("new_zeros(x.shape)", "field", lambda x: x + x.new_zeros(x.shape) + x.new_full(x.shape, 2.0)),
    ("zeros_like", "field", lambda x: torch.zeros_like(x) + x * torch.ones_like(x)),
    ("roll", "field", lambda x: torch.roll(x, 3, dims=2) - 2 * x.roll(-5, 2) + x.roll((1, -2), (2, 3))),
    ("flip", "field", lambda x: x.flip(2) + x.flip((2, 3)) * 0.5),
    ("split", "field", _split),
    ("chunk", "field", _chunk),
    ("unbind", "field", _unbind),
    ("rows written at the poles", "field", _poles_written_in_place),
    ("a halo turned by rot90 beside the rows (cube-sphere faces)", "field",
     lambda x: torch.cat([torch.rot90(x[:, :, :5], 1, (2, 3))[:, :, -1:], x[:, :, :5] * 2], 2)),
    ("narrow", "field", lambda x: x.narrow(2, 3, 7).sum(2) + torch.narrow(x, 2, -4, 4).mean(2)),
    ("select", "field", lambda x: x.select(2, -1) + x.select(2, 4)),
    ("positions from the shape", "field", _positions),
    ("interpolate(size=) from the shape", "field",
     lambda x: F.interpolate(x, size=(x.shape[2] * 2, x.shape[3] * 2), mode="bilinear", align_corners=False)),
    ("x[:, :, -1]", "field", lambda x: x[:, :, -1] * 2),
    ("crop x[:, :, 2:H-3]", "field", lambda x: x[:, :, 2:x.shape[2] - 3] * 2),
    ("steps x[:, :, ::3]", "field", lambda x: x[:, :, 1::3] + 1),
    ("half by shape", "field", lambda x: x[:, :, : x.shape[2] // 2] - x[:, :, x.shape[2] // 2:]),
    ("pad if the length is odd", "field", _pad_if_odd),
    ("coordinate channel", "field", _coord_channel),
    ("view(b, c, -1).mean(-1)", "field", lambda x: x.view(x.shape[0], x.shape[1], -1).mean(-1)),
    ("tokens and back", "field", lambda x: x.flatten(2).transpose(1, 2).reshape(x.shape[0], x.shape[2], x.shape[3], -1)),
    ("torch.zeros(x.shape) + x", "field", lambda x: torch.zeros(x.shape, dtype=x.dtype) + x),
    ("where with a positional mask", "field",
     lambda x: torch.where(torch.arange(x.shape[2]).view(1, 1, -1, 1) < 6, x, -x)),
    ("softmax over the sharded dim", "field", lambda x: x.softmax(dim=2)),
    ("einsum contraction over the sharded dim", "field", lambda x: torch.einsum("bchw,bchw->bc", x, x)),
    ("einsum keeping it", "field", lambda x: torch.einsum("bchw->bhwc", x) * 2),
    ("einsum with a plain weight", "field",
     lambda x: torch.einsum("bchw,cd->bdhw", x, torch.linspace(-1, 1, 6, dtype=x.dtype).view(3, 2))),
    ("einsum with a plain positional weight", "field",
     lambda x: torch.einsum("bchw,h->bcw", x, torch.linspace(0, 1, x.shape[2], dtype=x.dtype))),
    ("einsum with ellipsis", "field", lambda x: torch.einsum("...hw,...hw->...w", x, x)),
    ("setitem with global indices", "field", _setitem),
    ("a domain value written into a plain tensor", "field", _write_domain_into_plain),
    ("a statistic through a plain buffer", "field", _plain_buffer_of_a_reduction),
    ("expand", "field", lambda x: x[:1].expand(3, -1, -1, -1) * 2),
    ("pixels into the batch and back", "field",
     lambda x: (x.permute(0, 2, 3, 1).reshape(-1, x.shape[1]) @ torch.linspace(-1, 1, 6, dtype=x.dtype).view(3, 2))
     .reshape(x.shape[0], x.shape[2], x.shape[3], -1).permute(0, 3, 1, 2)),
    ("rotary table from the length", "tokens", _rotary),
    ("GPT-2 position ids from the length", "tokens", _gpt2_positions),
    ("attention scores, causal mask from the length", "tokens", _causal_mask),
    ("einsum attention", "tokens", lambda t: torch.einsum("bts,bsd->btd", torch.einsum("btd,bsd->bts", t, t).softmax(-1), t)),
]

#: Idioms refused on purpose (the result would need a layout mesh3d does not have): each must name its op.
REFUSED = [
    ("roll without dims", "field", lambda x: torch.roll(x, 3), "torch.roll"),
    ("renorm over slices of the sharded dim", "field", lambda x: x.renorm(2, 1, 1.0), "renorm"),
]


def _input(kind: str, seed: int) -> tuple[torch.Tensor, int]:
    g = torch.Generator().manual_seed(seed)
    if kind == "field":
        return torch.randn(B, C, H, W, generator=g, dtype=D64), 2
    return torch.randn(B, T, E, generator=g, dtype=D64), 1


def _hunt_body(sizes: tuple[int, ...]):
    import warnings

    from mesh3d import DistributedManager, domain

    DistributedManager.initialize(batch=1, domain=len(sizes), model=1)
    x, dim = _input("field", 0)
    meta = _metadata(x), _metadata(domain.shard(x, dim=dim, sizes=sizes))
    errors, refusals = {}, {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ResourceWarning)  # whole-size plain tensors are the point of some idioms
        for name, kind, fn in VALUES:
            x, dim = _input(kind, len(name))
            try:
                errors[name] = compare_to_one_process(lambda fn=fn: fn, x, dim, sizes)
            except Exception as err:  # reported by the test, with the idiom's name
                errors[name] = f"{type(err).__name__}: {err}"
        for name, kind, fn, _ in REFUSED:
            x, dim = _input(kind, 0)
            try:
                fn(domain.shard(x, dim=dim, sizes=sizes))
                refusals[name] = "ran"
            except (NotImplementedError, RuntimeError) as err:
                refusals[name] = str(err)
    return meta, errors, refusals


LAYOUTS = {2: [(9, 7), (0, 16), (16, 0), (1, 15)], 3: [(6, 0, 10), (1, 10, 5), (5, 5, 6)]}


@pytest.mark.parametrize("world", [2, 3])
@settings(max_examples=examples(3), deadline=None)
@given(data=st.data())
@example(data=None)
def test_every_size_idiom_equals_one_process_or_names_its_op(ranks, world, data):
    if data is None:  # the fixed layouts every run covers: uneven, empty and one-row shards
        layouts = LAYOUTS[world]
    else:
        cuts = sorted(data.draw(st.lists(st.integers(0, H), min_size=world - 1, max_size=world - 1)))
        bounds = [0, *cuts, H]
        layouts = [tuple(bounds[i + 1] - bounds[i] for i in range(world))]
    for sizes in layouts:
        for rank, ((want_meta, got_meta), errors, refusals) in enumerate(ranks.run(world, _hunt_body, sizes, timeout=240)):
            wrong_meta = {k: (want_meta[k], got_meta[k]) for k in want_meta if want_meta[k] != got_meta[k]}
            assert not wrong_meta, (sizes, rank, wrong_meta)
            bad = {k: v for k, v in errors.items() if isinstance(v, str) or v > TOL}
            assert not bad, (sizes, rank, bad)
            for name, _, _, op in REFUSED:
                assert op in refusals[name], (sizes, rank, name, refusals[name])


# ----------------------------------------------------------------------------- randomness in training mode
class DropNet(torch.nn.Module):
    """Dropout on the field, dropout2d, and stochastic depth (a per-sample mask from a plain torch.rand) in training."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Conv2d(C, 4, 3, padding=1, dtype=D64)
        self.b = torch.nn.Conv2d(4, 4, 3, padding=1, dtype=D64)
        self.head = torch.nn.Conv2d(4, 1, 1, dtype=D64)

    def forward(self, x):
        h = F.dropout(torch.relu(self.a(x)), 0.3, self.training)
        keep = (torch.rand(x.shape[0], 1, 1, 1, dtype=x.dtype) < 0.7).to(x.dtype) / 0.7   # timm's drop_path
        h = h + self.b(F.dropout2d(h, 0.2, self.training)) * keep
        return self.head(h)


def _random_body(batch: int, sizes: tuple[int, ...], steps: int = 3):
    from mesh3d import DistributedManager, domain

    dm = DistributedManager.initialize(batch=batch, domain=len(sizes), model=1)
    torch.manual_seed(123)
    ref = DropNet()
    mine = DropNet()
    mine.load_state_dict(ref.state_dict())
    opt_ref, opt = torch.optim.SGD(ref.parameters(), lr=0.1), torch.optim.SGD(mine.parameters(), lr=0.1)
    errs = []
    for step in range(steps):
        x, _ = _input("field", 100 + step)
        x = x[dm.axis_rank("batch"):dm.axis_rank("batch") + 1]       # this batch rank's sample
        my_seed = dm.manual_seed(step)                                 # the mesh's streams
        loss = (mine(domain.shard(x, dim=2, sizes=sizes)) ** 2).mean()
        loss.backward()
        for p in mine.parameters():
            p.grad = domain_grad_sum(p.grad)
        opt.step()
        opt.zero_grad()
        torch.manual_seed(my_seed)                                     # one process, seeded as this batch rank
        want = (ref(x) ** 2).mean()
        want.backward()
        opt_ref.step()
        opt_ref.zero_grad()
        errs.append(abs(float(loss.to_local()) - float(want)))
    errs.append(max(float((p - q).abs().max()) for p, q in zip(ref.parameters(), mine.parameters())))
    return max(errs), my_seed


def domain_grad_sum(g):
    from domain_cases import domain_sum

    return domain_sum(g)


@pytest.mark.parametrize("batch, sizes", [(1, (9, 7)), (1, (6, 0, 10)), (2, (1, 15))])
def test_dropout_and_stochastic_depth_equal_one_process_under_manual_seed(ranks, batch, sizes):
    results = ranks.run(batch * len(sizes), _random_body, batch, sizes, timeout=120)
    for err, _ in results:
        assert err < TOL, results
    seeds = [seed for _, seed in results]
    per_batch = [seeds[b * len(sizes):(b + 1) * len(sizes)] for b in range(batch)]
    assert all(len(set(s)) == 1 for s in per_batch), seeds           # one stream per sample's domain group
    assert len({s[0] for s in per_batch}) == batch, seeds             # and its own per batch rank


# ----------------------------------------------------------------------------- blocks and token grids answer alike
def _blocks_body(sizes):
    from mesh3d import DistributedManager, domain

    DistributedManager.initialize(batch=1, domain=(2, 2), model=1)
    x, _ = _input("field", 7)
    xs = domain.shard(x, dims=(2, 3), sizes=sizes)
    tokens, tx = x.flatten(2).transpose(1, 2), xs.flatten(2).transpose(1, 2)
    meta = [(tuple(a.shape), a.numel(), len(a), tuple(a.stride()), a.size(-1)) for a in (x, tokens)]
    got = [(tuple(a.shape), a.numel(), len(a), tuple(a.stride()), a.size(-1)) for a in (xs, tx)]
    mean = float(((xs ** 2).sum() / xs.numel()).to_local()) - float((x ** 2).sum() / x.numel())
    back = tx.transpose(1, 2).reshape(x.shape[0], x.shape[1], *xs.shape[2:])
    errs = {"hand-written mean": abs(mean),
            "tokens back to the grid": float((back.full_tensor().to_local() - x).abs().max()),
            "view(b, c, -1)": float((xs.view(x.shape[0], x.shape[1], -1).full_tensor().to_local()
                                     - x.view(x.shape[0], x.shape[1], -1)).abs().max())}
    return meta, got, errs


@pytest.mark.parametrize("sizes", [((9, 7), (3, 2)), ((16, 0), (1, 4))])
def test_blocks_and_token_grids_answer_sizes_as_the_whole_tensor(ranks, sizes):
    for meta, got, errs in ranks.run(4, _blocks_body, sizes, timeout=120):
        assert got == meta, (sizes, got, meta)
        assert max(errs.values()) < TOL, errs


# ----------------------------------------------------------------------------- the O(global) warning
def _warning_body():
    import warnings

    from mesh3d import DistributedManager, domain

    DistributedManager.initialize(batch=1, domain=2, model=1)
    x, _ = _input("field", 3)
    xs = domain.shard(x, dim=2, sizes=(9, 7))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("default")
        for _ in range(3):
            y = xs + torch.zeros(xs.shape, dtype=xs.dtype)  # the line the warning names
        z = xs + xs.new_zeros(xs.shape)                       # this rank's rows only: no warning
    ours = [w for w in seen if issubclass(w.category, ResourceWarning)]
    return [(w.filename.endswith("test_domain_global_sizes.py"), str(w.message)) for w in ours], \
        float((y - z).abs().max().to_local() if hasattr(y - z, "to_local") else 0.0)


def test_a_whole_size_plain_tensor_is_warned_about_once_naming_the_line(ranks):
    for warned, diff in ranks.run(2, _warning_body):
        assert len(warned) == 1, warned
        here, message = warned[0]
        assert here and "O(global) memory" in message and "new_zeros" in message, warned
        assert diff == 0.0
