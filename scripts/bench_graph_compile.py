"""A MeshGraphNet training step on graph tensors under ``torch.compile``: one graph against a graph break per graph op,
and against eager, on the same 2 domain ranks in one run.

Usage: ``python scripts/bench_graph_compile.py [--side 120] [--hidden 32] [--blocks 2] [--world 2] [--steps 20]``
(writes docs/benchmarks/graph_compile.json and .png)

Each contender runs on fresh spawned ranks (one thread each): the model of ``bench_graph_memory.py`` (``MGN``), a
triangulated channel partitioned along a Hilbert curve, forward, MSE loss and backward, the median of ``--steps``
steps after 3 warm-up steps (the compile included there). Contenders:

- ``eager``: wrapper domain tensors, no compile;
- ``compiled, one graph``: ``torch.compile(model, fullgraph=True)`` (Inductor) on wrapper tensors;
- ``compiled, a break per graph op``: the same on the storage subclass (``MESH3D_DOMAIN_WRAPPER=0``), whose graph
  rules run eagerly between compiled pieces, as every graph op did before;
- ``one process, compiled``: the plain model compiled on the whole mesh in one process, for scale.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
import torch.nn.functional as F

from bench_common import BENCH, cpu_model, spawn_ranks
from bench_graph_memory import mgn_step
from mesh3d import DistributedManager, graphs

CONTENDERS = ("eager", "compiled, one graph", "compiled, a break per graph op", "one process, compiled")


def _rank(rank: int, world: int, port: int, args, contender: str, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    if contender == "compiled, a break per graph op":
        os.environ["MESH3D_DOMAIN_WRAPPER"] = "0"
    model, inputs, t = mgn_step(rank, world, args, contender.startswith("one process"))
    whole = contender != "compiled, a break per graph op"
    step_model = model if contender == "eager" else torch.compile(model, backend=args.backend, fullgraph=whole)
    times = []
    for i in range(3 + args.steps):
        start = time.perf_counter()
        loss = F.mse_loss(step_model(*inputs), t)
        loss.backward()
        model.zero_grad(set_to_none=True)
        if i >= 3:
            times.append(time.perf_counter() - start)
        print(f"  {contender}, rank {rank}: step {i + 1} of {3 + args.steps}", flush=True) if rank == 0 and \
            (i + 1) % 5 == 0 else None
    queue.put((rank, {"median_s": statistics.median(times), "loss": float(loss)}))
    if not contender.startswith("one process"):
        DistributedManager.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--side", type=int, default=120)
    parser.add_argument("--hidden", type=int, default=32)
    parser.add_argument("--blocks", type=int, default=2)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--backend", default="inductor", help="torch.compile's backend (aot_eager: no code generated)")
    parser.add_argument("--only", nargs="*", choices=CONTENDERS, help="these contenders only (default: all)")
    parser.add_argument("--out", default=str(BENCH / "graph_compile.json"))
    args = parser.parse_args()
    mesh = graphs.channel_mesh(args.side, args.side)
    per = {}
    for contender in args.only or CONTENDERS:
        print(f"{contender} ...", flush=True)
        world = 1 if contender.startswith("one process") else args.world
        ranks = spawn_ranks(_rank, world, args, contender, timeout=1800)
        per[contender] = {"median_ms": round(1e3 * max(r["median_s"] for r in ranks.values()), 2),
                          "loss": ranks[0]["loss"]}
    base = per.get("compiled, one graph", next(iter(per.values())))["median_ms"]
    record = {"nodes": mesh.num_nodes, "edges": int(mesh.edges.shape[1]), "hidden": args.hidden, "blocks": args.blocks,
              "world": args.world, "steps": args.steps, "backend": args.backend, "step_ms": {k: v["median_ms"] for k, v in per.items()},
              "over_one_graph": {k: round(v["median_ms"] / base, 3) for k, v in per.items()},
              "losses": {k: v["loss"] for k, v in per.items()}, "cpu": cpu_model(), "torch": torch.__version__}
    print(json.dumps(record, indent=1))
    with open(args.out, "w") as f:
        json.dump(record, f, indent=1)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(7.5, 3))
    names = list(record["step_ms"])
    ax.barh(names, [record["step_ms"][n] for n in names], color=["grey", "tab:blue", "tab:orange", "tab:green"])
    for k, n in enumerate(names):
        ax.text(record["step_ms"][n], k, f" {record['over_one_graph'][n]:.2f}x", va="center")
    ax.set_xlabel("training step (ms, the slowest rank's median)")
    ax.set_title(f"MeshGraphNet, {mesh.num_nodes // 1000}K nodes, D={args.world}, one thread per rank")
    ax.invert_yaxis()
    fig.tight_layout()
    fig.savefig(str(args.out).replace(".json", ".png"), dpi=100)


if __name__ == "__main__":
    main()
