"""What a forecast reads: the initial conditions (and later the truth) of a weather dataset, this rank's block of each.

Usage::

    inputs = ForecastInputs("era5.zarr", {"z": [500], "t2m": None}, lead=np.timedelta64(6, "h"), stats=stats,
                            blocks=FieldBlocks.for_mesh((32, 64), (4, 8)))
    inits = inputs.init_times(["2020-01-10T00", 40])     # datetimes or time indices -> datetime64[ns]
    x = inputs.state(inits[0])                            # (C, h, w) normalized, this rank's block
    truth = inputs.raw(inits[0] + 3 * inputs.lead)        # (C, h, w) physical units (None past the dataset's end)
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from mesh3d.data.weather import WeatherDataset
from mesh3d.data.weather_channels import ChannelStats
from mesh3d.weather.layout import FieldBlocks
from mesh3d.weather.store import ChannelInfo, hours

__all__ = ["ForecastInputs", "variable_pairs", "weather_extra"]


def variable_pairs(variables: Any) -> list[tuple[str, list[Any] | None]]:
    """Channels as ordered ``(name, levels or None)`` pairs, from names, ``{name: levels}`` or pairs (JSON's lists).

    Usage: ``variable_pairs({"z": [500], "t2m": None})  # [("z", [500]), ("t2m", None)]``
    """
    if isinstance(variables, Mapping):
        items = list(variables.items())
    else:
        items = [(v, None) if isinstance(v, str) else tuple(v) for v in variables]
    out = []
    for item in items:
        if len(item) != 2 or not isinstance(item[0], str):
            raise ValueError(f"variables: give names, {{name: levels}} or [name, levels] pairs, got {item!r}")
        name, levels = item
        out.append((name, None if levels is None else [np.asarray(lv).item() for lv in levels]))
    return out


def weather_extra(dataset: WeatherDataset, lead_hours: float | None = None) -> dict[str, Any]:
    """What a checkpoint's ``extra["weather"]`` holds for ``mesh3d forecast``: the channels in order (as pairs: JSON
    objects lose their order), their names, the normalization and the model's step in hours.

    Usage: ``checkpoint.save(path, model, opt, step=k, extra={"weather": weather_extra(train_set, 6)})``
    """
    pairs: list[list[Any]] = []
    for c in dataset.channels:
        if pairs and pairs[-1][0] == c.variable and c.level is not None:
            pairs[-1][1].append(np.asarray(c.level).item())
        else:
            pairs.append([c.variable, None if c.level is None else [np.asarray(c.level).item()]])
    return {"variables": pairs, "channels": dataset.channel_names,
            "stats": None if dataset.stats is None else dataset.stats.to_dict(), "lead_hours": lead_hours}


class ForecastInputs:
    """A :class:`WeatherDataset` read at any time, on the blocks of a forecast store (``sizes`` aligned to its tiles).

    Usage: ``ForecastInputs(source, variables, lead=np.timedelta64(6, "h"), stats=stats, blocks=blocks)``
    """

    def __init__(self, source: Any, variables: Sequence[str] | Mapping[str, Sequence[Any] | None], *, lead: Any,
                 stats: ChannelStats | Mapping[str, Sequence[float]] | None, blocks: FieldBlocks | None = None,
                 names: Mapping[str, str] | None = None) -> None:
        names = dict(names or {})
        if isinstance(stats, str):
            raise ValueError(f"stats={stats!r}: a forecast normalizes with the training's statistics; pass them (a "
                             "ChannelStats or its dict)")
        variables = dict(variable_pairs(variables))
        probe = WeatherDataset(source, variables, lead=lead, steps=1, stats=stats, domain=((1,), (0,)), **names)
        self.lat, self.lon = probe.lat, probe.lon
        blocks = blocks if blocks is not None else FieldBlocks((len(self.lat), len(self.lon)), (1,), (0,),
                                                               ((len(self.lat),),))
        self.blocks = blocks
        if blocks.split:
            self.data = WeatherDataset(source, variables, lead=lead, steps=1, stats=probe.stats, sizes=blocks.sizes,
                                       domain=(blocks.grid, blocks.coords), **names)
        else:
            self.data = probe
        ds, time = self.data.dataset, self.data.dim_names["time"]
        self.times = np.asarray(ds[time].values)
        if not np.issubdtype(self.times.dtype, np.datetime64):
            raise ValueError(f"a forecast needs a datetime {time!r} coordinate (init and valid times); the dataset's is "
                             f"{self.times.dtype}")
        self.times = self.times.astype("datetime64[ns]")
        step = self.times[1] - self.times[0] if len(self.times) > 1 else np.timedelta64(0, "ns")
        self.lead = (step * self.data.lead).astype("timedelta64[ns]")
        self.stats = self.data.stats
        self._index = {t: i for i, t in enumerate(self.times.tolist())}

    @property
    def channels(self) -> tuple[ChannelInfo, ...]:
        ds = self.data.dataset
        return tuple(ChannelInfo(c.name, c.variable, None if c.level is None else float(c.level),
                                 str(ds[c.variable].attrs.get("units", ""))) for c in self.data.channels)

    def init_times(self, given: Sequence[Any]) -> tuple[np.datetime64, ...]:
        """Init times as datetime64[ns]: each a datetime (string or numpy) or an index into the dataset's times."""
        out = []
        for t in given:
            if isinstance(t, (int, np.integer)) and not isinstance(t, bool):
                if not -len(self.times) <= int(t) < len(self.times):
                    raise ValueError(f"init time index {t} is outside the dataset's {len(self.times)} times")
                out.append(self.times[int(t)])
                continue
            value = np.datetime64(t, "ns")
            if value.tolist() not in self._index:
                when = lambda v: np.datetime_as_string(v, unit="m")
                raise ValueError(f"init time {when(value)} is not a time of the dataset (its times run from "
                                 f"{when(self.times[0])} to {when(self.times[-1])} every {hours(self.times[1] - self.times[0])})")
            out.append(value)
        if not out or len(set(out)) != len(out):
            raise ValueError(f"give one or more distinct init times, got {[str(t) for t in out]}")
        return tuple(out)

    def index(self, when: Any) -> int | None:
        return self._index.get(np.datetime64(when, "ns").tolist())

    def raw(self, when: np.datetime64) -> np.ndarray | None:
        """This rank's block of every channel at ``when`` in physical units, fp64 (None: not in the dataset)."""
        t = self.index(when)
        return None if t is None else self.data.read_block([t])[0]

    def state(self, when: np.datetime64, dtype: torch.dtype) -> torch.Tensor:
        """This rank's block at ``when`` as the model sees it: normalized, ``(C, h, w)`` in ``dtype``.

        Read and normalized in fp64 for an fp64 model, else in fp32 (one fp32 copy of the block, not two in fp64)."""
        t = self.index(when)
        if t is None:
            raise ValueError(f"init time {when} is not in the dataset")
        wide = np.float64 if dtype == torch.float64 else np.float32
        return torch.from_numpy(self.normalize(self.data.read_block([t], dtype=wide)[0])).to(dtype)

    def normalize(self, raw: np.ndarray) -> np.ndarray:
        """``(raw - mean) / std`` per channel, in place (``raw`` is this rank's fresh fp64 read)."""
        if self.stats is None:
            return raw
        mean, std = self.stats.arrays(raw.shape[-3])
        raw -= mean.astype(raw.dtype)
        raw /= std.astype(raw.dtype)
        return raw

    def physical(self, state: np.ndarray, dtype: Any = np.float64) -> np.ndarray:
        """The model's normalized ``(..., C, h, w)`` values in physical units, computed in ``dtype`` (a new array)."""
        out = np.array(state, dtype=dtype)
        if self.stats is not None:
            mean, std = self.stats.arrays(out.shape[-3])
            out *= std.astype(dtype)
            out += mean.astype(dtype)
        return out
