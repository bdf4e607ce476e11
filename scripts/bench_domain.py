"""Benchmark the domain axis: its cost at one rank, its Python dispatch cost, and strong scaling.

Usage::

    python scripts/bench_domain.py                        # all parts, CPU, ~3 minutes on 2 cores
    python scripts/bench_domain.py --quick                # smaller sizes (a smoke run; do not publish)
    python scripts/bench_domain.py --device cuda --parts ops dispatch   # the one-rank parts on a GPU

Parts (each against plain torch on the same inputs, in the same run):
1. ``ops``: forward+backward of single ops (conv 2-D/3-D, transposed conv, GroupNorm, BatchNorm,
   pooling, interpolate, pointwise, SDPA) and of a whole U-Net step on a domain tensor at domain=1,
   over the plain module: the "tax" of the wrapper when nothing moves (goal: U-Net step <= 1.05).
2. ``dispatch``: the Python cost per op on tiny tensors, in microseconds (goal <= 30 us), and the
   Python time of ``full_tensor`` on 10^6 rows (goal < 5 ms).
3. ``scaling``: a conv stack on one large field over D = 1, 2, 4 processes, one thread each: step
   time (goal: D=2 at least 1.8x faster than D=1), bytes sent vs the minimum halo bytes, time spent
   inside exchanges (the most that overlapping them with compute could hide), activation bytes and
   peak RSS per rank vs plain torch in one process.
4. ``compile``: ``torch.compile`` (scripts/bench_compile.py): compiled domain vs compiled plain at D=1, compiled vs
   eager at D=2 and 4, compile time, graph breaks, recompiles, peak memory.
Writes docs/benchmarks/domain.json and domain.png (the compile part: domain_compile.json and .png);
scripts/bench_report.py puts them in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from mesh3d import DistributedManager, domain  # noqa: E402
from bench_common import (UNet, conv_stack, conv_stack_rank, cpu_model, median_step_time, paired_times, peak_rss_kb,  # noqa: E402
                          reset_peak_rss, rss_kb, spawn_ranks)
from bench_compile import add_arguments as add_compile_arguments, part_compile, plot_compile  # noqa: E402

OUT = Path(__file__).resolve().parents[1] / "docs" / "benchmarks"


# ----------------------------------------------------------------------------- part 1: ops at domain=1
def _median_time(fn, repeats: int, sync) -> float:
    fn()
    sync()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _op_cases(size: int, dtype, device):
    s, s3 = size, max(size // 8, 8)
    x2 = lambda c=16: torch.randn(2, c, s, s, dtype=dtype, device=device, requires_grad=True)  # noqa: E731
    conv = nn.Conv2d(16, 16, 3, padding=1).to(device, dtype)
    conv3 = nn.Conv3d(8, 8, 3, padding=1).to(device, dtype)
    tconv = nn.ConvTranspose2d(16, 8, 2, stride=2).to(device, dtype)
    gn, bn = nn.GroupNorm(4, 16).to(device, dtype), nn.BatchNorm2d(16).to(device, dtype)
    seq = torch.randn(2, 4, 4 * s, 32, dtype=dtype, device=device, requires_grad=True)
    return {
        "conv2d 3x3": (conv, x2(), 2),
        "conv3d 3x3x3": (conv3, torch.randn(2, 8, s3, s3, s3, dtype=dtype, device=device, requires_grad=True), 2),
        "conv_transpose2d": (tconv, x2(), 2),
        "group_norm": (gn, x2(), 2),
        "batch_norm (train)": (bn, x2(), 2),
        "max_pool2d": (lambda t: F.max_pool2d(t, 2), x2(), 2),
        "avg_pool2d": (lambda t: F.avg_pool2d(t, 3, 1, 1), x2(), 2),
        "interpolate bilinear": (lambda t: F.interpolate(t, scale_factor=2, mode="bilinear"), x2(), 2),
        "pointwise (gelu, add)": (lambda t: F.gelu(t) + t, x2(), 2),
        "sdpa": (lambda t: F.scaled_dot_product_attention(t, t, t), seq, 2),
    }


def part_ops(args, device) -> dict:
    from mesh3d import domain

    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    dtype = torch.float32
    results = {}
    for name, (fn, x, dim) in _op_cases(args.op_size, dtype, device).items():
        def plain(fn=fn, x=x):
            fn(x).sum().backward()

        def sharded(fn=fn, x=x, dim=dim):
            fn(domain.shard(x, dim=dim)).sum().backward()

        a, b = paired_times(plain, sharded, args.repeats * args.rounds, sync)
        a, b = [a], [b]
        results[name] = {"plain_s": min(a), "domain_s": min(b), "slowdown": min(b) / min(a)}
        print(f"  {name:24s} {min(a) * 1e3:8.2f} ms  x{min(b) / min(a):.3f}", flush=True)
    torch.manual_seed(0)
    unet = UNet().to(device, dtype)
    x = torch.randn(2, 3, args.unet_size, args.unet_size, dtype=dtype, device=device)
    target = torch.randn(2, 1, args.unet_size, args.unet_size, dtype=dtype, device=device)

    def unet_plain():
        F.mse_loss(unet(x), target).backward()

    def unet_domain():
        F.mse_loss(unet(domain.shard(x, dim=2)), domain.shard(target, dim=2)).backward()

    a, b = paired_times(unet_plain, unet_domain, args.repeats * args.rounds, sync)
    a, b = [a], [b]
    results["U-Net step"] = {"plain_s": min(a), "domain_s": min(b), "slowdown": min(b) / min(a)}
    print(f"  {'U-Net step':24s} {min(a) * 1e3:8.2f} ms  x{min(b) / min(a):.3f}", flush=True)
    return results


# ----------------------------------------------------------------------------- part 2: dispatch cost
def part_dispatch(args, device) -> dict:
    from mesh3d import domain
    from mesh3d.domain.rows import plan_exchange

    x = torch.randn(1, 2, 4, 4, device=device)
    w = torch.randn(2, 2, 3, 3, device=device)
    xs = domain.shard(x, dim=2)
    gn = nn.GroupNorm(1, 2).to(device)
    ops = {
        "add": lambda t: t + 1.0,
        "relu": torch.relu,
        "mul (two tensors)": lambda t: t * t,
        "conv2d": lambda t: F.conv2d(t, w, padding=1),
        "group_norm": gn,
        "max_pool2d": lambda t: F.max_pool2d(t, 2),
        "sum": lambda t: t.sum(),
        "reshape": lambda t: t.reshape(1, 2, -1),
    }
    n = args.dispatch_calls
    out = {}
    for name, fn in ops.items():
        def loop(fn=fn, t=x):
            for _ in range(n):
                fn(t)

        def loop_domain(fn=fn, t=xs):
            for _ in range(n):
                fn(t)

        plain = min(_median_time(loop, 3, lambda: None) for _ in range(3)) / n
        dom = min(_median_time(loop_domain, 3, lambda: None) for _ in range(3)) / n
        out[name] = {"plain_us": plain * 1e6, "domain_us": dom * 1e6, "overhead_us": (dom - plain) * 1e6}
        print(f"  {name:20s} +{(dom - plain) * 1e6:6.1f} us", flush=True)
    # On a multi-rank domain each layout-changing op is also journaled (for divergence detection):
    # its cost per op, measured on the journal itself (a one-rank domain does not journal).
    from mesh3d.domain.divergence import OpJournal

    journal = OpJournal()
    record = lambda: journal.record("torch.nn.functional.conv2d", (2, 512))  # noqa: E731
    per = min(_median_time(lambda: [record() for _ in range(n)], 3, lambda: None) for _ in range(3)) / n
    out["journal record (multi-rank only)"] = {"us": per * 1e6}
    print(f"  journal record (multi-rank domains): +{per * 1e6:.1f} us per layout-changing op", flush=True)
    big = domain.shard(torch.zeros(10**6, 1), dim=0)
    plan_exchange.cache_clear()
    whole = _median_time(lambda: big.full_tensor(), 5, lambda: None)
    copy = _median_time(lambda: big.to_local().clone(), 5, lambda: None)
    out["full_tensor 1e6 rows"] = {"total_ms": whole * 1e3, "copy_ms": copy * 1e3,
                                   "python_ms": max(whole - copy, 0.0) * 1e3}
    print(f"  full_tensor 1e6 rows: {whole * 1e3:.3f} ms (a plain copy of the shard: {copy * 1e3:.3f} ms)", flush=True)
    return out


# ----------------------------------------------------------------------------- part 3: strong scaling
class SavedBytes:
    """Counts the bytes autograd saves for backward (activation memory) during a forward."""

    def __init__(self) -> None:
        self.total = 0

    def __enter__(self):
        def pack(t):
            self.total += t.numel() * t.element_size()
            return t

        self._ctx = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
        self._ctx.__enter__()
        return self

    def __exit__(self, *exc):
        self._ctx.__exit__(*exc)


def _scaling_rank(rank: int, world: int, port: int, args, queue) -> None:
    model, x, sizes = conv_stack_rank(rank, world, port, args)
    result = {}
    if world == 1:  # plain torch in one process: the reference for time and memory
        def plain_step():
            (model(x) ** 2).mean().backward()

        plain_step()
        base = rss_kb()
        reset_peak_rss()
        with SavedBytes() as saved:
            start = time.perf_counter()
            for _ in range(args.steps):
                plain_step()
            elapsed = (time.perf_counter() - start) / args.steps
        result["plain"] = {"time_s": elapsed, "saved_bytes": saved.total / args.steps,
                           "peak_rss_kb": peak_rss_kb() - base}
        model.zero_grad(set_to_none=True)
        del saved

    def step():
        y = model(domain.shard(x, dim=2, sizes=sizes))
        (y * y).mean().backward()

    step()  # warm-up: plans are cached
    dist.barrier()
    base = rss_kb()
    reset_peak_rss()
    with domain.count_traffic() as traffic, SavedBytes() as saved:
        step_time = median_step_time(step, args.steps)
    result["domain"] = {"time_s": step_time, "bytes_sent": traffic.bytes_sent / args.steps,
                        "exchange_s": traffic.exchange_seconds / args.steps, "saved_bytes": saved.total / args.steps,
                        "peak_rss_kb": peak_rss_kb() - base, "rounds": traffic.rounds / args.steps,
                        "round_alone_s": _halo_round_alone(args, sizes) if world > 1 else 0.0,
                        **_full_tensor_million_rows(world)}
    queue.put((rank, result))
    DistributedManager.shutdown()


def _full_tensor_million_rows(world: int) -> dict:
    """``full_tensor`` of a 10^6-row tensor over this domain: all of it, and its Python part (planning, cold cache)."""
    from mesh3d import domain
    from mesh3d.domain.rows import Span, plan_exchange

    xs = domain.shard(torch.zeros(10**6, 1), dim=0)
    times, plans = [], []
    for _ in range(5):
        plan_exchange.cache_clear()
        dist.barrier()
        start = time.perf_counter()
        plan_exchange(xs.spec.sizes, ((Span.rows(0, 10**6),),) * world, xs.spec.comm.index)
        plans.append(time.perf_counter() - start)
        dist.barrier()
        start = time.perf_counter()
        xs.full_tensor()
        times.append(time.perf_counter() - start)
    return {"full_tensor_1e6_s": statistics.median(times), "plan_1e6_s": statistics.median(plans)}


def _halo_round_alone(args, sizes) -> float:
    """One halo exchange of the stack's widest activation, ranks started together: the transfer itself,
    without the waiting for a slower rank that an exchange inside a step also contains."""
    from mesh3d import domain
    from mesh3d.domain.halo import window_exchange
    from mesh3d.domain.exchange import gather_rows
    from mesh3d.domain.halo import plan_window

    xs = domain.shard(torch.randn(args.batch, args.channels, args.size, args.size), dim=2, sizes=sizes)
    comm = xs.spec.comm
    xplan, _ = window_exchange(xs.spec.sizes, plan_window(xs.spec.sizes, 3, 1, 1, 1, 1), comm.index, True)
    times = []
    for _ in range(20):
        dist.barrier()
        start = time.perf_counter()
        gather_rows(xs.to_local(), 2, xplan, comm)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _timed_alternately(contenders: dict, repeats: int, group) -> dict[str, float]:
    """Median time of each contender, run in turn call by call (rotating the order) with the ranks in step."""
    for fn in contenders.values():
        fn()
    samples: dict[str, list[float]] = {name: [] for name in contenders}
    names = list(contenders)
    for i in range(repeats):
        for name in names[i % len(names):] + names[:i % len(names)]:
            dist.barrier(group)
            start = time.perf_counter()
            contenders[name]()
            samples[name].append(time.perf_counter() - start)
    return {name: statistics.median(v) for name, v in samples.items()}


def _overlap_rank(rank: int, world: int, port: int, args, queue) -> None:
    """D=2. Forward of one 3x3 conv four ways: mesh3d with overlap (post the halo messages, compute the
    interior rows, then the two strips), mesh3d without (exchange, then the kernel), the same overlap
    written by hand, and the kernel alone on the shard (no exchange: the floor). Then forward+backward
    of the conv stack with overlap on and off, and plain torch on the shard alone (the floor)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    from mesh3d import DistributedManager, domain

    dm = DistributedManager.initialize(batch=1, domain=world)
    torch.manual_seed(0)
    conv = nn.Conv2d(args.channels, args.channels, 3, padding=1)
    x = torch.randn(args.batch, args.channels, args.size, args.size)
    # NOTE: contiguous shards, as every layer after the first sees them (shard() itself returns a view)
    sizes = domain.shard(x, dim=2).spec.sizes
    local = domain.shard(x, dim=2).to_local().contiguous()
    xs = domain.from_local(local, 2, sizes)
    group, peers = dm.group("domain"), dm.axis_ranks("domain")
    up, down = (peers[rank - 1] if rank > 0 else None), (peers[rank + 1] if rank < world - 1 else None)
    w, b = conv.weight.detach(), conv.bias.detach()

    def by_hand():
        ops, top, bottom = [], None, None
        if up is not None:
            top = torch.empty_like(local[:, :, :1])
            ops += [dist.P2POp(dist.isend, local[:, :, :1].contiguous(), up, group), dist.P2POp(dist.irecv, top, up, group)]
        if down is not None:
            bottom = torch.empty_like(local[:, :, :1])
            ops += [dist.P2POp(dist.isend, local[:, :, -1:].contiguous(), down, group),
                    dist.P2POp(dist.irecv, bottom, down, group)]
        works = dist.batch_isend_irecv(ops) if ops else []
        interior = F.conv2d(local, w, b, padding=(0, 1))          # rows 1 .. L-2: own rows only
        for work in works:
            work.wait()
        first = torch.cat([top if top is not None else torch.zeros_like(local[:, :, :1]), local[:, :, :2]], 2)
        last = torch.cat([local[:, :, -2:], bottom if bottom is not None else torch.zeros_like(local[:, :, :1])], 2)
        return torch.cat([F.conv2d(first, w, b, padding=(0, 1)), interior, F.conv2d(last, w, b, padding=(0, 1))], 2)

    def without_overlap():
        with domain.window_overlap(False):
            return conv(xs)

    repeats = args.steps * 4
    with torch.no_grad():
        ref = without_overlap().to_local()
        assert torch.allclose(by_hand(), ref, atol=1e-5), "the hand-written overlap is wrong"
        assert torch.equal(conv(xs).to_local(), ref) or torch.allclose(conv(xs).to_local(), ref, atol=1e-5)
        times = _timed_alternately({"mesh3d": lambda: conv(xs), "mesh3d_no_overlap": without_overlap,
                                    "by_hand": by_hand, "kernel_only": lambda: F.conv2d(local, w, b, padding=1)},
                                   repeats, group)
    stack = conv_stack(args.channels, args.layers)
    field = torch.randn(args.batch, 1, args.size, args.size)
    shard = domain.shard(field, dim=2).to_local().contiguous()
    fs = domain.from_local(shard, 2, sizes)

    def step_with(enabled: bool):
        def step():
            with domain.window_overlap(enabled):
                stack(fs).square().mean().backward()
        return step

    def step_plain():  # the shard alone, as if it were the whole field: no exchange, no wrapper
        stack(shard).square().mean().backward()

    steps = _timed_alternately({"step": step_with(True), "step_no_overlap": step_with(False), "step_kernel_only": step_plain},
                               repeats, group)
    queue.put((rank, {**times, **steps}))
    DistributedManager.shutdown()


