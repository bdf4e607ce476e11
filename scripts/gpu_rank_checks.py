"""The checks ``scripts/gpu_ranks.py`` runs on every rank of a multi-rank job that shares one GPU over staged gloo.

Each check builds what it needs on the current ``DistributedManager``, compares it with the same work done in one
process on this rank (fp64), raises on any difference and returns its figure. ``rank_checks`` runs a list of them and
returns ``{name: "PASS (figure)" | "FAIL error"}``; the CPU suite runs it on its gloo rank pool
(tests/test_staged_gloo.py), a GPU machine through ``gpu_check.py --ranks N``.

Usage (on every rank, after ``DistributedManager.initialize(1, N, 1, backend="gloo", device="cuda")``)::

    results = rank_checks(["domain", "unet", "ring"], Context(device=torch.device("cuda", 0), folder="/tmp/x"))
"""

from __future__ import annotations

import copy
import os
import signal
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch._dynamo.utils import counters

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from bench_common import UNet  # noqa: E402
from demo_3d import FieldNet  # noqa: E402

from mesh3d import DistributedManager, Plan, PeerLostError, checkpoint, domain, parallelize  # noqa: E402
from mesh3d._torch_private import run_compiled_graphs_without_subclass_dispatch  # noqa: E402
from mesh3d.staged_gloo import STAGED  # noqa: E402

__all__ = ["CHECKS", "Context", "layouts", "rank_checks"]

#: Tensor parallel styles of FieldNet's channel MLP on a model axis of more than one rank.
TP_STYLES = {"blocks.*.up": "colwise", "blocks.*.down": "rowwise"}


@dataclass
class Context:
    """What every check gets: the device type ranks compute on (``cuda``: the current one), a folder all ranks share,
    Dynamo's backend."""

    device: torch.device
    folder: str
    compile_backend: str = "inductor"


