"""MeshGraphNet on an unstructured 2-D CFD mesh (a triangulated channel around a cylinder), nodes partitioned over the
domain ranks, trained equal to one process; prints the halo bytes each message-passing layer moves beside what a
gather of every node would cost.

Usage::

    python examples/meshgraphnet.py                      # 4 ranks (torchrun, started for you): 13 s (docs/example_times.json)
    torchrun --nproc-per-node 3 examples/meshgraphnet.py run --partition metis --steps 5

The target is potential flow past the cylinder (velocity at each node, from its coordinates), the input the node
type and the inflow speed; edges carry the displacement between their nodes, computed inside the model from a plain
table of coordinates (``pos[src] - pos[dst]``). The model is plain PyTorch (``MeshGraphNet`` below); the partition
is a Hilbert curve over the coordinates (``--partition hilbert``), METIS (``metis``) or the BFS fallback (``bfs``),
with uneven parts. Rank 0 trains the same weights in one process (fp64) and checks every step's loss and the final
parameters; exit status 0 only when they match.
"""

from __future__ import annotations

import argparse
import copy
import os
import subprocess
import sys

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from _runs import torchrun_env
from mesh3d import DistributedManager, Plan, domain, graphs, parallelize

RTOL = 1e-9


def mlp(n_in: int, n_out: int, hidden: int = 32, norm: bool = True) -> nn.Sequential:
    layers = [nn.Linear(n_in, hidden), nn.SiLU(), nn.Linear(hidden, n_out)]
    return nn.Sequential(*layers, nn.LayerNorm(n_out)) if norm else nn.Sequential(*layers)


class Processor(nn.Module):
    """One message-passing layer: edges from (source, destination, edge), nodes from (node, sum of incoming edges)."""

    def __init__(self, h: int) -> None:
        super().__init__()
        self.edge, self.node = mlp(3 * h, h), mlp(2 * h, h)

    def forward(self, x, e, edge_index):
        src, dst = edge_index[0], edge_index[1]
        e = e + self.edge(torch.cat([x[src], x[dst], e], -1))
        return x + self.node(torch.cat([x, x.new_zeros(x.shape).index_add_(0, dst, e)], -1)), e


class MeshGraphNet(nn.Module):
    def __init__(self, node_in: int, out: int, h: int = 32, layers: int = 4) -> None:
        super().__init__()
        self.enc_node, self.enc_edge = mlp(node_in, h), mlp(3, h)
        self.layers = nn.ModuleList(Processor(h) for _ in range(layers))
        self.dec = mlp(h, out, norm=False)

    def forward(self, x, pos, edge_index):
        src, dst = edge_index[0], edge_index[1]
        d = pos[src] - pos[dst]
        x, e = self.enc_node(x), self.enc_edge(torch.cat([d, d.norm(dim=-1, keepdim=True)], -1))
        for layer in self.layers:
            x, e = layer(x, e, edge_index)
        return self.dec(x)


