"""Forecast memory and write throughput: peak memory per rank on a domain of D ranks against one process, for a
721 x 1440 field with 70 channels, its growth over the leads, and the forecast store's write throughput against
``np.save`` of the same bytes.

Usage::

    python scripts/bench_forecast.py --leads 10 --repeat 3             # 721 x 1440 x 70, D = 4: docs/benchmarks
    python scripts/bench_forecast.py --leads 60 --json docs/benchmarks/forecast_60.json   # flat over 60 leads?
    python scripts/bench_forecast.py --lat 361 --lon 720 --domain 4    # a smaller field

The script writes a synthetic dataset (70 surface fields, 2 times, fp32, zarr v3: the forecast reads only its
initial state) under ``--work``, then runs the same forecast (``mesh3d.weather.forecast_ensemble``: a residual pair
of 3x3 sphere convolutions 70 -> 16 -> 70 channels, fp32, one member, no restart state) three times, each in fresh
processes: alone, under torchrun on D ranks (the domain split in latitude slabs), and on D ranks again with
``release_memory=False`` (glibc's adaptive mmap threshold, what the forecast did before). Each process records its
peak RSS (VmHWM, reset after imports and the model), its RSS and peak after every lead, and the seconds its writes
took, then times ``np.save`` of the bytes it wrote into the same directory (one new file per lead, as the store
writes them) right after. It prints a table and writes docs/benchmarks/forecast.json and forecast.png (``--raw``: an
uncompressed store; ``--json`` names the output; ``--repeat N`` runs the two D-rank variants N times each,
alternating, and reports the ratio of their median times).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from bench_common import BENCH, cpu_model, peak_rss_kb, reset_peak_rss, rss_kb  # noqa: E402

WIDTH = 16


def variables(channels: int) -> list[str]:
    return [f"c{i:02d}" for i in range(channels)]


def write_dataset(path: str, lat: int, lon: int, channels: int, times: int) -> None:
    """``channels`` surface fields of smooth waves plus noise, fp32, chunked by 8 x 8 tiles, ``times`` 6-hourly times."""
    import xarray as xr

    g = np.random.default_rng(0)
    la = np.linspace(90, -90, lat)
    lo = np.arange(lon) * 360.0 / lon
    base = (np.cos(np.radians(la))[:, None] * np.sin(2 * np.radians(lo))[None, :]).astype(np.float32)
    data = {}
    for i, name in enumerate(variables(channels)):
        field = np.stack([base * (1 + 0.01 * i) + 0.1 * g.standard_normal((lat, lon), dtype=np.float32)
                          for _ in range(times)])
        data[name] = (("time", "lat", "lon"), field, {"units": "1"})
    ds = xr.Dataset(data, coords={"time": np.datetime64("2020-01-01T00", "ns") + np.arange(times) * np.timedelta64(6, "h"),
                                  "lat": la, "lon": lo})
    chunks = (1, -(-lat // 8), -(-lon // 8))
    ds.to_zarr(path, mode="w", consolidated=False, encoding={v: {"chunks": chunks} for v in data})


def model(channels: int):
    import torch
    from torch import nn

    from mesh3d.weather import SphereConv2d

    class Residual(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.net = nn.Sequential(SphereConv2d(channels, WIDTH, 3), nn.GELU(), SphereConv2d(WIDTH, channels, 3))

        def forward(self, x):
            return x + 0.1 * self.net(x)

    return Residual()


def worker(args: argparse.Namespace) -> None:
    """One process of the forecast (alone, or a rank under torchrun): prints one JSON line per rank (rank 0 gathers)."""
    import torch
    import torch.distributed as dist

    from mesh3d import DistributedManager
    from mesh3d.weather import forecast_ensemble

    world = int(os.environ.get("WORLD_SIZE", "1"))
    dm = DistributedManager.initialize(batch=1, domain=world, model=1) if world > 1 else None
    import xarray  # noqa: F401  (imported here: the baseline is the process after imports)
    import zarr  # noqa: F401

    torch.set_num_threads(1)
    net = model(args.channels)
    stats = {"mean": [0.0] * args.channels, "std": [1.0] * args.channels}
    base = rss_kb()
    reset_peak_rss()
    started = time.perf_counter()
    per_lead: list[list[int]] = []   # after each lead: [RSS, peak RSS since the last lead] in KiB

    def trace(_progress) -> None:
        per_lead.append([rss_kb(), peak_rss_kb()])
        reset_peak_rss()

    result = forecast_ensemble(net, args.data, variables(args.channels), args.out, init_times=[0], leads=args.leads,
                               stats=stats, restart_every=0, progress=trace, compress=not args.raw,
                               release_memory=not args.glibc_default)
    peak, seconds = max([peak_rss_kb(), *(p for _, p in per_lead)]), time.perf_counter() - started
    # NOTE: np.save of the bytes this process wrote, as many new files as leads, right after the store's writes:
    # both under the same load (other jobs on this machine move disk and page-cache rates by several times).
    save_seconds = time_np_save(os.path.dirname(args.out), result.bytes_written // args.leads, args.leads)
    record = {"rank": dm.rank if dm else 0, "world": world, "baseline_kb": base, "peak_kb": peak, "seconds": seconds,
              "write_seconds": result.write_seconds, "bytes_written": result.bytes_written,
              "np_save_seconds": save_seconds, "per_lead_kb": per_lead}
    records = [record]
    if dm is not None:
        records = [None] * world
        dist.all_gather_object(records, record)
        DistributedManager.shutdown()
    if record["rank"] == 0:
        print("RESULT " + json.dumps(records), flush=True)


def above(record: dict) -> int:
    """A process's peak RSS above its RSS after imports and the model, in KiB."""
    return record["peak_kb"] - record["baseline_kb"]


