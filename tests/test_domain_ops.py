"""Every non-conv op rule vs one process on uneven shards (fp64, tol 1e-10: only summation order differs),
the gradient convention (domain-summed grads == one-process grads), and every refusal raising."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings

from domain_cases import domain_sum, edge_examples, grads_err, layout_case, max_err, on_each_layout
from mesh3d import DistributedManager, domain
from mesh3d.domain import DomainTensor, balanced_sizes, split_sizes
from mesh3d.domain.ops.attention import neighbourhood_attention
from profiles import examples

TOL = 1e-10
H = 9


class _GatherThenLinear(torch.nn.Module):
    """A head applied after .full_tensor(): its grads must still domain-sum to the one-process grads."""

    def __init__(self):
        super().__init__()
        self.head = torch.nn.Linear(6, 3, dtype=torch.float64)

    def forward(self, x):
        return self.head(x.full_tensor() if isinstance(x, DomainTensor) else x)


def _cases():
    """name -> (make_module_or_fn, input shape, sharded dim)."""
    nn = torch.nn
    return {
        "pointwise": (lambda: (lambda x: torch.relu(x) * 2 + x.sigmoid() - F.gelu(x) / (1 + x * x)), (2, 4, H, 6), 2),
        "mean_sq": (lambda: (lambda x: (x * x).mean()), (2, 4, H, 6), 2),
        "sum_var_std_amax": (lambda: (lambda x: x.sum() + x.var() + x.std(dim=2).sum() + 3 * x.amax()), (2, 4, H, 6), 2),
        "mean_keepdim": (lambda: (lambda x: x.mean(dim=(2, 3), keepdim=True)), (2, 4, H, 6), 2),
        "channel_sum": (lambda: (lambda x: x.sum(dim=1)), (2, 4, H, 6), 2),
        "replicated_into_shards": (lambda: (lambda x: x / x.abs().amax() + x.mean()), (2, 4, H, 6), 2),
        "head_after_full_tensor": (_GatherThenLinear, (2, 4, H, 6), 2),
        "linear_channels_last": (lambda: nn.Linear(6, 5, dtype=torch.float64), (2, 4, H, 6), 2),
        "conv1x1": (lambda: nn.Conv2d(4, 3, 1, dtype=torch.float64), (2, 4, H, 6), 2),
        "groupnorm": (lambda: nn.GroupNorm(2, 4, dtype=torch.float64), (2, 4, H, 6), 2),
        "batchnorm": (lambda: nn.BatchNorm2d(4, dtype=torch.float64), (2, 4, H, 6), 2),
        "instancenorm": (lambda: nn.InstanceNorm2d(4, affine=True, track_running_stats=True, dtype=torch.float64),
                         (2, 4, H, 6), 3),
        "layernorm_sharded": (lambda: nn.LayerNorm([H, 6], dtype=torch.float64), (2, 4, H, 6), 2),
        "layernorm_local": (lambda: nn.LayerNorm([6], dtype=torch.float64), (2, 4, H, 6), 2),
        "maxpool2": (lambda: nn.MaxPool2d(2), (2, 4, H, 6), 2),
        "maxpool3s2p1": (lambda: nn.MaxPool2d(3, stride=2, padding=1, ceil_mode=True), (2, 4, H, 6), 2),
        "maxpool_dil": (lambda: nn.MaxPool1d(2, stride=1, dilation=2), (2, 4, H), 2),
        "avgpool3s2p1": (lambda: nn.AvgPool2d(3, stride=2, padding=1), (2, 4, H, 6), 2),
        "adaptive_avg": (lambda: nn.AdaptiveAvgPool2d((4, 3)), (2, 4, H, 6), 2),
        "adaptive_max": (lambda: nn.AdaptiveMaxPool2d((2, 5)), (2, 4, H, 6), 2),
        "nearest_x2": (lambda: nn.Upsample(scale_factor=2, mode="nearest"), (2, 4, H, 6), 2),
        "nearest_down": (lambda: (lambda x: F.interpolate(x, size=(4, 5), mode="nearest")), (2, 4, H, 6), 2),
        "bilinear_x2": (lambda: nn.Upsample(scale_factor=2, mode="bilinear"), (2, 4, H, 6), 2),
        "bilinear_ac": (lambda: nn.Upsample(scale_factor=2, mode="bilinear", align_corners=True), (2, 4, H, 6), 2),
        "bilinear_size_ac": (lambda: (lambda x: F.interpolate(x, size=(13, 4), mode="bilinear", align_corners=True)),
                             (2, 4, H, 6), 2),
        "bilinear_down": (lambda: (lambda x: F.interpolate(x, size=(5, 4), mode="bilinear")), (2, 4, H, 6), 2),
        "trilinear": (lambda: nn.Upsample(scale_factor=1.5, mode="trilinear"), (1, 2, H, 4, 3), 4),
        "sdpa": (lambda: (lambda x: F.scaled_dot_product_attention(x, x * 0.5, torch.tanh(x))), (2, 3, H, 5), 2),
        "sdpa_causal": (lambda: (lambda x: F.scaled_dot_product_attention(x, x, x, is_causal=True)), (2, 3, H, 5), 2),
        # reshapes use the local sizes (.shape is local), as attention code does with (B, T, heads, hd)
        "reshape_split_before": (lambda: (lambda x: x.reshape(x.shape[0], 2, 2, x.shape[2], 6) * 1.5), (2, 4, H, 6), 2),
        "view_split_after": (lambda: (lambda x: torch.tanh(x.view(*x.shape[:3], 3, 2))), (2, 4, H, 6), 2),
        "flatten_from_sharded": (lambda: (lambda x: torch.flatten(x, 2).sin()), (2, 4, H, 6), 2),
        "flatten_before_sharded": (lambda: (lambda x: x.flatten(0, 1) * 3), (2, 4, H, 6), 2),
        "reshape_merge_sharded": (lambda: (lambda x: x.reshape(x.shape[0], x.shape[1], -1) ** 2), (2, 4, H, 6), 2),
        "heads_roundtrip": (lambda: (lambda x: F.scaled_dot_product_attention(
            *(x.view(x.shape[0], x.shape[1], 2, 3).transpose(1, 2),) * 3, is_causal=True
        ).transpose(1, 2).reshape(x.shape[0], x.shape[1], -1)), (2, H, 6), 1),
    }


def _neighbourhood_ref(x, radius):
    n = x.shape[-2]
    idx = torch.arange(n)
    mask = (idx[None, :] - idx[:, None]).abs() <= radius
    return F.scaled_dot_product_attention(x, x, x, attn_mask=mask)


def _ops_body(sizes):
    DistributedManager.initialize(batch=1, domain=-1)
    errors = {}
    for i, (name, (make, shape, dim)) in enumerate(_cases().items()):
        torch.manual_seed(i)
        x = torch.randn(shape, dtype=torch.float64, requires_grad=True)
        ref = make()
        mod = copy.deepcopy(ref)
        y = ref(x)
        cot = torch.randn_like(y)
        (y * cot).sum().backward()
        gx, x.grad = x.grad, None
        local_sizes = sizes if shape[dim] == H else None
        ys = mod(domain.shard(x, dim=dim, sizes=local_sizes))
        if ys.sharded_dim is None:  # a replicated result: backward on it directly (the gradient convention)
            out = ys.to_local()
            (ys * cot).sum().backward()
        else:
            out = ys.full_tensor()
            (out * cot).sum().backward()
        err = max(max_err(out, y), max_err(domain_sum(x.grad), gx))
        if isinstance(ref, torch.nn.Module):
            err = max(err, grads_err(ref, mod))
            for b_ref, b in zip(ref.buffers(), mod.buffers()):
                err = max(err, max_err(b_ref.double(), b.double()))
        errors[name] = err
    # cross-entropy (class indices, weights, ignore_index) and mse/l1 against a sharded target
    torch.manual_seed(99)
    x = torch.randn(2, 5, H, 4, dtype=torch.float64, requires_grad=True)
    t = torch.randint(0, 5, (2, H, 4))
    t[0, 0, 0] = -100
    w = torch.rand(5, dtype=torch.float64)
    target_f = torch.randn(2, 5, H, 4, dtype=torch.float64)
    for name, fn, tgt, tdim in (
        ("cross_entropy", lambda a, b: F.cross_entropy(a, b, weight=w, label_smoothing=0.1), t, 1),
        ("mse", F.mse_loss, target_f, 2),
        ("l1_sum", lambda a, b: F.l1_loss(a, b, reduction="sum"), target_f, 2),
    ):
        x.grad = None
        ref = fn(x, tgt)
        ref.backward()
        gx, x.grad = x.grad, None
        got = fn(domain.shard(x, dim=2, sizes=sizes), domain.shard(tgt, dim=tdim, sizes=sizes))
        got.backward()
        errors[name] = max(max_err(got.to_local(), ref), max_err(domain_sum(x.grad), gx))
    # neighbourhood attention via halos
    x = torch.randn(2, 3, H, 5, dtype=torch.float64, requires_grad=True)
    ref = _neighbourhood_ref(x, 2)
    cot = torch.randn_like(ref)
    (ref * cot).sum().backward()
    gx, x.grad = x.grad, None
    xs = domain.shard(x, dim=2, sizes=sizes)
    out = neighbourhood_attention(xs, xs, xs, radius=2).full_tensor()
    (out * cot).sum().backward()
    errors["neighbourhood_attention"] = max(max_err(out, ref), max_err(domain_sum(x.grad), gx))
    # scatter: only src holds x, each rank receives its slice; gradient returns to src
    x = torch.randn(2, 3, H, 4, dtype=torch.float64, requires_grad=True)
    xs = domain.scatter(x if DistributedManager().axis_rank("domain") == 0 else None, dim=2, sizes=sizes)
    errors["scatter"] = max_err(xs.full_tensor(), x.detach())
    # maxima tied across shards: torch.amax/max share the gradient among every tie, on every shard holding one
    torch.manual_seed(7)
    tied = torch.randn(2, 3, H, 4, dtype=torch.float64)
    tied[:, :, ::3] = tied.max() + 1                          # the maximum on rows 0, 3 and 6
    zeros = torch.relu(torch.randn(2, 3, H, 4, dtype=torch.float64) - 1.5)   # ReLU's zeros: most columns all 0
    for name, x, fn in (("amax_tied", tied, lambda a: a.amax()), ("max_tied", tied, lambda a: torch.max(a)),
                        ("amax_dims_tied", tied, lambda a: a.amax(dim=(2, 3))),
                        ("amax_relu_zeros", zeros, lambda a: a.amax(dim=2))):
        x = x.clone().requires_grad_()
        ref = fn(x)
        cot = torch.randn_like(ref)
        (ref * cot).sum().backward()
        gx, x.grad = x.grad, None
        got = fn(domain.shard(x, dim=2, sizes=sizes))
        (got * cot).sum().backward()
        errors[name] = max(max_err(got.to_local(), ref), max_err(domain_sum(x.grad), gx))
    return errors


@settings(max_examples=examples(4), deadline=None, suppress_health_check=list(HealthCheck))
@given(case=layout_case(H, (2, 4)))
@edge_examples(H, (2, 4))
def test_ops_match_one_process(ranks, case):
    world, layouts = case
    for rank_errors in ranks.run(world, on_each_layout, _ops_body, layouts, timeout=90 * len(layouts)):
        for sizes, errors in zip(layouts, rank_errors):
            bad = {k: v for k, v in errors.items() if not v < TOL}
            assert not bad, (sizes, bad)


def _refusals_body():
    DistributedManager.initialize(batch=1, domain=-1)
    x = torch.randn(2, 4, H, 6, dtype=torch.float64)
    xs = domain.shard(x, dim=2)
    attempts = {
        "renorm": lambda: torch.renorm(xs, 2, 1, 1.0),
        "alpha_dropout": lambda: F.alpha_dropout(xs, 0.5, training=True),
        "cat_strided": lambda: torch.cat([xs.flatten(1, 2), xs.flatten(1, 2)], 1),  # cat of pieces: ops/pieces.py
        "plain_broadcast": lambda: xs + x[:, :, :4],  # neither length 1 nor the global length
        "ce_plain_target": lambda: F.cross_entropy(xs, torch.zeros(2, H, 6, dtype=torch.long)),
        "nearest_exact": lambda: F.interpolate(xs, scale_factor=2, mode="nearest-exact"),
        "avg_no_pad_count": lambda: F.avg_pool2d(xs, 3, 1, 1, count_include_pad=False),
        "roll_flattened": lambda: torch.roll(xs, 2),
        "linear_sharded": lambda: F.linear(xs.transpose(2, 3), torch.randn(3, H, dtype=torch.float64)),
        # groups=1 contracts the sharded channels (MLP-Mixer's token mixing); grouped channels have no rule
        "conv_channel_sharded": lambda: F.conv2d(domain.shard(x, dim=1), torch.randn(2, 2, 3, 3, dtype=torch.float64),
                                                 groups=2),
        "max_dim": lambda: xs.max(dim=2),
        "bad_sizes": lambda: domain.shard(x, dim=2, sizes=(H + 1,) + (0,) * (xs.spec.comm.size - 1)),
        "bad_dim": lambda: domain.shard(x, dim=7),
        "reshape_mixing_rows": lambda: xs.reshape(2, -1, 3),
        "strided_without_rule": lambda: xs.flatten(1, 2).flip(1),  # channels merged into the rows: a strided layout
        "bad_src": lambda: domain.scatter(x, dim=2, src=99),
    }
    messages = {}
    for name, attempt in attempts.items():
        try:
            attempt()
            messages[name] = None
        except (NotImplementedError, ValueError) as e:
            messages[name] = str(e)
    return messages


#: What every rank's refusal must say: the op (or the argument) it refuses, and what to do instead. ``{sizes}`` is the
#: default split of the H rows (torch.chunk's rule), ``{balanced}`` the balanced one, ``{last}`` the last domain rank.
REFUSALS = {
    "renorm": ["torch.renorm has no domain rule", "Call .full_tensor() first", "mesh3d.domain.register"],
    "alpha_dropout": ["F.alpha_dropout in training mode on a domain tensor", "use F.dropout, p=0",
                      "after .full_tensor()"],
    "cat_strided": ["torch.cat of strided domain tensors along the strided dim", "reshape them back to their unstrided"],
    "plain_broadcast": ["torch.Tensor.add: a non-sharded tensor of shape (2, 4, 4, 6) varies along the sharded dim 2",
                        "domain.shard(t, dim=2, sizes={sizes})", "or give it size 1 there"],
    "ce_plain_target": ["F.cross_entropy: the target must be sharded like the input",
                        "domain.shard(target, dim=1, sizes={sizes})"],
    "nearest_exact": ["F.interpolate(mode='nearest-exact')", "use nearest, linear, bilinear, bicubic, trilinear or area"],
    "avg_no_pad_count": ["torch.nn.functional.avg_pool2d: count_include_pad=False", "use count_include_pad=True, ceil_mode=False"],
    "roll_flattened": ["torch.roll without dims= flattens the tensor", "give dims=", "or call .full_tensor() first"],
    "linear_sharded": ["torch.linear acts along dim 3, which is sharded", "call .full_tensor() first or shard a different dim"],
    "conv_channel_sharded": ["torch.nn.functional.conv2d: the domain-sharded dim 1 is a channel dim",
                             "shard a spatial dim (2..3) instead"],
    "max_dim": ["torch.max/min with dim=", "use torch.amax(x, dim) or torch.maximum(a, b)"],
    "bad_sizes": ["sum to 10 but the sharded dim has length 9", "e.g. sizes={balanced}"],
    "bad_dim": ["domain.shard: dim=7 is out of range for a 4-D tensor", "(use 0..3)"],
    "reshape_mixing_rows": ["torch.reshape(2, ", "would mix rows of the sharded dim", "or call .full_tensor() first"],
    "strided_without_rule": ["flip has no rule for a strided layout", "reshape it back to the unstrided shape first",
                             "or call .full_tensor()"],
    "bad_src": ["domain.scatter: src=99 must be a domain rank index in 0..{last}"],
}
#: Refusals that quote this rank's local shape (so they differ between ranks): none, sizes are global.
QUOTES_LOCAL_SHAPE: set[str] = set()


@pytest.mark.parametrize(("world", "sizes", "balanced"), [(1, "(9,)", "(9,)"), (4, "(3, 3, 3, 0)", "(3, 2, 2, 2)")])
def test_refusals_name_the_op_and_what_to_do_on_every_rank(ranks, world, sizes, balanced):
    results = ranks.run(world, _refusals_body, timeout=60)
    assert set(results[0]) == set(REFUSALS)
    for rank, messages in enumerate(results):
        for name, fragments in REFUSALS.items():
            message = messages[name]
            assert message is not None, f"{name} did not raise on rank {rank}"
            missing = [f for f in (f.format(sizes=sizes, balanced=balanced, last=world - 1) for f in fragments)
                       if f not in message]
            assert not missing, (name, rank, missing, message)
            if name not in QUOTES_LOCAL_SHAPE:
                assert message == results[0][name], (name, rank)


def test_split_rule_is_torch_chunk():
    for length in range(0, 20):
        for parts in range(1, 9):
            chunks = [c.shape[0] for c in torch.arange(length).chunk(parts)] if length else []
            assert split_sizes(length, parts) == tuple(chunks + [0] * (parts - len(chunks)))
            assert sum(balanced_sizes(length, parts)) == length
    with pytest.raises(ValueError, match="sum to"):
        split_sizes(10, 2, (3, 3))
    with pytest.raises(ValueError, match="non-negative"):
        split_sizes(10, 2, (11, -1))


def _remembered_layout_body():
    x = torch.arange(2 * 9 * 3, dtype=torch.float64).reshape(2, 9, 3)
    seen = []
    for shape in ((1, 2, 1), (2, 1, 1), (1, 2, 1)):  # the domain over both ranks, then none, then both again
        DistributedManager.initialize(*shape)
        first, again = domain.shard(x, dim=1), domain.shard(x, dim=1)
        explicit = domain.shard(x, dim=1, sizes=[2, 7] if shape[1] == 2 else [9])  # a list: remembered as a tuple
        start = (0, 2)[explicit.spec.comm.index]
        seen.append((first.spec is again.spec, first.sizes, first.spec.comm.size, explicit.sizes,
                     torch.equal(explicit.to_local(), x[:, start:start + explicit.local_shape[1]])))
        DistributedManager.shutdown()
    return seen


def test_shard_remembers_each_layout_and_follows_a_new_mesh(ranks):
    """``shard`` makes a layout's spec once (it runs on every step's input); a new mesh is a new layout."""
    for seen in ranks.run(2, _remembered_layout_body, timeout=60):
        assert seen[0][:4] == (True, (5, 4), 2, (2, 7)) and seen[0][4]
        assert seen[1][:4] == (True, (9,), 1, (9,)) and seen[1][4]
        assert seen[2][:4] == (True, (5, 4), 2, (2, 7)) and seen[2][4]


def _backward_body():
    DistributedManager.initialize(batch=1, domain=-1)
    w = torch.tensor([1.5, -2.0], dtype=torch.float64, requires_grad=True)
    v = torch.tensor([0.5, 3.0], dtype=torch.float64, requires_grad=True)
    x = torch.arange(2.0, dtype=torch.float64).reshape(1, 2)
    ys = domain.shard(x, dim=1, sizes=(1, 1)) * w * v  # one element per rank, two in all
    out = {}
    try:
        ys.backward()
    except RuntimeError as e:
        out["non_scalar"] = str(e)
    loss = ys.sum()
    loss.backward(retain_graph=True, inputs=[w])  # only w accumulates; the graph stays for a second call
    out["w_only"] = (w.grad.tolist(), v.grad)
    loss.backward(torch.tensor(2.0, dtype=torch.float64))  # an explicit gradient, into both
    out["both"] = (w.grad.tolist(), v.grad.tolist())
    try:
        loss.backward(inputs=[])
    except RuntimeError as e:
        out["empty_inputs"] = str(e)
    return out


def test_domain_backward_answers_as_torch_does(ranks):
    """``DomainTensor.backward`` goes straight to the autograd engine: it still refuses an implicit gradient for a
    tensor of more than one element (counting the whole tensor, not the one-element shard), honours inputs= and
    retain_graph=, takes an explicit gradient, and refuses empty inputs. Gradients sum over the domain to torch's."""
    outs = ranks.run(2, _backward_body, timeout=60)
    for out in outs:
        assert "scalar outputs" in out["non_scalar"] and "2 elements" in out["non_scalar"], out
        assert out["w_only"][1] is None
        assert "cannot be empty" in out["empty_inputs"]
    x, w, v = [0.0, 1.0], [1.5, -2.0], [0.5, 3.0]
    w_grad = [sum(o["w_only"][0][i] for o in outs) for i in range(2)]
    assert w_grad == [x[i] * v[i] for i in range(2)]
    w_both = [sum(o["both"][0][i] for o in outs) for i in range(2)]
    v_both = [sum(o["both"][1][i] for o in outs) for i in range(2)]
    assert w_both == [3 * x[i] * v[i] for i in range(2)] and v_both == [2 * x[i] * w[i] for i in range(2)]