def layouts(parts: int, length: int) -> list[tuple[int, ...]]:
    """Two layouts of ``length`` rows on ``parts`` ranks: uneven, and uneven with an empty shard."""
    if parts == 1:
        return [(length,)]
    uneven = (length - (parts - 1) * 2, *[2] * (parts - 1))
    empty = (0, length) if parts == 2 else (length // 2, 0, *[1] * (parts - 3), length - length // 2 - (parts - 3))
    return [uneven, empty]


def _close(got: torch.Tensor, want: torch.Tensor, what: str, tol: float = 1e-9) -> float:
    if got.shape != want.shape:
        raise AssertionError(f"{what}: shape {tuple(got.shape)}, one process {tuple(want.shape)}")
    err = float((got.detach() - want.detach()).abs().max()) if want.numel() else 0.0
    scale = float(want.detach().abs().max()) if want.numel() else 1.0
    if not err <= tol * max(scale, 1.0):  # NOTE: a NaN fails too
        raise AssertionError(f"{what}: max abs difference {err:.3e} from one process (scale {scale:.3e})")
    return err


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _sum_grads(model: nn.Module, dm: DistributedManager) -> None:
    """Each domain rank's parameter gradients hold its rows' share: add them up (``parallelize`` does this itself)."""
    for p in model.parameters():
        dist.all_reduce(p.grad, group=dm.group("domain"))


def _scalar(t: torch.Tensor) -> torch.Tensor:
    """A loss (a domain tensor or DTensor answers as the whole) as a plain one-element tensor."""
    return torch.tensor(float(t.detach()), dtype=torch.float64)


def check_manager(dm: DistributedManager, ctx: Context) -> str:
    """The manager put this rank on the asked device (``cuda:LOCAL_RANK % device_count``) and made every mesh group a
    staged gloo group."""
    assert dm.backend == "gloo_staged", dm.backend
    cuda = ctx.device.type == "cuda"
    want = torch.device("cuda", dm.local_rank % torch.cuda.device_count()) if cuda else torch.device("cpu")
    assert dm.device == want and (not cuda or torch.cuda.current_device() == want.index), (dm.device, want)
    kinds = {axis: type(dm.group(axis)).__name__ for axis in ("batch", "domain", "model", "batch_domain", "world")}
    assert set(kinds.values()) == {"StagedGlooGroup"}, kinds
    t = torch.full((3,), float(dm.rank + 1), device=dm.device)
    dist.all_reduce(t, group=dm.group("world"))
    assert t.device == dm.device and t.tolist() == [dm.world_size * (dm.world_size + 1) / 2] * 3, t
    return f"({dm.backend} on {dm.device}, {dm.world_size} ranks, every mesh group staged)"


def check_domain(dm: DistributedManager, ctx: Context) -> str:
    """A conv / GroupNorm / strided conv stack on domain slabs: output and every gradient equal one process."""
    worst = 0.0
    d = dm.axis_size("domain")
    for sizes in layouts(d, 13):
        torch.manual_seed(2)
        net = nn.Sequential(nn.Conv2d(3, 8, 5, padding=2, padding_mode="circular"), nn.GroupNorm(2, 8), nn.SiLU(),
                            nn.Conv2d(8, 3, 3, stride=2, padding=1)).to(ctx.device, torch.float64)
        ref = copy.deepcopy(net)
        x = torch.randn(2, 3, 13, 10, device=ctx.device, dtype=torch.float64)
        want = ref(x)
        want.square().mean().backward()
        got = net(domain.shard(x, dim=2, sizes=sizes))
        got.square().mean().backward()
        _sum_grads(net, dm)
        worst = max(worst, _close(got.full_tensor().to_local(), want, f"output, sizes {sizes}"))
        for (name, p), q in zip(ref.named_parameters(), net.parameters()):
            worst = max(worst, _close(q.grad, p.grad, f"{name}.grad, sizes {sizes}"))
    return f"(D={d}, sizes {layouts(d, 13)}, fp64 output and gradients; max abs diff {worst:.1e})"


def check_unet(dm: DistributedManager, ctx: Context) -> str:
    """A two-level U-Net trained 3 SGD steps on domain slabs (uneven, one layout with an empty shard)."""
    d, worst = dm.axis_size("domain"), 0.0
    for sizes in layouts(d, 16):
        torch.manual_seed(0)
        ref = UNet(4).to(ctx.device, torch.float64)
        net = copy.deepcopy(ref)
        opts = [torch.optim.SGD(m.parameters(), lr=0.05) for m in (ref, net)]
        for step in range(3):
            x = torch.randn(2, 3, 16, 12, device=ctx.device, dtype=torch.float64)
            want, got = ref(x).square().mean(), net(domain.shard(x, dim=2, sizes=sizes)).square().mean()
            want.backward()
            got.backward()
            _sum_grads(net, dm)
            worst = max(worst, _close(_scalar(got), _scalar(want), f"loss, step {step}, sizes {sizes}"))
            for opt in opts:
                opt.step()
                opt.zero_grad()
        for (name, p), q in zip(ref.named_parameters(), net.parameters()):
            worst = max(worst, _close(q, p, f"{name} after 3 steps, sizes {sizes}"))
    return f"(D={d}, sizes {layouts(d, 16)}, 3 SGD steps fp64; max abs diff {worst:.1e})"


def check_ring(dm: DistributedManager, ctx: Context) -> str:
    """Ring attention over a sharded sequence against SDPA on the whole sequence: output and q/k/v gradients."""
    d, worst = dm.axis_size("domain"), 0.0
    sizes = layouts(d, 21)[0]
    for causal in (False, True):
        g = torch.Generator(device=ctx.device).manual_seed(3)
        q, k, v = (torch.randn(2, 2, 21, 8, device=ctx.device, dtype=torch.float64, generator=g).requires_grad_()
                   for _ in range(3))
        want = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        want.square().sum().backward()
        qs, ks, vs = (domain.shard(t.detach(), dim=2, sizes=sizes).requires_grad_() for t in (q, k, v))
        with domain.attention_mode("ring"):
            got = F.scaled_dot_product_attention(qs, ks, vs, is_causal=causal)
        got.square().sum().backward()
        worst = max(worst, _close(got.full_tensor().to_local(), want, f"output, causal={causal}"))
        for name, mine, ref in (("q", qs, q), ("k", ks, k), ("v", vs, v)):  # a domain leaf's grad answers as the whole
            worst = max(worst, _close(mine.grad.full_tensor().to_local(), ref.grad, f"d{name}, causal={causal}"))
    return f"(D={d}, sizes {sizes}, causal and not, fp64 output and dq/dk/dv; max abs diff {worst:.1e})"


def _strided_stack() -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, 8, 5, padding=2, padding_mode="circular"), nn.GroupNorm(2, 8), nn.SiLU(),
                         nn.Conv2d(8, 8, 3, stride=2, padding=1), nn.GELU(),
                         nn.ConvTranspose2d(8, 4, 2, stride=2), nn.Conv2d(4, 1, 3, padding=1))


