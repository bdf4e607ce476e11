"""``MeshDataLoader``: a torch ``DataLoader`` over a ``MeshSampler`` whose cursor counts delivered batches.

Workers, pinning, prefetching and collation stay torch's. What this adds: workers fetch batches
ahead of the training loop, so a sampler that counted the indices it handed out would be ahead of
the training; here the cursor moves when a batch is handed to the loop, so a checkpoint taken after
step ``k`` resumes at step ``k + 1`` whatever ``num_workers``/``prefetch_factor`` are. It has
``state_dict``/``load_state_dict`` (the sampler's), so Lightning saves it with its loop state.

Usage::

    loader = MeshDataLoader(dataset, MeshSampler(len(dataset), global_batch_size=32), num_workers=2)
    for batch in loader:
        ...
        loader.last_batch.global_ids      # the global batch this step trained on (every rank)
    checkpoint.save(path, model, opt, data=loader)   # JSON; resumes on any mesh
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from torch.utils.data import DataLoader, Dataset

from mesh3d.data.sampler import BatchInfo, MeshSampler
from mesh3d.faults.attach import WATCH

__all__ = ["MeshDataLoader"]

_OWN = ("batch_size", "shuffle", "sampler", "batch_sampler", "drop_last")


class MeshDataLoader(DataLoader):
    """``DataLoader(dataset, batch_size=sampler.local_batch_size, sampler=sampler)`` with an exact cursor.

    Usage: ``loader = MeshDataLoader(ds, MeshSampler(len(ds), global_batch_size=16), num_workers=2)``

    Keyword arguments go to ``DataLoader`` (``num_workers``, ``pin_memory``, ``collate_fn``,
    ``prefetch_factor``, ``persistent_workers`` ...); the batching ones come from the sampler.
    ``last_batch`` is the :class:`BatchInfo` of the batch last handed out (its global sample ids and,
    under ``tail="pad"``, ``local_valid`` to mask the padding with).
    """

    def __init__(self, dataset: Dataset, sampler: MeshSampler, **kwargs: Any) -> None:
        if not isinstance(sampler, MeshSampler):
            raise TypeError(f"MeshDataLoader needs a mesh3d.data.MeshSampler, got {type(sampler).__name__}")
        given = sorted(set(kwargs) & set(_OWN))
        if given:
            raise TypeError(f"MeshDataLoader sets {given} from the sampler (global_batch_size / batch ranks, tail); "
                            "pass only DataLoader's other arguments")
        if kwargs.get("in_order", True) is False:
            raise ValueError("MeshDataLoader(in_order=False) would hand out batches out of order; the cursor needs order")
        if hasattr(dataset, "__len__") and len(dataset) != sampler.num_samples_total:
            raise ValueError(f"the dataset has {len(dataset)} samples but the MeshSampler was built for "
                             f"{sampler.num_samples_total}")
        super().__init__(dataset, batch_size=sampler.local_batch_size, sampler=sampler, drop_last=False, **kwargs)
        sampler._commit_on_yield = False  # this loader moves the cursor when it hands a batch out
        self.last_batch: BatchInfo | None = None

    @property
    def mesh_sampler(self) -> MeshSampler:
        """The sampler (typed)."""
        sampler = self.sampler
        assert isinstance(sampler, MeshSampler)
        return sampler

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        sampler = self.mesh_sampler
        epoch, position = sampler.epoch, sampler.position
        for batch in super().__iter__():
            info = sampler.batch_info(epoch, position)
            sampler.commit(info)
            self.last_batch = info
            position = info.next_position
            WATCH.current.check()  # a lost peer is named here, before the step that would wait for it
            yield batch

    def state_dict(self) -> dict[str, Any]:
        """The sampler's JSON state (the same on every rank of any mesh)."""
        return self.mesh_sampler.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue the saved global sequence (see ``MeshSampler.load_state_dict``)."""
        self.mesh_sampler.load_state_dict(state)

    def check_state_dict(self, state: Any) -> None:
        """Raise ``ValueError`` if ``state`` cannot be loaded (no change is made)."""
        self.mesh_sampler.check_state_dict(state)
