"""Weather on the mesh against one process in fp64: longitude halos across the seam with longitude split, the
latitude-weighted loss and rollout training (by hand on (1, 2x2, 1), with FSDP on (2, 2x2, 1), resumed there from a
checkpoint of the first), and forecasts written block by block equal to the one-process forecast."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import weather_helpers as wh

TOL = 1e-10


def _hand_padded_reference(x, weights, lat_modes):
    """The sphere convolutions written out in the test: columns wrapped with cat, rows padded by F.pad's plain path."""
    for (w, b), mode in zip(weights, lat_modes):
        p_lat, p_lon = (w.shape[2] - 1) // 2, (w.shape[3] - 1) // 2
        x = torch.cat([x[..., -p_lon:], x, x[..., :p_lon]], dim=-1) if p_lon else x
        x = F.pad(x, (0, 0, p_lat, p_lat), mode=mode) if p_lat else x
        x = F.gelu(F.conv2d(x, w, b))
    return x


def _halo_body(grid, sizes, x, weights, lat_modes):
    from mesh3d import DistributedManager, domain
    from mesh3d.weather import SphereConv2d

    DistributedManager.initialize(batch=1, domain=grid)
    convs = []
    for (w, b), mode in zip(weights, lat_modes):
        conv = SphereConv2d(w.shape[1], w.shape[0], tuple(w.shape[2:]), lat_mode=mode, dtype=torch.float64)
        with torch.no_grad():
            conv.weight.copy_(w)
            conv.bias.copy_(b)
        convs.append(conv)
    xs = (domain.shard(x, dims=(2, 3), sizes=sizes) if len(grid) == 2 else domain.shard(x, dim=2, sizes=sizes[0]))
    refusal = None
    if len(grid) == 2:  # a block each rank holds itself, wrapped without communication; a wrong size refused
        again = domain.from_local(xs.to_local().clone(), dims=(2, 3), sizes=sizes)
        assert torch.equal(again.full_tensor().to_local(), x) and again.spec.sizes == xs.spec.sizes
        try:
            domain.from_local(xs.to_local(), dims=(2, 3), sizes=(sizes[1], sizes[0]))
        except ValueError as err:
            refusal = str(err)
    xs.requires_grad_(True)
    y = xs
    for conv in convs:
        y = F.gelu(conv(y))
    (y * y).mean().backward()
    grads = []
    for conv in convs:
        for p in (conv.weight, conv.bias):
            g = p.grad.clone()
            torch.distributed.all_reduce(g, group=DistributedManager().group("domain"))
            grads.append(g)
    offsets = xs.spec.offsets if len(grid) == 2 else (xs.spec.offset, 0)
    return y.full_tensor().to_local().detach(), xs.grad.to_local().clone(), offsets, grads, refusal


@pytest.mark.parametrize("world, grid, sizes", [
    (3, (1, 3), ((7,), (4, 0, 6))),        # longitude alone split, unevenly, with an empty block
    (4, (2, 2), ((4, 3), (1, 9))),         # the seam between the two ranks of each grid line: a 1-column block
    (2, (2,), ((3, 4), None)),             # latitude slabs: the seam is local
])
def test_periodic_longitude_halos_equal_one_process_when_longitude_is_split(ranks, world, grid, sizes):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 2, 7, 10, dtype=torch.float64, generator=g)
    shapes = [((3, 2, 3, 3), "replicate"), ((2, 3, 3, 5), "constant"), ((2, 2, 1, 7), "reflect")]
    weights = [(torch.randn(s, dtype=torch.float64, generator=g) / 4, torch.randn(s[0], dtype=torch.float64, generator=g))
               for s, _ in shapes]
    modes = [m for _, m in shapes]
    xr_ = x.clone().requires_grad_(True)
    params = [(w.clone().requires_grad_(True), b.clone().requires_grad_(True)) for w, b in weights]
    want = _hand_padded_reference(xr_, params, modes)
    (want * want).mean().backward()
    for y, gx, (h0, w0), grads, refusal in ranks.run(world, _halo_body, grid, sizes, x, weights, modes):
        assert refusal is None if len(grid) == 1 else "sizes" in refusal
        torch.testing.assert_close(y, want.detach(), rtol=TOL, atol=TOL)
        torch.testing.assert_close(gx, xr_.grad[:, :, h0:h0 + gx.shape[2], w0:w0 + gx.shape[3]], rtol=TOL, atol=1e-14)
        for got, p in zip(grads, [t for pair in params for t in pair]):
            torch.testing.assert_close(got, p.grad, rtol=TOL, atol=1e-14)


