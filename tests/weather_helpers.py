"""Shared by the weather tests (imported on every rank): a tiny ERA5-like dataset in zarr and NetCDF, a small
model on the sphere, and one training loop (rollout, latitude-weighted loss) that records each step."""

from __future__ import annotations

import os

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

T, H, W = 9, 7, 10                     # lat 7: (4, 3) over 2, (3, 3, 1) over 3; lon 10: (5, 5), (4, 4, 2)
LEVELS = (300, 500, 850)
VARIABLES = {"z": [850, 300], "t2m": None}   # 3 channels: z850, z300, t2m
CHUNKS = {"lat": 2, "lon": 5}
GLOBAL_BATCH, LR, ROLLOUT = 2, 0.01, 2


def fields(seed: int = 0) -> dict[str, np.ndarray]:
    g = np.random.default_rng(seed)
    lat = np.linspace(80, -80, H)
    lon = np.arange(W) * 360.0 / W
    t = np.arange(T)[:, None, None]
    wave = np.sin(np.radians(lon)[None, None, :] * 2 - 0.4 * t) * np.cos(np.radians(lat))[None, :, None]
    z = np.stack([wave * (1 + k) + 0.1 * g.standard_normal((T, H, W)) for k in range(len(LEVELS))], axis=1)
    t2m = (np.cos(np.radians(lat))[None, :, None] + 0.3 * wave + 0.1 * g.standard_normal((T, H, W))).astype(np.float32)
    return {"z": z * 100.0 + 5000.0, "t2m": t2m * 30 + 250, "lat": lat, "lon": lon}


def write_weather(root: str) -> dict[str, str]:
    """The same fields as a zarr v3 store (uncompressed, chunked 2 x 5 in lat x lon) and a NetCDF4 file (contiguous)."""
    import xarray as xr

    f = fields()
    ds = xr.Dataset({"z": (("time", "level", "lat", "lon"), f["z"]), "t2m": (("time", "lat", "lon"), f["t2m"])},
                    coords={"time": np.datetime64("2020-01-01T00", "ns") + np.arange(T) * np.timedelta64(6, "h"), "level": list(LEVELS),
                            "lat": f["lat"], "lon": f["lon"]})
    ds["z"].attrs["units"] = "m**2 s**-2"
    ds["t2m"].attrs["units"] = "K"
    paths = {"zarr": os.path.join(root, "w.zarr"), "nc": os.path.join(root, "w.nc")}
    chunks = {"z": (1, 1, CHUNKS["lat"], CHUNKS["lon"]), "t2m": (1, CHUNKS["lat"], CHUNKS["lon"])}
    ds.to_zarr(paths["zarr"], mode="w", consolidated=False,
               encoding={k: {"chunks": c, "compressors": None} for k, c in chunks.items()})
    ds.to_netcdf(paths["nc"], engine="h5netcdf")
    return paths


def sphere_net() -> nn.Module:
    from mesh3d.weather import SphereConv2d

    torch.manual_seed(0)
    return nn.Sequential(SphereConv2d(3, 6, 3), nn.GELU(), SphereConv2d(6, 3, (3, 5), lat_mode="constant")).double()


def batch_axis() -> tuple[int, object]:
    from mesh3d import DistributedManager

    if DistributedManager.is_initialized():
        dm = DistributedManager()
        return dm.axis_size("batch"), dm.group("batch")
    return 1, None


def global_value(value: torch.Tensor) -> float:
    """A per-batch-rank mean (replicated over the domain) averaged over the batch ranks."""
    value = value.detach()
    value = (value.to_local() if hasattr(value, "to_local") else value).clone()
    ranks, group = batch_axis()
    if ranks > 1:
        dist.all_reduce(value, group=group)
        value /= ranks
    return float(value)


def train(model, opt, loader, dataset, steps: int, domain_grads: bool) -> list[tuple[list[int], float, float]]:
    """``steps`` Adam steps of a ``ROLLOUT``-step rollout under the latitude-weighted MSE; per step (sample ids of this
    batch rank, global loss, global latitude-weighted RMSE of the first rollout step)."""
    from mesh3d import DistributedManager
    from mesh3d.weather import LatLonGrid, rmse, rollout, rollout_loss, weighted_mse

    weights = LatLonGrid(dataset.lat, dataset.lon).weights
    done = []
    while len(done) < steps:
        for batch in loader:
            batch = dataset.to_domain(batch)
            loss = rollout_loss(model, batch["x"], batch["y"], lambda p, t: weighted_mse(p, t, weights))
            loss.backward()
            if domain_grads and DistributedManager().axis_size("domain") > 1:  # the domain rule, by hand
                for p in model.parameters():
                    dist.all_reduce(p.grad, group=DistributedManager().group("domain"))
            opt.step()
            opt.zero_grad()
            with torch.no_grad():
                score = rmse(rollout(model, batch["x"], 1)[0], batch["y"][0], weights).mean()
            done.append((batch["index"].tolist(), global_value(loss), global_value(score)))
            if len(done) == steps:
                break
    return done
