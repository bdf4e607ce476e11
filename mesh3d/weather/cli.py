"""``mesh3d forecast`` and ``mesh3d score``: an ensemble forecast from a checkpoint, and the scores of a forecast store.

Usage::

    torchrun --nproc-per-node 8 -m mesh3d.cli forecast examples/weather.py:model runs/weather/ckpt \\
        runs/weather/era5_like.zarr --out runs/weather/ens.zarr --init 52,53,54 --leads 10 --members 8 \\
        --perturb 0.05 --batch 2 --domain 2x2 --scores runs/weather/scores
    srun -n 8 mesh3d forecast ...                   # SLURM: the same arguments
    mesh3d score runs/weather/ens.zarr --out runs/weather/scores
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
from mesh3d.planner.mesh import parse_grid
from mesh3d.planner.spec import load_spec
from mesh3d.weather.job import run_forecast, write_scores
from mesh3d.weather.scores import score_forecast

__all__ = ["add_forecast_arguments", "add_score_arguments", "parse_channels", "run_forecast_command", "run_score_command"]


def parse_channels(items: list[str]) -> dict[str, list[Any] | None]:
    """``["z:500,850", "t:850", "t2m"]`` → ``{"z": [500, 850], "t": [850], "t2m": None}``."""
    out: dict[str, list[Any] | None] = {}
    for item in items:
        name, _, levels = item.partition(":")
        out[name] = [float(v) if "." in v else int(v) for v in levels.split(",")] if levels else None
    return out


def _inits(text: str) -> list[Any]:
    return [int(t) if t.lstrip("-").isdigit() else t for t in text.split(",") if t]


def _hours(text: str) -> np.timedelta64:
    value = text.lower().removesuffix("h")
    if not value.isdigit() or int(value) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a lead time in whole hours (e.g. 6h)")
    return np.timedelta64(int(value), "h")


def _tile(text: str) -> tuple[int, int]:
    parts = text.lower().split("x")
    if len(parts) != 2 or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise argparse.ArgumentTypeError(f"{text!r} is not a tile: give LATxLON points, e.g. 91x180")
    return int(parts[0]), int(parts[1])


def _perturbation(text: str | None) -> Any:
    if text is None:
        return None
    if ":" in text:
        return load_spec(text)
    try:
        return [float(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--perturb {text!r}: give a Gaussian scale (0.05), one per channel "
                                         "(0.05,0.1,...), or a function as module:name or file.py:name") from None


def add_forecast_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", metavar="MODULE:FACTORY", help="a function returning the model (package.module:name or file.py:name)")
    p.add_argument("checkpoint", help="a mesh3d checkpoint directory (saved on any mesh)")
    p.add_argument("dataset", help="the initial conditions (and truth): a zarr v3 store or NetCDF4/HDF5 file")
    p.add_argument("--out", required=True, help="the forecast store (zarr); an existing one of the same run is continued")
    p.add_argument("--init", required=True, type=_inits, help="init times: datetimes (2020-01-14T00) or time indices, "
                   "comma-separated")
    p.add_argument("--leads", required=True, type=int, help="lead times to forecast (model steps)")
    p.add_argument("--members", type=int, default=1, help="ensemble members per init time (default 1)")
    p.add_argument("--seed", type=int, default=0, help="the ensemble's seed (a member depends on it, never on the mesh)")
    p.add_argument("--perturb", default=None, help="initial perturbation: a Gaussian scale in normalized units, one per "
                   "channel, or a function module:name taking (x, noise)")
    p.add_argument("--model-noise", action="store_true", help="the model draws its own noise: it is called as model(x, noise)")
    p.add_argument("--channels", nargs="+", default=None, metavar="VAR[:LEVELS]",
                   help="channels, e.g. z:500 t:850 t2m (default: the checkpoint's extra['weather'])")
    p.add_argument("--stats", default=None, help="normalization JSON {'mean': [...], 'std': [...]} (default: the checkpoint's)")
    p.add_argument("--lead", type=_hours, default=None, help="the model's step, e.g. 6h (default: the checkpoint's)")
    for axis, default in (("batch", "-1"), ("domain", "1"), ("model", "1")):
        p.add_argument(f"--{axis}", dest=f"{axis}_axis", default=default,
                       help=f"{axis} axis size{' (a grid such as 2x2 splits lat x lon)' if axis == 'domain' else ''} "
                            f"(default {default})")
    p.add_argument("--plan", default=None, help="a Plan splitting the weights over the model axis (module:name; batch=None)")
    p.add_argument("--batch-size", type=int, default=1, help="samples per model call on each batch rank (default 1)")
    p.add_argument("--dtype", choices=("float32", "float64", "bfloat16"), default=None, help="cast the model (default: "
                   "the checkpoint's)")
    p.add_argument("--store-dtype", choices=("float32", "float64"), default=None, help="the store's dtype (default: the model's)")
    p.add_argument("--no-compress", action="store_true", help="store raw bytes (default: zstd, zarr's default codec)")
    p.add_argument("--tile", type=_tile, default=None, help="the store's chunk tile LATxLON (default: 8 x 8 tiles)")
    p.add_argument("--restart-every", type=int, default=1, help="keep the state every n leads for a resume (0: recompute)")
    p.add_argument("--scores", default=None, metavar="DIR", help="score the store and write scores.csv/.json/.png here")
    p.add_argument("--quiet", action="store_true", help="no progress lines")


def _load_stats(path: str | None) -> Any:
    if path is None:
        return None
    with open(path) as f:
        return ChannelStats.from_dict(json.load(f)).to_dict()


def run_forecast_command(args: argparse.Namespace) -> int:
    """Initialize the mesh, forecast (and score), print a summary on rank 0, shut down."""
    try:
        dm = DistributedManager.initialize(batch=int(args.batch_axis), domain=parse_grid(args.domain_axis),
                                           model=int(args.model_axis))
        dtype = getattr(torch, args.dtype) if args.dtype else None
        quiet = {"progress": None} if args.quiet else {}
        result, table = run_forecast(
            args.model, args.checkpoint, args.dataset, args.out, init_times=args.init, leads=args.leads,
            members=args.members, variables=parse_channels(args.channels) if args.channels else None,
            stats=_load_stats(args.stats), lead=args.lead, plan=args.plan, dtype=dtype, scores=args.scores,
            seed=args.seed, perturbation=_perturbation(args.perturb), model_noise=args.model_noise,
            batch_size=args.batch_size, tile=args.tile, store_dtype=args.store_dtype, compress=not args.no_compress,
            restart_every=args.restart_every,
            **quiet)
    except (ValueError, TypeError, FileNotFoundError, ImportError, CheckpointError) as err:
        print(f"mesh3d forecast: {err}", file=sys.stderr)
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
    DistributedManager.shutdown()
    return 0


def add_score_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("store", help="a forecast store written by mesh3d forecast")
    p.add_argument("--out", required=True, metavar="DIR", help="where scores.csv, scores.json and scores.png go")
    p.add_argument("--dataset", default=None, help="the truth (default: the dataset the forecast read)")
    for axis, default in (("batch", "-1"), ("domain", "1")):
        p.add_argument(f"--{axis}", dest=f"{axis}_axis", default=default, help=f"{axis} axis size (default {default})")


def run_score_command(args: argparse.Namespace) -> int:
    try:
        dm = DistributedManager.initialize(batch=int(args.batch_axis), domain=parse_grid(args.domain_axis), model=1)
        table = score_forecast(args.store, args.dataset)
    except (ValueError, FileNotFoundError) as err:
        print(f"mesh3d score: {err}", file=sys.stderr)
        return 2
    if dm.rank == 0:
        write_scores(table, args.out)
        print(table.format(), flush=True)
    DistributedManager.shutdown()
    return 0