# ---------------------------------------------------------------- rollout training, resumed on another mesh
def _train_body(shape, grid, path, steps, ckpt, resume):
    from mesh3d import DistributedManager, Plan, checkpoint, parallelize
    from mesh3d.data import MeshDataLoader, MeshSampler, WeatherDataset

    DistributedManager.initialize(batch=shape[0], domain=grid, model=1)
    ds = WeatherDataset(path, wh.VARIABLES, steps=wh.ROLLOUT, stats="compute", dtype=torch.float64)
    loader = MeshDataLoader(ds, MeshSampler(len(ds), wh.GLOBAL_BATCH, seed=1))
    fsdp = shape[0] > 1
    model = parallelize(wh.sphere_net(), Plan(batch="fsdp")) if fsdp else wh.sphere_net()
    opt = torch.optim.Adam(model.parameters(), lr=wh.LR)
    if resume:
        checkpoint.load(ckpt, model, opt, data=loader)
    before = ds.bytes_read
    record = wh.train(model, opt, loader, ds, steps, domain_grads=not fsdp)
    if not resume:
        checkpoint.save(ckpt, model, opt, step=steps, data=loader)
    params = [(p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone() for p in model.parameters()]
    return record, params, ds.stats, ds.bytes_read - before, ds.bytes_requested, ds.block


def _reference(path, steps):
    from mesh3d.data import MeshDataLoader, MeshSampler, WeatherDataset

    ds = WeatherDataset(path, wh.VARIABLES, steps=wh.ROLLOUT, stats="compute", dtype=torch.float64)
    loader = MeshDataLoader(ds, MeshSampler(len(ds), wh.GLOBAL_BATCH, seed=1))
    model = wh.sphere_net()
    record = wh.train(model, torch.optim.Adam(model.parameters(), lr=wh.LR), loader, ds, steps, domain_grads=False)
    return record, [p.detach() for p in model.parameters()], ds.stats


def test_weighted_rollout_training_equals_one_process_and_resumes_with_fsdp_on_another_mesh(ranks, tmp_path):
    paths = wh.write_weather(str(tmp_path))
    k, m = 2, 3    # 7 samples, global batch 2: saved mid-epoch, resumed across the epoch's end
    want, want_params, want_stats = _reference(paths["zarr"], k + m)
    ckpt = str(tmp_path / "ck")
    for rank, (record, _, stats, nbytes, _, block) in enumerate(
            ranks.run(4, _train_body, (1,), (2, 2), paths["zarr"], k, ckpt, False)):
        assert [ids for ids, _, _ in record] == [ids for ids, _, _ in want[:k]]
        np.testing.assert_allclose([r[1:] for r in record], [r[1:] for r in want[:k]], rtol=TOL)
        np.testing.assert_allclose(stats.mean + stats.std, want_stats.mean + want_stats.std, rtol=1e-12)
        assert nbytes > 0 and block == {0: {"lat": (0, 4), "lon": (0, 5)}, 1: {"lat": (0, 4), "lon": (5, 10)},
                                        2: {"lat": (4, 7), "lon": (0, 5)}, 3: {"lat": (4, 7), "lon": (5, 10)}}[rank]
    for rank, (record, params, _, _, _, block) in enumerate(
            ranks.run(8, _train_body, (2,), (2, 2), paths["nc"], m, ckpt, True)):
        np.testing.assert_allclose([r[1:] for r in record], [r[1:] for r in want[k:]], rtol=TOL)
        assert [i for ids, _, _ in want[k:] for i in ids[rank // 4::2]] == [i for ids, _, _ in record for i in ids]
        for got, p in zip(params, want_params):
            torch.testing.assert_close(got, p, rtol=TOL, atol=1e-13)


# ---------------------------------------------------------------- forecasts written block by block
def _forecast_body(shape, grid, path, out, steps, params):
    from mesh3d import DistributedManager
    from mesh3d.data import MeshDataLoader, MeshSampler, WeatherDataset
    from mesh3d.weather import ForecastWriter, forecast

    DistributedManager.initialize(batch=shape[0], domain=grid, model=shape[1])
    ds = WeatherDataset(path, wh.VARIABLES, steps=1, dtype=torch.float64, stats={"mean": [5000, 5000, 250],
                                                                                 "std": [100, 100, 30]})
    model = wh.sphere_net()
    with torch.no_grad():
        for p, v in zip(model.parameters(), params):
            p.copy_(v)
    loader = MeshDataLoader(ds, MeshSampler(len(ds), 2, seed=0, shuffle=False, tail="pad"))
    writer = None
    for batch in loader:
        batch = ds.to_domain(batch)
        if writer is None:
            writer = ForecastWriter(out, len(ds), steps, like=batch["x"], channels=ds.channel_names, lat=ds.lat, lon=ds.lon)
        forecast(model, batch["x"], steps, writer, sample_ids=batch["index"])
    writer.close()
    return writer.chunks, writer.writes


@pytest.mark.parametrize("world, shape, grid, fmt", [(8, (2, 1), (2, 2), "zarr"), (6, (1, 2), (3,), "npy"),
                                                      (3, (1, 1), (3, 1), "npy")])
def test_written_forecast_equals_the_one_process_forecast(ranks, tmp_path, world, shape, grid, fmt):
    import xarray as xr

    from mesh3d.data import WeatherDataset
    from mesh3d.weather import forecast

    paths = wh.write_weather(str(tmp_path))
    model = wh.sphere_net()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    params = [p.detach().clone() for p in model.parameters()]
    out = str(tmp_path / f"fc.{fmt}")
    results = ranks.run(world, _forecast_body, shape, grid, paths["zarr"], out, 3, params)
    ds = WeatherDataset(paths["zarr"], wh.VARIABLES, steps=1, dtype=torch.float64,
                        stats={"mean": [5000, 5000, 250], "std": [100, 100, 30]})
    x0 = torch.stack([ds[i]["x"] for i in range(len(ds))])
    want = torch.stack(forecast(model, x0, 3), dim=1).numpy()
    got = xr.open_zarr(out, consolidated=False)["forecast"].values if fmt == "zarr" else np.load(out)
    np.testing.assert_allclose(got, want, rtol=TOL, atol=1e-12)  # every entry written (NaN-filled otherwise)
    chunks = {c for c, _ in results}
    assert chunks == ({(1, 1, 3, 4, 5)} if fmt == "zarr" else {(1, 1, 3, 2, 10)})  # block-aligned chunk grid
    assert [w for _, w in results] == ([True, False] * 3 if shape[1] == 2 else [True] * world)  # one model rank writes
