"""The multi-process parts of ``scripts/bench_domain.py``: strong scaling of a conv stack over D ranks, and halo
exchanges overlapped with compute (D=2).

Usage (bench_domain.py calls these; ``bench_blocks.py`` reuses ``SavedBytes``)::

    runs = part_scaling(args)      # one dict per D in args.domains, plain torch in one process as the reference
    overlap = part_overlap(args)   # halo messages in flight while the interior rows are computed
"""

from __future__ import annotations

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
from mesh3d.domain.comm.exchange import gather_rows  # noqa: E402
from mesh3d.domain.halo.windows import plan_window, window_exchange  # noqa: E402
from mesh3d.domain.comm.rows import Span, plan_exchange  # noqa: E402
from bench_common import conv_stack, conv_stack_rank, median_step_time, peak_rss_kb, reset_peak_rss, rss_kb, spawn_ranks  # noqa: E402

__all__ = ["SavedBytes", "min_halo_bytes", "part_overlap", "part_scaling"]


# ----------------------------------------------------------------------------- part 3: strong scaling
class SavedBytes:
    """Counts the bytes autograd saves for backward (activation memory) during a forward."""

    def __init__(self) -> None:
        self.total = 0

    def __enter__(self):
        def pack(t):
            # NOTE: a domain tensor saved whole (a wrapper's element-wise op runs below autograd, which saves the
            # wrapper) holds this rank's shard: its numel() is the whole tensor's
            local = t.to_local() if isinstance(t, domain.DomainTensor) else t
            self.total += local.numel() * local.element_size()
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
