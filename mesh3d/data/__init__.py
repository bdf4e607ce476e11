"""Data on the mesh: a global sample order that resumes exactly on any mesh, and per-rank slabs of each sample.

Usage::

    from mesh3d.data import MeshSampler, MeshDataLoader, SlabDataset
    sampler = MeshSampler(len(ds), global_batch_size=32, seed=0)         # split over the batch axis
    loader = MeshDataLoader(ds, sampler, num_workers=2, pin_memory=True)  # torch's DataLoader underneath
    checkpoint.save(path, model, opt, data=loader)                        # JSON cursor; resume on any mesh
    slabs = SlabDataset("fields.npy", dim=2)                              # each domain rank reads its rows

See docs/data.md.
"""

from mesh3d.data.loader import MeshDataLoader
from mesh3d.data.sampler import BatchInfo, MeshSampler
from mesh3d.data.slabs import SlabDataset

__all__ = ["BatchInfo", "MeshDataLoader", "MeshSampler", "SlabDataset"]