class FromFeatures(nn.Module):
    """``model(x, edge_index)`` with the positions in the first 2 feature columns (what ``mesh3d check --graph`` calls)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = MeshGraphNet(4, 2, h=8, layers=2)

    def forward(self, x, edge_index):
        return self.net(x, x[:, :2], edge_index)


def tiny() -> nn.Module:
    """Usage: ``mesh3d check examples/meshgraphnet.py:tiny --graph icosahedral:2 --input 162x4``"""
    return FromFeatures()


def problem(nx: int = 48, ny: int = 16):
    """The mesh, node inputs (one-hot type, inflow speed) and targets (potential flow past the cylinder) per sample."""
    mesh = graphs.channel_mesh(nx, ny)
    center, radius = np.array([1.0, 0.6]), 0.2
    rel = mesh.points - center
    r2 = np.maximum((rel ** 2).sum(1), radius ** 2)
    onehot = np.eye(len(graphs.meshes.NODE_TYPES))[mesh.node_type]
    samples = []
    for speed in (0.5, 1.0, 1.5, 2.0):
        u = speed * (1 - radius ** 2 * (rel[:, 0] ** 2 - rel[:, 1] ** 2) / r2 ** 2)
        v = speed * (-2 * radius ** 2 * rel[:, 0] * rel[:, 1] / r2 ** 2)
        x = np.concatenate([onehot, np.full((mesh.num_nodes, 1), speed)], 1)
        samples.append((torch.from_numpy(x), torch.from_numpy(np.stack([u, v], 1))))
    return mesh, samples


def partition(mesh, parts: int, method: str) -> graphs.Partition:
    if method == "hilbert":  # uneven on purpose: the first rank takes a smaller share
        n = mesh.num_nodes
        first = n // (2 * parts)
        rest = [(n - first) // (parts - 1)] * (parts - 1) if parts > 1 else []
        sizes = [first, *rest[:-1], n - first - sum(rest[:-1])] if parts > 1 else [n]
        return graphs.sfc_partition(mesh.points, parts, sizes=sizes)
    return graphs.metis_partition(mesh.edges, mesh.num_nodes, parts, method="auto" if method == "metis" else "bfs")


def run(args: argparse.Namespace) -> int:
    dm = DistributedManager.initialize(batch=1, domain=int(os.environ.get("WORLD_SIZE", "1")))
    d, me = dm.axis_size("domain"), dm.axis_rank("domain")
    torch.set_default_dtype(torch.float64)
    mesh, samples = problem()
    part = partition(mesh, d, args.partition)
    g = graphs.Graph(mesh.edges, part)
    pos = torch.from_numpy(mesh.points)
    torch.manual_seed(0)
    ref = MeshGraphNet(samples[0][0].shape[1], 2)
    net = parallelize(copy.deepcopy(ref), Plan())    # the domain sums its gradients (batch 1: nothing else to do)
    opt, opt_ref = torch.optim.Adam(net.parameters(), lr=3e-3), torch.optim.Adam(ref.parameters(), lr=3e-3)
    ei, edges = domain.edge_index(g), torch.from_numpy(mesh.edges)
    if me == 0:
        print(f"mesh: {mesh.num_nodes} nodes, {edges.shape[1]} edges; {args.partition} partition over {d} ranks: "
              f"nodes {part.counts}, edges {g.edges.counts}", flush=True)
    ok = True
    for step in range(args.steps):
        x, t = samples[step % len(samples)]
        with domain.count_traffic() as traffic:
            loss = F.mse_loss(net(domain.shard_nodes(x, part), pos, ei), domain.shard_nodes(t, part))
        loss.backward()
        opt.step()
        opt.zero_grad()
        loss_ref = F.mse_loss(ref(x, pos, edges), t)
        loss_ref.backward()
        opt_ref.step()
        opt_ref.zero_grad()
        got, want = loss.item(), loss_ref.item()  # not float(): torch warns for a tensor that requires grad
        same = abs(got - want) <= RTOL * abs(want)
        ok &= same
        if me == 0:
            print(f"step {step} loss {got:.6f} one-process {want:.6f}{'' if same else '  <-- DIFFERS'}", flush=True)
        if step == 0:
            report_traffic(traffic.bytes_sent, g, part, 32, len(net.layers), d)
    worst = max((p.full_tensor() - q).abs().max().item() for p, q in zip(net.parameters(), ref.parameters()))
    ok &= worst <= 1e-8
    flag = torch.tensor(int(ok))
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    if me == 0:
        print(f"parameters after {args.steps} steps: max abs diff {worst:.2e}; "
              f"{'MATCHES one process' if int(flag) else 'DIFFERS from one process'}", flush=True)
    DistributedManager.shutdown()
    return 0 if int(flag) else 1


def report_traffic(sent: int, g: graphs.Graph, part: graphs.Partition, h: int, layers: int, d: int) -> None:
    """Each rank's bytes in the forward, and per layer: the halo (from the partition) beside a gather of every node."""
    mine = torch.tensor([sent], dtype=torch.int64)
    every = [torch.zeros_like(mine) for _ in range(d)]
    dist.all_gather(every, mine)
    if dist.get_rank() != 0:
        return
    halo = g.halo_counts(part)
    per_layer = sum(halo) * h * 8
    gather_all = sum(part.n - c for c in part.counts) * h * 8
    print(f"halo rows per rank {halo}: {per_layer} bytes per message-passing layer (fp64, {h} features) against "
          f"{gather_all} bytes to gather every node on every rank ({per_layer / gather_all:.3f}x)")
    total = sum(int(v) for v in every)
    print(f"forward of step 0 sent {[int(v) for v in every]} bytes per rank: {total} in all = {layers} layers x "
          f"{per_layer} + {total - layers * per_layer} for the loss's sum (coordinates never travel: a plain table)",
          flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("phase", nargs="?", default="all", choices=["all", "run"])
    parser.add_argument("--partition", default="hilbert", choices=["hilbert", "metis", "bfs"])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--ranks", type=int, default=4)
    args = parser.parse_args()
    if args.phase == "run":
        return run(args)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(args.ranks),
           os.path.abspath(__file__), "run", "--partition", args.partition, "--steps", str(args.steps)]
    return subprocess.run(cmd, env=torchrun_env()).returncode


if __name__ == "__main__":
    raise SystemExit(main())
