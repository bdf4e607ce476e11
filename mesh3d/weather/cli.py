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
from mesh3d.faults import CollectiveTimeoutError, PeerLostError
from mesh3d.faults.summary import ranks_text, shared_ranks
from mesh3d.manager import DistributedManager
from mesh3d.mesh_shape import parse_grid
from mesh3d.planner.spec import load_spec
from mesh3d.weather.job import run_forecast
from mesh3d.weather.agreement import agreed_checks
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
        try:
            DistributedManager.shutdown()
        except CheckpointError:
            pass  # a pending save's failure: the command already reports its own


#: What ends a forecast or a scoring in one line: a bad argument, a rank's failure agreed by every rank
#: (CheckpointError), a peer lost or a collective timed out (named by the watch), a file that cannot be read or
#: written. Anything else is a bug: its traceback is shown.
REPORTED = (ValueError, TypeError, ImportError, OSError, CheckpointError, PeerLostError, CollectiveTimeoutError)


def report(command: str, err: BaseException) -> int:
    """Print ``err`` in one line on stderr, once: an error every rank shares (a wrong rank count, an agreed failure)
    by the lowest of them, a rank's own error by that rank, naming it; shut the mesh down; return the exit status 2."""
    ranks = shared_ranks(err)
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_available() and dist.is_initialized() else (0, 1)
    text = " ".join(str(err).split()) or type(err).__name__
    if not isinstance(err, (ValueError, CheckpointError, PeerLostError, CollectiveTimeoutError)):
        text = f"{type(err).__name__}: {text}"
    if ranks is not None and len(ranks) > 1:
        text += f" ({ranks_text(ranks)}{': every rank' if len(ranks) == world else ''}, reported once)"
    elif world > 1 and not isinstance(err, (PeerLostError, CollectiveTimeoutError)):
        who = DistributedManager().describe_rank(rank) if DistributedManager.is_initialized() else f"rank {rank}"
        text = f"{who}: {text}"
    if ranks is None or rank == min(ranks):
        print(f"mesh3d {command}: {text}", file=sys.stderr, flush=True)
    _shut_down()
    return 2


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
            restart_every=args.restart_every, convention=args.convention,
            **quiet)
    except REPORTED as err:
        return report("forecast", err)
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
        metrics = args.metrics.split(",") if args.metrics else None
        regions, clim = agreed_checks("mesh3d score: the arguments", lambda: (
            parse_regions(args.regions), open_climatology(args.climatology) if args.climatology else None), dm)
        tables = score_regions(args.store, args.dataset, climatology=clim, regions=regions, metrics=metrics)
    except REPORTED as err:
        return report("score", err)
    if dm.rank == 0:
        boxes = {r.name: r for r in regions}
        write_score_files(tables, args.out, regions=boxes)
        print(summary_text(tables, boxes), flush=True)
    DistributedManager.shutdown()
    return 0