def lead_growth(record: dict) -> float:
    """The peak RSS above the baseline in the last lead over that in lead 2 (1.0: flat; lead 1 reads the dataset)."""
    per_lead = record["per_lead_kb"]
    if len(per_lead) < 2:
        return 1.0
    return (per_lead[-1][1] - record["baseline_kb"]) / (per_lead[1][1] - record["baseline_kb"])


def run_forecast(args: argparse.Namespace, world: int, out: str, glibc_default: bool = False) -> list[dict]:
    shutil.rmtree(out, ignore_errors=True)
    common = [str(Path(__file__)), "--worker", "--data", args.data, "--out", out, "--channels", str(args.channels),
              "--leads", str(args.leads), *(["--raw"] if args.raw else []), *(["--glibc-default"] if glibc_default else [])]
    launch = [sys.executable, *common] if world == 1 else \
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(world), *common]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(HERE.parent)}
    done = subprocess.run(launch, env=env, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"the forecast on {world} process(es) failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    line = next(x for x in done.stdout.splitlines() if x.startswith("RESULT "))
    return json.loads(line.removeprefix("RESULT "))


def time_np_save(directory: str, nbytes: int, files: int) -> float:
    """Seconds ``np.save`` takes to write ``files`` new files of ``nbytes`` (fp32) into ``directory``, as the store
    writes its leads: each a new file, no fsync (the store's chunks are not fsynced either)."""
    array = np.random.default_rng(1).standard_normal(nbytes // 4, dtype=np.float32)
    paths = [os.path.join(directory, f"np_save_{os.getpid()}_{i}.npy") for i in range(files)]
    start = time.perf_counter()
    for path in paths:
        np.save(path, array)
    seconds = time.perf_counter() - start
    for path in paths:
        os.remove(path)
    return seconds


def plot(path: Path, summary: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, c, b) = plt.subplots(1, 3, figsize=(15, 3.8), constrained_layout=True)
    one, ranks = summary["one_process"], summary["ranks"]
    labels = ["one process"] + [f"rank {r['rank']}" for r in ranks]
    totals = [one["peak_kb"] / 2 ** 20] + [r["peak_kb"] / 2 ** 20 for r in ranks]
    above_gib = [above(one) / 2 ** 20] + [above(r) / 2 ** 20 for r in ranks]
    x = np.arange(len(labels))
    a.bar(x - 0.2, totals, 0.4, label="peak RSS")
    a.bar(x + 0.2, above_gib, 0.4, label="peak above the process after imports")
    a.axhline(0.30 * above_gib[0], color="C1", ls=":", lw=1.0, label="0.30 x one process's peak above imports")
    a.set_xticks(x, labels, rotation=20)
    a.set_ylabel("GiB")
    a.set_title(f"{summary['field']}, D = {summary['domain']}, {summary['leads']} leads")
    a.legend(fontsize=8)
    worst = max(ranks, key=lambda r: r["peak_kb"])
    adaptive = max(summary["ranks_glibc_default"], key=lambda r: r["peak_kb"])
    for record, label, style in ((one, "one process", "-"), (worst, f"worst of {summary['domain']} ranks", "-"),
                                 (adaptive, "worst rank, glibc's adaptive mmap threshold", "--")):
        leads = np.arange(1, len(record["per_lead_kb"]) + 1)
        c.plot(leads, [(p - record["baseline_kb"]) / 2 ** 10 for _, p in record["per_lead_kb"]], style, marker=".",
               label=label)
    c.set_yscale("log")
    c.set_xlabel("lead")
    c.set_ylabel("peak RSS in the lead above imports (MiB)")
    c.set_title("per lead")
    c.legend(fontsize=8)
    groups = ["one process", f"D = {summary['domain']}, all ranks"]
    x2 = np.arange(2)
    b.bar(x2 - 0.2, [summary["store_one_mb_s"], summary["store_ranks_mb_s"]], 0.4, label="forecast store (zarr)")
    b.bar(x2 + 0.2, [summary["np_save_one_mb_s"], summary["np_save_ranks_mb_s"]], 0.4, color="grey",
          label="np.save, the same bytes")
    b.set_xticks(x2, groups)
    b.legend(fontsize=8)
    b.set_ylabel("MB/s (same disk, right after)")
    b.set_title("write throughput")
    fig.suptitle(summary["machine"], fontsize=9)
    fig.savefig(path, dpi=90)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lat", type=int, default=721)
    parser.add_argument("--lon", type=int, default=1440)
    parser.add_argument("--channels", type=int, default=70)
    parser.add_argument("--domain", type=int, default=4)
    parser.add_argument("--leads", type=int, default=2)
    parser.add_argument("--work", default="runs/bench_forecast")
    parser.add_argument("--json", default=str(BENCH / "forecast.json"))
    parser.add_argument("--raw", action="store_true", help="an uncompressed store (default: zstd, zarr's default)")
    parser.add_argument("--repeat", type=int, default=1,
                        help="run the two D-rank variants this many times each, alternating, for their time ratio")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--glibc-default", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--data", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return 0
    os.makedirs(args.work, exist_ok=True)
    args.data = os.path.join(args.work, f"data_{args.lat}x{args.lon}x{args.channels}.zarr")
    if not os.path.exists(args.data):
        write_dataset(args.data, args.lat, args.lon, args.channels, 2)
    one = run_forecast(args, 1, os.path.join(args.work, "one.zarr"))[0]
    # NOTE: the two D-rank variants alternate, so that a slow spell of the machine falls on both alike; the
    # records kept are those of the last run of each, the time ratio is that of the medians of the slowest ranks.
    ranks_seconds, adaptive_seconds = [], []
    for _ in range(args.repeat):
        ranks = run_forecast(args, args.domain, os.path.join(args.work, "ranks.zarr"))
        adaptive = run_forecast(args, args.domain, os.path.join(args.work, "ranks_glibc.zarr"), glibc_default=True)
        ranks_seconds.append(max(r["seconds"] for r in ranks))
        adaptive_seconds.append(max(r["seconds"] for r in adaptive))
    worst = max(ranks, key=lambda r: r["peak_kb"])
    worst_adaptive = max(adaptive, key=lambda r: r["peak_kb"])
    summary = {
        "machine": f"{cpu_model()}, {os.cpu_count()} cores, torch {__import__('torch').__version__}",
        "field": f"{args.lat} x {args.lon} x {args.channels} fp32", "domain": args.domain, "leads": args.leads,
        "one_process": one, "ranks": ranks, "ranks_glibc_default": adaptive,
        "peak_ratio": worst["peak_kb"] / one["peak_kb"],
        "peak_above_baseline_ratio": above(worst) / above(one),
        "glibc_default_peak_above_baseline_ratio": above(worst_adaptive) / above(one),
        # NOTE: growth over the leads: the worst rank's peak in the last lead over its peak in lead 2
        "rank_growth_last_over_lead2": lead_growth(worst), "glibc_default_growth_last_over_lead2": lead_growth(worst_adaptive),
        "one_growth_last_over_lead2": lead_growth(one),
        "ranks_seconds": ranks_seconds, "glibc_default_seconds": adaptive_seconds,
        "seconds_over_glibc_default": float(np.median(ranks_seconds) / np.median(adaptive_seconds)),
        "np_save_one_mb_s": one["bytes_written"] / one["np_save_seconds"] / 1e6,
        "np_save_ranks_mb_s": sum(r["bytes_written"] for r in ranks) / max(r["np_save_seconds"] for r in ranks) / 1e6,
        "store_one_mb_s": one["bytes_written"] / one["write_seconds"] / 1e6,
        "store_ranks_mb_s": sum(r["bytes_written"] for r in ranks) / max(r["write_seconds"] for r in ranks) / 1e6,
        "load_average": os.getloadavg()[0],
    }
    summary["store_one_vs_np_save"] = summary["store_one_mb_s"] / summary["np_save_one_mb_s"]
    summary["store_ranks_vs_np_save"] = summary["store_ranks_mb_s"] / summary["np_save_ranks_mb_s"]
    Path(args.json).write_text(json.dumps(summary, indent=1))
    plot(Path(args.json).with_suffix(".png"), summary)
    gib = lambda kb: kb / 2 ** 20  # noqa: E731
    print(f"{summary['field']}, D = {args.domain}, {args.leads} leads on {summary['machine']}")
    print(f"peak RSS: one process {gib(one['peak_kb']):.2f} GiB ({gib(one['peak_kb'] - one['baseline_kb']):.2f} above its "
          f"{gib(one['baseline_kb']):.2f} after imports); worst rank {gib(worst['peak_kb']):.2f} GiB "
          f"({gib(worst['peak_kb'] - worst['baseline_kb']):.2f} above): ratio {summary['peak_ratio']:.2f} "
          f"(above baseline {summary['peak_above_baseline_ratio']:.2f}; glibc's adaptive threshold "
          f"{summary['glibc_default_peak_above_baseline_ratio']:.2f}); goal <= 0.30 above baseline")
    print(f"growth, peak in lead {args.leads} over lead 2: worst rank {summary['rank_growth_last_over_lead2']:.3f} "
          f"(glibc's adaptive threshold {summary['glibc_default_growth_last_over_lead2']:.3f}), one process "
          f"{summary['one_growth_last_over_lead2']:.3f}")
    print(f"time, slowest rank (median of {args.repeat}): {np.median(ranks_seconds):.1f} s, glibc's adaptive threshold "
          f"{np.median(adaptive_seconds):.1f} s: ratio {summary['seconds_over_glibc_default']:.3f}")
    print(f"write throughput: one process: store {summary['store_one_mb_s']:.0f} MB/s, np.save {summary['np_save_one_mb_s']:.0f}"
          f" MB/s ({summary['store_one_vs_np_save']:.2f}x); {args.domain} ranks together: store "
          f"{summary['store_ranks_mb_s']:.0f} MB/s, np.save {summary['np_save_ranks_mb_s']:.0f} MB/s "
          f"({summary['store_ranks_vs_np_save']:.2f}x); load average {summary['load_average']:.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
