"""Channels of a weather dataset (variables and pressure levels) and their normalization statistics.

Usage::

    channels = select_channels(ds, {"z": [500], "t": [850, 500], "t2m": None}, level="level")
    [c.name for c in channels]            # ['z500', 't850', 't500', 't2m']
    stats = ChannelStats(mean=(...), std=(...)); stats.to_dict()    # JSON, saved beside a checkpoint
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["Channel", "ChannelStats", "select_channels"]


@dataclass(frozen=True)
class Channel:
    """One input channel: a variable, and the index and value of its level (``None`` for a surface field).

    Usage: ``Channel("z", 500, 1).name  # 'z500'``; ``dataset.channels``
    """

    variable: str
    level: Any = None
    level_index: int | None = None

    @property
    def name(self) -> str:
        if self.level is None:
            return self.variable
        level = self.level.item() if hasattr(self.level, "item") else self.level
        return f"{self.variable}{int(level) if float(level).is_integer() else level}"


def select_channels(ds: Any, variables: Sequence[str] | Mapping[str, Sequence[Any] | None], *, level: str,
                    dims: Sequence[str]) -> tuple[Channel, ...]:
    """The channels of ``variables`` in order: a name (every level it has) or ``{name: levels or None}``.

    Usage: ``select_channels(ds, {"z": [500], "t2m": None}, level="level", dims=("time", "lat", "lon"))``

    ``dims`` are the dims every variable must have besides ``level`` (time, lat, lon); a variable with
    other dims is refused, naming them.
    """
    chosen = dict(variables) if isinstance(variables, Mapping) else {v: None for v in variables}
    if not chosen:
        raise ValueError("WeatherDataset: select at least one variable, e.g. variables=['t2m'] or {'z': [500]}")
    out: list[Channel] = []
    for name, levels in chosen.items():
        if name not in ds.data_vars:
            raise ValueError(f"WeatherDataset: no variable {name!r}; the dataset has {sorted(map(str, ds.data_vars))}")
        var_dims = tuple(ds[name].dims)
        extra = [d for d in var_dims if d not in (*dims, level)]
        missing = [d for d in dims if d not in var_dims]
        if extra or missing:
            raise ValueError(f"WeatherDataset: variable {name!r} has dims {var_dims}; need {tuple(dims)} and at most "
                             f"{level!r} (missing {missing}, unexpected {extra}); name the dims with lat=, lon=, time=, level=")
        if level not in var_dims:
            if levels is not None:
                raise ValueError(f"WeatherDataset: variable {name!r} has no {level!r} dim, so levels={levels!r} "
                                 "cannot be selected; pass None for a surface field")
            out.append(Channel(name))
            continue
        have = np.asarray(ds[level].values).tolist()
        for value in have if levels is None else levels:
            if value not in have:
                raise ValueError(f"WeatherDataset: {name!r} has no level {value!r}; its levels are {have}")
            out.append(Channel(name, value, have.index(value)))
    return tuple(out)


@dataclass(frozen=True)
class ChannelStats:
    """Per-channel mean and standard deviation: ``x_normalized = (x - mean) / std``.

    Usage: ``ChannelStats.from_dict(json.load(f))``; ``stats.to_dict()``
    """

    mean: tuple[float, ...]
    std: tuple[float, ...]

    def __post_init__(self) -> None:
        if len(self.mean) != len(self.std) or any(not s > 0 for s in self.std):
            raise ValueError(f"ChannelStats: need one mean and one positive std per channel, got mean={self.mean}, "
                             f"std={self.std}")

    def to_dict(self) -> dict[str, list[float]]:
        return {"mean": list(self.mean), "std": list(self.std)}

    @classmethod
    def from_dict(cls, data: Mapping[str, Sequence[float]]) -> ChannelStats:
        return cls(tuple(float(v) for v in data["mean"]), tuple(float(v) for v in data["std"]))

    @classmethod
    def from_moments(cls, total: np.ndarray, squares: np.ndarray, count: float) -> ChannelStats:
        """From per-channel sums of values and of squares over ``count`` points (fp64)."""
        mean = total / count
        var = np.maximum(squares / count - mean ** 2, 0.0)
        return cls(tuple(mean.tolist()), tuple(np.sqrt(np.where(var > 0, var, 1.0)).tolist()))

    def arrays(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        """(mean, std) shaped ``(n, 1, 1)`` for broadcasting over (channel, lat, lon)."""
        if len(self.mean) != n:
            raise ValueError(f"ChannelStats has {len(self.mean)} channels but the dataset selects {n}")
        return np.asarray(self.mean).reshape(n, 1, 1), np.asarray(self.std).reshape(n, 1, 1)
