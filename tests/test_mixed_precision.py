"""Mixed precision against its own reference: one process under the SAME precision policy, not fp32.

A low-precision parallel run differs from fp32 by the low precision itself; compared with fp32 it hides any parallel
error smaller than that gap. So every case runs three things on each rank: the parallel run, one process under the
same policy, one process in fp32; distances are measured against the low-precision one-process run.

Policies: FSDP mixed precision (``Plan(param_dtype=bf16)``, fp32 reduction), fp16 parameters with a ``GradScaler``
(its first step overflows and is skipped, by every rank alike), and ``torch.autocast`` (bf16) over fp32 parameters.
Model: the U-Net of the domain tests (convolutions with halos, strided, dilated+circular and transposed; GroupNorm
statistics over the domain; max pooling; bilinear upsampling), FSDP over batch x domain, on (1, 2, 2) with slabs and
on a 2x2 block grid. Asserted, per policy and mesh:

* the forward at equal parameters (every step: the one-process runs use the parallel run's current parameters):
  the loss is within a tenth of the low-precision run's distance from fp32 (in fact equal: halos move bits, and
  statistics, interpolation and reductions of half-precision shards are float32 until one rounding, as torch's
  kernels are);
* the first gradient, and the parameters after 3 SGD steps: no farther from fp32 than 1.25x the low-precision one
  process, and nearer to it than fp32 is. NOTE: not a tenth here: FSDP computes each rank's gradient in the low
  dtype, rounded once per rank before the fp32 reduction, where one process rounds the whole gradient once; that
  difference is of the size of the low dtype's rounding of the gradient itself (measured: 0.5 to 0.8 of the
  distance from fp32 after 3 steps).

Unit cases in bf16 and fp16 on 3 uneven ranks (an empty shard) and on 2x2 blocks: the halo exchange (convolutions
equal one process bit for bit), norm statistics and reductions over the domain (GroupNorm, LayerNorm, sums, means,
variances and losses within a tenth of the one-process run's distance from fp64; BatchNorm, InstanceNorm and softmax,
whose bf16/fp16 CPU kernels round in between where mesh3d rounds once, no farther from fp64 than 1.1x of one
process), and the ring's merge of attention blocks (no farther from fp64 than 1.25x the
one-process kernel: the ring rounds each block's probabilities against the block's own maximum, so it cannot be
bitwise; a merge in the low dtype was 1.7x farther, measured in bf16).
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F

from domain_models import H, W, TinyUNet
from domain_compose import UNET_STYLES
from parallel_models import full

STEPS = 3
LR = 0.05
LOW = {"bf16": torch.bfloat16, "fp16": torch.float16, "autocast": None}
#: The fp16 scaler: its first scale overflows the gradients (a skipped step, scale x 2**-5), the next ones do not.
SCALER = {"init_scale": 2.0**21, "backoff_factor": 2.0**-5}


def _forward(master: torch.nn.Module, policy: str | None, x: torch.Tensor, work: dict) -> torch.Tensor:
    """One process's output under ``policy`` (None: fp32) with ``master``'s fp32 parameters, as FSDP's mixed
    precision computes it: parameters and input cast to the low dtype, or autocast over fp32 parameters."""
    if policy is None:
        return master(x)
    if policy == "autocast":
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return master(x)
    low = work.setdefault(policy, copy.deepcopy(master).to(LOW[policy]))
    with torch.no_grad():
        for w, m in zip(low.parameters(), master.parameters()):
            w.copy_(m)
    return low(x.to(LOW[policy]))


def _loss(out: torch.Tensor, y) -> torch.Tensor:
    return F.mse_loss(out.float(), y)


def _one_process(policy: str | None, x, y, skip: tuple[int, ...] = ()) -> dict:
    """STEPS SGD steps of one process under ``policy`` (none at the steps in ``skip``): losses, the first gradient,
    final parameters, scales."""
    torch.manual_seed(0)
    master = TinyUNet()
    opt = torch.optim.SGD(master.parameters(), lr=LR)
    scaler = torch.amp.GradScaler("cpu", **SCALER) if policy == "fp16" else None
    work: dict = {}
    out = {"losses": [], "scales": []}
    for step in range(STEPS):
        loss = _loss(_forward(master, policy, x, work), y)
        (scaler.scale(loss) if scaler else loss).backward()
        if policy in ("bf16", "fp16"):  # the low-precision copy's gradients, reduced in fp32 (reduce_dtype)
            for w, m in zip(work[policy].parameters(), master.parameters()):
                m.grad, w.grad = w.grad.float(), None
        _first_gradient(out, [p.grad for p in master.parameters()], scaler)
        if step in skip:
            opt.zero_grad()
        else:
            _step(opt, scaler, out)
        out["losses"].append(float(loss))
    out["params"] = [p.detach().clone() for p in master.parameters()]
    return out


def _first_gradient(out: dict, grads: list[torch.Tensor], scaler) -> None:
    """Keep the first finite (unscaled) gradient: the fp16 run's first step overflows and leaves the parameters."""
    if "grad" not in out and all(bool(g.isfinite().all()) for g in grads):
        out["grad"] = [g.detach().clone() / (scaler.get_scale() if scaler else 1.0) for g in grads]


