"""Sizing a graph job (``mesh3d plan --graph``): nodes, edges and halo per rank from the partition, the bytes each
message-passing layer moves against a gather of every node, and the activations a layer holds per rank.

Usage::

    graph = load_graph("icosahedral:6")                # or "channel:400x200", or MODULE:FACTORY (see load_graph)
    job = plan_graph(graph, parts=4, features=512, layers=16, dtype_bytes=2, method="hilbert")
    print(job.table()); job.to_json()

No process group and no model run: the figures come from the graph and its partition alone (``mesh3d.graphs``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from mesh3d.graphs import Graph, Partition, TriMesh, channel_mesh, icosahedral_mesh, metis_partition, sfc_partition
from mesh3d.planner.spec import load_spec

__all__ = ["GraphInput", "GraphJob", "load_graph", "partition_graph", "plan_graph"]


@dataclass(frozen=True)
class GraphInput:
    """A graph to plan or check on: its ``(2, E)`` edges, node count and (optional) coordinates for curve partitions."""

    edge_index: np.ndarray
    num_nodes: int
    coords: np.ndarray | None = None


def load_graph(spec: str) -> GraphInput:
    """``"icosahedral:R"`` (refinement R), ``"channel:NXxNY"``, or ``MODULE:FACTORY`` returning a ``TriMesh``, a
    ``GraphInput`` or a dict with ``edge_index``, ``num_nodes`` and optionally ``coords``.

    Usage: ``load_graph("icosahedral:6").num_nodes == 40962``
    """
    kind, _, arg = spec.partition(":")
    try:
        if kind == "icosahedral":
            return _from(icosahedral_mesh(int(arg)))
        if kind == "channel":
            nx, ny = (int(v) for v in arg.lower().split("x"))
            return _from(channel_mesh(nx, ny))
    except ValueError as err:
        raise ValueError(f"--graph {spec!r}: write icosahedral:R (e.g. icosahedral:6) or channel:NXxNY (e.g. "
                         f"channel:400x200) ({err})") from None
    made = load_spec(spec)
    made = made() if callable(made) else made
    if isinstance(made, (TriMesh, GraphInput)):
        return _from(made) if isinstance(made, TriMesh) else made
    if isinstance(made, dict) and "edge_index" in made:
        return GraphInput(np.asarray(made["edge_index"]), int(made.get("num_nodes") or np.max(made["edge_index"]) + 1),
                          None if made.get("coords") is None else np.asarray(made["coords"]))
    raise ValueError(f"--graph {spec}: the factory must return a mesh3d.graphs.TriMesh, a GraphInput or a dict with "
                     f"edge_index (and num_nodes, coords); got {type(made).__name__}")


def _from(mesh: TriMesh) -> GraphInput:
    return GraphInput(mesh.edges, mesh.num_nodes, mesh.points)


def partition_graph(graph: GraphInput, parts: int, method: str = "hilbert", sizes: tuple[int, ...] | None = None) -> Partition:
    """The graph's nodes over ``parts`` ranks: a Hilbert curve over the coordinates (``sizes`` per rank allowed),
    METIS or its breadth-first fallback.

    Usage: ``partition_graph(load_graph("icosahedral:3"), 4, "metis")``
    """
    if method == "hilbert" and graph.coords is not None:
        return sfc_partition(graph.coords, parts, sizes=sizes)
    if method not in ("hilbert", "metis", "bfs"):
        raise ValueError(f"partition method {method!r}: choose hilbert, metis or bfs")
    return metis_partition(graph.edge_index, graph.num_nodes, parts, method="auto" if method == "metis" else "bfs")


@dataclass
class GraphJob:
    """Per rank: nodes, edges, halo rows; per layer: halo bytes, a gather of every node's bytes, activations."""

    nodes: int
    edges: int
    parts: int
    method: str
    features: int
    layers: int
    dtype_bytes: int
    batch: int
    ranks: list[dict[str, int]] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in ("nodes", "edges", "parts", "method", "features", "layers", "dtype_bytes",
                                              "batch", "ranks")}

    def table(self) -> str:
        head = ["rank", "nodes", "edges", "halo rows", "halo MB/layer", "gather-all MB/layer", "activations MB/layer"]
        rows = [[str(r["rank"]), str(r["nodes"]), str(r["edges"]), str(r["halo_rows"]), _mb(r["halo_bytes_per_layer"]),
                 _mb(r["gather_all_bytes_per_layer"]), _mb(r["activation_bytes_per_layer"])] for r in self.ranks]
        widths = [max(len(x[i]) for x in [head, *rows]) for i in range(len(head))]
        lines = [f"graph job: {self.nodes} nodes, {self.edges} edges over {self.parts} domain ranks ({self.method} "
                 f"partition); {self.layers} layers of {self.features} features, {self.dtype_bytes} bytes each, batch "
                 f"{self.batch}",
                 *("  " + "  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in [head, *rows]),
                 "halo: rows this rank receives per gather of the sources (x[src]); its gradient goes back in backward. "
                 "activations: one layer's node rows (own and halo) and edge messages (source, destination, edge: 3x)."]
        return "\n".join(lines)


def _mb(n: int) -> str:
    return f"{n / 2 ** 20:.2f}"


def plan_graph(graph: GraphInput, parts: int, *, features: int, layers: int, dtype_bytes: int = 4, batch: int = 1,
               method: str = "hilbert", partition: Partition | None = None) -> GraphJob:
    """Size a graph job from its partition (see the module docstring).

    Usage: ``plan_graph(load_graph("icosahedral:6"), 8, features=512, layers=16, dtype_bytes=2).table()``
    """
    part = partition if partition is not None else partition_graph(graph, parts, method)
    g = Graph(graph.edge_index, part)
    halo = g.halo_counts(part)
    row = features * dtype_bytes * batch
    job = GraphJob(graph.num_nodes, int(graph.edge_index.shape[1]), parts, method, features, layers, dtype_bytes, batch)
    for r in range(parts):
        n, e = part.counts[r], g.edges.counts[r]
        job.ranks.append({"rank": r, "nodes": n, "edges": e, "halo_rows": halo[r], "halo_bytes_per_layer": halo[r] * row,
                          "gather_all_bytes_per_layer": (graph.num_nodes - n) * row,
                          "activation_bytes_per_layer": (n + halo[r]) * row + 3 * e * row})
    return job
