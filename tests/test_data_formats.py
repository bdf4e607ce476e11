"""zarr v3, HDF5 and NetCDF4 through ``domain.read`` and ``SlabDataset`` on 3 uneven domain ranks: the rows and the
bytes each rank reads, and training saved on one mesh and resumed on another equal to the ``.npy`` path."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

import data_helpers as dh
from mesh3d.data import MeshDataLoader, MeshSampler, SlabDataset, StoredArray

ROW_BYTES = dh.C * dh.W * 8   # one row of H in one sample (C, W) of fp64


def write_formats(root: str) -> dict[str, dict[str, str]]:
    """data_helpers' x and y as .npy, a zarr v3 store (uncompressed, one chunk per row of a sample), an HDF5 file
    (contiguous) and a NetCDF4 file (written by xarray): {format: {"x": ..., "y": ...}} (paths; names inside)."""
    import h5py
    import xarray as xr
    import zarr

    npy = dh.write_dataset(root)
    arrays = {name: np.load(path) for name, path in npy.items()}
    out = {"npy": npy, "zarr": {}, "h5": {}, "nc": {}}
    for name, a in arrays.items():
        path = os.path.join(root, f"{name}.zarr")
        z = zarr.create_array(path, shape=a.shape, chunks=(1, dh.C, 1, dh.W), dtype=a.dtype, compressors=None)
        z[:] = a
        out["zarr"][name] = path
    with h5py.File(os.path.join(root, "xy.h5"), "w") as f:
        for name, a in arrays.items():
            f.create_dataset(name, data=a)
    xr.Dataset({n: (("n", "c", "h", "w"), a) for n, a in arrays.items()}).to_netcdf(os.path.join(root, "xy.nc"),
                                                                                    engine="h5netcdf")
    for name in arrays:
        out["h5"][name] = os.path.join(root, "xy.h5")
        out["nc"][name] = os.path.join(root, "xy.nc")
    return out


def _open(fmt: str, paths: dict[str, str]) -> dict[str, object]:
    if fmt == "npy":
        return dict(paths)
    return {name: StoredArray(path, None if fmt == "zarr" else name) for name, path in paths.items()}


SIZES = (2, 0, 7)   # 9 rows over 3 domain ranks, one empty


def _read_body(formats):
    from mesh3d import DistributedManager, domain

    DistributedManager.initialize(1, 3, 1)
    whole = torch.from_numpy(np.load(formats["npy"]["x"]))
    out = {}
    for fmt in ("zarr", "h5", "nc"):
        x = _open(fmt, formats[fmt])["x"]
        before = x.bytes_read
        xs = domain.read(x, dim=1, sizes=SIZES, prefix=(4,))          # rows of H in sample 4
        first = x.bytes_read - before
        before = x.bytes_read
        again = domain.read(x, dim=1, sizes=SIZES, prefix=(6,))
        want = domain.shard(whole[6], dim=1, sizes=SIZES)
        out[fmt] = (torch.equal(xs.to_local(), domain.shard(whole[4], dim=1, sizes=SIZES).to_local())
                    and torch.equal(again.to_local(), want.to_local()) and again.spec.sizes == SIZES,
                    first, x.bytes_read - before)
    return out


def test_domain_read_of_zarr_hdf5_and_netcdf_gives_each_rank_its_rows_and_reads_only_them(ranks, tmp_path):
    formats = write_formats(str(tmp_path))
    for rank, result in enumerate(ranks.run(3, _read_body, formats)):
        for fmt, (ok, first, second) in result.items():
            assert ok, (fmt, rank)
            assert second == SIZES[rank] * ROW_BYTES, (fmt, rank, second)   # exactly this rank's rows
            assert first >= second  # the first read of an HDF5 file also reads its chunk index / metadata


def _setup(shape, fmt, paths):
    from mesh3d import DistributedManager, Plan, parallelize

    DistributedManager.initialize(*shape)
    ds = SlabDataset(_open(fmt, paths), dim=2, sizes=SIZES if shape[1] == 3 else None)
    loader = MeshDataLoader(ds, MeshSampler(len(ds), dh.GLOBAL_BATCH, seed=3))
    model = parallelize(dh.field_net(), Plan(batch="fsdp"))
    return ds, loader, model, torch.optim.AdamW(model.parameters(), lr=dh.LR)


def _train_save_body(shape, fmt, paths, steps, path):
    from mesh3d import checkpoint

    ds, loader, model, opt = _setup(shape, fmt, paths)
    before = ds.bytes_read
    record = dh.train(model, opt, loader, ds, steps)
    checkpoint.save(path, model, opt, step=steps, data=loader)
    return record, ds.bytes_read - before


def _resume_body(shape, fmt, paths, steps, path):
    from mesh3d import checkpoint

    ds, loader, model, opt = _setup(shape, fmt, paths)
    checkpoint.load(path, model, opt, data=loader)
    before = ds.bytes_read
    return dh.train(model, opt, loader, ds, steps), ds.bytes_read - before


def _npy_reference(paths, steps):
    ds = SlabDataset(paths, dim=2)
    loader = MeshDataLoader(ds, MeshSampler(len(ds), dh.GLOBAL_BATCH, seed=3))
    model = dh.field_net()
    return dh.train(model, torch.optim.AdamW(model.parameters(), lr=dh.LR), loader, ds, steps)


@pytest.mark.parametrize("fmt_a, fmt_b", [("zarr", "nc"), ("h5", "zarr")])
def test_training_from_zarr_hdf5_netcdf_saved_and_resumed_on_another_mesh_equals_the_npy_path(ranks, tmp_path,
                                                                                               fmt_a, fmt_b):
    formats = write_formats(str(tmp_path))
    k, m = 3, 2
    want = _npy_reference(formats["npy"], k + m)
    path = str(tmp_path / "ck")
    for rank, (record, nbytes) in enumerate(ranks.run(3, _train_save_body, (1, 3, 1), fmt_a, formats[fmt_a], k, path)):
        assert [ids for ids, _ in record] == [ids for ids, _ in want[:k]]
        np.testing.assert_allclose([loss for _, loss in record], [loss for _, loss in want[:k]], rtol=1e-10)
        assert nbytes == 2 * k * dh.GLOBAL_BATCH * SIZES[rank] * ROW_BYTES  # x and y: this rank's rows, nothing else
    for record, nbytes in ranks.run(2, _resume_body, (2, 1, 1), fmt_b, formats[fmt_b], m, path):
        assert nbytes == 2 * m * dh.GLOBAL_BATCH // 2 * dh.H * ROW_BYTES  # one domain rank: whole samples, once each
        np.testing.assert_allclose([loss for _, loss in record], [loss for _, loss in want[k:]], rtol=1e-10)
        assert [ids for ids, _ in record] == [ids for ids, _ in want[k:]]
