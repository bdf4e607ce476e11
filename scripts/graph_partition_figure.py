"""The figure of docs/domain.md "Graphs and meshes": a triangulated channel partitioned over 4 ranks along a Hilbert
curve, one rank's edges and the halo nodes they read from the other ranks.

Usage: ``python scripts/graph_partition_figure.py [--out docs/graph_partition.png]`` (needs matplotlib)
"""

from __future__ import annotations

import argparse
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np

from mesh3d import graphs

COLORS = ["tab:blue", "tab:orange", "tab:green", "tab:purple"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "docs" / "graph_partition.png"))
    parser.add_argument("--rank", type=int, default=1)
    args = parser.parse_args()
    mesh = graphs.channel_mesh(40, 14, jitter=0.3)
    part = graphs.sfc_partition(mesh.points, 4, sizes=(110, 150, 150, mesh.num_nodes - 410))
    g = graphs.Graph(mesh.edges, part)
    plan = g.halo(part, args.rank)
    xy, owner = mesh.points, part.owner
    fig, ax = plt.subplots(figsize=(10, 3.6))
    ax.triplot(xy[:, 0], xy[:, 1], mesh.faces, color="0.85", linewidth=0.5)
    mine = g.edge_index[:, g.edges.items(args.rank)]
    crossing = owner[mine[0]] != args.rank
    for e, style in ((mine[:, ~crossing], dict(color=COLORS[args.rank], alpha=0.35, linewidth=0.7)),
                     (mine[:, crossing], dict(color="black", linewidth=1.2))):
        ax.plot(np.stack([xy[e[0], 0], xy[e[1], 0]]), np.stack([xy[e[0], 1], xy[e[1], 1]]), **style)
    for r in range(4):
        at = owner == r
        ax.scatter(xy[at, 0], xy[at, 1], s=9, color=COLORS[r], label=f"rank {r}: {part.counts[r]} nodes", zorder=3)
    halo = plan.halo_ids
    ax.scatter(xy[halo, 0], xy[halo, 1], s=60, facecolors="none", edgecolors="red", linewidths=1.4, zorder=4,
               label=f"rank {args.rank}'s halo: {len(halo)} nodes of {dict(plan.recv)} (rank: rows)")
    ax.set_aspect("equal")
    ax.set_axis_off()
    ax.set_title(f"{mesh.num_nodes} nodes over 4 ranks (Hilbert curve, uneven). Rank {args.rank} owns the edges into "
                 f"its nodes;\nblack: those whose source another rank owns: their sources are its halo "
                 f"({sum(g.halo_counts(part))} rows over all ranks per gather)", fontsize=9)
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.02), ncol=3, fontsize=7, frameon=False)
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