def _step(opt, scaler, out: dict) -> None:
    if scaler is None:
        opt.step()
    else:
        scaler.step(opt)
        scaler.update()
        out["scales"].append(scaler.get_scale())
    opt.zero_grad()


def _norm(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return float(torch.cat([(p - q).flatten() for p, q in zip(a, b)]).norm())


def _parallel(dm, shape, sizes, policy: str, x, y) -> dict:
    """The parallel run; at every step the one-process forwards at its current parameters (low and fp32)."""
    from mesh3d import Plan, domain, parallelize

    torch.manual_seed(0)
    model = TinyUNet()
    low = LOW[policy]
    model = parallelize(model, Plan(batch="fsdp", model=UNET_STYLES if shape[2] > 1 else None, param_dtype=low,
                                    reduce_dtype=torch.float32 if low else None))
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    scaler = torch.amp.GradScaler("cpu", **SCALER) if policy == "fp16" else None
    where = {"dims": (2, 3)} if isinstance(shape[1], tuple) else {"dim": 2}
    xs, ys = domain.shard(x, sizes=sizes, **where), domain.shard(y, sizes=sizes, **where)
    probe, work = TinyUNet(), {}
    out = {"forward": [], "losses": [], "scales": []}
    for step in range(STEPS):
        with torch.no_grad():  # one process at the parallel run's parameters: its low-precision and fp32 forwards
            for p, q in zip(probe.parameters(), model.parameters()):
                p.copy_(full(q))
            at_low, at_fp32 = (float(_loss(_forward(probe, pol, x, work), y)) for pol in (policy, None))
        if policy == "autocast":
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = _loss(model(xs), ys)
        else:
            loss = _loss(model(xs), ys)
        (scaler.scale(loss) if scaler else loss).backward()
        value = float(loss.to_local())
        out["forward"].append((abs(value - at_low), abs(at_low - at_fp32)))
        _first_gradient(out, [full(p.grad) for p in model.parameters()], scaler)
        _step(opt, scaler, out)
        out["losses"].append(value)
    out["params"] = [full(p) for p in model.parameters()]
    return out


def _policies_body(shape, sizes):
    """Every policy on one mesh: the parallel run against one process under the same policy and in fp32."""
    from mesh3d import DistributedManager

    dm = DistributedManager.initialize(*shape)
    g = torch.Generator().manual_seed(7)
    x, y = torch.randn(2, 2, H, W, generator=g), torch.randn(2, 2, H, W, generator=g)
    report = {}
    for policy in LOW:
        # the fp16 run skips its first step (the scaler's overflow): fp32 does the same steps
        fp32 = _one_process(None, x, y, skip=(0,) if policy == "fp16" else ())
        low, par = _one_process(policy, x, y), _parallel(dm, shape, sizes, policy, x, y)
        report[policy] = {
            "forward": par["forward"],
            "grad": (_norm(par["grad"], fp32["grad"]), _norm(low["grad"], fp32["grad"]), _norm(par["grad"], low["grad"])),
            "params": (_norm(par["params"], fp32["params"]), _norm(low["params"], fp32["params"]),
                       _norm(par["params"], low["params"])),
            "scales": (par["scales"], low["scales"]),
        }
    return report


def _check_policies(report: dict) -> None:
    for policy, r in report.items():
        for step, (parallel, low) in enumerate(r["forward"]):
            assert low > 0, (policy, step, "the policy must change the forward, else nothing is tested")
            assert parallel <= 0.1 * low, (policy, step, parallel, low)
        for what in ("grad", "params"):
            par_fp32, low_fp32, par_low = r[what]
            assert low_fp32 > 0, (policy, what)
            assert par_fp32 <= 1.25 * low_fp32 and par_low <= low_fp32, (policy, what, r[what])
    scales, one_process = report["fp16"]["scales"]
    assert scales == one_process and scales[0] < SCALER["init_scale"] and scales[1] == scales[0], scales


def test_mixed_precision_on_slabs_with_fsdp_and_a_model_axis_against_its_own_reference(ranks):
    for report in ranks.run(4, _policies_body, (1, 2, 2), (9, 5), timeout=300):
        _check_policies(report)


def test_mixed_precision_on_blocks_with_fsdp_against_its_own_reference(ranks):
    for report in ranks.run(4, _policies_body, (1, (2, 2), 1), ((8, 6), (6, 4)), timeout=300):
        _check_policies(report)


# ----------------------------------------------------------------------------- unit cases in bf16 and fp16
def _unit_ops(dtype):
    """name -> (op, kind): "exact" (halo exchanges only move bits), "stats" (statistics over the domain, where torch's
    kernel rounds once as mesh3d does) or "accurate" (torch's bf16/fp16 CPU kernel rounds in between: BatchNorm and
    InstanceNorm, 1.4x farther from fp64 than float32-then-one-rounding; softmax: mesh3d no less accurate)."""
    torch.manual_seed(0)
    conv = torch.nn.Conv2d(4, 4, 3, padding=1).to(dtype)
    circular = torch.nn.Conv2d(4, 4, 3, padding=2, dilation=2, padding_mode="circular").to(dtype)
    up = torch.nn.ConvTranspose2d(4, 4, 3, stride=2).to(dtype)
    gn, inorm = torch.nn.GroupNorm(2, 4).to(dtype), torch.nn.InstanceNorm2d(4, affine=True).to(dtype)
    bn, ln = torch.nn.BatchNorm2d(4).to(dtype), torch.nn.LayerNorm([4, 12, 6]).to(dtype)
    for norm in (gn, inorm, bn, ln):  # affine parameters away from 1 and 0
        with torch.no_grad():
            norm.weight.uniform_(0.5, 1.5)
            norm.bias.uniform_(-0.5, 0.5)
    return {
        "conv": (conv, "exact"), "dilated circular conv": (circular, "exact"), "transposed conv": (up, "exact"),
        "bilinear": (lambda t: F.interpolate(t, scale_factor=2, mode="bilinear"), "exact"),
        "group_norm": (gn, "stats"), "instance_norm": (inorm, "accurate"), "batch_norm": (bn, "accurate"),
        "layer_norm": (ln, "stats"), "mean": (lambda t: t.mean(dim=(2, 3)), "stats"),
        "var": (lambda t: t.var(dim=(2, 3)), "stats"), "mse": (lambda t: F.mse_loss(t, 0.5 * t.detach() + 0.1), "stats"),
        "softmax": (lambda t: t.softmax(dim=2), "accurate"),
    }


def _units_body(layout: str, sizes):
    """Every unit op in bf16 and fp16 against one process in the same dtype and in fp64: max |parallel - low|, then
    |parallel - low|, |low - fp64|, |parallel - fp64| as 2-norms."""
    from mesh3d import DistributedManager, domain

    DistributedManager.initialize(batch=1, domain=(2, 2) if layout == "blocks" else len(sizes))
    where = {"dims": (2, 3)} if layout == "blocks" else {"dim": 2}
    out = {}
    for dtype in (torch.bfloat16, torch.float16):
        x64 = torch.randn(2, 4, 12, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(1)) * 3 + 1
        x = x64.to(dtype)
        for name, (op, kind) in _unit_ops(dtype).items():
            if layout == "blocks" and name in ("layer_norm", "softmax", "var"):
                continue  # over one block dim, or no rule on blocks
            low = op(x)
            exact = (copy.deepcopy(op).double() if isinstance(op, torch.nn.Module) else op)(x64)
            got = op(domain.shard(x, sizes=sizes, **where))
            got = got.full_tensor().to_local()
            out[(str(dtype), name, kind)] = (float((got.double() - low.double()).abs().max()),
                                             float((got.double() - low.double()).norm()),
                                             float((low.double() - exact).norm()), float((got.double() - exact).norm()))
    return out


def _ring_body(sizes):
    """Attention on a sharded sequence in bf16 and fp16, in the ring (blocks merged) and gathered, against one process in
    the same dtype and in fp64: |parallel - fp64| and |low - fp64| as 2-norms."""
    from mesh3d import DistributedManager, domain

    DistributedManager.initialize(batch=1, domain=len(sizes))
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 4, sum(sizes), 8, dtype=torch.float64, generator=g) for _ in range(3))
    out = {}
    for dtype in (torch.bfloat16, torch.float16):
        for causal in (False, True):
            exact = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
            low = F.scaled_dot_product_attention(q.to(dtype), k.to(dtype), v.to(dtype), is_causal=causal)
            for mode in ("ring", "gather"):
                shard = lambda t: domain.shard(t.to(dtype), dim=2, sizes=sizes)  # noqa: E731
                with domain.attention_mode(mode):
                    got = F.scaled_dot_product_attention(shard(q), shard(k), shard(v), is_causal=causal)
                got = got.full_tensor().to_local().double()
                out[(str(dtype), causal, mode)] = (float((got - exact).norm()), float((low.double() - exact).norm()))
    return out


