"""Ensemble scores of a forecast store against the dataset's truth, on the mesh, without gathering a field.

Per channel and lead, over the init times (each rank reads its (lat, lon) block of every member and of the truth,
reduces it to a few latitude-weighted sums per channel, and one all-reduce of those sums gives every rank the table):

- ``rmse``: of the ensemble mean, ``sqrt(mean_t <(mean_m f - o)^2>)``, where ``<g>`` is the latitude-weighted mean
  over the globe (``LatLonGrid.weights``, WeatherBench 2's cell-area rule);
- ``crps``: the fair CRPS, ``mean_t <1/M sum_m |f_m - o| - 1/(2 M (M - 1)) sum_m sum_m' |f_m - f_m'|>`` (the second
  term 0 for one member: then it is the mean absolute error);
- ``spread``: ``sqrt(mean_t <var_m f>)`` with the unbiased member variance (NaN for one member), and
  ``spread_skill = spread / rmse``;
- ``acc``: of the ensemble mean, ``mean_t <fa oa> / sqrt(<fa^2> <oa^2>)`` with anomalies from ``climatology``
  (default: each channel's normalization mean, a constant field).

Leads whose valid time is past the dataset's end are NaN (``inits`` counts the init times scored at each lead).
Per member, ``member_rmse`` and ``member_mae`` score each member alone. ``score_regions`` gives a table per named
region (mesh3d/weather/regions.py: the weights restricted to a lat/lon box), all from the same reads and one
all-reduce; ``metrics=`` chooses what the tables report (``METRICS``).

Usage::

    table = score_forecast("fc.zarr")                  # every rank calls it; the dataset and stats from the store's record
    print(table.format()); table.to_csv("scores.csv"); table.to_json("scores.json")
    tables = score_regions("fc.zarr", regions=["global", "tropics", "alps=44:49,5:17"], metrics=["rmse", "acc"])
"""

from __future__ import annotations

import csv
import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from mesh3d.checkpoint.comm import collective_step
from mesh3d.manager import DistributedManager
from mesh3d.weather.agreement import agreed_checks
from mesh3d.weather.climatology import check_climatology, climatology_block
from mesh3d.weather.grid import lat_weights
from mesh3d.weather.inputs import ForecastInputs
from mesh3d.weather.layout import FieldBlocks
from mesh3d.weather.regions import Region, parse_regions
from mesh3d.weather.fields import FieldArrays
from mesh3d.weather.store import read_spec

__all__ = ["METRICS", "SCORES", "ScoreTable", "block_sums", "member_block_sums", "score_forecast", "score_regions",
           "scores_from_sums"]

SCORES = ("rmse", "crps", "spread", "spread_skill", "acc")
#: Scores of each member alone, ``(leads, members, channels)``: the RMSE and the mean absolute error.
MEMBER_SCORES = ("member_rmse", "member_mae")
METRICS = SCORES + MEMBER_SCORES
#: The latitude-weighted sums per (init, lead, channel) that the scores are made of, in this order.
SUMS = ("sq_err", "abs_err", "pair_abs", "variance", "fa_oa", "fa_fa", "oa_oa", "count")


