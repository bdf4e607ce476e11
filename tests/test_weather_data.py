"""WeatherDataset in one process, rank by rank (``domain=(grid, coords)``): each rank's (lat, lon) block, channels and
lead times from zarr and NetCDF against the numpy fields, the bytes each rank reads, chunk alignment, statistics;
latitude weights and the scores against formulas written here."""

from __future__ import annotations

import itertools
import pickle

import numpy as np
import pytest
import torch

import weather_helpers as wh
from mesh3d.data import ChannelStats, WeatherDataset
from mesh3d.weather import LatLonGrid, acc, lat_weights, rmse, weighted_mse


def _want(f, t, lead, steps):
    """(steps + 1, C, H, W) in channel order z850, z300, t2m: the raw fields at t, t + lead, ..."""
    times = [t + k * lead for k in range(steps + 1)]
    return np.stack([f["z"][times, 2], f["z"][times, 0], f["t2m"][times].astype(np.float64)], axis=1)


def _chunks_hit(a, b, chunk):
    return (b - 1) // chunk - a // chunk + 1 if b > a else 0


@pytest.mark.parametrize("fmt", ["zarr", "nc"])
@pytest.mark.parametrize("grid, sizes", [((2, 2), None), ((3, 1), None), ((2, 2), ((5, 2), (3, 7))),
                                         ((3, 1), ((1, 6, 0), (10,)))])
def test_each_rank_reads_its_block_channels_and_lead_times_and_only_their_bytes(tmp_path, fmt, grid, sizes):
    path = wh.write_weather(str(tmp_path))[fmt]
    f = wh.fields()
    lead, steps = 2, 2
    tiles = np.full((steps + 1, 3, wh.H, wh.W), np.nan)
    data_bytes = []
    for coords in itertools.product(*(range(g) for g in grid)):
        ds = WeatherDataset(path, wh.VARIABLES, lead=np.timedelta64(12, "h"), steps=steps, sizes=sizes,
                            domain=(grid, coords), dtype=torch.float64)
        assert ds.lead == lead and len(ds) == wh.T - lead * steps and ds.channel_names == ["z850", "z300", "t2m"]
        (a, b), (c, d) = ds.block["lat"], ds.block["lon"]
        if sizes is not None:
            assert (b - a, d - c) == (sizes[0][coords[0]], sizes[1][coords[1]])
        ds[0]  # the first read also takes the store's metadata
        before = ds.bytes_read
        item = ds[3]
        want = _want(f, 3, lead, steps)[..., a:b, c:d]
        np.testing.assert_array_equal(item["x"].numpy(), want[0])
        assert len(item["y"]) == steps
        np.testing.assert_array_equal(torch.stack(item["y"]).numpy(), want[1:])
        tiles[..., a:b, c:d] = np.concatenate([item["x"][None].numpy(), torch.stack(item["y"]).numpy()])
        nbytes = ds.bytes_read - before
        per_point = (steps + 1) * (2 * 8 + 4)   # two z levels (f8) and t2m (f4) at each of steps + 1 times
        if fmt == "nc":  # contiguous variables: exactly this rank's points
            assert nbytes == per_point * (b - a) * (d - c)
        else:  # uncompressed chunks of 2 x 5: every chunk the block touches, whole
            assert nbytes == per_point * _chunks_hit(a, b, 2) * 2 * _chunks_hit(c, d, 5) * 5
        data_bytes.append(nbytes)
    np.testing.assert_array_equal(tiles, _want(f, 3, lead, steps))  # the blocks tile the globe, once each
    if fmt == "zarr" and sizes is None:  # chunk-aligned split: no chunk read by two ranks
        assert sum(data_bytes) == (steps + 1) * (2 * 8 + 4) * 8 * 10  # 4 x 2 chunks of 2 x 5 (the last row padded)


def test_default_split_follows_the_chunks_where_every_rank_gets_some(tmp_path):
    paths = wh.write_weather(str(tmp_path))
    sizes = {grid: WeatherDataset(paths["zarr"], ["t2m"], domain=(grid, (0,) * len(grid))).sizes
             for grid in [(2, 2), (3, 1), (4,), (2, 3)]}
    assert sizes == {(2, 2): ((4, 3), (5, 5)), (3, 1): ((2, 2, 3), (10,)), (4,): ((2, 2, 2, 1),),
                     (2, 3): ((4, 3), (4, 4, 2))}  # lon: 2 chunks for 3 ranks, so torch.chunk's split
    assert WeatherDataset(paths["nc"], ["t2m"], domain=((3, 1), (0, 0))).sizes == ((3, 3, 1), (10,))


