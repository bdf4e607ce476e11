"""Figures of a forecast (one process, matplotlib): scores against lead time, and maps of truth, forecast and error.

Usage::

    fig = score_figure(table)                            # a ScoreTable: one line per channel in each score's panel
    fig = forecast_maps(fc, truth, channel="z500", units="m", init="2020-01-14T00", model="SFNO", lead_hours=[6, 24, 48])
    fig.savefig("forecast.png")
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from mesh3d.weather.grid import lat_weights
from mesh3d.weather.scores import ScoreTable

__all__ = ["GEOPOTENTIAL", "forecast_maps", "score_figure"]

#: Variable names drawn with contour lines (geopotential and geopotential height, ERA5 and WeatherBench 2 names).
GEOPOTENTIAL = ("z", "zg", "gh", "geopotential", "geopotential_height")


def _pyplot() -> Any:
    import matplotlib  # noqa: PLC0415 (optional: the weather extra)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415 (optional: the weather extra)

    return plt


def score_figure(table: ScoreTable, title: str = "") -> Any:
    """Four panels against lead time (h): RMSE of the ensemble mean and fair CRPS (each divided by the channel's
    ``scale``, its normalization std, when the table has one), spread/skill and ACC; one line per channel."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 4, figsize=(16, 3.8), constrained_layout=True)
    scale = np.asarray(table.scale if table.scale is not None else np.ones(len(table.channels)))
    unit = " / σ (channel std)" if table.scale is not None else " (channel units)"
    panels = (("rmse", f"RMSE of the ensemble mean{unit}", scale), ("crps", f"fair CRPS{unit}", scale),
              ("spread_skill", "spread / skill", None), ("acc", "ACC of the ensemble mean", None))
    for ax, (name, label, by) in zip(axes, panels):
        values = getattr(table, name)
        for c, channel in enumerate(table.channels):
            ax.plot(table.lead_hours, values[:, c] / (by[c] if by is not None else 1), marker="o", ms=3, label=channel)
        if name == "spread_skill":
            ax.axhline(1.0, color="grey", lw=0.8, ls="--")
        ax.set_xlabel("lead time (h)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[0].legend(title="channel", fontsize=8)
    fig.suptitle(title or f"{table.members}-member ensemble, {int(table.inits.max(initial=0))} init times")
    return fig


def forecast_maps(forecast: np.ndarray, truth: np.ndarray, *, lat: Sequence[float], lon: Sequence[float], channel: str,
                  units: str, init: Any, model: str, lead_hours: Sequence[float], variable: str = "") -> Any:
    """Truth (top), forecast (middle) and forecast - truth (bottom, titled with its latitude-weighted RMSE) of one
    channel at each lead: ``forecast`` and ``truth`` are ``(leads, H, W)`` in physical units. Axes in degrees,
    colour bars labelled with the channel and its units, contour lines for geopotential."""
    plt = _pyplot()
    lats, lons = np.asarray(lat, dtype=np.float64), np.asarray(lon, dtype=np.float64)
    forecast, truth = np.asarray(forecast, dtype=np.float64), np.asarray(truth, dtype=np.float64)
    weights = lat_weights(lats).numpy()
    step = lons[1] - lons[0]
    extent = (lons[0] - step / 2, lons[-1] + step / 2, lats.min(), lats.max())
    origin = "upper" if lats[0] > lats[-1] else "lower"
    contours = (variable or channel.rstrip("0123456789")).lower() in GEOPOTENTIAL
    n = len(lead_hours)
    fig, axes = plt.subplots(3, n, figsize=(4.2 * n, 7.6), constrained_layout=True, squeeze=False)
    low, high = float(truth.min()), float(truth.max())
    error = forecast - truth
    span = float(np.abs(error).max()) or 1.0
    for col, hours in enumerate(lead_hours):
        rmse = float(np.sqrt((weights * error[col] ** 2).mean()))
        for row, (field, name) in enumerate(((truth[col], "truth"), (forecast[col], "forecast"), (error[col], "error"))):
            ax = axes[row, col]
            is_error = row == 2
            image = ax.imshow(field, extent=extent, origin=origin, aspect="auto", cmap="RdBu_r" if is_error else "viridis",
                              vmin=-span if is_error else low, vmax=span if is_error else high)
            if contours and not is_error:
                ax.contour(lons, lats, field, levels=np.linspace(low, high, 9)[1:-1], colors="k", linewidths=0.6)
            ax.set_title(f"{name}, +{hours:g} h" + (f": RMSE {rmse:.3g} {units}" if is_error else ""), fontsize=9)
            ax.set_xlabel("longitude (°E)")
            ax.set_ylabel("latitude (°N)")
            if col == n - 1:
                label = f"{channel} forecast - truth ({units})" if is_error else f"{channel} ({units})"
                fig.colorbar(image, ax=axes[row, :], shrink=0.9, label=label)
    fig.suptitle(f"{model}: {channel} from init {np.datetime_as_string(np.datetime64(init, 'm'))} UTC")
    return fig
