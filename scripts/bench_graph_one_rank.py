"""A MeshGraphNet training step on graph tensors at domain=1 against the same model in plain torch, in one process.

Usage: ``python scripts/bench_graph_one_rank.py [--sides 8 40 120] [--steps 30] [--rounds 5]``
(writes docs/benchmarks/graph_one_rank.json and .png; ``--out`` for another path)

The model of ``bench_graph_memory.py`` (``MGN``: gathers ``x[src]``, a cat along the features, ``index_add_`` at the
destinations, MLPs with LayerNorm) on a triangulated channel of ``side x side`` points, one thread: forward, MSE loss,
backward. Contenders, taking turns round by round, each keeping its best round's median step:

- ``plain``: the model on plain tensors, the floor;
- ``domain``: on graph tensors of a one-rank domain, as it runs (a graph call whose signature was seen answered from
  the layout its first call's rule gave, ``dispatch.kept``, where the rule declares that layout from metadata);
- ``domain, every call its rule``: the same with kept answers off, every call through the dispatcher and its rule
  (as every graph call ran before 2026-12-07).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import BENCH, cpu_model  # noqa: E402
from bench_graph_memory import MGN  # noqa: E402

from mesh3d import DistributedManager, domain, graphs  # noqa: E402
from mesh3d.domain.dispatch.kept import KEPT  # noqa: E402

CONTENDERS = ("plain", "domain", "domain, every call its rule")


def _median_step(model, inputs, target, steps: int) -> float:
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        F.mse_loss(model(*inputs), target).backward()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure(side: int, hidden: int, steps: int, rounds: int) -> dict:
    """Each contender's best round's median step (ms) on a ``side x side`` channel."""
    mesh = graphs.channel_mesh(side, side)
    edges = torch.from_numpy(mesh.edges)
    torch.manual_seed(0)
    model = MGN(hidden, 2)
    x, e, t = torch.randn(mesh.num_nodes, 3), torch.randn(edges.shape[1], 3), torch.randn(mesh.num_nodes, 2)
    part = graphs.sfc_partition(mesh.points, 1)
    g = graphs.Graph(mesh.edges, part)
    sharded = (domain.shard_nodes(x, part), domain.shard_edges(e, g), domain.edge_index(g)), domain.shard_nodes(t, part)
    best = dict.fromkeys(CONTENDERS, float("inf"))
    for _ in range(rounds):
        for name in CONTENDERS:
            inputs, target = ((x, e, edges), t) if name == "plain" else sharded
            if name == "domain, every call its rule":
                with KEPT.off():
                    step = _median_step(model, inputs, target, steps)
            else:
                _median_step(model, inputs, target, 2)  # NOTE: warm: the first calls keep their answers
                step = _median_step(model, inputs, target, steps)
            best[name] = min(best[name], step)
            model.zero_grad()
    ms = {k: v * 1e3 for k, v in best.items()}
    row = {"side": side, "nodes": mesh.num_nodes, "edges": int(edges.shape[1]), "ms": ms,
           "ratio": {k: ms[k] / ms["plain"] for k in CONTENDERS[1:]}}
    print(f"  {mesh.num_nodes:6d} nodes: plain {ms['plain']:.2f} ms, domain {ms['domain']:.2f} ms "
          f"({row['ratio']['domain']:.2f}x), every call its rule {ms[CONTENDERS[2]]:.2f} ms "
          f"({row['ratio'][CONTENDERS[2]]:.2f}x)", flush=True)
    return row


def _plot(report: dict, path: Path) -> None:
    import matplotlib  # noqa: PLC0415 (optional: the bench extra)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415 (optional)

    rows = report["rows"]
    fig, ax = plt.subplots(figsize=(7, 3.5))
    labels = [f"{r['nodes']} nodes" for r in rows]
    for i, name in enumerate(CONTENDERS[1:]):
        ax.bar([j + (i - 0.5) * 0.35 for j in range(len(rows))], [r["ratio"][name] for r in rows], width=0.35,
               label=name)
    ax.axhline(1.0, color="black", linewidth=0.8, label="plain torch")
    ax.set_xticks(range(len(rows)), labels)
    ax.set_ylabel("step time / plain torch")
    ax.set_title("MeshGraphNet step at domain=1, one thread")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sides", type=int, nargs="+", default=[8, 40, 120])
    parser.add_argument("--hidden", type=int, default=32)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", default=str(BENCH / "graph_one_rank.json"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    DistributedManager.initialize(batch=1, domain=1)
    try:
        rows = [measure(side, args.hidden, args.steps, args.rounds) for side in args.sides]
    finally:
        DistributedManager.shutdown()
    report = {"rows": rows, "cpu": cpu_model(), "torch": torch.__version__, "steps": args.steps, "rounds": args.rounds}
    out = Path(args.out)
    out.write_text(json.dumps(report, indent=1) + "\n")
    try:
        _plot(report, out.with_suffix(".png"))
    except ImportError:
        print("matplotlib missing: no plot", flush=True)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
