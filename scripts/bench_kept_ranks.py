"""Host cost of one op on domain tensors of a multi-rank domain: answered from its kept step against the dispatcher's
walk (every call planned by its rule), with torch's op on the shard alone as the floor.

Usage (2 gloo ranks on this machine; the table goes to rank 0's stdout, and ``--json`` writes it)::

    python -m torch.distributed.run --standalone --nproc-per-node 2 scripts/bench_kept_ranks.py --json out.json
    python -m torch.distributed.run --standalone --nproc-per-node 4 scripts/bench_kept_ranks.py --blocks  # 2x2 blocks
    python -m torch.distributed.run --standalone --nproc-per-node 4 scripts/bench_kept_ranks.py --tokens  # a token grid
    python scripts/bench_kept_ranks.py --plot kept.png run1.json run2.json   # kept / walk per op and run, no ranks
    python scripts/bench_kept_ranks.py --plot-change change.png before1.json,before2.json after1.json,after2.json

Each op of ``OPS`` runs ``--calls`` times in a loop on a 1x4x16x16 field sharded along dim 2 (8 rows a rank), one
thread a rank, the ranks in step (a barrier before each loop); the contenders take turns, round by round, and each
keeps its best round's median (the machine may be shared). A halo exchange's own cost (messages between the ranks) is
in both; what differs is the walk and the rule's planning. ``--blocks``: the field as 2x2 blocks over dims 2 and 3 (4
ranks); an op the blocks refuse is left out. ``--tokens``: those blocks flattened into a token grid (1, 256, 4), timed
on a ViT block's ops (``token_ops``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from mesh3d import DistributedManager, domain
from mesh3d.domain.dispatch.kept import KEPT


def ops(w1: torch.Tensor, w3: torch.Tensor, gn: tuple[torch.Tensor, torch.Tensor], field: torch.Tensor) -> dict:
    """The ops timed; ``field``: a plain tensor of the global shape (a position embedding: each rank adds its rows;
    on the shard alone, the same rows sliced)."""
    return {
        "add": lambda t: t + 1.0,
        "relu": torch.relu,
        "conv2d 1x1": lambda t: F.conv2d(t, w1),
        "conv2d 3x3 (halo)": lambda t: F.conv2d(t, w3, padding=1),
        "group_norm": lambda t: F.group_norm(t, 2, *gn),
        "max_pool2d": lambda t: F.max_pool2d(t, 2),
        "interpolate": lambda t: F.interpolate(t, scale_factor=2, mode="bilinear", align_corners=False),
        "reshape": lambda t: t.reshape(1, 4, -1),
        "transpose": lambda t: t.transpose(2, 3),
        "slice": lambda t: t[:, :, 1:],
        "sum": lambda t: t.sum(),
        "mean over (2, 3)": lambda t: t.mean((2, 3)),
        "add a whole field": lambda t: t + field[:, :, :t.shape[2], :t.shape[3]],
        "softmax over dim 2": lambda t: torch.softmax(t, 2),
        "var over dims 2 and 3": lambda t: t.var((2, 3)),
    }


def token_ops(w: torch.Tensor, ln: tuple[torch.Tensor, torch.Tensor]) -> dict:
    """The ops timed on a token grid (``--tokens``): a ViT block's, between its patch embedding and its head."""
    return {
        "add": lambda t: t + 1.0,
        "gelu": F.gelu,
        "linear": lambda t: F.linear(t, w),
        "layer_norm": lambda t: F.layer_norm(t, (t.shape[-1],), *ln),
        "transpose": lambda t: t.transpose(1, 2),
        "softmax over channels": lambda t: torch.softmax(t, -1),
        "chunk": lambda t: t.chunk(2, -1),
        "sum over channels": lambda t: t.sum(-1),
        "mean over tokens": lambda t: t.mean(1),
    }


