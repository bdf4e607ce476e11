"""Helpers the benchmark scripts share: this process's RSS and the step-time/memory ratio plot.

Usage (from a script in scripts/, whose folder is on sys.path)::

    from bench_common import peak_rss_kb, plot_ratios, reset_peak_rss, rss_kb
    base = rss_kb()
    reset_peak_rss(); ...; extra_kb = peak_rss_kb() - base     # the peak of one phase
    plot_ratios("docs/benchmarks/x.png", step_ratio, memory_ratio, ylabel="mesh3d / by hand")
"""

from __future__ import annotations

import json
import os
import platform
import socket
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

from mesh3d import DistributedManager, domain

#: Where the benchmark scripts write their JSON and PNG files (docs/benchmarks.md is made from them).
BENCH = Path(__file__).resolve().parents[1] / "docs" / "benchmarks"


def load_bench_json(name: str) -> dict | None:
    """A benchmark's JSON from ``BENCH``, or None where that benchmark has not been run."""
    path = BENCH / name
    return json.loads(path.read_text()) if path.exists() else None


def _status_kb(field: str) -> int:
    """One KiB field of /proc/self/status (0 where /proc is missing)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(f"{field}:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def rss_kb() -> int:
    """This process's resident set size in KiB (0 where /proc is missing)."""
    return _status_kb("VmRSS")


def reset_peak_rss() -> bool:
    """Reset this process's peak RSS (VmHWM) to its current RSS; False where the kernel does not allow it."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def peak_rss_kb() -> int:
    """This process's peak resident set size (VmHWM) in KiB since start or the last :func:`reset_peak_rss`."""
    return _status_kb("VmHWM")


def plot_ratios(path: str | Path, step_time_ratio: float, peak_memory_ratio: float, ylabel: str,
                goal: float = 1.03) -> bool:
    """A two-bar PNG of the ratios against the goal line; False (and no file) without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(4, 3))
    ax.bar(["step time", "peak memory"], [step_time_ratio, peak_memory_ratio])
    ax.axhline(goal, color="red", linestyle="--", label=f"goal {goal}")
    ax.set_ylabel(ylabel)
    ax.legend(loc="lower left")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def median_step_time(step: Callable[[], object], steps: int) -> float:
    """Median seconds of ``step()`` over ``steps`` calls, the ranks of the default group started together each time."""
    times = []
    for _ in range(steps):
        dist.barrier()
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def cpu_model() -> str:
    """The CPU's model name (recorded in a benchmark's JSON: its figures hold for that machine)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


# ----------------------------------------------------------------------------- models shared by the domain benchmarks
def conv_stack(channels: int, layers: int, dims: int = 2) -> nn.Module:
    conv = nn.Conv2d if dims == 2 else nn.Conv3d
    mods: list[nn.Module] = [conv(1, channels, 3, padding=1)]
    for _ in range(layers - 2):
        mods += [nn.GELU(), conv(channels, channels, 3, padding=1)]
    mods += [nn.GELU(), conv(channels, 1, 3, padding=1)]
    return nn.Sequential(*mods)


class UNet(nn.Module):
    """Two levels: conv-GroupNorm-GELU blocks, max pooling, transposed-conv and bilinear upsampling, skips."""

    def __init__(self, c: int = 16) -> None:
        super().__init__()

        def block(i: int, o: int) -> nn.Module:
            return nn.Sequential(nn.Conv2d(i, o, 3, padding=1), nn.GroupNorm(4, o), nn.GELU(),
                                 nn.Conv2d(o, o, 3, padding=1), nn.GroupNorm(4, o), nn.GELU())

        self.enc1, self.enc2, self.mid = block(3, c), block(c, 2 * c), block(2 * c, 4 * c)
        self.up2 = nn.ConvTranspose2d(4 * c, 2 * c, 2, stride=2)
        self.dec2 = block(4 * c, 2 * c)
        self.dec1 = block(3 * c, c)
        self.head = nn.Conv2d(c, 1, 1)

    def forward(self, x):
        e1 = self.enc1(x)
        e2 = self.enc2(F.max_pool2d(e1, 2))
        m = self.mid(F.max_pool2d(e2, 2))
        d2 = self.dec2(torch.cat([self.up2(m), e2], 1))
        up = F.interpolate(d2, scale_factor=2, mode="bilinear", align_corners=False)
        return self.head(self.dec1(torch.cat([up, e1], 1)))


def paired_times(plain, other, repeats: int, sync) -> tuple[float, float]:
    """Median times of two steps run alternately, call by call, so the allocator's and caches' state
    drifts alike for both (blocks of one then the other differ by up to 2x on CPU from malloc alone)."""
    plain(), other()
    sync()
    a, b = [], []
    for _ in range(repeats):
        for fn, out in ((plain, a), (other, b)):
            start = time.perf_counter()
            fn()
            sync()
            out.append(time.perf_counter() - start)
    return statistics.median(a), statistics.median(b)


def spawn_ranks(target: Callable[..., None], world: int, *args: object, timeout: float = 600) -> dict[int, object]:
    """Run ``target(rank, world, port, *args, queue)`` on ``world`` fresh processes; each puts ``(rank, result)``.

    Usage: ``per_rank = spawn_ranks(_scaling_rank, 4, args)  # {0: result, 1: result, ...}``
    """
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [ctx.Process(target=target, args=(r, world, port, *args, queue)) for r in range(world)]
    for p in procs:
        p.start()
    per_rank = dict(queue.get(timeout=timeout) for _ in procs)
    for p in procs:
        p.join()
    return per_rank


def conv_stack_rank(rank: int, world: int, port: int, args) -> tuple[nn.Module, torch.Tensor, tuple[int, ...]]:
    """One spawned rank of a domain of ``world``: the manager started, the conv stack, its input and the layout.

    Usage: ``model, x, sizes = conv_stack_rank(rank, world, port, args)  # args: channels, layers, batch, size``
    """
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    DistributedManager.initialize(batch=1, domain=world)
    torch.manual_seed(0)
    model = conv_stack(args.channels, args.layers)
    x = torch.randn(args.batch, 1, args.size, args.size)
    return model, x, domain.balanced_sizes(args.size, world)

