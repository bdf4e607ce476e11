"""Benchmark attention over the domain axis: the ring against gathering K/V and against Ulysses, in one run.

Usage::

    python scripts/bench_attention.py                     # ~6 min on the 2-core CPU; writes docs/benchmarks/attention.json
    python scripts/bench_attention.py --seq 1024 --steps 1 --out /tmp/attention.json     # a smoke run

Measured, each configuration on D fresh processes (one thread each; D=1 is torch's SDPA in one process):

- **peak memory growth per rank** of one forward+backward (q, k, v built on each rank for its own rows, fp32,
  non-causal), for ring / gather / Ulysses at S = ``--seq`` and D = 1, 2, 4, and for the ring and gather as S
  and D double together (S = ``--seq`` * D / 4); the ring's head groups 1 vs the default;
- **K/V bytes in flight per rank** (``RING_STATS``: the block computed on plus the one arriving), in blocks of
  this rank's keys and values;
- **step time** (forward+backward, median of ``--steps``; the slowest rank) of the three modes at D = 1, 2, 4,
  and ring / gather at shorter sequences (where ``auto`` switches), with each rank's compute time (its main
  thread's CPU time: what the step would take with a core per rank, whatever else loads the machine);
- **causal balance**: (query, key) pairs computed per rank, max / mean, and the step time, with the zigzag
  layout and without it.

Each job runs once untimed first. Glibc's dynamic mmap threshold is pinned (MALLOC_MMAP_THRESHOLD_) so that freed tensors leave the process and
each phase's peak RSS (VmHWM, reset per phase) is its own. scripts/bench_report.py puts the JSON in
docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import socket
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import cpu_model, peak_rss_kb, reset_peak_rss, rss_kb  # noqa: E402

OUT = Path(__file__).resolve().parents[1] / "docs" / "benchmarks" / "attention.json"


def _step(job: dict, world: int):
    """A closure running one forward+backward of the job's attention on this rank's rows (fresh q, k, v)."""
    from mesh3d import domain
    from mesh3d.domain.core.split import balanced_sizes

    sizes = balanced_sizes(job["seq"], world)
    rows = sizes[dist.get_rank() if world > 1 else 0]
    heads, hd = job["heads"], job["head_dim"]

    def run():
        q, k, v = (domain.from_local(torch.randn(1, heads, rows, hd, requires_grad=True), dim=2, sizes=sizes)
                   for _ in range(3))
        with domain.attention_mode(job["mode"], head_groups=job.get("groups"), balance=job.get("balance", True)):
            out = domain.attention(q, k, v, is_causal=job.get("causal", False))
        out.to_local().sum().backward()
        return q
    return run


def _job(job: dict, world: int, steps: int) -> dict:
    from mesh3d.domain.attention.ring import RING_STATS

    run = _step(job, world)
    run()  # warm-up: one-time allocations (thread pools, plans, caches) are not the job's
    gc.collect()
    base = rss_kb()
    reset_peak_rss()
    RING_STATS.reset()
    run()
    out = {"peak_growth_mb": (peak_rss_kb() - base) / 1024, "in_flight_bytes": RING_STATS.max_in_flight_bytes,
           "grad_in_flight_bytes": RING_STATS.max_grad_in_flight_bytes, "work": RING_STATS.work}
    if job.get("time"):
        walls, cpus = [], []
        for _ in range(steps):
            dist.barrier()
            wall, cpu = time.perf_counter(), time.thread_time()
            run()
            walls.append(time.perf_counter() - wall)
            cpus.append(time.thread_time() - cpu)
        out["step_s"], out["cpu_s"] = statistics.median(walls), statistics.median(cpus)
    return out


def _rank(rank: int, world: int, port: int, jobs: list[dict], steps: int, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    torch.manual_seed(rank)
    from mesh3d import DistributedManager

    DistributedManager.initialize(batch=1, domain=world)
    results = [_job(job, world, steps) for job in jobs]
    queue.put((rank, results))
    DistributedManager.shutdown()


def _launch(world: int, jobs: list[dict], steps: int) -> list[list[dict]]:
    """Run ``jobs`` on ``world`` fresh processes; per job, every rank's result."""
    os.environ["MALLOC_MMAP_THRESHOLD_"] = str(1 << 20)  # NOTE: read by glibc at process start (the children)
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [ctx.Process(target=_rank, args=(r, world, port, jobs, steps, queue)) for r in range(world)]
    for p in procs:
        p.start()
    per_rank = [res for _, res in sorted(queue.get(timeout=1800) for _ in procs)]
    for p in procs:
        p.join()
    return [[per_rank[r][j] for r in range(world)] for j in range(len(jobs))]


