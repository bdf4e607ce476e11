"""Shared by the forecast tests (imported on every rank and by ``mesh3d forecast`` runs the tests start): the weather
example's model and data with a checkpoint, small models (one with its own noise, one that kills its own process at a
chosen call), and references written here without mesh3d's forecast code: the documented noise rule, a forecast
loop on whole fields, and the scores in numpy."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import numpy as np
import torch
from torch import nn

import weather_helpers as wh

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = str(ROOT / "examples" / "weather.py")
HERE = str(Path(__file__).resolve())
#: The environment variable ``killing_model`` reads: ``"RANK:CALL"`` kills that rank's process at that model call.
KILL_ENV = "MESH3D_TEST_KILL_AT"


def example():
    """examples/weather.py as a module (its SFNO, its store writer, its channels)."""
    from mesh3d.planner.spec import load_spec

    return load_spec(f"{EXAMPLE}:model").__globals__


def example_checkpoint(root: str) -> dict:
    """The example's store and a checkpoint of its model with weights moved off the zero-initialized head, the
    channels, statistics and lead time in ``extra['weather']``."""
    from mesh3d import checkpoint
    from mesh3d.data import WeatherDataset
    from mesh3d.weather import weather_extra

    ex = example()
    store, ckpt = os.path.join(root, "era5_like.zarr"), os.path.join(root, "ckpt")
    ex["write_store"](store)
    train = WeatherDataset(store, ex["VARIABLES"], steps=1, stats="compute", domain=((1,), (0,)))
    stats = train.stats.to_dict()
    net = ex["model"]()
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in net.parameters():
            p.add_(0.03 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    checkpoint.save(ckpt, net, step=11, extra={"weather": weather_extra(train, 6)})
    return {"store": store, "ckpt": ckpt, "stats": stats, "variables": ex["VARIABLES"], "model": f"{EXAMPLE}:model"}


class NoisyNet(nn.Module):
    """``sphere_net`` with its own noise: model(x, noise) adds 0.05 of a noise field smoothed by a sphere convolution,
    and a dropout (drawn from torch's generator, seeded per member and lead)."""

    def __init__(self) -> None:
        super().__init__()
        from mesh3d.weather import SphereConv2d

        self.net = wh.sphere_net()
        torch.manual_seed(1)
        self.smooth = SphereConv2d(3, 3, 3).double()
        self.drop = nn.Dropout(0.2)

    def forward(self, x, noise):
        return self.drop(self.net(x)) + 0.05 * self.smooth(noise.normal(x))


def noisy_net() -> nn.Module:
    return NoisyNet().train()  # NOTE: dropout on at inference: the model's own noise


class _Killing(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = wh.sphere_net().float()
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        where = os.environ.get(KILL_ENV)
        if where:
            rank, call = (int(v) for v in where.split(":"))
            if int(os.environ.get("RANK", "0")) == rank and self.calls == call:
                os.kill(os.getpid(), signal.SIGKILL)           # a real kill: no cleanup, no exception
        return self.net(x)


def killing_model() -> nn.Module:
    """``sphere_net`` (fp32) whose rank RANK kills its process at model call CALL when MESH3D_TEST_KILL_AT=RANK:CALL."""
    return _Killing()


def sphere_checkpoint(root: str, factory=killing_model) -> dict:
    """weather_helpers' store and a checkpoint of ``factory()``'s weights (perturbed), with extra['weather']."""
    from mesh3d import checkpoint

    paths = wh.write_weather(root)
    net = factory()
    with torch.no_grad():
        for p in net.parameters():
            p.add_(0.05 * torch.randn_like(p))
    stats = {"mean": [5000.0, 5000.0, 250.0], "std": [100.0, 100.0, 30.0]}
    ckpt = os.path.join(root, "ckpt")
    weather = {"variables": [[k, v] for k, v in wh.VARIABLES.items()], "stats": stats, "lead_hours": 6}
    checkpoint.save(ckpt, net, step=3, extra={"weather": weather})
    return {"store": paths["zarr"], "nc": paths["nc"], "ckpt": ckpt, "stats": stats, "variables": wh.VARIABLES}


# ---------------------------------------------------------------- references written without mesh3d's forecast code
def documented_noise(seed: int, member: int, init: np.datetime64, stream: int, draw: int, shape: tuple) -> np.ndarray:
    """The rule docs/weather.md states: row r of channel c from Philox(key, counter=[0, 0, r, c])."""
    init_ns = int(np.datetime64(init, "ns").astype(np.int64)) % 2 ** 64
    key = np.random.SeedSequence([seed, member, init_ns, stream, draw]).generate_state(2, np.uint64)
    c, h, w = shape
    out = np.empty(shape)
    for ch in range(c):
        for r in range(h):
            gen = np.random.Generator(np.random.Philox(key=key, counter=np.array([0, 0, r, ch], dtype=np.uint64)))
            out[ch, r] = gen.standard_normal(w)
    return out


def raw_fields(store: str, variables: dict, times) -> np.ndarray:
    """``(len(times), C, H, W)`` physical values read with xarray (channels in the order of ``variables``)."""
    import xarray as xr

    ds = xr.open_zarr(store, consolidated=False)
    parts = []
    for name, levels in variables.items():
        var = ds[name].isel(time=list(times))
        if levels is None:
            parts.append(var.values[:, None])
        else:
            parts.append(np.stack([var.sel(level=lv).values for lv in levels], axis=1))
    return np.concatenate(parts, axis=1).astype(np.float64)


def hand_forecast(net, store: str, variables: dict, stats: dict, inits, members: int, leads: int, seed: int,
                  scale: float) -> np.ndarray:
    """``(inits, leads, members, C, H, W)``: whole fields in one process, each member perturbed by the documented rule."""
    times = np.asarray(__import__("xarray").open_zarr(store, consolidated=False)["time"].values)
    mean = np.asarray(stats["mean"]).reshape(-1, 1, 1)
    std = np.asarray(stats["std"]).reshape(-1, 1, 1)
    x0 = (raw_fields(store, variables, inits) - mean) / std
    out = np.empty((len(inits), leads, members, *x0.shape[1:]))
    dtype = next(net.parameters()).dtype
    with torch.no_grad():
        for i, t in enumerate(inits):
            for m in range(members):
                z = documented_noise(seed, m, times[t], 0, 0, x0.shape[1:])
                x = torch.from_numpy(x0[i] + scale * z)[None].to(dtype)
                for k in range(leads):
                    x = net(x)
                    out[i, k, m] = x[0].double().numpy() * std + mean
    return out


def lat_band_weights(lat: np.ndarray) -> np.ndarray:
    """Cell-area weights written here: each latitude's band between the midpoints to its neighbours, mean 1."""
    order = np.argsort(lat)
    s = np.radians(lat[order])
    edges = np.concatenate([[-np.pi / 2], (s[1:] + s[:-1]) / 2, [np.pi / 2]])
    area = np.empty_like(s)
    area[order] = np.sin(edges[1:]) - np.sin(edges[:-1])
    return area / area.mean()


def smooth_perturbation(x, noise):
    """A perturbation function: white noise smoothed by a sphere convolution (halos across blocks and the seam)."""
    from mesh3d.weather import SphereConv2d

    torch.manual_seed(3)
    conv = SphereConv2d(x.shape[1], x.shape[1], 3, bias=False).to(x.dtype)
    return x + 0.2 * conv(noise.normal(x))


class Failing(nn.Module):
    """``net`` until its ``at``-th call, which raises (a run stopped mid-way, in this process)."""

    def __init__(self, net: nn.Module, at: int) -> None:
        super().__init__()
        self.net, self.at, self.calls = net, at, 0

    def forward(self, x):
        self.calls += 1
        if self.calls == self.at:
            raise RuntimeError(f"stopped at call {self.at}")
        return self.net(x)


def chunk_files(store: str) -> dict[str, tuple[int, int]]:
    """Every chunk file of the store's fields: ``"init/lead/member/.../field"`` -> (mtime_ns, inode)."""
    out = {}
    for field in sorted(os.listdir(store)):
        base = os.path.join(store, field, "c")
        if field == "restart" or not os.path.isdir(base) or not os.path.isfile(os.path.join(store, field, "zarr.json")):
            continue
        for d, _, files in os.walk(base):
            for f in files:
                st = os.stat(os.path.join(d, f))
                out[f"{os.path.relpath(os.path.join(d, f), base)}/{field}"] = (st.st_mtime_ns, st.st_ino)
    return {k: v for k, v in out.items() if k.count("/") >= 4}   # coordinates have one dim: no init/lead/member path


def channel_count(store: str) -> int:
    """How many channels (field and level) a forecast store holds: one chunk each per (init, lead, member, tile)."""
    import zarr

    return len(json.loads(zarr.open_group(store, mode="r").attrs["mesh3d_channels"]))


class ChannelMLP(nn.Module):
    """A residual MLP over the channels at every point: weights for tensor parallelism on the model axis."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(2)
        self.up, self.down = nn.Linear(3, 8), nn.Linear(8, 3)

    def forward(self, x):
        h = torch.tanh(self.up(x.permute(0, 2, 3, 1)))
        return x + 0.5 * self.down(h).permute(0, 3, 1, 2)


def channel_mlp() -> nn.Module:
    return ChannelMLP().double()


def mlp_plan():
    """up column-wise, down row-wise over the model axis; the weights whole on each batch rank (inference)."""
    from mesh3d import Plan

    return Plan(model={"up": "colwise", "down": "rowwise"}, batch=None)