def per_call(fn, t: torch.Tensor, n: int, clock=time.perf_counter) -> float:
    for _ in range(n // 4):
        fn(t)
    times = []
    for _ in range(3):
        dist.barrier()
        start = clock()
        for _ in range(n):
            fn(t)
        times.append(clock() - start)
    return statistics.median(times) / n


def plot(png: str, json_paths: list[str]) -> None:
    """Kept over walk per op, a bar per ``--json`` file (runs of the same setting: their spread is the noise), no file
    without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    runs = []
    for path in json_paths:
        with open(path) as f:
            runs.append(json.load(f))
    run, names = runs[0], list(runs[0]["ops"])
    width = 0.8 / len(runs)
    fig, ax = plt.subplots(figsize=(8, 3.2))
    for i, r in enumerate(runs):
        ratios = [r["ops"][n]["kept"] / r["ops"][n]["walk"] for n in names]
        ax.bar([k + i * width for k in range(len(names))], ratios, width, label=r.get("label", f"run {i + 1}"))
    ax.set_xticks([k + 0.4 - width / 2 for k in range(len(names))], names)
    ax.legend(fontsize=8)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_ylabel("kept / walk (host time per call)")
    ax.set_title(f"domain={run['domain']}{' (2x2 blocks)' if run.get('blocks') else ''}, torch {run['torch']}")
    ax.tick_params(axis="x", labelrotation=45, labelsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    plt.close(fig)


def plot_change(png: str, before: list[str], after: list[str]) -> None:
    """After over before per op (kept steps; the runs of each side summed: two commits run alternately), no file
    without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    sides = []
    for paths in (before, after):
        runs = []
        for path in paths:
            with open(path) as f:
                runs.append(json.load(f))
        sides.append(runs)
    names = [n for n in sides[1][0]["ops"] if n in sides[0][0]["ops"]]
    ratios = [sum(r["ops"][n]["kept"] for r in sides[1]) / sum(r["ops"][n]["kept"] for r in sides[0]) for n in names]
    fig, ax = plt.subplots(figsize=(7, 3))
    ax.barh(names, ratios)
    ax.axvline(1.0, color="black", linewidth=0.8)
    ax.set_xlabel("after / before (host time per call, kept step)")
    ax.set_title(f"domain={sides[1][0]['domain']}, torch {sides[1][0]['torch']}")
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    plt.close(fig)


def main() -> None:
    if sys.argv[1:2] == ["--plot"]:
        plot(sys.argv[2], sys.argv[3:])
        return
    if sys.argv[1:2] == ["--plot-change"]:
        plot_change(sys.argv[2], sys.argv[3].split(","), sys.argv[4].split(","))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=500)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", default=None)
    parser.add_argument("--blocks", action="store_true", help="2x2 blocks over dims 2 and 3 (4 ranks)")
    parser.add_argument("--tokens", action="store_true", help="the 2x2 blocks flattened into a token grid (4 ranks)")
    parser.add_argument("--cpu", action="store_true", help="time this thread's CPU (more ranks than cores: the host "
                        "cost without the waits for a core; a message's wait on its peer is left out too)")
    parser.add_argument("--ops", default=None, help="comma-separated names of OPS to run (default: all)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    grid = args.blocks or args.tokens
    dm = DistributedManager.initialize(batch=1, domain=(2, 2) if grid else -1)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 4, 16, 16, generator=g)
    w1, w3 = torch.randn(4, 4, 1, 1, generator=g), torch.randn(4, 4, 3, 3, generator=g)
    gn = (torch.randn(4, generator=g), torch.randn(4, generator=g))
    xs = domain.shard(x, dims=(2, 3)) if grid else domain.shard(x, dim=2)
    timed = ops(w1, w3, gn, torch.randn(1, 4, 16, 16, generator=g))
    if args.tokens:  # NOTE: (1, 256 tokens, 4 channels), 64 tokens a rank
        xs, timed = xs.flatten(2).transpose(1, 2), token_ops(torch.randn(4, 4, generator=g), gn)
    local, clock = xs.to_local(), time.thread_time if args.cpu else time.perf_counter
    table = {}
    for name, fn in timed.items():
        if args.ops and name not in args.ops.split(","):
            continue
        try:
            fn(xs)
        except NotImplementedError:  # NOTE: refused alike on every rank (by name, before any message)
            continue
        best = {"shard": float("inf"), "kept": float("inf"), "walk": float("inf")}
        for _ in range(args.rounds):
            best["shard"] = min(best["shard"], per_call(fn, local, args.calls, clock))
            best["kept"] = min(best["kept"], per_call(fn, xs, args.calls, clock))
            with KEPT.off():
                best["walk"] = min(best["walk"], per_call(fn, xs, args.calls, clock))
        table[name] = {k: v * 1e6 for k, v in best.items()}
    if dist.get_rank() == 0:
        kind = " (a token grid of 2x2 blocks)" if args.tokens else " (2x2 blocks)" if args.blocks else ""
        print(f"domain={dm.axis_size('domain')}{kind}, torch {torch.__version__}, one thread a rank, us per call"
              f"{' (CPU time)' if args.cpu else ''}")
        print(f"{'op':20s} {'shard alone':>12s} {'kept':>8s} {'walk':>8s} {'kept/walk':>10s}")
        for name, t in table.items():
            print(f"{name:20s} {t['shard']:12.1f} {t['kept']:8.1f} {t['walk']:8.1f} {t['kept'] / t['walk']:10.2f}")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"domain": dm.axis_size("domain"), "blocks": args.blocks, "tokens": args.tokens, "cpu": args.cpu,
                       "torch": torch.__version__, "ops": table}, f, indent=1)
    DistributedManager.shutdown()


if __name__ == "__main__":
    main()