def test_statistics_normalize_each_channel(tmp_path):
    paths = wh.write_weather(str(tmp_path))
    f = wh.fields()
    ds = WeatherDataset(paths["nc"], wh.VARIABLES, steps=1, stats="compute", dtype=torch.float64)
    raw = _want(f, 0, 1, wh.T - 2)  # every time used as an input: 0 .. T - 2
    np.testing.assert_allclose(ds.stats.mean, raw.mean(axis=(0, 2, 3)), rtol=1e-12)
    np.testing.assert_allclose(ds.stats.std, raw.std(axis=(0, 2, 3)), rtol=1e-10)
    x = ds[4]["x"].numpy()
    np.testing.assert_allclose(x, (raw[4] - raw.mean(axis=(0, 2, 3))[:, None, None]) / raw.std(axis=(0, 2, 3))[:, None, None],
                               rtol=1e-9, atol=1e-12)
    again = WeatherDataset(paths["zarr"], wh.VARIABLES, stats=ds.stats.to_dict(), dtype=torch.float64)
    assert again.stats == ChannelStats.from_dict(ds.stats.to_dict())


@pytest.mark.parametrize("kwargs, message", [
    ({"variables": ["q"]}, "no variable 'q'; the dataset has \\['t2m', 'z'\\]"),
    ({"variables": {"z": [700]}}, "'z' has no level 700; its levels are \\[300, 500, 850\\]"),
    ({"variables": {"t2m": [500]}}, "'t2m' has no 'level' dim"),
    ({"variables": ["t2m"], "lead": np.timedelta64(9, "h")}, "not a positive multiple of the time step"),
    ({"variables": ["t2m"], "steps": 5, "lead": 2}, "input times must lie in 0..-2"),
    ({"variables": ["t2m"], "domain": ((2, 2, 2), (0, 0, 0))}, "must have 1 dim \\(lat slabs\\) or 2"),
    ({"variables": ["t2m"], "sizes": ((7,), (5, 5))}, "sizes=\\(7,\\) must be 2 non-negative ints"),
])
def test_bad_selections_say_what_would_be_right(tmp_path, kwargs, message):
    path = wh.write_weather(str(tmp_path))["zarr"]
    kwargs = {"domain": ((2, 2), (0, 0)), **kwargs}
    with pytest.raises(ValueError, match=message):
        WeatherDataset(path, **kwargs)


def test_dims_named_latitude_and_longitude_are_taken_as_they_are(tmp_path):
    """ARCO ERA5 and WeatherBench 2 name the dims latitude/longitude (and the CDS pressure_level, valid_time)."""
    import xarray as xr

    path = wh.write_weather(str(tmp_path))["zarr"]
    plain = WeatherDataset(path, wh.VARIABLES, steps=1, domain=((2, 2), (1, 0)), dtype=torch.float64)
    renamed = xr.open_zarr(path, consolidated=False).rename(lat="latitude", lon="longitude", level="pressure_level",
                                                            time="valid_time")
    ds = WeatherDataset(renamed, wh.VARIABLES, steps=1, domain=((2, 2), (1, 0)), dtype=torch.float64)
    assert ds.dim_names == {"lat": "latitude", "lon": "longitude", "time": "valid_time", "level": "pressure_level"}
    assert ds.block == {"latitude": (4, 7), "longitude": (0, 5)} and ds.channel_names == plain.channel_names
    assert torch.equal(ds[2]["x"], plain[2]["x"]) and torch.equal(ds[2]["y"][0], plain[2]["y"][0])
    with pytest.raises(ValueError, match=r"lead=9 h is not a positive multiple of the time step 6 h"):
        WeatherDataset(renamed, ["t2m"], lead=np.timedelta64(9, "h"))
    with pytest.raises(ValueError, match=r"name the dims with lat=, lon=, time=, level="):
        WeatherDataset(renamed.rename(latitude="y"), ["t2m"])


