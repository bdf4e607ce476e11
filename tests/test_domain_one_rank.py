"""Wrapper tensors on a one-rank domain run torch's op on the shard, in the layout the rule gave (``dispatch.one_rank``).

Checked against references the path did not build: every ruled slab function the layout sweep calls, on a one-rank
domain, gives what the dispatcher gives (the same values, the same kind of result, the same spec), on the second call
of each signature (the kept one) as on the first; a small U-Net trains equal to one process (fp64, 3 Adam steps) with
the path taken; a result of another length than the rule's, a write, a rule registered later and a multi-rank domain
each take the dispatcher.
"""

from __future__ import annotations

import contextlib
import copy

import torch
import torch.nn as nn
import torch.nn.functional as F

D64 = torch.float64


def _same(a, b) -> bool:
    """Equal values, and equal layouts where both are domain tensors (the kind of result too)."""
    from mesh3d.domain import DomainTensor

    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if type(a) is not type(b):
            return False
        if isinstance(a, DomainTensor):
            if a.spec != b.spec:
                return False
            a, b = a.to_local(), b.to_local()
        if a.shape != b.shape or a.dtype != b.dtype:
            return False
        if a.is_floating_point() or a.is_complex():
            return bool(torch.allclose(a, b, rtol=1e-12, atol=1e-13, equal_nan=True))
        return bool(torch.equal(a, b))
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(p, q) for p, q in zip(a, b))
    return a == b


def _sweep_body():
    from layout_cases import calls, plain

    from mesh3d import DistributedManager, domain
    from mesh3d.domain.core.wrapped import wrapper_tensors
    from mesh3d.domain.dispatch.one_rank import ONE_RANK
    from mesh3d.domain.dispatch.registry import RULES, op_name

    DistributedManager.initialize(batch=1, domain=1)
    g = torch.Generator().manual_seed(5)
    x0 = torch.randn(2, 3, 7, 4, dtype=D64, generator=g)
    y0 = torch.randn(2, 3, 7, 4, dtype=D64, generator=g).abs() + 0.5
    xp, yp = plain("slab", x0), plain("slab", y0)
    outcome: dict[str, str] = {}
    with wrapper_tensors():
        for func in sorted(RULES, key=op_name):
            for i, call in enumerate(calls(func, xp, yp, 2)):
                label = f"{op_name(func)}#{i}"
                try:
                    with ONE_RANK.off():
                        expected = call(domain.shard(x0.clone(), dim=2), domain.shard(y0.clone(), dim=2))
                except Exception:  # noqa: BLE001  (refused, or not a call this function takes: not kept either)
                    continue
                hits = ONE_RANK.hits
                try:
                    got = [call(domain.shard(x0.clone(), dim=2), domain.shard(y0.clone(), dim=2)) for _ in range(2)]
                except Exception as err:  # noqa: BLE001  (the test reports it)
                    outcome[label] = f"WRONG: {type(err).__name__}: {str(err)[:200]}"
                    continue
                kept = ONE_RANK.hits > hits
                outcome[label] = ("kept " if kept else "") + ("equal" if all(_same(o, expected) for o in got) else
                                                             f"WRONG: {got[1]!r:.200} != {expected!r:.200}")
    return outcome


def test_every_ruled_slab_call_equals_the_dispatchers_answer(ranks):
    (outcome,) = ranks.run(1, _sweep_body, timeout=600)
    wrong = {k: v for k, v in outcome.items() if "WRONG" in v}
    assert wrong == {}, wrong
    kept = sum(v.startswith("kept") for v in outcome.values())
    assert kept > 100, (kept, len(outcome))


class _UNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Sequential(nn.Conv2d(2, 4, 3, padding=1), nn.GroupNorm(2, 4), nn.GELU())
        self.b = nn.Sequential(nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4), nn.SiLU())
        self.up = nn.ConvTranspose2d(4, 4, 2, stride=2)
        self.head = nn.Conv2d(8, 1, 1)

    def forward(self, x):
        e = self.a(x)
        m = self.b(F.max_pool2d(e, 2))
        u = F.interpolate(m, scale_factor=2, mode="bilinear", align_corners=False) + self.up(m)
        return self.head(torch.cat([u, e], 1))