def part_overlap(args) -> dict:
    per_rank = spawn_ranks(_overlap_rank, 2, args)
    out = {k: max(per_rank[r][k] for r in per_rank) for k in per_rank[0]}
    out["overlap_vs_no_overlap"] = out["mesh3d"] / out["mesh3d_no_overlap"]
    out["step_overlap_vs_no_overlap"] = out["step"] / out["step_no_overlap"]
    print(f"  one conv forward at D=2: mesh3d {out['mesh3d'] * 1e3:.2f} ms (overlap), "
          f"{out['mesh3d_no_overlap'] * 1e3:.2f} ms without (x{out['overlap_vs_no_overlap']:.2f}), by hand "
          f"{out['by_hand'] * 1e3:.2f} ms, kernel alone {out['kernel_only'] * 1e3:.2f} ms", flush=True)
    print(f"  conv stack fwd+bwd at D=2: {out['step'] * 1e3:.1f} ms (overlap), {out['step_no_overlap'] * 1e3:.1f} ms "
          f"without (x{out['step_overlap_vs_no_overlap']:.2f}), the shard alone in plain torch "
          f"{out['step_kernel_only'] * 1e3:.1f} ms", flush=True)
    return out


def min_halo_bytes(size: int, world: int, batch: int, channels: int, layers: int) -> int:
    """Rows each 3x3 'same' conv must read across each internal boundary (forward) and return (backward)."""
    row = batch * size * 4  # one fp32 row of one channel
    in_channels = [1] + [channels] * (layers - 1)
    forward = sum(2 * row * c for c in in_channels)  # one row each way across the boundary
    backward = sum(2 * row * c for c in in_channels[1:])  # the input x needs no gradient
    return (forward + backward) * (world - 1)


