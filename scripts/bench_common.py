"""Helpers the benchmark scripts share: this process's RSS and the step-time/memory ratio plot.

Usage (from a script in scripts/, whose folder is on sys.path)::

    from bench_common import peak_rss_kb, plot_ratios, reset_peak_rss, rss_kb
    base = rss_kb()
    reset_peak_rss(); ...; extra_kb = peak_rss_kb() - base     # the peak of one phase
    plot_ratios("docs/benchmarks/x.png", step_ratio, memory_ratio, ylabel="mesh3d / by hand")
"""

from __future__ import annotations

import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch.distributed as dist


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