def check_compile(dm: DistributedManager, ctx: Context) -> str:
    """``torch.compile`` of a strided stack's step on domain slabs (the halo exchanges in the graph) equals eager
    plain torch over 3 SGD steps, with no graph break."""
    run_compiled_graphs_without_subclass_dispatch()  # NOTE: a no-op on torch >= 2.13; GPU images may ship 2.11
    d, worst = dm.axis_size("domain"), 0.0
    sizes = layouts(d, 34)[0]
    torch.manual_seed(0)
    plain = _strided_stack().to(ctx.device, torch.float64)
    sharded = copy.deepcopy(plain)
    opts = [torch.optim.SGD(m.parameters(), lr=0.05) for m in (plain, sharded)]
    step = torch.compile(lambda t: (sharded(t) ** 2).mean(), backend=ctx.compile_backend, dynamic=False,
                         options={"guard_filter_fn": domain.guard_filter})
    counters.clear()
    for i in range(3):
        x = torch.randn(2, 3, 34, 20, device=ctx.device, dtype=torch.float64)
        want, got = (plain(x) ** 2).mean(), step(domain.shard(x, dim=2, sizes=sizes))
        want.backward()
        got.backward()
        _sum_grads(sharded, dm)
        worst = max(worst, _close(_scalar(got), _scalar(want), f"loss, step {i}"))
        for (name, p), q in zip(plain.named_parameters(), sharded.parameters()):
            worst = max(worst, _close(q.grad, p.grad, f"{name}.grad, step {i}"))
        for opt in opts:
            opt.step()
            opt.zero_grad()
    breaks, graphs = sum(counters["graph_break"].values()), counters["stats"]["unique_graphs"]
    assert breaks == 0, f"{breaks} graph breaks: {dict(counters['graph_break'])}"
    return f"(D={d}, {ctx.compile_backend}, sizes {sizes}, 3 SGD steps fp64, {graphs} graph(s), 0 graph breaks; " \
           f"max abs diff {worst:.1e})"


def check_compose(dm: DistributedManager, ctx: Context) -> str:
    """FieldNet (demo_3d) with FSDP over batch x domain, TP over model (colwise/rowwise channel MLP) and its field
    split over domain: 3 AdamW steps equal one process (losses, gradients, parameters)."""
    shape = tuple(dm.mesh.shape)
    torch.manual_seed(0)
    ref = FieldNet(width=12, hidden=48).to(ctx.device, torch.float64)
    model = parallelize(copy.deepcopy(ref), Plan(batch="fsdp", model=TP_STYLES if shape[2] > 1 else None))
    opt_ref, opt = (torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (ref, model))
    nb, b, d = dm.axis_size("batch"), dm.axis_rank("batch"), dm.axis_size("domain")
    sizes, worst = layouts(d, 14)[-1], 0.0
    for step in range(3):
        g = torch.Generator(device=ctx.device).manual_seed(10 + step)
        x, y = (torch.randn(2 * nb, 2, 14, 6, device=ctx.device, dtype=torch.float64, generator=g) for _ in range(2))
        loss_ref = F.mse_loss(ref(x), y)
        loss_ref.backward()
        mine = slice(2 * b, 2 * b + 2)
        xs, ys = (domain.shard(t[mine], dim=2, sizes=sizes) if d > 1 else t[mine] for t in (x, y))
        loss = F.mse_loss(model(xs), ys)
        loss.backward()
        local = loss.detach().to_local().clone() if isinstance(loss, domain.DomainTensor) else loss.detach().clone()
        dist.all_reduce(local, group=dm.group("batch"))
        worst = max(worst, _close(local / nb, loss_ref, f"loss, step {step}"))
        for (name, p), q in zip(ref.named_parameters(), model.parameters()):
            worst = max(worst, _close(_full(q.grad), p.grad, f"{name}.grad, step {step}"))
        for o in (opt_ref, opt):
            o.step()
            o.zero_grad()
    for (name, p), q in zip(ref.named_parameters(), model.parameters()):
        worst = max(worst, _close(_full(q), p, f"{name} after 3 steps"))
    return f"(mesh {shape}, domain sizes {sizes if d > 1 else '-'}, 3 AdamW steps fp64; max abs diff {worst:.1e})"


