"""``mesh3d forecast`` and ``mesh3d score``: an ensemble forecast from a checkpoint, and the scores of a forecast store
(their arguments: ``mesh3d.commands``).

Usage::

    torchrun --nproc-per-node 8 -m mesh3d.cli forecast examples/weather.py:model runs/weather/ckpt \\
        runs/weather/era5_like.zarr --out runs/weather/ens.zarr --init 52,53,54 --leads 10 --members 8 \\
        --perturb 0.05 --batch 2 --domain 2x2 --scores runs/weather/scores
    srun -n 8 mesh3d forecast ...                   # SLURM: the same arguments
    mesh3d score runs/weather/ens.zarr --out runs/weather/scores --region global --region tropics \\
        --region alps=44:49,5:17 --metrics rmse,crps,acc,member_rmse --climatology clim.nc
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from mesh3d.checkpoint import CheckpointError
from mesh3d.data.weather_channels import ChannelStats
from mesh3d.manager import DistributedManager
from mesh3d.mesh_shape import parse_grid
from mesh3d.planner.spec import load_spec
from mesh3d.weather.job import run_forecast
from mesh3d.weather.climatology import open_climatology
from mesh3d.weather.regions import parse_regions
from mesh3d.weather.score_files import summary_text, write_score_files
from mesh3d.weather.scores import score_regions

__all__ = ["parse_channels", "run_forecast_command", "run_score_command"]


def parse_channels(items: list[str]) -> dict[str, list[Any] | None]:
    """``["z:500,850", "t:850", "t2m"]`` → ``{"z": [500, 850], "t": [850], "t2m": None}``."""
    out: dict[str, list[Any] | None] = {}
    for item in items:
        name, _, levels = item.partition(":")
        out[name] = [float(v) if "." in v else int(v) for v in levels.split(",")] if levels else None
    return out


def _perturbation(text: str | None) -> Any:
    if text is None:
        return None
    if ":" in text:
        return load_spec(text)
    try:
        return [float(v) for v in text.split(",")]
    except ValueError:
        raise ValueError(f"--perturb {text!r}: give a Gaussian scale (0.05), one per channel "
                         "(0.05,0.1,...), or a function as module:name or file.py:name") from None


def _load_stats(path: str | None) -> Any:
    if path is None:
        return None
    with open(path) as f:
        return ChannelStats.from_dict(json.load(f)).to_dict()


def _shut_down() -> None:
    """The mesh gone after a refusal too (the command may run inside a process that goes on: mesh3d.cli.main)."""
    if DistributedManager.is_initialized():
        DistributedManager.shutdown()


def run_forecast_command(args: argparse.Namespace) -> int:
    """Initialize the mesh, forecast (and score), print a summary on rank 0, shut down."""
    try:
        dm = DistributedManager.initialize(batch=int(args.batch_axis), domain=parse_grid(args.domain_axis),
                                           model=int(args.model_axis))
        dtype = getattr(torch, args.dtype) if args.dtype else None
        quiet = {"progress": None} if args.quiet else {}
        lead = None if args.lead is None else np.timedelta64(args.lead, "h")  # --lead 6h: parsed to hours
        result, table = run_forecast(
            args.model, args.checkpoint, args.dataset, args.out, init_times=args.init, leads=args.leads,
            members=args.members, variables=parse_channels(args.channels) if args.channels else None,
            stats=_load_stats(args.stats), lead=lead, plan=args.plan, dtype=dtype, scores=args.scores,
            seed=args.seed, member_range=args.member_range, perturbation=_perturbation(args.perturb),
            model_noise=args.model_noise,
            batch_size=args.batch_size, tile=args.tile, store_dtype=args.store_dtype, compress=not args.no_compress,
            restart_every=args.restart_every,
            **quiet)
    except (ValueError, TypeError, FileNotFoundError, ImportError, CheckpointError) as err:
        print(f"mesh3d forecast: {err}", file=sys.stderr)
        _shut_down()
        return 2
    # NOTE: a batch rank's domain and model ranks all count its samples' skipped and recomputed leads: one of them says.
    leader = dm.coordinates["domain"] == 0 and dm.coordinates["model"] == 0
    counts = torch.tensor([result.written, result.skipped * leader, result.recomputed * leader, result.bytes_written],
                          dtype=torch.float64)
    if dm.world_size > 1:
        dist.all_reduce(counts, group=dm.world_mesh.get_group())
    if dm.rank == 0:
        written, skipped, recomputed, nbytes = (int(v) for v in counts.tolist())
        print(f"forecast: {args.out}: {written} blocks written ({nbytes / 1e6:.1f} MB) by {dm.world_size} rank(s) in "
              f"{result.seconds:.1f} s; {skipped} sample-leads were already written (not rewritten), {recomputed} "
              f"steps recomputed", flush=True)
        if table is not None:
            print(table.format(), flush=True)
        elif args.scores:
            print(f"forecast: {args.out} still lacks members of other jobs (--member-range): not scored; the job that "
                  "completes it scores it (or run mesh3d score)", flush=True)
    DistributedManager.shutdown()
    return 0


def run_score_command(args: argparse.Namespace) -> int:
    try:
        dm = DistributedManager.initialize(batch=int(args.batch_axis), domain=parse_grid(args.domain_axis), model=1)
        regions = parse_regions(args.regions)
        metrics = args.metrics.split(",") if args.metrics else None
        clim = open_climatology(args.climatology) if args.climatology else None
        tables = score_regions(args.store, args.dataset, climatology=clim, regions=regions, metrics=metrics)
    except (ValueError, FileNotFoundError, CheckpointError) as err:   # CheckpointError: a rank's failure, agreed
        print(f"mesh3d score: {err}", file=sys.stderr)
        _shut_down()
        return 2
    if dm.rank == 0:
        boxes = {r.name: r for r in regions}
        write_score_files(tables, args.out, regions=boxes)
        print(summary_text(tables, boxes), flush=True)
    DistributedManager.shutdown()
    return 0