def test_halo_exchange_statistics_and_reductions_in_half_precision_equal_one_process(ranks):
    for layout, sizes, world in (("slabs", (7, 0, 5), 3), ("blocks", ((8, 4), (2, 4)), 4)):
        for results in ranks.run(world, _units_body, layout, sizes, timeout=120):
            for (dtype, name, kind), (worst, parallel, low, parallel_fp64) in results.items():
                assert low > 0, (layout, dtype, name)
                if kind == "exact":
                    assert worst == 0, (layout, dtype, name, worst)
                elif kind == "stats":
                    assert parallel <= 0.1 * low, (layout, dtype, name, parallel, low)
                else:
                    assert parallel_fp64 <= 1.1 * low, (layout, dtype, name, parallel_fp64, low)


def test_ring_merge_in_half_precision_is_as_accurate_as_one_process(ranks):
    for results in ranks.run(3, _ring_body, (9, 4, 7), timeout=120):
        for case, (parallel, low) in results.items():
            assert low > 0 and parallel <= 1.25 * low, (case, parallel, low)


def _reduce_dtype_body(reduce_dtype):
    """bf16 parameters; batch rank 0's gradient is 1, rank 1's 2**-10 (both exact in bf16): their sum 1 + 2**-10 is
    exact in fp32 and rounds to 1 in bf16 (8 bits of mantissa)."""
    from mesh3d import DistributedManager, Plan, parallelize

    dm = DistributedManager.initialize(batch=2, domain=1, model=1)
    model = torch.nn.Linear(4, 2, bias=False)
    torch.nn.init.ones_(model.weight)
    model = parallelize(model, Plan(batch="fsdp", param_dtype=torch.bfloat16, reduce_dtype=reduce_dtype))
    x = torch.full((1, 4), 1.0 if dm.axis_rank("batch") == 0 else 2.0 ** -10)
    model(x).sum().backward()
    return model.weight.grad.full_tensor().tolist()


def test_fsdp_reduces_gradients_in_the_reduce_dtype(ranks):
    """Plan(reduce_dtype=float32) with bf16 parameters: the gradient reduction runs in fp32, so a small rank's share
    is kept (a bf16 reduction would drop it: the tolerances of the model tests above are larger than that loss)."""
    exact = (1.0 + 2.0 ** -10) / 2                                  # the mean over the 2 batch ranks, in fp32
    for grad in ranks.run(2, _reduce_dtype_body, torch.float32, timeout=60):
        assert grad == [[exact] * 4] * 2, grad
    for grad in ranks.run(2, _reduce_dtype_body, torch.bfloat16, timeout=60):
        assert grad == [[0.5] * 4] * 2, grad                          # what bf16 does: the share is lost