@dataclass
class ScoreTable:
    """Scores per lead and channel (arrays ``(leads, channels)``), with the channels' names and units.

    Usage: ``table.rmse[lead_index, channel_index]``; ``table.rows()``; ``table.format()``
    """

    channels: list[str]
    units: list[str]
    lead_hours: list[float]
    members: int
    inits: np.ndarray
    rmse: np.ndarray
    crps: np.ndarray
    spread: np.ndarray
    spread_skill: np.ndarray
    acc: np.ndarray
    #: Each channel's normalization std (what the score figure divides RMSE and CRPS by), when known.
    scale: list[float] | None = None
    #: The region the scores average over (``mesh3d.weather.regions``).
    region: str = "global"
    #: Each member alone, ``(leads, members, channels)``: RMSE and mean absolute error (None: not computed).
    member_rmse: np.ndarray | None = None
    member_mae: np.ndarray | None = None
    #: What ``rows``, ``member_rows``, ``format`` and the files report (a subset of ``METRICS``, in its order).
    metrics: tuple[str, ...] = SCORES

    def rows(self) -> list[dict[str, Any]]:
        """One dict per (lead, channel): region, lead_hours, channel, units, inits and each chosen ensemble score (None
        for NaN)."""
        out = []
        for k, h in enumerate(self.lead_hours):
            for c, name in enumerate(self.channels):
                row: dict[str, Any] = {"region": self.region, "lead_hours": h, "channel": name, "units": self.units[c],
                                       "inits": int(self.inits[k])}
                for score in (m for m in self.metrics if m in SCORES):
                    row[score] = _value(getattr(self, score)[k, c])
                out.append(row)
        return out

    def member_rows(self) -> list[dict[str, Any]]:
        """One dict per (lead, member, channel) with each chosen member score; empty when none is chosen."""
        chosen = [m for m in self.metrics if m in MEMBER_SCORES and getattr(self, m) is not None]
        if not chosen:
            return []
        return [{"region": self.region, "lead_hours": h, "member": j, "channel": name, "units": self.units[c],
                 "inits": int(self.inits[k]), **{m: _value(getattr(self, m)[k, j, c]) for m in chosen}}
                for k, h in enumerate(self.lead_hours) for j in range(self.members)
                for c, name in enumerate(self.channels)]

    def to_csv(self, path: str | os.PathLike) -> None:
        write_csv(path, self.rows())

    def to_json(self, path: str | os.PathLike) -> None:
        with open(path, "w") as f:
            json.dump({"members": self.members, "region": self.region, "scores": self.rows(),
                       "member_scores": self.member_rows()}, f, indent=1)

    def format(self) -> str:
        """The table as text, one line per (lead, channel), each chosen score labelled with the channel and its units."""
        columns = [c for c in _COLUMNS if c[0] in self.metrics]
        lines = [f"{'lead':>7}  {'channel':<10} " + " ".join(f"{label:>{width}}" for _, label, width, _ in columns)
                 + "  units"]
        for r in self.rows():
            cells = [f"{r[name]:{fmt}}" if r[name] is not None else "n/a" for name, _, _, fmt in columns]
            lines.append(f"{r['lead_hours']:>5g} h  {r['channel']:<10} "
                         + " ".join(f"{cell:>{width}}" for cell, (_, _, width, _) in zip(cells, columns))
                         + f"  {r['units'] or '-'}")
        return "\n".join(lines)


#: ``format``'s columns: (score, label, width, number format).
_COLUMNS = (("rmse", "RMSE", 11, "11.4g"), ("crps", "CRPS", 11, "11.4g"), ("spread", "spread", 11, "11.4g"),
            ("spread_skill", "spread/skill", 12, "12.3f"), ("acc", "ACC", 7, "7.4f"))


def _value(v: Any) -> float | None:
    v = float(v)
    return None if np.isnan(v) else v


def write_csv(path: str | os.PathLike, rows: list[dict[str, Any]]) -> None:
    """``rows`` (dicts with the same keys) as CSV, None as an empty cell."""
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]) if rows else [])
        writer.writeheader()
        writer.writerows({k: ("" if v is None else v) for k, v in r.items()} for r in rows)


def block_sums(members: np.ndarray, truth: np.ndarray, weights: np.ndarray, climatology: np.ndarray) -> np.ndarray:
    """``(len(SUMS), C)``: the latitude-weighted sums over a block of ``members`` (M, C, h, w) against ``truth`` (C, h, w).

    ``weights`` is the block's ``(h, 1)`` rows of the global weights, or ``(h, w)`` (zero outside a region);
    ``climatology`` broadcasts to ``(C, h, w)``.
    """
    m = members.shape[0]
    mean = members.mean(axis=0)
    w = weights[None]
    wsum = lambda field: (field * w).sum(axis=(-2, -1))
    ordered = np.sort(members, axis=0)
    rank = (2 * np.arange(m) - m + 1).reshape(-1, 1, 1, 1)
    pair = 2 * (ordered * rank).sum(axis=0)                       # sum over m, m' of |f_m - f_m'|
    var = ((members - mean) ** 2).sum(axis=0) / (m - 1) if m > 1 else np.zeros_like(mean)
    fa, oa = mean - climatology, truth - climatology
    count = np.broadcast_to(w, mean.shape)
    return np.stack([wsum((mean - truth) ** 2), wsum(np.abs(members - truth).mean(axis=0)), wsum(pair), wsum(var),
                     wsum(fa * oa), wsum(fa * fa), wsum(oa * oa), wsum(count)])


