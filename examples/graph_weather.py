"""A GraphCast-style encoder-processor-decoder on an icosahedral mesh over the weather dataset's lat x lon grid: the
grid field sharded as lat x lon blocks, the mesh partitioned over the same ranks, trained with domain=4 equal to one
process, checkpointed (its node-partitioned mesh embedding too) and resumed on 2 ranks.

Usage::

    python examples/graph_weather.py --out runs/graph_weather    # data, train on 4 ranks, resume on 2: 32 s (docs/example_times.json)

or phase by phase::

    python examples/graph_weather.py data --out runs/graph_weather
    torchrun --nproc-per-node 4 examples/graph_weather.py train --out runs/graph_weather    # domain 2x2 (lat x lon)
    torchrun --nproc-per-node 2 examples/graph_weather.py resume --out runs/graph_weather   # domain 2x1

``data`` writes examples/weather.py's synthetic 32 x 64 store (z500, t850, t2m, u10 every 6 h). The model
(``GraphWeather``) embeds each grid point, sends it to the mesh along grid-to-mesh edges (every mesh node within
0.6 mesh edges of the point), passes messages on the mesh (MeshGraphNet blocks), and sends the mesh back to the
grid along mesh-to-grid edges (the 3 nearest mesh nodes of each point); a learned embedding per mesh node lives
on the rank that owns the node (a node-partitioned parameter, with its Adam state saved by
``checkpoint.save_nodes`` and resharded on resume). Rank 0 trains the same weights in one process; every step's
loss must match. Each phase prints the halo bytes of each layer beside what a gather of every node would cost.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from weather import TIMES, TEST_TIMES, VARIABLES, write_store  # noqa: E402  (the weather example's dataset)
from _runs import fresh_output, torchrun_env  # noqa: E402  (a rerun starts afresh in the folder it owns)

from mesh3d import DistributedManager, Plan, checkpoint, domain, graphs, parallelize  # noqa: E402
from mesh3d.data import MeshDataLoader, MeshSampler, WeatherDataset  # noqa: E402
from mesh3d.weather import LatLonGrid, weighted_mse  # noqa: E402

EXAMPLE = "examples/graph_weather.py"
OUTPUTS = ["era5_like.zarr", "ckpt"]  # what the phases write under --out, in order
H, REFINEMENTS, LAYERS, GLOBAL_BATCH, LR, SEED = 16, 2, 2, 2, 2e-3, 0
TRAIN_STEPS, RESUME_STEPS = 4, 3
RTOL = 1e-4  # fp32: only the summation order differs


def mlp(n_in: int, n_out: int, norm: bool = True) -> nn.Sequential:
    layers = [nn.Linear(n_in, H), nn.SiLU(), nn.Linear(H, n_out)]
    return nn.Sequential(*layers, nn.LayerNorm(n_out)) if norm else nn.Sequential(*layers)


class Bipartite(nn.Module):
    """Messages from source nodes to destination nodes (B, N, H) along edges, with the edge's geometry."""

    def __init__(self) -> None:
        super().__init__()
        self.edge, self.node, self.geo = mlp(3 * H, H), mlp(2 * H, H), mlp(3, H)

    def forward(self, xs, xd, pos_s, pos_d, ei):
        s, d = ei[0], ei[1]
        geo = self.geo(pos_s[s] - pos_d[d]).unsqueeze(0).expand(xs.shape[0], -1, -1)
        e = self.edge(torch.cat([xs.index_select(1, s), xd.index_select(1, d), geo], -1))
        return xd + self.node(torch.cat([xd, xd.new_zeros(xd.shape).index_add_(1, d, e)], -1))


class MeshBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.edge, self.node = mlp(2 * H, H), mlp(2 * H, H)

    def forward(self, x, ei):
        s, d = ei[0], ei[1]
        e = self.edge(torch.cat([x.index_select(1, s), x.index_select(1, d)], -1))
        return x + self.node(torch.cat([x, x.new_zeros(x.shape).index_add_(1, d, e)], -1))


