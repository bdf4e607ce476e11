"""Benchmark the halo exchange pattern on blocks: one grid dim after the other, or all neighbours at once.

Usage::

    python scripts/bench_halo_rounds.py                      # 2x2 grid, 16 channels, blocks 32..1024 wide, ~1 min
    python scripts/bench_halo_rounds.py --sides 64 --iters 50 --out /tmp/rounds.json   # a smoke run

On a 2x2 grid each rank needs, for a 3x3 'same' window, one row from its neighbour along grid dim 0,
one column from its neighbour along grid dim 1 and one corner element from its diagonal neighbour.
Four ways to build that extended block (``C x (h+1) x (w+1)``) are timed, per rank, the ranks started
together each iteration (the worst rank's median is reported):

- ``mesh3d``: what the product runs, ``blocks.gather_planned`` of ``window_plans``: one header round on the domain group
  (the peers check they agree), then every neighbour's box in one ``batch_isend_irecv``;
- ``mesh3d_per_dim``: the same call with blocks overlap on, where it goes one grid dim after the other
  (per dim a header round and the rows on the grid line; the second pass carries the corner);
- ``per_dim``: two passes by hand, rows only, no header round: that pattern's own cost;
- ``all_at_once``: one ``batch_isend_irecv`` of all three messages (row, column, corner) by hand, then
  one assembly: the floor for the one-round pattern.

Writes docs/benchmarks/halo_rounds.json; scripts/bench_report.py puts it in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import cpu_model, median_step_time  # noqa: E402

OUT = Path(__file__).resolve().parents[1] / "docs" / "benchmarks" / "halo_rounds.json"


def _swap(pairs: list[tuple[int, torch.Tensor, torch.Tensor]]) -> None:
    """Send and receive all (peer, outgoing, incoming) buffers in one batched round."""
    ops = [dist.P2POp(dist.isend, out, peer) for peer, out, _ in pairs]
    ops += [dist.P2POp(dist.irecv, into, peer) for peer, _, into in pairs]
    for work in dist.batch_isend_irecv(ops):
        work.wait()


def _edge(t: torch.Tensor, dim: int, low: bool) -> torch.Tensor:
    """The one row of ``t`` along ``dim`` that faces the neighbour (contiguous, ready to send)."""
    return t.narrow(dim, t.shape[dim] - 1 if low else 0, 1).contiguous()


def _join(local: torch.Tensor, halo: torch.Tensor, dim: int, low: bool) -> torch.Tensor:
    return torch.cat([local, halo] if low else [halo, local], dim)


def _rank(rank: int, port: int, args, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="4")
    torch.set_num_threads(1)
    from mesh3d import DistributedManager, domain
    from mesh3d.domain.core.settings import SETTINGS
    from mesh3d.domain.layouts.blocks import gather_planned, window_plans
    from mesh3d.domain.core.tensor import unwrap

    dm = DistributedManager.initialize(batch=1, domain=(2, 2))
    i, j = dm.axis_rank("domain_0"), dm.axis_rank("domain_1")
    low_i, low_j = i == 0, j == 0  # the low block's neighbour lies above it (its last row is sent)
    grid_rank = {(a, b): dm.axis_ranks("domain")[2 * a + b] for a in (0, 1) for b in (0, 1)}
    down, across, diagonal = grid_rank[1 - i, j], grid_rank[i, 1 - j], grid_rank[1 - i, 1 - j]
    results = {}
    for side in args.sides:
        torch.manual_seed(0)
        x = torch.randn(1, args.channels, 2 * side, 2 * side)
        xs = domain.shard(x, dims=(2, 3))
        local = unwrap(xs).contiguous()

        def mesh3d_pattern():
            plans, _ = window_plans(xs._spec, 2, (3, 3), (1, 1), (1, 1), [(1, 1), (1, 1)])
            return gather_planned(local, xs._spec, plans, 0.0, SETTINGS.value.overlap.blocks)

        def mesh3d_per_dim():
            with domain.window_overlap(True):  # gather_planned then sends what overlapped peers send: per grid dim
                return mesh3d_pattern()

        def per_dim():
            row = torch.empty_like(_edge(local, 2, low_i))
            _swap([(down, _edge(local, 2, low_i), row)])
            ext = _join(local, row, 2, low_i)
            col = torch.empty_like(_edge(ext, 3, low_j))
            _swap([(across, _edge(ext, 3, low_j), col)])
            return _join(ext, col, 3, low_j)

        def all_at_once():
            row, col = _edge(local, 2, low_i), _edge(local, 3, low_j)
            corner = _edge(row, 3, low_j)
            got = [torch.empty_like(t) for t in (row, col, corner)]
            _swap([(down, row, got[0]), (across, col, got[1]), (diagonal, corner, got[2])])
            c, h, w = local.shape[1:]
            ext = local.new_empty(1, c, h + 1, w + 1)
            r0, c0 = int(not low_i), int(not low_j)  # where this rank's own block starts in ext
            ext[:, :, r0:r0 + h, c0:c0 + w] = local
            rr, cc = (h if low_i else 0), (w if low_j else 0)
            ext[:, :, rr:rr + 1, c0:c0 + w] = got[0]
            ext[:, :, r0:r0 + h, cc:cc + 1] = got[1]
            ext[:, :, rr:rr + 1, cc:cc + 1] = got[2]
            return ext

        with torch.no_grad():
            want = mesh3d_pattern()
            assert all(torch.equal(fn(), want) for fn in (mesh3d_per_dim, per_dim, all_at_once)), "the patterns disagree"
            times = {name: median_step_time(fn, args.iters)
                     for name, fn in (("mesh3d", mesh3d_pattern), ("mesh3d_per_dim", mesh3d_per_dim),
                                      ("per_dim", per_dim), ("all_at_once", all_at_once))}
        results[side] = times
        if rank == 0:
            print(f"  block {side}x{side}: " + ", ".join(f"{k} {v * 1e6:.0f} us" for k, v in times.items()), flush=True)
    queue.put((rank, results))
    DistributedManager.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sides", type=int, nargs="+", default=[32, 128, 512, 1024], help="block side lengths")
    parser.add_argument("--channels", type=int, default=16)
    parser.add_argument("--iters", type=int, default=200)
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    print(f"== 2x2 grid, {args.channels} channels fp32, one thread per rank on {os.cpu_count()} cores, "
          f"median of {args.iters} exchanges", flush=True)
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [ctx.Process(target=_rank, args=(r, port, args, queue)) for r in range(4)]
    for p in procs:
        p.start()
    per_rank = [r for _, r in sorted(queue.get(timeout=900) for _ in procs)]
    for p in procs:
        p.join()
    rows = []
    for side in args.sides:
        worst = {k: max(r[side][k] for r in per_rank) for k in per_rank[0][side]}
        rows.append({"side": side, "halo_bytes_per_rank": 4 * args.channels * (2 * side + 1),
                     **{f"{k}_s": v for k, v in worst.items()},
                     "all_at_once_vs_per_dim": worst["all_at_once"] / worst["per_dim"],
                     "mesh3d_vs_mesh3d_per_dim": worst["mesh3d"] / worst["mesh3d_per_dim"],
                     "mesh3d_vs_all_at_once": worst["mesh3d"] / worst["all_at_once"]})
        print(f"  block {side}: by hand, all at once / per dim {rows[-1]['all_at_once_vs_per_dim']:.3f}; mesh3d, "
              f"one round / per dim {rows[-1]['mesh3d_vs_mesh3d_per_dim']:.3f}; mesh3d / by hand all at once "
              f"{rows[-1]['mesh3d_vs_all_at_once']:.3f}", flush=True)
    report = {"config": {"channels": args.channels, "iters": args.iters, "grid": [2, 2],
                         "torch": torch.__version__, "cpu_count": os.cpu_count(), "cpu": cpu_model()}, "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    _plot(args.out.with_suffix(".png"), rows)
    print(f"wrote {args.out}")


def _plot(path: Path, rows: list[dict]) -> None:
    """Time ratios against the block side (no file without matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    sides = [r["side"] for r in rows]
    fig, ax = plt.subplots(figsize=(5, 3))
    ax.plot(sides, [r["mesh3d_vs_mesh3d_per_dim"] for r in rows], "o-", label="mesh3d: one round / per dim")
    ax.plot(sides, [r["all_at_once_vs_per_dim"] for r in rows], "s--", label="by hand: one round / per dim")
    ax.axhline(1.0, color="red", linestyle=":")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("block side (2x2 grid)")
    ax.set_ylabel("time ratio")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    main()