def part_scaling(args) -> list[dict]:
    runs = []
    for world in args.domains:
        per_rank = spawn_ranks(_scaling_rank, world, args)
        dom = [per_rank[r]["domain"] for r in range(world)]
        run = {
            "domain": world,
            "step_time_s": max(r["time_s"] for r in dom),
            "bytes_sent_per_step": sum(r["bytes_sent"] for r in dom),
            "min_halo_bytes_per_step": min_halo_bytes(args.size, world, args.batch, args.channels, args.layers),
            "exchange_fraction": max(r["exchange_s"] / r["time_s"] for r in dom),
            # the transfers alone (rounds x one round with the ranks in step): what overlap could hide at most
            "transfer_fraction": max(r["rounds"] * r["round_alone_s"] / r["time_s"] for r in dom),
            "peak_rank_activation_bytes": max(r["saved_bytes"] for r in dom),
            "peak_rank_rss_kb": max(r["peak_rss_kb"] for r in dom),
            "full_tensor_1e6_ms": max(r["full_tensor_1e6_s"] for r in dom) * 1e3,
            "full_tensor_1e6_planning_ms": max(r["plan_1e6_s"] for r in dom) * 1e3,
        }
        if "plain" in per_rank[0]:
            run["plain"] = per_rank[0]["plain"]
        runs.append(run)
        print(f"  D={world}: {run['step_time_s'] * 1e3:.1f} ms/step, inside exchanges {run['exchange_fraction']:.1%} "
              f"of it, of which transfers {run['transfer_fraction']:.1%}", flush=True)
    one = next(r for r in runs if r["domain"] == 1)
    plain = one["plain"]
    for run in runs:
        halo = run["min_halo_bytes_per_step"]
        run["bytes_vs_halo"] = run["bytes_sent_per_step"] / halo if halo else 1.0
        run["speedup_vs_one_rank"] = one["step_time_s"] / run["step_time_s"]
        run["time_vs_plain_torch"] = run["step_time_s"] / plain["time_s"]
        run["activation_vs_plain_torch"] = run["peak_rank_activation_bytes"] / plain["saved_bytes"]
        run["peak_rss_vs_plain_torch"] = run["peak_rank_rss_kb"] / plain["peak_rss_kb"] if plain["peak_rss_kb"] else None
    return runs