class GraphWeather(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.embed, self.encoder, self.decoder = mlp(channels, H), Bipartite(), Bipartite()
        self.processor = nn.ModuleList(MeshBlock() for _ in range(LAYERS))
        self.head = mlp(H, channels, norm=False)

    def forward(self, field, mesh_embed, geo):
        b, c, nlat, nlon = field.shape
        tokens = self.embed(field.flatten(2).transpose(1, 2))                 # (B, lat*lon, H)
        grid = to_nodes(tokens)
        mesh = mesh_embed.unsqueeze(0).expand(b, -1, -1)
        mesh = self.encoder(grid, mesh, geo["grid_pos"], geo["mesh_pos"], geo["g2m"])
        for block in self.processor:
            mesh = block(mesh, geo["mesh"])
        grid = self.decoder(mesh, grid, geo["mesh_pos"], geo["grid_pos"], geo["m2g"])
        delta = to_tokens(self.head(grid), tokens).transpose(1, 2).reshape(b, c, nlat, nlon)
        return field + delta


def to_nodes(tokens):
    """The grid's tokens as nodes of the grid partition (a no-op in one process)."""
    return domain.nodes_from_tokens(tokens) if isinstance(tokens, domain.DomainTensor) else tokens


def to_tokens(nodes, like):
    return domain.tokens_from_nodes(nodes, like) if isinstance(nodes, domain.DomainTensor) else nodes


# ---------------------------------------------------------------------------------------------- the graphs
def geometry(lat: np.ndarray, lon: np.ndarray):
    mesh = graphs.icosahedral_mesh(REFINEMENTS)
    glat, glon = np.meshgrid(lat, lon, indexing="ij")
    return mesh, {"grid_pos": torch.from_numpy(graphs.lat_lon_to_xyz(glat.ravel(), glon.ravel())).float(),
                  "mesh_pos": torch.from_numpy(mesh.points).float(),
                  "g2m": graphs.grid_to_mesh_edges(lat, lon, mesh, 0.6 * mesh.longest_edge()),
                  "mesh": mesh.edges, "m2g": graphs.mesh_to_grid_edges(lat, lon, mesh)}


def mesh_embedding(num_nodes: int) -> torch.Tensor:
    return torch.randn(num_nodes, H, generator=torch.Generator().manual_seed(SEED)) * 0.1


def laid_out(ds: WeatherDataset, mesh, geo: dict):
    """The partitions (grid: its lat x lon blocks; mesh: by the block each node falls in) and the graphs."""
    grid_part = graphs.grid_block_partition(ds.sizes if len(ds.sizes) == 2 else (ds.sizes[0], (len(ds.lon),)))
    mlat, mlon = mesh.lat_lon()
    mesh_part = graphs.latlon_block_partition(mlat, mlon, ds.lat, ds.lon, grid_part_sizes(ds))
    g = {"g2m": graphs.Graph(geo["g2m"], grid_part, mesh_part), "mesh": graphs.Graph(geo["mesh"], mesh_part),
         "m2g": graphs.Graph(geo["m2g"], mesh_part, grid_part)}
    return grid_part, mesh_part, g


def grid_part_sizes(ds: WeatherDataset):
    return ds.sizes if len(ds.sizes) == 2 else (ds.sizes[0], (len(ds.lon),))


def report_halo(g: dict, grid_part, mesh_part) -> None:
    """Per layer: the halo rows (from the partitions) x H features x 4 bytes x batch, beside gathering every node."""
    rows = [("encoder (grid rows to the mesh)", g["g2m"].halo_counts(grid_part), grid_part),
            *[(f"processor {k} (mesh halo)", g["mesh"].halo_counts(mesh_part), mesh_part) for k in range(LAYERS)],
            ("decoder (mesh rows to the grid)", g["m2g"].halo_counts(mesh_part), mesh_part)]
    for name, halo, part in rows:
        per_layer = sum(halo) * H * 4 * GLOBAL_BATCH
        gather = sum(part.n - c for c in part.counts) * H * 4 * GLOBAL_BATCH
        print(f"  {name:32s} halo rows {halo}: {per_layer:7d} bytes per step, a gather of every node {gather:8d} "
              f"({per_layer / gather:.3f}x)")


# ---------------------------------------------------------------------------------------------- training
def train_set(store: str, **kw) -> WeatherDataset:
    return WeatherDataset(store, VARIABLES, lead=np.timedelta64(6, "h"), steps=1, times=range(TIMES - TEST_TIMES - 1), **kw)


def step_loss(net, embed, batch, geo, weights):
    return weighted_mse(net(batch["x"], embed, geo), batch["y"][0], weights)


def one_process(store: str, stats, steps: int) -> list[float]:
    ds = train_set(store, stats=stats, domain=((1,), (0,)))
    mesh, geo = geometry(ds.lat, ds.lon)
    geo = {k: torch.from_numpy(v) if isinstance(v, np.ndarray) else v for k, v in geo.items()}
    torch.manual_seed(SEED)
    net = GraphWeather(len(ds.channels))
    embed = nn.Parameter(mesh_embedding(mesh.num_nodes))
    opt, opt_nodes = torch.optim.Adam(net.parameters(), lr=LR), torch.optim.Adam([embed], lr=LR)
    loader = MeshDataLoader(ds, MeshSampler(len(ds), GLOBAL_BATCH, seed=SEED, batch_ranks=1, batch_rank=0))
    weights, losses = LatLonGrid(ds.lat, ds.lon).weights, []
    while len(losses) < steps:
        for batch in loader:
            loss = step_loss(net, embed, batch, geo, weights)
            loss.backward()
            for o in (opt, opt_nodes):
                o.step()
                o.zero_grad()
            losses.append(loss.item())
            if len(losses) == steps:
                break
    return losses


def phase(out: str, resume: bool) -> int:
    dm = DistributedManager.initialize(batch=1, domain=(2, 1) if resume else (2, 2))
    me = dm.axis_rank("domain")
    store, ckpt = os.path.join(out, "era5_like.zarr"), os.path.join(out, "ckpt")
    ds = train_set(store, stats="compute")
    mesh, geo = geometry(ds.lat, ds.lon)
    grid_part, mesh_part, g = laid_out(ds, mesh, geo)
    geo_dom = {"grid_pos": geo["grid_pos"], "mesh_pos": geo["mesh_pos"],
               **{k: domain.edge_index(graph) for k, graph in g.items()}}
    torch.manual_seed(SEED)
    net = parallelize(GraphWeather(len(ds.channels)), Plan(batch="fsdp"))
    rows = mesh_embedding(mesh.num_nodes).index_select(0, mesh_part.tensor("items", me))
    embed = nn.Parameter(rows)  # this rank's mesh nodes only: a node-partitioned parameter, outside the model
    opt, opt_nodes = torch.optim.Adam(net.parameters(), lr=LR), torch.optim.Adam([embed], lr=LR)
    loader = MeshDataLoader(ds, MeshSampler(len(ds), GLOBAL_BATCH, seed=SEED))
    first = 0
    if resume:
        first = checkpoint.load(ckpt, net, opt, data=loader).step
        saved, extra = checkpoint.load_nodes(os.path.join(ckpt, "nodes"), mesh_part)
        with torch.no_grad():
            embed.copy_(saved["mesh_embed"])
        opt_nodes.state[embed] = {"step": torch.tensor(float(extra["step"])), "exp_avg": saved["mesh_embed.exp_avg"],
                                  "exp_avg_sq": saved["mesh_embed.exp_avg_sq"]}
    if me == 0:
        print(f"domain grid {dm.domain_grid}: grid {len(ds.lat)}x{len(ds.lon)} in blocks {ds.sizes}; mesh "
              f"{mesh.num_nodes} nodes over ranks {mesh_part.counts}; edges g2m {g['g2m'].edges.counts} mesh "
              f"{g['mesh'].edges.counts} m2g {g['m2g'].edges.counts}")
        report_halo(g, grid_part, mesh_part)
    weights, losses = LatLonGrid(ds.lat, ds.lon).weights, []
    steps = RESUME_STEPS if resume else TRAIN_STEPS
    while len(losses) < steps:
        for batch in loader:
            with domain.count_traffic() as traffic:
                loss = step_loss(net, domain.nodes_from_local(embed, mesh_part), ds.to_domain(batch), geo_dom, weights)
            loss.backward()
            for o in (opt, opt_nodes):
                o.step()
                o.zero_grad()
            losses.append(float(loss.detach().to_local()))
            if len(losses) == 1 and me == 0:
                print(f"  forward of the first step: rank 0 sent {traffic.bytes_sent} bytes in {traffic.rounds} exchanges")
            if len(losses) == steps:
                break
    if not resume:
        checkpoint.save(ckpt, net, opt, step=TRAIN_STEPS, data=loader)
        state = opt_nodes.state[embed]
        checkpoint.save_nodes(os.path.join(ckpt, "nodes"), {"mesh_embed": embed.detach(), "mesh_embed.exp_avg":
                              state["exp_avg"], "mesh_embed.exp_avg_sq": state["exp_avg_sq"]}, mesh_part,
                              extra={"step": int(state["step"])})
    ok = True
    if me == 0:
        want = one_process(store, ds.stats, TRAIN_STEPS + RESUME_STEPS)[first:first + steps]
        for step, (got, ref) in enumerate(zip(losses, want), start=first):
            same = abs(got - ref) <= RTOL * abs(ref)
            ok &= same
            print(f"step {step} loss {got:.6f} one-process {ref:.6f}{'' if same else '  <-- DIFFERS'}", flush=True)
        print(f"{'resumed on' if resume else 'trained on'} {dm.domain_grid}: "
              f"{'MATCHES one process' if ok else 'DIFFERS from one process'}", flush=True)
    flag = torch.tensor(int(ok))
    dist.broadcast(flag, src=0)
    DistributedManager.shutdown()
    return 0 if int(flag) else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("phase", nargs="?", default="all", choices=["all", "data", "train", "resume"])
    parser.add_argument("--out", default="runs/graph_weather")
    args = parser.parse_args()
    if args.phase != "resume" and int(os.environ.get("RANK", "0")) == 0:  # before the mesh: the others write after it
        # A rerun of a phase replaces what that phase and the later ones wrote (checkpoints are never overwritten).
        fresh_output(args.out, EXAMPLE, OUTPUTS[OUTPUTS.index("ckpt" if args.phase == "train" else "era5_like.zarr"):],
                     known=OUTPUTS)
    if args.phase == "data":
        write_store(os.path.join(args.out, "era5_like.zarr"))
        return 0
    if args.phase in ("train", "resume"):
        return phase(args.out, resume=args.phase == "resume")
    write_store(os.path.join(args.out, "era5_like.zarr"))
    run = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node"]
    for n, name in (("4", "train"), ("2", "resume")):
        done = subprocess.run([*run, n, os.path.abspath(__file__), name, "--out", args.out], env=torchrun_env())
        if done.returncode:
            print(f"graph_weather: the {name} phase FAILED (exit {done.returncode})")
            return done.returncode
    print("graph_weather: every check passed")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
