"""A weather model on the mesh, end to end: ERA5-like fields from zarr, a spherical Fourier neural operator on a
lat x lon domain grid, latitude-weighted rollout training against one process, resume on another mesh, an 8-step
forecast written block by block into a CF-style store and scored on the mesh, and a picture of truth, forecast and error.

Usage::

    python examples/weather.py --out runs/weather     # all phases (8 CPU ranks, then 4): 60 s (docs/example_times.json)

or phase by phase::

    python examples/weather.py data --out runs/weather                                       # the synthetic zarr store
    torchrun --nproc-per-node 8 examples/weather.py train  --out runs/weather   # batch 2 x domain 2x2 (lat x lon)
    torchrun --nproc-per-node 4 examples/weather.py resume --out runs/weather   # batch 1 x domain 4 (lat slabs)
    python examples/weather.py plot --out runs/weather                                       # forecast.png

``data`` writes a 33 x 64 (5.625 degree, both poles) store of 4 channels (z500, t850, t2m, u10) every 6 hours: zonal bands, two
eastward-moving waves, noise. ``train`` reads each rank's (lat, lon) block with ``WeatherDataset``, trains
``SFNO`` (below) on 2-step rollouts (output fed back, each step under activation checkpointing) with the
latitude-weighted MSE, and rank 0 trains the same weights in one process: every step's loss must match.
``resume`` loads the checkpoint (weights, Adam, the data cursor) on another mesh, continues like the
uninterrupted run, saves ``ckpt-7`` (what ``mesh3d forecast`` starts from: docs/weather.md, Forecasting), then
forecasts 8 steps from held-out times with ``forecast_ensemble``, each rank writing its own block of every step to
``forecast.zarr`` (no gather), scores it per channel, and checks the store against a one-process forecast. Exit
status 0 only when every check passes.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch_harmonics import InverseRealSHT, RealSHT

from mesh3d import DistributedManager, Plan, checkpoint, parallelize
from mesh3d.data import MeshDataLoader, MeshSampler, WeatherDataset
from mesh3d.weather import (LatLonGrid, SphereConv2d, channels_array, forecast, forecast_ensemble, rmse, rollout_loss,
                            score_forecast, weather_extra, weighted_mse)
from mesh3d.weather.figures import forecast_maps

NLAT, NLON, TIMES, TEST_TIMES = 33, 64, 64, 12
VARIABLES = {"z": [500], "t": [850], "t2m": None, "u10": None}
GLOBAL_BATCH, ROLLOUT, LR, SEED = 4, 2, 2e-3, 0
TRAIN_STEPS, RESUME_STEPS, FORECAST_STEPS = 4, 3, 8
#: Relative tolerance of the parallel loss against one process (fp32: only the summation order differs).
RTOL = 1e-4


# ---------------------------------------------------------------------------------------------- the model
class SphericalConv(nn.Module):
    """A spectral convolution on the sphere: torch-harmonics' SHT, one complex weight per degree l, its inverse SHT.
    Nothing here knows the mesh: on lat x lon blocks mesh3d runs the SHT's FFT over the sharded longitudes and its
    Legendre sums over the sharded latitudes as pencils, as Makani's distributed SHT does (docs/domain.md, Ops)."""

    def __init__(self, channels: int, sht: RealSHT, isht: InverseRealSHT) -> None:
        super().__init__()
        self.sht, self.isht = sht, isht                        # shared by every layer (their tables are not saved)
        scale = 1 / channels
        self.weight = nn.Parameter(scale * torch.randn(channels, channels, sht.lmax, 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        spec = self.sht(x)                                                          # (B, C, l, m), complex
        spec = torch.einsum("bilm,iol->bolm", spec, torch.view_as_complex(self.weight))
        return self.isht(spec)


class Block(nn.Module):
    def __init__(self, width: int, sht: RealSHT, isht: InverseRealSHT) -> None:
        super().__init__()
        self.spectral = SphericalConv(width, sht, isht)
        self.local = SphereConv2d(width, width, 3)            # longitude circular across the seam, latitude not
        self.mlp = nn.Sequential(nn.Conv2d(width, 2 * width, 1), nn.GELU(), nn.Conv2d(2 * width, width, 1))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        h = h + nn.functional.gelu(self.spectral(h) + self.local(h))
        return h + self.mlp(h)


class SFNO(nn.Module):
    """Lift, spherical blocks, project; predicts the state one lead time later (a residual on the input)."""

    def __init__(self, channels: int = 4, width: int = 16, depth: int = 2, nlat: int = NLAT, nlon: int = NLON,
                 lmax: int = 12) -> None:
        super().__init__()
        self.lift = nn.Conv2d(channels, width, 1)
        # NOTE: the equiangular grid with both poles (ERA5's): torch-harmonics' Clenshaw-Curtis quadrature
        sht = RealSHT(nlat, nlon, lmax=lmax, mmax=lmax, grid="equiangular")
        isht = InverseRealSHT(nlat, nlon, lmax=lmax, mmax=lmax, grid="equiangular")
        self.blocks = nn.ModuleList(Block(width, sht, isht) for _ in range(depth))
        self.head = nn.Conv2d(width, channels, 1)
        nn.init.zeros_(self.head.weight)          # NOTE: starts as persistence (x -> x); training adds the dynamics
        nn.init.zeros_(self.head.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lift(x)
        for block in self.blocks:
            h = block(h)
        return x + self.head(h)


def model() -> nn.Module:
    torch.manual_seed(SEED)
    return SFNO()


def sfno_025() -> nn.Module:
    """The same architecture at 0.25 degrees (721 x 1440) with ERA5's 73 channels (FourCastNet 2 / SFNO's set: 8
    surface fields and 5 variables on 13 pressure levels), width 256, 4 blocks, degrees up to 240: for ``mesh3d plan``."""
    return SFNO(channels=73, width=256, depth=4, nlat=721, nlon=1440, lmax=240)


# ---------------------------------------------------------------------------------------------- the data
def write_store(path: str) -> None:
    """An ERA5-like 6-hourly zarr v3 store on the 5.625 degree grid: zonal bands, two eastward waves, noise."""
    import xarray as xr

    g = np.random.default_rng(0)
    lat = np.linspace(90, -90, NLAT)                                 # both poles, as ERA5's grid
    lon = np.arange(NLON) * 360.0 / NLON
    t = np.arange(TIMES)[:, None, None] * 0.25                      # days
    phi, lam = np.radians(lat)[None, :, None], np.radians(lon)[None, None, :]
    wave = (np.cos(phi) ** 2 * np.sin(4 * lam - 2 * np.pi * t / 6) + 0.5 * np.cos(phi) * np.sin(2 * lam - 2 * np.pi * t / 12
            + 1) * np.sin(2 * phi))
    noise = lambda s: s * g.standard_normal((TIMES, NLAT, NLON))
    z500 = 5600 - 600 * np.sin(phi) ** 2 + 120 * wave + noise(5)
    t850 = 290 - 40 * np.sin(phi) ** 2 + 4 * wave + noise(0.5)
    t2m = 300 - 50 * np.sin(phi) ** 2 + 3 * wave + noise(0.5)
    u10 = 8 * np.sin(3 * phi) + 3 * np.cos(phi) * np.cos(4 * lam - 2 * np.pi * t / 6) + noise(0.5)
    z = np.stack([z500, z500 - 4100 + 0.3 * wave], axis=1)          # levels 500 and 850 hPa
    temp = np.stack([t850 - 30 + noise(0.5), t850], axis=1)
    ds = xr.Dataset({"z": (("time", "level", "lat", "lon"), z), "t": (("time", "level", "lat", "lon"), temp),
                     "t2m": (("time", "lat", "lon"), t2m), "u10": (("time", "lat", "lon"), u10)},
                    coords={"time": np.datetime64("2020-01-01T00", "ns") + np.arange(TIMES) * np.timedelta64(6, "h"), "level": [500, 850],
                            "lat": lat, "lon": lon})
    ds = ds.astype("float32")
    for name, units, long_name in (("z", "m", "geopotential height"), ("t", "K", "temperature"),
                                   ("t2m", "K", "2 m temperature"), ("u10", "m s-1", "10 m eastward wind")):
        ds[name].attrs.update(units=units, long_name=long_name)
    chunks = {"z": (1, 1, 8, 32), "t": (1, 1, 8, 32), "t2m": (1, 8, 32), "u10": (1, 8, 32)}
    ds.to_zarr(path, mode="w", consolidated=False, encoding={k: {"chunks": c} for k, c in chunks.items()})


def train_set(path: str) -> WeatherDataset:
    """Inputs from the training times (the last TEST_TIMES are held out), 2 targets each, per-channel statistics."""
    return WeatherDataset(path, VARIABLES, lead=np.timedelta64(6, "h"), steps=ROLLOUT, stats="compute",
                          times=range(TIMES - TEST_TIMES - ROLLOUT))


# ---------------------------------------------------------------------------------------------- training
def run_steps(net, opt, loader, ds, steps: int, parallel: bool) -> list[float]:
    weights = LatLonGrid(ds.lat, ds.lon).weights
    losses = []
    while len(losses) < steps:
        for batch in loader:
            if parallel:
                batch = ds.to_domain(batch)
            loss = rollout_loss(net, batch["x"], batch["y"], lambda p, t: weighted_mse(p, t, weights))
            loss.backward()
            opt.step()
            opt.zero_grad()
            value = (loss.to_local() if hasattr(loss, "to_local") else loss).detach().clone()
            if parallel and DistributedManager().axis_size("batch") > 1:
                dist.all_reduce(value, group=DistributedManager().group("batch"))
                value /= DistributedManager().axis_size("batch")
            losses.append(float(value))
            if len(losses) == steps:
                break
    return losses


def one_process(path: str, steps: int) -> list[float]:
    """The same weights, data order and steps in one process, on whole fields (no mesh)."""
    ds = WeatherDataset(path, VARIABLES, lead=np.timedelta64(6, "h"), steps=ROLLOUT, stats=train_set_stats(path),
                        times=range(TIMES - TEST_TIMES - ROLLOUT), domain=((1,), (0,)))
    loader = MeshDataLoader(ds, MeshSampler(len(ds), GLOBAL_BATCH, seed=SEED, batch_ranks=1, batch_rank=0))
    net = model()
    return run_steps(net, torch.optim.Adam(net.parameters(), lr=LR), loader, ds, steps, parallel=False)


def train_set_stats(path: str) -> dict:
    with open(os.path.join(os.path.dirname(path), "stats.json")) as f:
        return json.load(f)


def phase_train(out: str, resume: bool) -> int:
    dm = DistributedManager.initialize(batch=1 if resume else 2, domain=(4,) if resume else (2, 2), model=1)
    store, ckpt = os.path.join(out, "era5_like.zarr"), os.path.join(out, "ckpt")
    ds = train_set(store)                                    # stats: a collective over the domain group
    if dm.rank == 0 and not resume:
        with open(os.path.join(out, "stats.json"), "w") as f:
            json.dump(ds.stats.to_dict(), f)
    loader = MeshDataLoader(ds, MeshSampler(len(ds), GLOBAL_BATCH, seed=SEED))
    net = parallelize(model(), Plan(batch="fsdp"))
    opt = torch.optim.Adam(net.parameters(), lr=LR)
    first = 0
    if resume:
        first = checkpoint.load(ckpt, net, opt, data=loader).step
    start = time.perf_counter()
    losses = run_steps(net, opt, loader, ds, RESUME_STEPS if resume else TRAIN_STEPS, parallel=True)
    seconds = time.perf_counter() - start
    # NOTE: the channels (in order), their statistics and the step, for `mesh3d forecast` (docs/weather.md, Forecasting).
    weather = {"weather": weather_extra(ds, lead_hours=6)}
    if not resume:
        checkpoint.save(ckpt, net, opt, step=TRAIN_STEPS, data=loader, extra=weather)
    else:
        checkpoint.save(f"{ckpt}-{TRAIN_STEPS + RESUME_STEPS}", net, step=TRAIN_STEPS + RESUME_STEPS, extra=weather)
    block = {k: v for k, v in ds.block.items()}
    print(f"rank {dm.rank}: block lat {block['lat']} lon {block['lon']}: read {ds.bytes_read} bytes of compressed chunks "
          f"for {ds.bytes_requested} bytes of its own points", flush=True)
    ok = True
    if dm.rank == 0:
        dist.barrier()
        want = one_process(store, TRAIN_STEPS + RESUME_STEPS)[first:]
        print(f"mesh {dict(dm.shape)} domain grid {dm.domain_grid}: {len(losses)} steps in {seconds:.1f} s")
        for step, (got, ref) in enumerate(zip(losses, want), start=first):
            same = abs(got - ref) <= RTOL * abs(ref)
            ok &= same
            print(f"step {step} loss {got:.6f} one-process {ref:.6f}{'' if same else '  <-- DIFFERS'}", flush=True)
        print(f"training on {tuple(dm.mesh.shape)}: {'MATCHES one process' if ok else 'DIFFERS from one process'}")
    else:
        dist.barrier()
    if resume:
        ok &= forecast_and_check(net, store, out, dm)
    flag = torch.tensor(int(ok))
    dist.broadcast(flag, src=0)
    DistributedManager.shutdown()
    return 0 if int(flag) else 1


def forecast_and_check(net, store: str, out: str, dm: DistributedManager) -> bool:
    """8 leads from every held-out start, each rank writing its block of a CF-style store; scored on the mesh (no
    gather); rank 0 checks the store against a forecast of whole fields in one process and prints the scores."""
    stats = train_set_stats(store)
    # NOTE: inference needs no FSDP: every rank holds the whole (small) model, and only the fields are split.
    plain = model()
    plain.load_state_dict({k: (v.full_tensor() if hasattr(v, "full_tensor") else v) for k, v in net.state_dict().items()})
    inits = list(range(TIMES - TEST_TIMES, TIMES - FORECAST_STEPS))
    path = os.path.join(out, "forecast.zarr")                    # a new store each run (main removed the old one)
    forecast_ensemble(plain, store, VARIABLES, path, init_times=inits, leads=FORECAST_STEPS, lead=np.timedelta64(6, "h"),
                      stats=stats, batch_size=2, tile=(8, 16), progress=None, run={"model": "examples/weather.py:SFNO"})
    table = score_forecast(path)                                # every rank: block sums, one all-reduce
    if dm.rank != 0:
        return True
    import xarray as xr

    written = channels_array(xr.open_zarr(path)).isel(member=0)  # (init_time, lead_time, channel, latitude, longitude)
    one = WeatherDataset(store, VARIABLES, lead=np.timedelta64(6, "h"), steps=FORECAST_STEPS, stats=stats,
                         times=inits, domain=((1,), (0,)))
    x0 = torch.stack([one[i]["x"] for i in range(len(one))])
    mean, std = (torch.tensor(v).reshape(1, 1, -1, 1, 1) for v in (stats["mean"], stats["std"]))
    want = torch.stack(forecast(plain, x0, FORECAST_STEPS), dim=1).double() * std + mean   # physical units
    truth = torch.stack([torch.stack(one[i]["y"]) for i in range(len(one))]).double() * std + mean
    err = float((torch.from_numpy(written.values) - want).abs().max())
    same = err <= 1e-5 * float(want.abs().max())
    weights = LatLonGrid(one.lat, one.lon).weights
    persistence = rmse((x0.double() * std[:, 0] + mean[:, 0])[:, None], truth, weights).pow(2).mean(0).sqrt()
    for k in (0, 3, 7):
        for c, (name, units) in enumerate(zip(table.channels, table.units)):
            print(f"lead {table.lead_hours[k]:2g} h  {name:<5} RMSE {table.rmse[k, c]:7.3f} {units:<5} (persistence "
                  f"{persistence[k, c]:7.3f})  ACC {table.acc[k, c]:.3f}")
    print(f"forecast.zarr {dict(written.sizes)}, written block by block: max abs diff {err:.2e} from the one-process "
          f"forecast: {'MATCHES one process' if same else 'DIFFERS'}", flush=True)
    return same


# ---------------------------------------------------------------------------------------------- the picture
def phase_plot(out: str) -> int:
    """z500 of the first held-out start: truth, forecast and their difference at +6, +24 and +48 h."""
    import xarray as xr

    fc = xr.open_zarr(os.path.join(out, "forecast.zarr"))
    era5 = xr.open_zarr(os.path.join(out, "era5_like.zarr"), consolidated=False)
    init, leads = fc["init_time"].values[0], [0, 3, 7]
    z500 = fc["z"].sel(level=500).isel(init_time=0, member=0, lead_time=leads)   # one variable per field
    valid = init + fc["lead_time"].values[leads]
    truth = era5["z"].sel(level=500, time=valid).values            # geopotential height (m), as the store holds it
    fig = forecast_maps(z500.values, truth, lat=fc["latitude"].values, lon=fc["longitude"].values, channel="z500",
                        units=fc["z"].attrs["units"], init=init, variable="z",
                        model=f"SFNO (examples/weather.py, {TRAIN_STEPS + RESUME_STEPS} Adam steps)",
                        lead_hours=[6 * (k + 1) for k in leads])
    path = os.path.join(out, "forecast.png")
    fig.savefig(path, dpi=80)
    print(f"saved {path}")
    return 0


#: What the phases write under --out, in the order they write it, and each phase's first.
OUTPUTS = ["era5_like.zarr", "stats.json", "ckpt", f"ckpt-{TRAIN_STEPS + RESUME_STEPS}", "forecast.zarr", "forecast.png"]
PHASE_FIRST = {"all": "era5_like.zarr", "data": "era5_like.zarr", "train": "stats.json", "resume": OUTPUTS[3],
               "plot": "forecast.png"}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("phase", nargs="?", default="all", choices=["all", "data", "train", "resume", "plot"])
    parser.add_argument("--out", default="runs/weather")
    args = parser.parse_args()
    # NOTE: imported here: examples/ is on sys.path when this file runs, not when tools import it by path.
    from _runs import fresh_output, torchrun_env

    if int(os.environ.get("RANK", "0")) == 0:  # before the mesh exists: the other ranks write only after collectives
        # A rerun of a phase replaces what that phase and the later ones wrote (checkpoints are never overwritten).
        fresh_output(args.out, "examples/weather.py", OUTPUTS[OUTPUTS.index(PHASE_FIRST[args.phase]):],
                     known=OUTPUTS)
    if args.phase == "data":
        write_store(os.path.join(args.out, "era5_like.zarr"))
        return 0
    if args.phase in ("train", "resume"):
        return phase_train(args.out, resume=args.phase == "resume")
    if args.phase == "plot":
        return phase_plot(args.out)
    start = time.perf_counter()
    write_store(os.path.join(args.out, "era5_like.zarr"))
    run = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node"]
    for n, phase in (("8", "train"), ("4", "resume")):
        done = subprocess.run([*run, n, os.path.abspath(__file__), phase, "--out", args.out], env=torchrun_env())
        if done.returncode:
            print(f"weather: the {phase} phase FAILED (exit {done.returncode})")
            return done.returncode
    code = phase_plot(args.out)
    print(f"weather: every check passed in {time.perf_counter() - start:.0f} s" if code == 0 else "weather: FAILED")
    return code


if __name__ == "__main__":
    raise SystemExit(main())
