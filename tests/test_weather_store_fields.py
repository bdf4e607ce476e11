"""The forecast store's fields (mesh3d/weather/fields.py), in one process: one variable per field with its units and CF
names, pressure levels as a dimension, blocks written in the model's channel order read back as written (by zarr, by
xarray as WeatherBench 2-style code selects a level, and stacked by ``channels_array``), and channel sets that cannot
be fields refused by name."""

from __future__ import annotations

import numpy as np
import pytest

from mesh3d.weather import channels_array
from mesh3d.weather.cf_names import cf_attrs
from mesh3d.weather.fields import ChannelInfo, FieldArrays, field_layout
from mesh3d.weather.store import ForecastStore, StoreSpec, create_store, read_spec

# Channels out of level order, a field whose levels are not one run of the store's levels (z: 50 and 1000 around t's
# 500), and surface fields between them.
CHANNELS = (ChannelInfo("z1000", "z", 1000.0, "m2 s-2"), ChannelInfo("t2m", "t2m", None, "K"),
            ChannelInfo("t500", "t", 500.0, "K"), ChannelInfo("z50", "z", 50.0, "m2 s-2"),
            ChannelInfo("t850", "t", 850.0, "K"), ChannelInfo("msl", "msl", None, "Pa"))


def _spec(**kwargs) -> StoreSpec:
    inits = (np.datetime64("2020-01-01T00"), np.datetime64("2020-01-02T00"))
    return StoreSpec(inits, np.timedelta64(6, "h"), 3, 2, CHANNELS, np.linspace(80, -80, 9), np.arange(0, 360, 30.0),
                     (4, 5), "float64", **kwargs)


def test_blocks_written_in_channel_order_read_back_as_fields_levels_and_stacked(tmp_path):
    import xarray as xr

    path = str(tmp_path / "fc.zarr")
    create_store(path, _spec())
    store = ForecastStore(path)
    rng = np.random.default_rng(0)
    whole = rng.standard_normal((2, 3, 2, len(CHANNELS), 9, 12))    # (init, lead, member, channel, lat, lon)
    for i in range(2):
        for k in range(3):
            for rows, cols in (((0, 4), (0, 7)), ((4, 9), (0, 7)), ((0, 9), (7, 12))):   # blocks of a 2 + 1 mesh
                store.write(i, k, 0, whole[i, k, :, :, rows[0]:rows[1], cols[0]:cols[1]], rows, cols)
    store.finish()

    ds = xr.open_zarr(path)
    assert sorted(ds.data_vars) == ["msl", "t", "t2m", "z"] and ds["level"].values.tolist() == [50.0, 500.0, 850.0, 1000.0]
    for c, ch in enumerate(CHANNELS):   # as WeatherBench 2-style code reads a field: by name, then .sel(level=...)
        got = ds[ch.variable] if ch.level is None else ds[ch.variable].sel(level=ch.level)
        np.testing.assert_array_equal(got.values, whole[:, :, :, c])
        assert got.attrs["units"] == ch.units and got.attrs["long_name"]
    assert ds["z"].sel(level=500).isnull().all() and ds["t"].sel(level=50).isnull().all()   # never forecast
    assert ds["t"].attrs["standard_name"] == "air_temperature" and ds["msl"].attrs["standard_name"] == \
        "air_pressure_at_mean_sea_level" and ds["z"].attrs["standard_name"] == "geopotential"
    stacked = channels_array(ds)
    assert stacked["channel"].values.tolist() == [c.name for c in CHANNELS]
    np.testing.assert_array_equal(stacked.values, whole)
    np.testing.assert_array_equal(FieldArrays.open(path, CHANNELS).read(1, 2, (2, 7), (3, 11)), whole[1, 2, :, :, 2:7, 3:11])
    again = read_spec(path)
    assert again.channels == CHANNELS and again.tile == (4, 5) and (again.leads, again.members) == (3, 2)


@pytest.mark.parametrize(("channels", "says"), [
    ((ChannelInfo("z500", "z", 500.0, "m"), ChannelInfo("z", "z", None, "m")), "either on pressure levels"),
    ((ChannelInfo("a", "t", 500.0, "K"), ChannelInfo("b", "t", 500.0, "K")), "at level 500 twice"),
    ((ChannelInfo("t500", "t", 500.0, "K"), ChannelInfo("t850", "t", 850.0, "degC")), "one field has one unit"),
    ((ChannelInfo("lvl", "level", None, "1"),), "cannot be a field"),
    ((ChannelInfo("x", "a/b", None, "1"),), "cannot be a field"),
], ids=["levels-and-surface", "level-twice", "units", "coordinate-name", "slash"])
def test_channels_that_are_not_fields_are_refused_by_name(channels, says):
    with pytest.raises(ValueError, match=says):
        field_layout(channels)


def test_cf_names_by_variable_and_units():
    assert cf_attrs("z", "m")["standard_name"] == "geopotential_height"
    assert cf_attrs("geopotential", "m2 s-2")["standard_name"] == "geopotential"
    assert cf_attrs("2t", "K") == {"standard_name": "air_temperature", "long_name": "2 metre temperature"}
    assert cf_attrs("10m_u_component_of_wind", "m s-1")["standard_name"] == "eastward_wind"
    assert cf_attrs("my_tracer", "1") == {"long_name": "my_tracer"}                   # no CF name: none invented