def _summary(job: dict, ranks: list[dict], world: int) -> dict:
    from mesh3d.domain.core.settings import SETTINGS

    groups = min(job.get("groups") or SETTINGS.value.attention.head_groups, job["heads"])
    block = 2 * job["seq"] / world * job["heads"] / groups * job["head_dim"] * 4  # k + v of one head group
    work = [r["work"] for r in ranks]
    out = {**{k: v for k, v in job.items() if k != "time"}, "domain": world,
           "peak_growth_mb": max(r["peak_growth_mb"] for r in ranks),
           "in_flight_blocks": max(r["in_flight_bytes"] for r in ranks) / block if job["mode"] == "ring" else None,
           "grad_in_flight_blocks": max(r["grad_in_flight_bytes"] for r in ranks) / block
           if job["mode"] == "ring" else None,
           "work_max_over_mean": max(work) / (sum(work) / len(work)) if sum(work) else None}
    if "step_s" in ranks[0]:
        cpu = [r["cpu_s"] for r in ranks]
        out.update(step_s=max(r["step_s"] for r in ranks), cpu_s_max=max(cpu), cpu_s_max_over_mean=max(cpu) / (sum(cpu) / len(cpu)))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    shape = {"heads": args.heads, "head_dim": args.head_dim}
    rows: list[dict] = []
    for world in (1, 2, 4):
        jobs = []
        for mode in (("ring", "gather", "ulysses") if world > 1 else ("ring",)):
            jobs.append({"mode": mode, "seq": args.seq, "time": True, "phase": "modes", **shape})
        if world > 1:
            jobs.append({"mode": "ring", "seq": args.seq, "groups": 1, "phase": "head_groups", **shape})
        for mode in ("ring", "gather"):  # S and D doubling together
            jobs.append({"mode": mode, "seq": args.seq * world // 4, "phase": "weak", **shape})
        if world == 4:
            for seq in (args.seq // 8, args.seq // 4, args.seq // 2):
                for mode in ("ring", "gather"):
                    jobs.append({"mode": mode, "seq": seq, "time": True, "phase": "crossover", **shape})
            for balance in (True, False):
                jobs.append({"mode": "ring", "seq": args.seq, "causal": True, "balance": balance, "time": True,
                             "phase": "causal", **shape})
        print(f"== D={world}: {len(jobs)} jobs (S={args.seq}, {args.heads} heads of {args.head_dim}, fp32)", flush=True)
        for job, ranks in zip(jobs, _launch(world, jobs, args.steps)):
            rows.append(_summary(job, ranks, world))
            r = rows[-1]
            print(f"  {r['phase']:11s} {r['mode']:7s} S={r['seq']:5d} peak {r['peak_growth_mb']:7.1f} MB"
                  + (f", step {r['step_s']:.3f} s (cpu {r['cpu_s_max']:.3f} s)" if "step_s" in r else "")
                  + (f", K/V in flight {r['in_flight_blocks']:.2f} blocks" if r["in_flight_blocks"] else "")
                  + (f", work max/mean {r['work_max_over_mean']:.3f}" if r.get("causal") else ""), flush=True)
    report = {"config": {**shape, "seq": args.seq, "steps": args.steps, "dtype": "float32",
                         "torch": torch.__version__, "cpu_count": os.cpu_count(), "cpu": cpu_model(),
                         "load_average_1_5_15_min_at_end": list(os.getloadavg())},
              "rows": rows, "ratios": _ratios(rows, args.seq)}
    print(json.dumps(report["ratios"], indent=1))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    _plot(args.out.with_suffix(".png"), rows, args.seq)
    print(f"wrote {args.out}")


def _find(rows, **want) -> dict:
    return next(r for r in rows if all(r.get(k) == v for k, v in want.items()))


def _div(a: float, b: float) -> float | None:
    return a / b if b else None


def _ratios(rows: list[dict], seq: int) -> dict:
    one = _find(rows, phase="modes", domain=1)
    out = {f"peak_{m}_d4_over_d1": _div(_find(rows, phase="modes", mode=m, domain=4)["peak_growth_mb"],
                                        one["peak_growth_mb"]) for m in ("ring", "gather", "ulysses")}
    for key in ("step_s", "cpu_s_max"):
        out.update({f"{key}_{m}_over_gather_d{d}": _find(rows, phase="modes", mode=m, domain=d)[key] /
                    _find(rows, phase="modes", mode="gather", domain=d)[key] for m in ("ring", "ulysses") for d in (2, 4)})
    weak = [_find(rows, phase="weak", mode="ring", domain=d)["peak_growth_mb"] for d in (1, 2, 4)]
    out["ring_weak_peak_d4_over_d1"] = _div(weak[-1], weak[0])
    out["gather_weak_peak_d4_over_d1"] = _div(_find(rows, phase="weak", mode="gather", domain=4)["peak_growth_mb"],
                                              _find(rows, phase="weak", mode="gather", domain=1)["peak_growth_mb"])
    bal, unbal = (_find(rows, phase="causal", balance=b) for b in (True, False))
    out["causal_work_max_over_mean_zigzag"] = bal["work_max_over_mean"]
    out["causal_work_max_over_mean_contiguous"] = unbal["work_max_over_mean"]
    out["causal_step_zigzag_over_contiguous"] = bal["step_s"] / unbal["step_s"]
    out["causal_cpu_max_zigzag_over_contiguous"] = bal["cpu_s_max"] / unbal["cpu_s_max"]
    out["causal_cpu_max_over_mean_zigzag"] = bal["cpu_s_max_over_mean"]
    out["causal_cpu_max_over_mean_contiguous"] = unbal["cpu_s_max_over_mean"]
    out["ring_in_flight_blocks_max"] = max(r["in_flight_blocks"] for r in rows if r["in_flight_blocks"])
    out["ring_head_groups_1_peak_over_default_d4"] = _div(
        _find(rows, phase="head_groups", domain=4)["peak_growth_mb"],
        _find(rows, phase="modes", mode="ring", domain=4)["peak_growth_mb"])
    timed = [r for r in rows if r["domain"] == 4 and "cpu_s_max" in r and not r.get("causal")]
    out["crossover_d4_cpu_ring_over_gather"] = {
        s: _find(timed, mode="ring", seq=s)["cpu_s_max"] / _find(timed, mode="gather", seq=s)["cpu_s_max"]
        for s in (seq // 8, seq // 4, seq // 2, seq)}
    out["crossover_d4_step_ring_over_gather"] = {
        s: _find(timed, mode="ring", seq=s)["step_s"] / _find(timed, mode="gather", seq=s)["step_s"]
        for s in (seq // 8, seq // 4, seq // 2, seq)}
    return out


def _plot(path: Path, rows: list[dict], seq: int) -> None:
    """Peak memory per rank and compute time against D, per mode (no file without matplotlib). Compute, not wall
    time: on a shared 2-core machine the wall time mostly measures the other processes."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, (mem, time_ax, weak) = plt.subplots(1, 3, figsize=(12, 3.4))
    for mode, marker in (("ring", "o-"), ("gather", "s--"), ("ulysses", "^:")):
        pts = [r for r in rows if r["phase"] == "modes" and (r["mode"] == mode or r["domain"] == 1)]
        mem.plot([r["domain"] for r in pts], [r["peak_growth_mb"] for r in pts], marker, label=mode)
        time_ax.plot([r["domain"] for r in pts], [r["cpu_s_max"] for r in pts], marker, label=mode)
    for mode, marker in (("ring", "o-"), ("gather", "s--")):
        pts = [r for r in rows if r["phase"] == "weak" and r["mode"] == mode]
        weak.plot([r["domain"] for r in pts], [r["peak_growth_mb"] for r in pts], marker, label=mode)
    mem.set_title(f"peak growth per rank, S={seq}")
    mem.set_ylabel("MB")
    time_ax.set_title("forward+backward: compute, slowest rank")
    time_ax.set_ylabel("s")
    weak.set_title(f"peak per rank, S = {seq // 4} x D")
    weak.set_ylabel("MB")
    for ax in (mem, time_ax, weak):
        ax.set_xlabel("D (domain ranks)")
        ax.set_xticks([1, 2, 4])
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    main()
