"""``run_forecast``: from a trained checkpoint to a written, scored ensemble forecast (what ``mesh3d forecast`` runs).

The model is built by its factory, split over the model axis when a plan says so (``Plan(model=..., batch=None)``:
inference keeps the weights whole on each batch rank), loaded from the checkpoint (saved on any mesh), cast to
``dtype`` and put in eval mode; then :func:`forecast_ensemble` writes the store and, with ``scores=``, every rank
scores it and global rank 0 writes the score files there (``write_score_files``: ``scores.nc``, ``.csv``, ``.json``,
``.txt``, ``.png``).

The dataset's channels, its normalization and the model's lead time come from the arguments or, when not given,
from the checkpoint's ``extra["weather"]`` (``{"variables": ..., "stats": ..., "lead_hours": 6}``; the weather
example saves them).

Usage::

    dm = DistributedManager.initialize(batch=2, domain=(2, 2))            # or one process: no manager
    result, table = run_forecast("examples/weather.py:model", "runs/weather/ckpt", "runs/weather/era5_like.zarr",
                                 "runs/weather/ens.zarr", init_times=[52, 53, 54], leads=10, members=8,
                                 perturbation=0.05, scores="runs/weather/scores")
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch
from torch import nn

from mesh3d.checkpoint import load as load_checkpoint
from mesh3d.checkpoint import read_index
from mesh3d.data.weather_channels import Channel
from mesh3d.manager import DistributedManager
from mesh3d.parallel import Plan, parallelize
from mesh3d.planner.spec import load_model_factory, load_plan
from mesh3d.weather.campaign import ForecastResult, forecast_ensemble
from mesh3d.weather.inputs import variable_pairs
from mesh3d.weather.score_files import write_score_files
from mesh3d.weather.scores import ScoreTable, score_forecast
from mesh3d.weather.store import ForecastStore

__all__ = ["load_forecast_model", "run_forecast", "weather_settings"]


def weather_settings(checkpoint: str | os.PathLike, variables: Any = None, stats: Any = None,
                     lead: Any = None) -> tuple[Any, Any, Any]:
    """``(variables, stats, lead)``: those given, the rest from the checkpoint's ``extra["weather"]``.

    Usage: ``variables, stats, lead = weather_settings("ckpt")``
    """
    saved = (read_index(os.fspath(checkpoint)).get("extra") or {}).get("weather") or {}
    if variables is None and isinstance(saved.get("variables"), Mapping) and len(saved["variables"]) > 1:
        raise ValueError(f"{checkpoint}: extra['weather']['variables'] is a mapping, whose order the checkpoint's JSON "
                         "does not keep; save [[name, levels], ...] pairs (mesh3d.weather.weather_extra(dataset)), or "
                         "pass the channels (--channels z:500 t2m ...)")
    given = variables
    variables = variables if variables is not None else saved.get("variables")
    if saved.get("channels") is not None and variables is not None:
        names = [Channel(name, level).name for name, levels in variable_pairs(variables) for level in (levels or [None])]
        if names != list(saved["channels"]):
            raise ValueError(f"the channels {names} {'given' if given is not None else 'named'} are not the ones the "
                             f"checkpoint's model was trained on, in its order: {list(saved['channels'])}")
    stats = stats if stats is not None else saved.get("stats")
    if lead is None and saved.get("lead_hours") is not None:
        lead = np.timedelta64(int(saved["lead_hours"]), "h")
    if variables is None:
        raise ValueError(f"{checkpoint}: its extra['weather'] names no variables; pass them (--channels z:500 t2m ...), "
                         "or save the checkpoint with extra={'weather': {'variables': ..., 'stats': ..., 'lead_hours': ...}}")
    return variables, stats, lead if lead is not None else 1


def load_forecast_model(model: str | Callable[[], nn.Module], checkpoint: str | os.PathLike, *,
                        plan: str | Plan | None = None, dtype: torch.dtype | None = None) -> nn.Module:
    """The model for inference: built, split over the model axis by ``plan`` (if any), loaded, cast, in eval mode.

    Usage: ``net = load_forecast_model("examples/weather.py:model", "ckpt", dtype=torch.float64)``
    """
    net = load_model_factory(model)()
    if plan is not None:
        chosen = load_plan(plan)
        if chosen.batch is not None:
            raise ValueError(f"a forecast keeps the weights whole on each batch rank; the plan shards them over batch "
                             f"(batch={chosen.batch!r}): use Plan(model=..., batch=None) (the model axis splits them)")
        net = parallelize(net, chosen)
    if DistributedManager.is_initialized():
        device = DistributedManager().device
        if next(iter(net.parameters()), torch.empty(0)).device.type != device.type:
            net = net.to(device)
    load_checkpoint(os.fspath(checkpoint), net)
    if dtype is not None:
        net = net.to(dtype)
    return net.eval()


def run_forecast(model: str | Callable[[], nn.Module], checkpoint: str | os.PathLike, source: Any, out: str, *,
                 init_times: Any, leads: int, members: int = 1, variables: Any = None, stats: Any = None, lead: Any = None,
                 plan: str | Plan | None = None, dtype: torch.dtype | None = None, scores: str | None = None,
                 names: Mapping[str, str] | None = None, **options: Any) -> tuple[ForecastResult, ScoreTable | None]:
    """Load ``checkpoint`` into ``model`` and forecast (``options``: :func:`forecast_ensemble`'s); every rank calls it.

    Usage: ``result, table = run_forecast("pkg.mod:make", "ckpt", "era5.zarr", "fc.zarr", init_times=[...], leads=10)``
    """
    variables, stats, lead = weather_settings(checkpoint, variables, stats, lead)
    net = load_forecast_model(model, checkpoint, plan=plan, dtype=dtype)
    index = read_index(os.fspath(checkpoint))
    run = {"model": model if isinstance(model, str) else getattr(model, "__qualname__", "a function"),
           "checkpoint": os.path.abspath(os.fspath(checkpoint)), "step": index.get("step"),
           "dtype": str(next(iter(net.parameters()), torch.empty(0)).dtype).removeprefix("torch."), **options.pop("run", {})}
    result = forecast_ensemble(net, source, variables, out, init_times=init_times, leads=leads, lead=lead, stats=stats,
                               members=members, names=names, run=run, **options)
    if scores is None:
        return result, None
    if not ForecastStore(out).complete:   # NOTE: a job of some members only; the job that completes the store scores it
        return result, None
    table = score_forecast(out)
    if not DistributedManager.is_initialized() or DistributedManager().rank == 0:
        write_score_files(table, scores, title=f"{run['model']} (step {run['step']}): {members} members")
    return result, table