def _training_body():
    from mesh3d import DistributedManager, domain
    from mesh3d.domain.core.wrapped import wrapper_tensors
    from mesh3d.domain.dispatch.one_rank import ONE_RANK

    DistributedManager.initialize(batch=1, domain=1)
    torch.manual_seed(0)
    ref = _UNet().double()
    models = {"kept": copy.deepcopy(ref), "dispatcher": copy.deepcopy(ref)}
    opts = {k: torch.optim.Adam(m.parameters(), lr=1e-2) for k, m in [("ref", ref), *models.items()]}
    g = torch.Generator().manual_seed(1)
    worst = {k: 0.0 for k in models}
    hits = ONE_RANK.hits
    for _ in range(3):
        x, t = torch.randn(2, 2, 12, 10, dtype=D64, generator=g), torch.randn(2, 1, 12, 10, dtype=D64, generator=g)
        opts["ref"].zero_grad()
        F.mse_loss(ref(x), t).backward()
        opts["ref"].step()
        for name, model in models.items():
            opts[name].zero_grad()
            with wrapper_tensors(), (ONE_RANK.off() if name == "dispatcher" else contextlib.nullcontext()):
                loss = F.mse_loss(model(domain.shard(x, dim=2)), domain.shard(t, dim=2))
                loss.backward()
            opts[name].step()
        for name, model in models.items():
            for p, q in zip(ref.parameters(), model.parameters()):
                worst[name] = max(worst[name], (p - q).abs().max().item())
    return worst, ONE_RANK.hits - hits


def test_a_unet_trains_equal_to_one_process_with_layouts_kept(ranks):
    (result,) = ranks.run(1, _training_body, timeout=300)
    worst, hits = result
    assert max(worst.values()) < 1e-12, worst
    # the path answered the model's norms, pooling, interpolation and transposed convolution (its convolutions take
    # the convolutions' own short path, ``ops.conv_short``, which needs no rank count)
    assert hits > 10, hits


def _edges_body():
    from mesh3d import DistributedManager, domain
    from mesh3d.domain.core.wrapped import wrapper_tensors
    from mesh3d.domain.dispatch.one_rank import ONE_RANK, _on_shards
    from mesh3d.domain.dispatch.registry import RULES
    from mesh3d.domain.dispatch.step import Step

    DistributedManager.initialize(batch=1, domain=1)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 3, 8, 4, dtype=D64, generator=g)
    out = {}
    with wrapper_tensors():
        xs = domain.shard(x, dim=2)
        # torch's result of another length along the sharded dim than the rule's (a data-dependent size): refused
        spec = xs.spec
        out["size"] = _on_shards(lambda t: t[:, :, :5], (xs,), {}, (spec,))[0] is NotImplemented
        # a write takes the dispatcher every time
        hits = ONE_RANK.hits
        for _ in range(2):
            h = xs * 1.0
            F.relu(h, inplace=True)
        out["write"] = (ONE_RANK.hits == hits, torch.equal(h.full_tensor(), F.relu(x)))
        # a rule registered after a call is kept: its answer from then on, and the old one's after it is dropped
        saved = RULES.snapshot()
        for _ in range(2):
            F.softsign(xs)
        domain.register(F.softsign, override=True)(lambda t: Step(lambda v: v * 0.0 + 7.0, (t,), out=t.spec))
        mine = [F.softsign(xs).full_tensor() for _ in range(2)]
        RULES.restore(saved)
        back = [F.softsign(xs).full_tensor() for _ in range(2)]
        out["rule"] = (all(bool((m == 7.0).all()) for m in mine), all(torch.allclose(b, F.softsign(x)) for b in back))
    return out


def test_other_sizes_writes_and_new_rules_take_the_dispatcher(ranks):
    (out,) = ranks.run(1, _edges_body, timeout=300)
    assert out == {"size": True, "write": (True, True), "rule": (True, True)}, out


def _multi_rank_body():
    from mesh3d import DistributedManager, domain
    from mesh3d.domain.core.wrapped import wrapper_tensors
    from mesh3d.domain.dispatch.one_rank import ONE_RANK

    DistributedManager.initialize(batch=1, domain=2)
    x = torch.randn(1, 2, 6, 4, dtype=D64, generator=torch.Generator().manual_seed(4))
    w = torch.randn(3, 2, 3, 3, dtype=D64, generator=torch.Generator().manual_seed(5))
    hits = ONE_RANK.hits
    with wrapper_tensors():
        xs = domain.shard(x, dim=2, sizes=(5, 1))
        got = [F.conv2d(xs, w, padding=1).full_tensor() for _ in range(3)]
    return ONE_RANK.hits - hits, max((o - F.conv2d(x, w, padding=1)).abs().max().item() for o in got)


def test_a_multi_rank_domain_takes_the_dispatcher(ranks):
    for hits, err in ranks.run(2, _multi_rank_body, timeout=300):
        assert hits == 0 and err < 1e-12, (hits, err)