def check_async_save(dm: DistributedManager, ctx: Context) -> str:
    """``async_save`` of FSDP state on the device: an update still queued when the call starts is in the checkpoint,
    one queued right after it returns is not; a fresh model loads it back exactly."""
    model = parallelize(FieldNet(width=64, hidden=256).to(ctx.device), Plan(batch="fsdp"))
    with torch.no_grad():
        want = {k: 2 * _full(v) for k, v in model.state_dict().items()}
        if ctx.device.type == "cuda":
            torch.cuda._sleep(100_000_000)  # GPU time: the doubling below is still queued when the save starts
        for p in model.parameters():
            p.mul_(2)
        handle = checkpoint.async_save(os.path.join(ctx.folder, "async"), model, step=2)
        for p in model.parameters():  # after the call returns: must not reach the checkpoint
            p.add_(1)
    path = handle.wait()
    fresh = parallelize(FieldNet(width=64, hidden=256).to(ctx.device), Plan(batch="fsdp"), seed=9)
    info = checkpoint.load(path, fresh)
    for name, value in fresh.state_dict().items():
        if not torch.equal(_full(value), want[name]):
            raise AssertionError(f"{name}: the checkpoint does not hold the state at the call")
    return f"(step {info.step}, {len(want)} tensors on {dm.world_size} ranks hold the state queued before the call)"


def check_kill(dm: DistributedManager, ctx: Context) -> str:
    """The last rank SIGKILLs itself in the middle of training steps; every other rank must raise a ``PeerLostError``
    naming it. Run it last: the job has lost a rank afterwards."""
    victim = dm.world_size - 1
    torch.manual_seed(0)
    net = parallelize(nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.Conv2d(4, 1, 3, padding=1)).to(ctx.device),
                      Plan(batch="fsdp"))
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    x = torch.randn(1, 1, 4 * dm.axis_size("domain"), 6, device=ctx.device)
    xs = domain.shard(x, dim=2) if dm.axis_size("domain") > 1 else x
    started = killed = time.time()
    try:
        with dm.guard("the kill check"):
            for step in range(200):
                if dm.rank == victim and step == 3:
                    os.kill(os.getpid(), signal.SIGKILL)
                if step == 3:
                    killed = time.time()
                net(xs).square().sum().backward()
                opt.step()
                opt.zero_grad()
    except PeerLostError as err:
        named = f"rank {victim}"
        if named not in str(err):
            raise AssertionError(f"{type(err).__name__} does not name {named}: {err}") from err
        return f"({type(err).__name__} named {dm.describe_rank(victim)} {time.time() - killed:.1f} s after step 3)"
    raise AssertionError(f"no error in {time.time() - started:.0f} s of steps after rank {victim} was killed")


CHECKS: dict[str, Callable[[DistributedManager, Context], str]] = {
    "manager": check_manager, "domain": check_domain, "unet": check_unet, "ring": check_ring,
    "compile": check_compile, "compose": check_compose, "async_save": check_async_save, "kill": check_kill,
}


def rank_checks(names: list[str], ctx: Context, report: Callable[[dict[str, str]], None] | None = None) -> dict[str, str]:
    """Run the checks ``names`` (in order) on the current manager; ``{name: "PASS (...)" or "FAIL ..."}``, plus the
    transport's figures under ``"staging"``. A failing check is reported and the next one runs. ``report`` gets the
    results so far after each check (a rank that dies in a later one has told its earlier results)."""
    dm = DistributedManager()
    out: dict[str, str] = {}
    for name in names:
        try:
            out[name] = f"PASS {CHECKS[name](dm, ctx)}"
        except Exception:  # noqa: BLE001 - every failure is reported, the next check still runs
            traceback.print_exc()
            out[name] = "FAIL " + traceback.format_exc().strip().splitlines()[-1][:400]
        stats = STAGED.stats
        out["staging"] = (f"{stats.staged_ops} ops staged ({stats.bytes_to_host} B to host, {stats.bytes_to_device} B "
                          f"to device), {stats.plain_ops} plain; host buffers {stats.allocated} made, {stats.reused} reused")
        if report is not None:
            report(dict(out))
    return out
