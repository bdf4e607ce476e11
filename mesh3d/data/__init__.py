"""Data on the mesh: a global sample order that resumes exactly on any mesh, and per-rank slabs of each sample.

Usage::

    from mesh3d.data import MeshSampler, MeshDataLoader, SlabDataset
    sampler = MeshSampler(len(ds), global_batch_size=32, seed=0)         # split over the batch axis
    loader = MeshDataLoader(ds, sampler, num_workers=2, pin_memory=True)  # torch's DataLoader underneath
    checkpoint.save(path, model, opt, data=loader)                        # JSON cursor; resume on any mesh
    slabs = SlabDataset("fields.npy", dim=2)                              # each domain rank reads its rows
    slabs = SlabDataset(StoredArray("fields.zarr"), dim=2)                # zarr v3 / HDF5 / NetCDF4, reads counted
    era5 = WeatherDataset("era5.zarr", {"z": [500], "t2m": None}, steps=2)   # (lat, lon) blocks of a weather dataset
    flow = NodeDataset({"x": StoredArray("flow.zarr", "x")}, part)       # a graph's nodes: this rank's only

See docs/data.md and docs/weather.md.
"""

from mesh3d.data.loader import MeshDataLoader
from mesh3d.data.nodes import NodeDataset
from mesh3d.data.sampler import BatchInfo, MeshSampler
from mesh3d.data.slabs import SlabDataset
from mesh3d.data.stored import StoredArray
from mesh3d.data.weather import WeatherDataset, open_weather
from mesh3d.data.weather_channels import Channel, ChannelStats

__all__ = ["BatchInfo", "Channel", "ChannelStats", "MeshDataLoader", "MeshSampler", "NodeDataset", "SlabDataset",
           "StoredArray", "WeatherDataset", "open_weather"]
