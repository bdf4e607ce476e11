"""``MeshSampler``: one global sample order per epoch, split over the batch axis, resumable on any mesh.

The order of epoch ``e`` is ``torch.randperm(N)`` from a generator seeded with ``seed + e`` (or
``0..N-1`` without shuffling): it depends on the seed and the epoch only, never on the mesh.
Global batch ``k`` of an epoch is positions ``[k*G, (k+1)*G)`` of that order; batch rank ``b`` of
``B`` takes the positions ``b, b+B, b+2B, ...`` of it (``G/B`` samples). Domain and model ranks of
one batch rank therefore get the same indices. With ``B`` fixed this is exactly what
``DistributedSampler(num_replicas=B, rank=b, seed=seed)`` gives each rank when ``G`` divides ``N``.

The cursor (epoch, position in the epoch's order) is the whole state. It is global, so a run
saved on one mesh resumes on any other (other batch, domain, model or world size) with the same
global sequence of samples. Uneven tails (``N % G`` samples left at the end of an epoch):

* ``tail="drop"`` (default): they are skipped; every epoch has ``N // G`` full global batches and
  every sample appears at most once per epoch (exactly once when ``G`` divides ``N``);
* ``tail="pad"``: the last global batch is filled up to ``G`` with the first samples of the epoch's
  order again; :meth:`MeshSampler.batch_info` (and ``MeshDataLoader.last_batch``) marks those
  positions invalid, so the loss can mask them. Every sample is valid exactly once per epoch.

Usage::

    sampler = MeshSampler(len(dataset), global_batch_size=32, seed=0)      # batch axis from the manager
    loader = MeshDataLoader(dataset, sampler, num_workers=2, pin_memory=True)
    state = sampler.state_dict()             # JSON: {"epoch": 3, "position": 96, "seed": 0, ...}
    sampler.load_state_dict(state)           # on any mesh
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import DistributedSampler
from mesh3d.manager import DistributedManager

__all__ = ["MeshSampler", "BatchInfo", "TAILS", "STATE_FORMAT", "check_mesh_sampler"]

TAILS = ("drop", "pad")
STATE_FORMAT = "mesh3d.data.MeshSampler"
_STATE_VERSION = 1


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _batch_axis() -> tuple[int, int]:
    """(batch ranks, this rank's batch index): the manager's batch axis, else the world, else (1, 0)."""
    if DistributedManager.is_initialized():
        dm = DistributedManager()
        return dm.axis_size("batch"), dm.axis_rank("batch")
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size(), dist.get_rank()
    return 1, 0


@dataclass(frozen=True)
class BatchInfo:
    """Which samples one global batch holds: its global ids, which are real (not padding), and this rank's share.

    Usage: ``info = sampler.batch_info(epoch=0, position=64); info.global_ids, info.local_valid``
    """

    epoch: int
    position: int                 #: where the batch starts in the epoch's order
    global_ids: tuple[int, ...]   #: the G sample indices, in global-batch order
    valid: tuple[bool, ...]       #: False where ``tail="pad"`` repeated a sample to fill the batch
    local_ids: tuple[int, ...]    #: this batch rank's indices (positions b, b+B, ... of the batch)
    local_valid: tuple[bool, ...]

    @property
    def next_position(self) -> int:
        """Where the next global batch starts (the epoch's length N once this one reaches its end)."""
        return self.position + sum(self.valid)


class _Sized:
    """What ``DistributedSampler.__init__`` needs of a dataset: its length."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n


class MeshSampler(DistributedSampler):
    """Yield this batch rank's sample indices of each global batch; the cursor resumes on any mesh.

    Usage: ``sampler = MeshSampler(len(ds), global_batch_size=16, seed=0, tail="drop")``

    A ``DistributedSampler`` (so Lightning and other tools leave it in place) that yields, per
    global batch, ``local_batch_size = global_batch_size / B`` indices; use it with
    ``DataLoader(ds, batch_size=sampler.local_batch_size, sampler=sampler)`` or, to keep the cursor
    exact under worker prefetching, with :class:`mesh3d.data.MeshDataLoader`.

    Args:
        num_samples: the dataset's length N.
        global_batch_size: G, samples per optimizer step over all batch ranks; a multiple of B.
        seed: the order of epoch ``e`` comes from ``seed + e``.
        shuffle: False keeps ``0..N-1`` in every epoch.
        tail: ``"drop"`` or ``"pad"`` (see the module docstring).
        batch_ranks, batch_rank: B and this rank's index; default the ``DistributedManager``'s batch
            axis (with only a process group, every rank is a batch rank; in a plain process, (1, 0)).

    ``num_samples`` as an *attribute* is ``DistributedSampler``'s per-rank count (what ``len`` gives);
    the dataset length is ``num_samples_total``.

    The cursor moves as indices are taken from the iterator (exact with ``num_workers=0``):
    ``MeshDataLoader`` moves it instead when a batch is handed to the training loop. After the
    last batch of an epoch it moves to the next epoch; ``set_epoch(e)`` with a new ``e`` starts
    epoch ``e`` at its beginning and with the current epoch keeps the position (a resumed epoch).
    """

    def __init__(self, num_samples: int, global_batch_size: int, *, seed: int = 0, shuffle: bool = True,
                 tail: str = "drop", batch_ranks: int | None = None, batch_rank: int | None = None) -> None:
        if not _is_int(num_samples) or num_samples < 1:
            raise ValueError(f"MeshSampler(num_samples={num_samples!r}): the dataset length must be an int >= 1")
        if not _is_int(global_batch_size) or global_batch_size < 1:
            raise ValueError(f"MeshSampler(global_batch_size={global_batch_size!r}) must be an int >= 1")
        if not _is_int(seed):
            raise ValueError(f"MeshSampler(seed={seed!r}) must be an int")
        if tail not in TAILS:
            raise ValueError(f"MeshSampler(tail={tail!r}) must be one of {TAILS}")
        if (batch_ranks is None) != (batch_rank is None):
            raise ValueError("MeshSampler: pass both batch_ranks and batch_rank, or neither (then the manager's batch axis)")
        if batch_ranks is None:
            batch_ranks, batch_rank = _batch_axis()
        if not _is_int(batch_ranks) or batch_ranks < 1 or not _is_int(batch_rank) or not 0 <= batch_rank < batch_ranks:
            raise ValueError(f"MeshSampler(batch_ranks={batch_ranks!r}, batch_rank={batch_rank!r}): need "
                             "ints with 0 <= batch_rank < batch_ranks")
        if global_batch_size % batch_ranks:
            lower = global_batch_size - global_batch_size % batch_ranks
            raise ValueError(
                f"MeshSampler: global_batch_size={global_batch_size} does not split evenly over {batch_ranks} batch "
                f"ranks; use a multiple of {batch_ranks} (e.g. {lower or batch_ranks} or {lower + batch_ranks})")
        if tail == "drop" and global_batch_size > num_samples:
            raise ValueError(f"MeshSampler: global_batch_size={global_batch_size} > num_samples={num_samples} with "
                             "tail='drop' gives no batch at all; use a smaller global batch or tail='pad'")
        super().__init__(_Sized(num_samples), num_replicas=batch_ranks, rank=batch_rank, shuffle=shuffle, seed=seed,
                         drop_last=tail == "drop")
        self.global_batch_size, self.tail = global_batch_size, tail
        self.num_samples = self.steps_per_epoch() * self.local_batch_size  # DistributedSampler's per-rank count
        self.total_size = self.num_samples * batch_ranks
        self.position = 0           # where the cursor stands in this epoch's order (self.epoch)
        self.samples_seen = 0       # valid samples handed out over all epochs (informational)
        self._commit_on_yield = True
        #: False: ``set_epoch`` is ignored and only the cursor decides (MeshStrategy sets this: Lightning
        #: counts an epoch stopped by ``max_steps`` as done, so its epoch number runs ahead of the data).
        self.follow_set_epoch = True
        self._orders: dict[int, torch.Tensor] = {}

    # ------------------------------------------------------------------ the global sequence
    @property
    def num_samples_total(self) -> int:
        """N, the dataset length."""
        return len(self.dataset)

    @property
    def local_batch_size(self) -> int:
        """Indices per global batch on this batch rank (G / B)."""
        return self.global_batch_size // self.num_replicas

    def epoch_order(self, epoch: int) -> torch.Tensor:
        """The global order of ``epoch`` (int64, length N): the same on every mesh."""
        if epoch not in self._orders:
            n = self.num_samples_total
            if self.shuffle:
                order = torch.randperm(n, generator=torch.Generator().manual_seed(self.seed + epoch))
            else:
                order = torch.arange(n)
            self._orders = {epoch: order}  # one epoch cached: orders are cheap to rebuild
        return self._orders[epoch]

    def steps_per_epoch(self, position: int = 0) -> int:
        """Global batches from ``position`` to the end of an epoch under the tail rule."""
        left = self.num_samples_total - position
        return left // self.global_batch_size if self.tail == "drop" else math.ceil(left / self.global_batch_size)

    def batch_info(self, epoch: int, position: int) -> BatchInfo:
        """The global batch starting at ``position`` of ``epoch`` (pure: depends on no state)."""
        n, g, b, nb = self.num_samples_total, self.global_batch_size, self.rank, self.num_replicas
        if not 0 <= position < n or (self.tail == "drop" and position + g > n):
            raise ValueError(f"no global batch of {g} starts at position {position} of an epoch of {n} samples "
                             f"(tail={self.tail!r})")
        order = self.epoch_order(epoch).tolist()
        real = order[position:position + g]
        ids = real + order[: g - len(real)]  # tail="pad": the epoch's first samples fill the batch
        valid = [True] * len(real) + [False] * (g - len(real))
        return BatchInfo(epoch, position, tuple(ids), tuple(valid), tuple(ids[b::nb]), tuple(valid[b::nb]))

    # ------------------------------------------------------------------ torch Sampler protocol
    def __len__(self) -> int:
        """This rank's indices in one whole epoch (``len(DataLoader)`` is then the steps per epoch)."""
        return self.steps_per_epoch() * self.local_batch_size

    def __iter__(self) -> Iterator[int]:
        epoch, position = self.epoch, self.position  # read at the first next(), after any load/set_epoch
        for _ in range(self.steps_per_epoch(position)):
            info = self.batch_info(epoch, position)
            yield from info.local_ids[:-1]
            if self._commit_on_yield:
                self.commit(info)
            yield info.local_ids[-1]
            position = info.next_position

    def set_epoch(self, epoch: int) -> None:
        """Start ``epoch`` (a new one from its beginning; the current one stays where its cursor is)."""
        if not _is_int(epoch) or epoch < 0:
            raise ValueError(f"MeshSampler.set_epoch({epoch!r}): epochs are ints >= 0")
        if self.follow_set_epoch and epoch != self.epoch:
            self.epoch, self.position = epoch, 0

    def commit(self, info: BatchInfo) -> None:
        """Count ``info``'s global batch as consumed: the cursor moves past it (to the next epoch at its end)."""
        if (info.epoch, info.position) != (self.epoch, self.position):
            raise RuntimeError(f"MeshSampler: batch at epoch {info.epoch} position {info.position} consumed, but the "
                               f"cursor is at epoch {self.epoch} position {self.position} (batches out of order?)")
        self.samples_seen += sum(info.valid)
        self.position = info.next_position
        if self.steps_per_epoch(self.position) == 0:
            self.epoch, self.position = self.epoch + 1, 0

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """The cursor and what fixes the order, as JSON: the same on every rank of any mesh."""
        return {"format": STATE_FORMAT, "version": _STATE_VERSION, "num_samples": self.num_samples_total,
                "seed": self.seed, "shuffle": self.shuffle, "global_batch_size": self.global_batch_size,
                "tail": self.tail, "epoch": self.epoch, "position": self.position, "samples_seen": self.samples_seen}

    def check_state_dict(self, state: Any) -> None:
        """Raise ``ValueError`` saying what is wrong if ``state`` cannot continue this sampler's sequence."""
        if not isinstance(state, dict) or state.get("format") != STATE_FORMAT:
            raise ValueError(f"not a MeshSampler state (expected a dict with format={STATE_FORMAT!r}): {state!r:.200}")
        if state.get("version") != _STATE_VERSION:
            raise ValueError(f"MeshSampler state version {state.get('version')!r} is not {_STATE_VERSION} (newer mesh3d?)")
        for key in ("num_samples", "seed", "global_batch_size", "epoch", "position", "samples_seen"):
            if not _is_int(state.get(key)) or (key != "seed" and state[key] < 0):
                raise ValueError(f"MeshSampler state: {key}={state.get(key)!r} must be a non-negative int")
        if not isinstance(state.get("shuffle"), bool) or state.get("tail") not in TAILS:
            raise ValueError(f"MeshSampler state: shuffle must be a bool and tail one of {TAILS}: {state!r:.200}")
        for key, mine in (("num_samples", self.num_samples_total), ("seed", self.seed), ("shuffle", self.shuffle)):
            if state[key] != mine:
                raise ValueError(
                    f"the saved sampler has {key}={state[key]!r} but this one has {key}={mine!r}: it would continue "
                    f"another sample sequence; build MeshSampler with {key}={state[key]!r} to resume")
        if state["position"] >= self.num_samples_total:
            raise ValueError(f"MeshSampler state: position {state['position']} is past the epoch's "
                             f"{self.num_samples_total} samples")

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue the saved global sequence (the global batch size and tail rule may differ from the saved run's)."""
        self.check_state_dict(state)
        self.epoch, self.position, self.samples_seen = state["epoch"], state["position"], state["samples_seen"]
        if self.steps_per_epoch(self.position) == 0:  # e.g. a larger global batch no longer fits the epoch's rest
            self.epoch, self.position = self.epoch + 1, 0


def check_mesh_sampler(sampler: Any, manager: Any) -> None:
    """Raise if ``sampler`` is a ``MeshSampler`` split over other batch ranks than ``manager``'s batch axis.

    Usage: ``check_mesh_sampler(loader.sampler, DistributedManager())``
    """
    if not isinstance(sampler, MeshSampler):
        return
    want = (manager.axis_size("batch"), manager.axis_rank("batch"))
    if (sampler.num_replicas, sampler.rank) != want:
        raise ValueError(
            f"this rank's MeshSampler is split over {sampler.num_replicas} batch ranks as rank {sampler.rank}, but the "
            f"mesh's batch axis has {want[0]} ranks and this is batch rank {want[1]}; build the MeshSampler inside "
            "train_dataloader() without batch_ranks/batch_rank (it then follows the mesh)")