def member_block_sums(members: np.ndarray, truth: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """``(2, M, C)``: each member's latitude-weighted sums of the squared and the absolute error over a block."""
    err, w = members - truth, weights[None, None]
    return np.stack([(err ** 2 * w).sum(axis=(-2, -1)), (np.abs(err) * w).sum(axis=(-2, -1))])


def scores_from_sums(sums: np.ndarray, members: int, points: float,
                     member_sums: np.ndarray | None = None) -> dict[str, np.ndarray]:
    """The scores ``(leads, channels)`` from the global sums ``(inits, leads, len(SUMS), channels)`` of every unit
    (all zero where a unit was not scored); ``points`` is the weights' total over the region (H * W for the globe: the
    weights have mean 1). With ``member_sums`` ``(inits, leads, 2, M, channels)`` (``member_block_sums``'), also
    ``member_rmse`` and ``member_mae`` ``(leads, M, channels)``."""
    scored = sums[:, :, SUMS.index("count")] > 0                      # (inits, leads, channels)
    extra = {} if member_sums is None else _member_scores(member_sums, scored, points)
    n = scored.sum(axis=0)
    per = {name: sums[:, :, i] / points for i, name in enumerate(SUMS)}
    with np.errstate(invalid="ignore", divide="ignore"):
        mean_t = lambda v: np.where(n > 0, np.where(scored, v, 0).sum(axis=0) / n, np.nan)
        pair_term = per["pair_abs"] / (2 * members * (members - 1)) if members > 1 else 0 * per["pair_abs"]
        rmse = np.sqrt(mean_t(per["sq_err"]))
        spread = np.sqrt(mean_t(per["variance"])) if members > 1 else np.full_like(rmse, np.nan)
        acc = mean_t(per["fa_oa"] / np.sqrt(per["fa_fa"] * per["oa_oa"]))
        return {"rmse": rmse, "crps": mean_t(per["abs_err"] - pair_term), "spread": spread,
                "spread_skill": spread / rmse, "acc": acc, **extra}


def _member_scores(member_sums: np.ndarray, scored: np.ndarray, points: float) -> dict[str, np.ndarray]:
    scored = scored[:, :, None, :]                                    # (inits, leads, 1, channels)
    n = scored.sum(axis=0)
    with np.errstate(invalid="ignore", divide="ignore"):
        mean_t = lambda v: np.where(n > 0, np.where(scored, v, 0).sum(axis=0) / n, np.nan)
        return {"member_rmse": np.sqrt(mean_t(member_sums[:, :, 0] / points)),
                "member_mae": mean_t(member_sums[:, :, 1] / points)}


def _climatology(climatology: Any, inputs: ForecastInputs, blocks: FieldBlocks, channels: int) -> np.ndarray:
    (r0, r1), (c0, c1) = blocks.rows, blocks.cols
    if climatology is None:
        if inputs.stats is None:
            raise ValueError("score_forecast: ACC needs a climatology: pass climatology= (C,), (C, H, W), a DataArray "
                             "(channel, latitude, longitude) or {channel: field} (open_climatology), or stats= whose "
                             "means serve as one")
        return np.asarray(inputs.stats.mean, dtype=np.float64).reshape(-1, 1, 1)
    if isinstance(climatology, Mapping):                                  # one field per channel (open_climatology)
        return climatology_block(climatology, [c.name for c in inputs.channels], blocks.rows, blocks.cols)
    if hasattr(climatology, "isel"):                                      # an xarray.DataArray: read this block only
        lat, lon = (d for d in climatology.dims if d != "channel")
        return np.asarray(climatology.isel({lat: slice(r0, r1), lon: slice(c0, c1)}).values, dtype=np.float64)
    clim = np.asarray(climatology, dtype=np.float64)
    if clim.shape == (channels,):
        return clim.reshape(-1, 1, 1)
    if clim.ndim != 3 or clim.shape[0] != channels:
        raise ValueError(f"score_forecast: climatology= must be (C,) or (C, H, W) with C = {channels}, got {clim.shape}")
    return clim[:, r0:r1, c0:c1]


def score_forecast(store: str | os.PathLike, source: Any = None,
                   variables: Sequence[str] | Mapping[str, Sequence[Any] | None] | None = None, *, stats: Any = None,
                   climatology: Any = None, names: Mapping[str, str] | None = None, region: str | Region = "global",
                   metrics: Sequence[str] | None = None) -> ScoreTable:
    """Score the store against the truth in ``source`` (default: the dataset its run read); every rank calls it.

    Usage: ``table = score_forecast("fc.zarr"); table.rmse``
    """
    return next(iter(score_regions(store, source, variables, stats=stats, climatology=climatology, names=names,
                                   regions=[region], metrics=metrics).values()))


def check_metrics(metrics: Sequence[str] | None) -> tuple[str, ...]:
    """The chosen metrics in ``METRICS``' order (default: all); an unknown one is refused naming the valid ones."""
    if metrics is None:
        return METRICS
    unknown = [m for m in metrics if m not in METRICS]
    if unknown or not metrics:
        raise ValueError(f"metrics: unknown {unknown or 'none chosen'}; choose from {', '.join(METRICS)}")
    return tuple(m for m in METRICS if m in metrics)


def score_regions(store: str | os.PathLike, source: Any = None,
                  variables: Sequence[str] | Mapping[str, Sequence[Any] | None] | None = None, *, stats: Any = None,
                  climatology: Any = None, names: Mapping[str, str] | None = None,
                  regions: Sequence[str | Region] | None = None,
                  metrics: Sequence[str] | None = None) -> dict[str, ScoreTable]:
    """A ``ScoreTable`` per region (names in ``REGIONS``, ``NAME=SOUTH:NORTH,WEST:EAST`` boxes or ``Region``s;
    default: global), all from one read of each block and one all-reduce; every rank calls it.

    Usage: ``tables = score_regions("fc.zarr", regions=["global", "tropics", "europe"]); tables["europe"].rmse``
    """
    dm = DistributedManager() if DistributedManager.is_initialized() else None
    path = os.fspath(store)
    # NOTE: checked on every rank, agreed before the sums' collectives: a refusal is raised on every rank at once (a
    # rank without a block never reads the climatology; one rank failing to read the store's metadata tells the rest)
    chosen, boxes, spec, inputs, blocks, region_weights, totals = agreed_checks(
        "score_forecast: the request", lambda: _checked_request(path, source, variables, stats, climatology, names,
                                                                regions, metrics), dm)
    coords = dm.coordinates if dm is not None else {"model": 0, "batch": 0}
    batch_ranks = dm.axis_size("batch") if dm is not None else 1
    n_init, n_lead, m, c = len(spec.init_times), spec.leads, spec.members, len(spec.channels)
    sums = np.zeros((len(boxes), n_init, n_lead, len(SUMS), c))
    member_sums = np.zeros((len(boxes), n_init, n_lead, 2, m, c))
    (r0, r1), (c0, c1) = blocks.rows, blocks.cols

    def local_sums() -> None:
        if coords["model"] != 0 or r1 <= r0 or c1 <= c0:
            return
        fields = FieldArrays.open(path, spec.channels)
        mine = [w[r0:r1] if w.shape[1] == 1 else w[r0:r1, c0:c1] for w in region_weights]
        clim = _climatology(climatology, inputs, blocks, c)
        units = [(i, k) for i in range(n_init) for k in range(n_lead)]
        for i, k in units[coords["batch"]::batch_ranks]:
            truth = inputs.raw(spec.init_times[i] + spec.lead * (k + 1))
            if truth is None:
                continue
            block = fields.read(i, k, (r0, r1), (c0, c1)).astype(np.float64, copy=False)
            for r, w in enumerate(mine):
                sums[r, i, k] = block_sums(block, truth, w, clim)
                member_sums[r, i, k] = member_block_sums(block, truth, w)

    if dm is not None and dm.world_size > 1:
        # NOTE: a rank failing to read its blocks tells every rank, which all raise the same error, instead of
        # leaving them in the all-reduce until the group's timeout
        collective_step("score_forecast: the sums of this rank's blocks", local_sums,
                        group=dm.world_mesh.get_group())
        # NOTE: a few sums per (region, init, lead, channel, member), no field
        total = torch.from_numpy(np.concatenate([sums.reshape(-1), member_sums.reshape(-1)]))
        dist.all_reduce(total, group=dm.world_mesh.get_group())
        sums, member_sums = (total[:sums.size].numpy().reshape(sums.shape),
                             total[sums.size:].numpy().reshape(member_sums.shape))
    else:
        local_sums()
    hours = [float(np.timedelta64(spec.lead * (k + 1), "ns").astype(np.int64) / 3.6e12) for k in range(n_lead)]
    scale = None if inputs.stats is None else list(inputs.stats.std)
    tables = {}
    for r, box in enumerate(boxes):
        scores = scores_from_sums(sums[r], m, totals[r], member_sums[r])
        n = (sums[r, :, :, SUMS.index("count")] > 0).sum(axis=0)[:, 0]
        tables[box.name] = ScoreTable([ch.name for ch in spec.channels], [ch.units for ch in spec.channels], hours, m,
                                      n, **scores, scale=scale, region=box.name, metrics=chosen)
    return tables


def _checked_request(path: str, source: Any, variables: Any, stats: Any, climatology: Any, names: Any, regions: Any,
                     metrics: Any) -> tuple:
    chosen, boxes = check_metrics(metrics), parse_regions(regions)
    spec = read_spec(path)
    run = spec.run
    source = source if source is not None else run.get("source")
    variables = variables if variables is not None else run.get("variables")
    if source is None or variables is None:
        raise ValueError("score_forecast: pass source= (the truth) and variables=: the store does not record them (its "
                         "forecast read an xarray.Dataset passed in, not a path)")
    stats = stats if stats is not None else run.get("stats")
    names = names if names is not None else run.get("names")
    blocks = FieldBlocks.for_mesh((spec.lat.size, spec.lon.size), spec.tile)
    inputs = ForecastInputs(source, variables, lead=spec.lead, stats=stats, blocks=blocks, names=names)
    if inputs.lat.shape != spec.lat.shape or inputs.lon.shape != spec.lon.shape or not (
            np.allclose(inputs.lat, spec.lat) and np.allclose(inputs.lon, spec.lon)):
        raise ValueError(f"score_forecast: the dataset's grid ({inputs.lat.size} x {inputs.lon.size}) is not the store's "
                         f"({spec.lat.size} x {spec.lon.size}, or other coordinates)")
    if [c.name for c in inputs.channels] != [c.name for c in spec.channels]:
        raise ValueError(f"score_forecast: the dataset's channels {[c.name for c in inputs.channels]} are not the "
                         f"store's {[c.name for c in spec.channels]}")
    if isinstance(climatology, Mapping):
        check_climatology(climatology, [ch.name for ch in spec.channels], spec.lat, spec.lon)
    elif climatology is not None and not hasattr(climatology, "isel"):
        whole = (len(spec.channels), spec.lat.size, spec.lon.size)
        if np.shape(climatology) not in (whole[:1], whole):
            raise ValueError(f"score_forecast: climatology= must be (C,) or (C, H, W) = {whole}, got "
                             f"{np.shape(climatology)}")
    weights = lat_weights(spec.lat).numpy()
    # (H, 1) for the globe (the scores as they always were, bit for bit), else (H, W), zero outside the box
    region_weights = [weights if box.is_global else weights * box.mask(spec.lat, spec.lon) for box in boxes]
    totals = [float(spec.lat.size * spec.lon.size) if box.is_global else float(w.sum())
              for box, w in zip(boxes, region_weights)]
    empty = [box.describe() for box, total in zip(boxes, totals) if total <= 0]
    if empty:
        raise ValueError(f"score_forecast: no grid point lies in region {', '.join(empty)} (the grid: latitudes "
                         f"{spec.lat.min():g}..{spec.lat.max():g}, longitudes {spec.lon.min():g}..{spec.lon.max():g})")
    return chosen, boxes, spec, inputs, blocks, region_weights, totals