def _replicated_results_body(sizes):
    """Replicated results of reductions over the sharded dim, from fp32 values of many magnitudes (sums whose bits
    depend on the order of the ranks' partial sums)."""
    DistributedManager.initialize(batch=1, domain=-1)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 64, 12, generator=g) * 10 ** (torch.rand(2, 64, 12, generator=g) * 8 - 4)
    t = torch.randn(2, 64, 12, generator=g)
    xs, ts = domain.shard(x, dim=2, sizes=sizes), domain.shard(t, dim=2, sizes=sizes)
    outs = {"sum": xs.sum(dim=2), "mean": xs.mean(), "var": xs.var(dim=2), "mse": F.mse_loss(xs, ts),
            "softmax_stats": torch.softmax(xs, dim=2).sum(dim=2)}
    return {k: v.to_local() for k, v in outs.items()}


@pytest.mark.parametrize("world, sizes", [(3, (5, 4, 3)), (4, (2, 0, 6, 4))])
def test_replicated_results_are_the_same_bits_on_every_rank(ranks, world, sizes):
    """A replicated value is one value: every rank adds the partial sums in the same (rank) order, so at D >= 3, where
    (a + b) + c and (c + a) + b round differently, every rank still holds the same bits."""
    results = ranks.run(world, _replicated_results_body, sizes, timeout=60)
    for name, first in results[0].items():
        assert first.dtype == torch.float32 and first.numel() > 1 or name in ("mean", "mse")
        for rank, result in enumerate(results[1:], start=1):
            assert torch.equal(result[name], first), (name, rank, float((result[name] - first).abs().max()))