# ----------------------------------------------------------------------------- report
def _plot(report: dict) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    panels = [k for k in ("ops", "scaling") if k in report]
    if not panels:
        return
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4), squeeze=False)
    for ax, key in zip(axes[0], panels):
        if key == "ops":
            names = list(report["ops"])
            ax.barh(names, [report["ops"][n]["slowdown"] for n in names])
            ax.axvline(1.05, color="red", linestyle="--", label="goal 1.05 (U-Net step)")
            ax.set_xlabel("domain=1 time / plain torch (fwd+bwd)")
            ax.legend(loc="lower right")
        else:
            runs = report["scaling"]
            ds = [r["domain"] for r in runs]
            ax.plot(ds, [r["speedup_vs_one_rank"] for r in runs], "o-", label="speedup vs D=1")
            ax.plot(ds, ds, "--", color="grey", label="ideal")
            ax.plot(ds, [r["activation_vs_plain_torch"] * r["domain"] for r in runs], "s-",
                    label="activation/rank x D vs plain")
            ax.set_xlabel("domain size D (processes, 1 thread each)")
            ax.legend()
    fig.tight_layout()
    fig.savefig(OUT / "domain.png", dpi=100)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parts", nargs="+", default=["ops", "dispatch", "scaling", "overlap", "compile"],
                        choices=["ops", "dispatch", "scaling", "overlap", "compile"])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--quick", action="store_true", help="small sizes: a smoke run")
    parser.add_argument("--op-size", type=int, default=128)
    parser.add_argument("--unet-size", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dispatch-calls", type=int, default=2000)
    parser.add_argument("--size", type=int, default=512)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--channels", type=int, default=16)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--domains", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--out", default=str(OUT / "domain.json"))
    add_compile_arguments(parser)
    args = parser.parse_args()
    if args.quick:
        args.op_size, args.unet_size, args.size, args.rounds, args.repeats = 32, 32, 128, 1, 2
        args.dispatch_calls, args.steps = 200, 2
        args.compile_unet, args.compile_repeats = 32, 3
    device = torch.device(args.device)
    if device.type == "cpu":
        torch.set_num_threads(1)
    report = {"config": {**vars(args), "torch": torch.__version__, "cpu_count": os.cpu_count(),
                         "device_name": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                         "cpu": cpu_model()}}
    if "ops" in args.parts:
        print("== one rank: domain wrapper vs plain torch, forward+backward", flush=True)
        report["ops"] = part_ops(args, device)
    if "dispatch" in args.parts:
        print("== Python dispatch cost per op (tiny tensors)", flush=True)
        report["dispatch"] = part_dispatch(args, device)
    if "scaling" in args.parts and device.type == "cpu":
        print(f"== strong scaling: {args.layers}-conv stack, {args.batch}x1x{args.size}x{args.size}", flush=True)
        report["scaling"] = part_scaling(args)
    if "overlap" in args.parts and device.type == "cpu":
        print("== overlap: halo messages in flight while the interior rows are computed (D=2)", flush=True)
        report["overlap"] = part_overlap(args)
    OUT.mkdir(parents=True, exist_ok=True)
    if "compile" in args.parts and device.type == "cpu":
        # NOTE: a file of its own (docs/benchmarks/domain_compile.json), so this part can be rerun alone
        print("== torch.compile: compiled domain steps vs compiled plain (D=1) and vs eager (D=2, 4)", flush=True)
        compiled = {"config": report["config"], **part_compile(args)}
        (OUT / "domain_compile.json").write_text(json.dumps(compiled, indent=2) + "\n")
        plot_compile(compiled, OUT / "domain_compile.png")
        if args.parts == ["compile"]:
            print(f"wrote {OUT / 'domain_compile.json'}")
            return
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    if Path(args.out).resolve() == (OUT / "domain.json").resolve():
        _plot(report)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