def test_latitude_weights_integrate_over_the_sphere():
    lat = np.linspace(90, -90, 721)                   # 0.25 degrees, poles included
    w = lat_weights(lat)
    assert w.shape == (721, 1) and float(w.mean()) == pytest.approx(1.0) and float(w[0]) > 0
    # The mean over the sphere of sin^2(lat) is 1/3; of cos^2(lat), 2/3 (area element cos(lat)).
    assert float((w[:, 0] * torch.from_numpy(np.sin(np.radians(lat)) ** 2)).mean()) == pytest.approx(1 / 3, abs=1e-6)
    assert float((w[:, 0] * torch.from_numpy(np.cos(np.radians(lat)) ** 2)).mean()) == pytest.approx(2 / 3, abs=1e-6)
    torch.testing.assert_close(lat_weights(lat[::-1].copy()), w.flip(0))
    with pytest.raises(ValueError, match="periodic"):
        LatLonGrid(lat, np.arange(0, 180, 1.0))


def test_latitude_weights_follow_the_grid_s_own_order():
    """An asymmetric grid, descending (as ERA5's), ascending and shuffled: each latitude's weight is its band's area,
    the band reaching halfway to its neighbours in latitude (not in the list), computed here with math alone."""
    lat = [80.0, 50.0, 10.0, -30.0, -85.0]                      # descending, unevenly spaced, not symmetric
    edges = [90.0, 65.0, 30.0, -10.0, -57.5, -90.0]
    area = [np.sin(np.radians(a)) - np.sin(np.radians(b)) for a, b in zip(edges[:-1], edges[1:])]
    want = np.array(area) / np.mean(area)
    for order in ([0, 1, 2, 3, 4], [4, 3, 2, 1, 0], [2, 0, 4, 1, 3]):
        got = lat_weights([lat[i] for i in order])[:, 0].numpy()
        np.testing.assert_allclose(got, want[order], rtol=1e-12, err_msg=str(order))


def test_scores_match_their_formulas():
    g = torch.Generator().manual_seed(0)
    pred, truth, clim = (torch.randn(2, 3, 5, 8, dtype=torch.float64, generator=g) for _ in range(3))
    w = lat_weights(np.linspace(70, -70, 5))
    wn = w.numpy()[:, 0]
    p, t, c = pred.numpy(), truth.numpy(), clim.numpy()
    want_rmse = np.sqrt(np.einsum("h,bchw->bc", wn, (p - t) ** 2) / (5 * 8))
    fa, oa = p - c, t - c
    want_acc = np.einsum("h,bchw->bc", wn, fa * oa) / np.sqrt(np.einsum("h,bchw->bc", wn, fa ** 2)
                                                              * np.einsum("h,bchw->bc", wn, oa ** 2))
    np.testing.assert_allclose(rmse(pred, truth, w).numpy(), want_rmse, rtol=1e-12)
    np.testing.assert_allclose(acc(pred, truth, w, clim).numpy(), want_acc, rtol=1e-12)
    assert float(weighted_mse(pred, truth, w)) == pytest.approx(float((want_rmse ** 2).mean()), rel=1e-12)
    with pytest.raises(ValueError, match=r"latitude weights must be \(H, 1\) with H = 5"):
        rmse(pred, truth, w[:4])


def test_dataloader_workers_reopen_the_store_and_give_the_same_batches(tmp_path):
    from torch.utils.data import DataLoader

    from mesh3d.data import StoredArray

    paths = wh.write_weather(str(tmp_path))
    for fmt in ("zarr", "nc"):
        ds = WeatherDataset(paths[fmt], wh.VARIABLES, steps=2, domain=((2, 2), (1, 1)), dtype=torch.float64)
        plain = [ds[i] for i in range(len(ds))]
        for batch in DataLoader(ds, batch_size=3, num_workers=2):
            for j, i in enumerate(batch["index"].tolist()):
                assert torch.equal(batch["x"][j], plain[i]["x"]) and all(
                    torch.equal(y[j], want) for y, want in zip(batch["y"], plain[i]["y"]))
        again = pickle.loads(pickle.dumps(ds))  # spawn/forkserver workers receive the dataset pickled
        assert torch.equal(again[1]["x"], plain[1]["x"]) and again.bytes_read > 0
    x = pickle.loads(pickle.dumps(StoredArray(paths["nc"], "t2m")))
    assert np.array_equal(x[2, 1:3], wh.fields()["t2m"][2, 1:3])  # reopened here (its metadata read again)
    before = x.bytes_read
    assert np.array_equal(x[3, 1:3], wh.fields()["t2m"][3, 1:3]) and x.bytes_read - before == 2 * wh.W * 4
