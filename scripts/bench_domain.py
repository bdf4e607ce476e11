"""Benchmark: a conv stack on a large 2-D field, domain-sharded over D = 1, 2, 4 (, 8) CPU ranks.

Usage::

    python scripts/bench_domain.py                      # 512x512 field, D in 1 2 4
    python scripts/bench_domain.py --size 2048 --domains 1 2 4 8

Per D it reports, for one training step (forward + backward) of the same conv stack:
- bytes sent by the halo exchange / the minimum halo bytes (rows a shard must read from its
  neighbours and send back as gradients): goal 1.0;
- step time of the domain-sharded model / step time of the best simple alternative, which gathers
  the whole input on every rank and runs the model whole (a ratio < 1 means sharding wins);
- per-rank activation memory (bytes autograd saves for backward) / one process's: goal <= 1.2/D.
Writes docs/benchmarks/domain.json (and domain.png if matplotlib is importable).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

OUT = Path(__file__).resolve().parents[1] / "docs" / "benchmarks"


def conv_stack(channels: int, layers: int) -> nn.Module:
    mods: list[nn.Module] = [nn.Conv2d(1, channels, 3, padding=1)]
    for _ in range(layers - 2):
        mods += [nn.GELU(), nn.Conv2d(channels, channels, 3, padding=1)]
    mods += [nn.GELU(), nn.Conv2d(channels, 1, 3, padding=1)]
    return nn.Sequential(*mods)


class SavedBytes:
    """Counts the bytes autograd saves for backward (activation memory) during a forward."""

    def __init__(self) -> None:
        self.total = 0

    def __enter__(self):
        def pack(t):
            self.total += t.numel() * t.element_size()
            return t

        self._ctx = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
        self._ctx.__enter__()
        return self

    def __exit__(self, *exc):
        self._ctx.__exit__(*exc)


def _rank(rank: int, world: int, port: int, args, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    from mesh3d import DistributedManager, domain
    from mesh3d.domain.exchange import TRAFFIC

    DistributedManager.initialize(batch=1, domain=world)
    torch.manual_seed(0)
    model = conv_stack(args.channels, args.layers)
    x = torch.randn(1, 1, args.size, args.size)
    sizes = domain.balanced_sizes(args.size, world)

    def sharded_step():
        y = model(domain.shard(x, dim=2, sizes=sizes))
        (y * y).mean().backward()

    def gathered_step():  # baseline: every rank gathers the whole input and runs the model whole
        whole = domain.shard(x, dim=2, sizes=sizes).full_tensor()
        (model(whole) ** 2).mean().backward()

    results = {}
    for name, step in (("sharded", sharded_step), ("gathered", gathered_step)):
        step()  # warm-up (plans are cached)
        dist.barrier()
        TRAFFIC["bytes_sent"] = 0
        with SavedBytes() as saved:
            start = time.perf_counter()
            for _ in range(args.repeats):
                step()
            dist.barrier()
            elapsed = (time.perf_counter() - start) / args.repeats
        results[name] = {"time_s": elapsed, "bytes_sent": TRAFFIC["bytes_sent"] / args.repeats,
                         "saved_bytes": saved.total / args.repeats}
    queue.put((rank, results))
    DistributedManager.shutdown()


def min_halo_bytes(size: int, world: int, channels: int, layers: int) -> int:
    """Rows each 3x3 'same' conv must read across each internal boundary (forward) and return (backward)."""
    row = size * 4  # one fp32 row of one channel
    in_channels = [1] + [channels] * (layers - 1)
    forward = sum(2 * row * c for c in in_channels)  # one row each way across the boundary
    backward = sum(2 * row * c for c in in_channels[1:])  # the input x needs no gradient
    return (forward + backward) * (world - 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=512)
    parser.add_argument("--channels", type=int, default=16)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--domains", type=int, nargs="+", default=[1, 2, 4])
    args = parser.parse_args()
    report = {"config": vars(args), "runs": []}
    for world in args.domains:
        ctx = mp.get_context("spawn")
        queue = ctx.Queue()
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        procs = [ctx.Process(target=_rank, args=(r, world, port, args, queue)) for r in range(world)]
        for p in procs:
            p.start()
        per_rank = dict(queue.get() for _ in procs)
        for p in procs:
            p.join()
        sharded = [per_rank[r]["sharded"] for r in range(world)]
        gathered = [per_rank[r]["gathered"] for r in range(world)]
        sent = sum(r["bytes_sent"] for r in sharded)
        halo = min_halo_bytes(args.size, world, args.channels, args.layers)
        run = {
            "domain": world,
            "step_time_s": max(r["time_s"] for r in sharded),
            "gathered_step_time_s": max(r["time_s"] for r in gathered),
            "bytes_sent_per_step": sent,
            "min_halo_bytes_per_step": halo,
            "bytes_vs_halo": sent / halo if halo else 1.0,
            "peak_rank_activation_bytes": max(r["saved_bytes"] for r in sharded),
        }
        report["runs"].append(run)
    one = next((r for r in report["runs"] if r["domain"] == 1), report["runs"][0])
    for run in report["runs"]:
        run["time_vs_gathered"] = run["step_time_s"] / run["gathered_step_time_s"]
        run["time_vs_one_process"] = run["step_time_s"] / one["step_time_s"]
        run["activation_vs_one_process"] = run["peak_rank_activation_bytes"] / one["peak_rank_activation_bytes"]
        run["activation_goal"] = 1.2 / run["domain"]
        print(json.dumps(run))
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "domain.json").write_text(json.dumps(report, indent=2) + "\n")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    ds = [r["domain"] for r in report["runs"]]
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.5))
    axes[0].plot(ds, [r["bytes_vs_halo"] for r in report["runs"]], "o-")
    axes[0].set_title("bytes sent / min halo bytes")
    axes[1].plot(ds, [r["time_vs_gathered"] for r in report["runs"]], "o-")
    axes[1].set_title("step time / gather-whole-input")
    axes[2].plot(ds, [r["activation_vs_one_process"] for r in report["runs"]], "o-", label="measured")
    axes[2].plot(ds, [r["activation_goal"] for r in report["runs"]], "--", label="1.2/D")
    axes[2].set_title("activation bytes per rank / one process")
    axes[2].legend()
    for ax in axes:
        ax.set_xlabel("domain size D")
    fig.tight_layout()
    fig.savefig(OUT / "domain.png", dpi=100)


if __name__ == "__main__":
    main()
