"""DistributedManager: the one owner of the process group and the (batch, domain, model) mesh.

Usage::

    from mesh3d import DistributedManager
    dm = DistributedManager.initialize(batch=2, domain=2, model=-1)   # torchrun, SLURM or plain python
    dm.mesh                      # DeviceMesh of shape (2, 2, 2), names ("batch", "domain", "model")
    dm.group("model")            # this rank's process group on the model axis
    DistributedManager.shutdown()
"""

from __future__ import annotations

import os
import sys
import warnings
from collections.abc import Iterable
from datetime import timedelta
from typing import ClassVar

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from mesh3d._torch_private import clear_dtensor_caches, flatten_mesh, group_options, live_process_groups, unflatten_mesh
from mesh3d.faults import PeerWatch, WatchSettings
from mesh3d.faults.attach import WATCH, start_watch
from mesh3d.faults.summary import SUMMARY, mark_shared
from mesh3d.group_settings import DEFAULT_TIMEOUT, as_timeout, choose_transport, init_default_group
from mesh3d.launcher import LaunchInfo, detect_launcher
from mesh3d.mesh_shape import AXES, JobMesh
from mesh3d.preempt import STOP, agree_to_stop
from mesh3d.teardown import EXIT_DRAIN_TIMEOUT_ON_ERROR, SHUTDOWN_DRAIN_TIMEOUT, Teardown, exiting_on_error

__all__ = ["DistributedManager", "DERIVED_AXES", "DEFAULT_TIMEOUT"]

#: Meshes derived from the 3-D mesh: ``batch_domain`` is where parameter gradients are
#: reduced (averaged over batch, summed over domain) and where FSDP shards; ``world``
#: spans every rank. Both are built once, eagerly, because creating a group is a
#: collective that every rank must join: building one lazily on a subset of ranks hangs.
DERIVED_AXES: tuple[str, str] = ("batch_domain", "world")

class DistributedManager:
    """Singleton owning the process group and the named 3-D ``DeviceMesh``.

    Usage: ``dm = DistributedManager.initialize(batch=-1, domain=2, model=2); dm.group("model")``

    ``DistributedManager()`` returns the initialized instance (a clear error before :meth:`initialize`). Axis names
    everywhere: ``"batch"``, ``"domain"``, ``"model"`` and the derived ``"batch_domain"`` and ``"world"``.
    """

    _instance: ClassVar[DistributedManager | None] = None
    #: Called by ``shutdown()`` after the groups are gone: per-mesh state other parts keep (``on_shutdown``).
    _shutdown_hooks: ClassVar[list] = []
    #: What runs before the groups go (``on_teardown``), the drain, and the exit handler (mesh3d/teardown.py).
    _teardown: ClassVar[Teardown] = Teardown()
    #: Counts the meshes this process has built: state keyed to a mesh (a domain tensor's spec) records it.
    _epochs: ClassVar[int] = 0

    mesh: DeviceMesh
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str
    launcher: str
    timeout: timedelta
    #: The domain axis as a grid: ``(D,)`` for slabs, e.g. ``(2, 2)`` for blocks (``initialize(domain=(2, 2))``).
    domain_grid: tuple[int, ...]
    #: This mesh's number among the meshes this process built (``group_of_epoch``).
    epoch: int
    _created_default_group: bool
    watch: PeerWatch  #: heartbeats and named faults (mesh3d/faults/watch.py); a no-op watch in a world of one

    def __new__(cls) -> DistributedManager:
        if cls._instance is None:
            raise RuntimeError(
                "DistributedManager is not initialized: call DistributedManager.initialize(batch=..., domain=..., "
                "model=...) first; it works under torchrun, SLURM and in a plain `python` process"
            )
        return cls._instance

    # ------------------------------------------------------------------ lifecycle

    @classmethod
    def initialize(
        cls,
        batch: int = -1,
        domain: int | tuple[int, ...] = 1,
        model: int = 1,
        *,
        backend: str | None = None,
        device: str | torch.device | None = None,
        timeout: float | timedelta | None = None,
        stop_signals: Iterable[int | str] | None = None,
        watch: WatchSettings | None = None,
    ) -> DistributedManager:
        """Join (or start) the process group and build the (batch, domain, model) mesh.

        At most one size may be -1; it is inferred from the world size. Every check on
        the arguments runs before any collective, so a bad request raises ``ValueError``
        on every rank instead of hanging. ``device`` ("cpu", "cuda"; default from the backend): CUDA ranks compute on
        ``cuda:LOCAL_RANK % device_count``; ``backend="gloo", device="cuda"`` lets ranks share one GPU (staged gloo,
        docs/manager.md: for tests and machines without NCCL). ``timeout`` (seconds or timedelta; default
        ``MESH3D_TIMEOUT`` or 10 minutes) bounds every collective on the mesh's groups.
        ``domain=(2, 2)`` factors the domain axis into a grid (blocks; ``dm.domain_grid``, and the
        grid lines' groups ``dm.group("domain_0")``, ``"domain_1"``, ...); the mesh keeps its three axes.
        ``stop_signals`` (default ``MESH3D_STOP_SIGNALS``, e.g. ``"SIGUSR1"``) set the flag ``should_stop`` agrees on.
        ``watch`` (default ``WatchSettings.from_env()``) times the peer watch that names a lost rank (mesh3d/faults).
        """
        timeout = as_timeout(timeout)
        watch = WatchSettings.from_env() if watch is None else watch
        STOP.install(stop_signals)  # bad names raise here, on every rank, before any collective
        reuse = dist.is_available() and dist.is_initialized()
        info = LaunchInfo("existing", dist.get_rank(), dist.get_world_size(), int(os.environ.get(
            "LOCAL_RANK", dist.get_rank()))) if reuse else detect_launcher()
        # NOTE: the checks below give every rank the same error from the same arguments: it is reported once.
        SUMMARY.install(info.rank, info.world_size)
        try:
            asked = JobMesh.resolve(info.world_size, batch, domain, model)
        except ValueError as err:
            raise mark_shared(err, range(info.world_size)) from None
        shape, grid = (asked.batch, asked.domain, asked.model), asked.grid

        if cls._instance is not None:
            current = tuple(cls._instance.mesh.shape)
            if current == shape and cls._instance.domain_grid == grid:
                return cls._instance
            raise RuntimeError(
                f"DistributedManager is already initialized with (batch, domain, model)={current}; asked for {shape}. "
                "Call DistributedManager.shutdown() before initializing a different mesh"
            )

        backend, device = choose_transport(backend, device, info.local_rank, str(dist.get_backend()) if reuse else None)
        if device.type == "cuda":
            torch.cuda.set_device(device)

        created_default_group = not reuse
        if created_default_group:
            init_default_group(info, backend, device, timeout)

        self = object.__new__(cls)
        self.rank, self.world_size, self.local_rank = info.rank, info.world_size, info.local_rank
        self.device, self.backend, self.launcher, self.timeout = device, backend, info.launcher, timeout
        self._created_default_group = created_default_group
        self.domain_grid = grid
        try:
            self.watch = start_watch(self.rank, self.world_size, watch, self.describe_rank)  # first beat
            self._build_meshes(shape)
        except BaseException:
            if created_default_group:
                dist.destroy_process_group()
            raise
        self.watch.begin([r for axis in AXES for r in self.axis_ranks(axis)])  # NOTE: all beat before the mesh
        WATCH.install(self.watch)
        cls._epochs += 1
        self.epoch = cls._epochs
        cls._instance = self
        cls._teardown.run_at_exit(cls._teardown_at_exit)
        return self

    def _build_meshes(self, shape: tuple[int, int, int]) -> None:
        options = group_options(self.backend, self.timeout)
        override = None if options is None else (self.backend, options)
        per_axis = None if override is None else {name: override for name in AXES}
        self.mesh = init_device_mesh(self.device.type, shape, mesh_dim_names=AXES, backend_override=per_axis)
        self._meshes: dict[str, DeviceMesh] = {name: self.mesh[name] for name in AXES}
        self._meshes["batch_domain"] = flatten_mesh(self.mesh["batch", "domain"], "batch_domain", override)
        self._meshes["world"] = flatten_mesh(self.mesh, "world", override)
        if len(self.domain_grid) > 1:
            # NOTE: the grid lines' groups are made here, eagerly, on every rank (making a group is a collective).
            names = tuple(f"domain_{i}" for i in range(len(self.domain_grid)))
            grid_mesh = unflatten_mesh(self._meshes["domain"], self.domain_grid, names, override)
            self._meshes.update({name: grid_mesh[name] for name in names})
        # Splits of batch_domain into (replicate, shard), made on first use (HSDP/DDP), shard size -> mesh.
        self._batch_domain_splits: dict[int, DeviceMesh] = {}
        self._groups: dict[str, dist.ProcessGroup] = {}  # axis -> group, looked up once (hot: every domain exchange)

    @classmethod
    def is_initialized(cls) -> bool:
        """Whether :meth:`initialize` has run (and :meth:`shutdown` has not since)."""
        return cls._instance is not None

    @classmethod
    def shutdown(cls) -> None:
        """Finish background work, drain and destroy the groups the manager created, and forget the singleton.

        Call it on every rank (it waits at most ``SHUTDOWN_DRAIN_TIMEOUT`` for the peers' drain: mesh3d/teardown.py).
        A pending background save is finished first; its unseen failure is raised here, after the teardown, on every
        rank. A default group the user made before :meth:`initialize` is drained and left alone; one the manager made
        is destroyed with every group made from it. Safe when not initialized; at exit it runs by itself.
        """
        self = cls._instance
        if self is None:
            return
        WATCH.clear()  # the watch stops; peers read "done": this rank is not lost
        failures = cls._teardown.finish_background_work()
        late = cls._teardown.drain(self._owned_groups(), min(self.timeout, SHUTDOWN_DRAIN_TIMEOUT))
        if late:
            warnings.warn(
                "DistributedManager.shutdown(): some peers did not reach the teardown barrier in time (they left "
                "first, or never called shutdown()); this rank's own teardown is complete: " + "; ".join(late[:4]),
                RuntimeWarning, stacklevel=2)
        self._destroy_groups()
        STOP.uninstall()
        if failures:
            raise failures[0]

    def _destroy_groups(self) -> None:
        """Destroy the (drained) groups this manager owns, forget the singleton and the per-mesh state."""
        cls = type(self)
        owned = self._owned_groups()
        cls._instance = None
        self._batch_domain_splits.clear()
        if self._created_default_group:
            if dist.is_initialized():
                dist.destroy_process_group()  # the default group and every group made from it
        else:
            live = live_process_groups()
            for group in owned:
                if group in live:  # the user may have destroyed some already
                    dist.destroy_process_group(group)
        # DeviceMesh equality ignores process groups, so DTensor's caches would hand a later
        # mesh of the same shape these destroyed groups; forget them with the groups.
        clear_dtensor_caches()
        for hook in cls._shutdown_hooks:
            hook()

    def _owned_groups(self) -> list[dist.ProcessGroup]:
        """The groups shutdown destroys: every live group when the manager made the default one, else the mesh's."""
        if self._created_default_group:
            return live_process_groups()
        groups = [mesh.get_group() for mesh in self._meshes.values()]
        groups += [split.get_group(dim) for split in self._batch_domain_splits.values() for dim in range(2)]
        unique: dict[int, dist.ProcessGroup] = {}
        for group in groups:
            if group is not dist.group.WORLD:
                unique.setdefault(id(group), group)
        return list(unique.values())

    @classmethod
    def _teardown_at_exit(cls) -> None:
        """At exit, :meth:`shutdown`'s teardown for a script that never called it: every live gloo group drained (after
        an uncaught exception the peers are waited for briefly, so the error reaches the launcher), nothing raised."""
        WATCH.clear()
        for err in cls._teardown.finish_background_work():
            print(f"mesh3d: at exit, {type(err).__name__}: {err}", file=sys.stderr)
        timeout = EXIT_DRAIN_TIMEOUT_ON_ERROR if exiting_on_error() else SHUTDOWN_DRAIN_TIMEOUT
        if cls._instance is not None:
            timeout = min(timeout, cls._instance.timeout)
        cls._teardown.drain(live_process_groups(), timeout)
        if cls._instance is not None:
            cls._instance._destroy_groups()

    @classmethod
    def on_teardown(cls, hook) -> None:
        """Run ``hook()`` first at ``shutdown()`` and at exit, while the groups still work (finish background work).

        Usage: ``DistributedManager.on_teardown(IN_FLIGHT.finish)``
        """
        cls._teardown.add(hook)

    @classmethod
    def on_shutdown(cls, hook) -> None:
        """Run ``hook()`` at every ``shutdown()`` (state tied to the mesh, such as the domain op journal).

        Usage: ``DistributedManager.on_shutdown(my_cache.clear)``
        """
        if hook not in cls._shutdown_hooks:
            cls._shutdown_hooks.append(hook)

    def should_stop(self) -> bool:
        """True on every rank once any rank got a stop signal: call it at a step boundary, on every rank.

        Usage: ``if dm.should_stop(): manager.save(...); DistributedManager.shutdown(); sys.exit(PREEMPTED_EXIT_CODE)``
        """
        with self.watch.doing("agreeing to stop (should_stop)"):
            self.watch.check()
            try:
                return agree_to_stop(self.group("world"), self.device if "nccl" in self.backend else None)
            except RuntimeError as err:
                raise self.watch.translate(err) from err

    def guard(self, label: str = "a step"):
        """A block whose collectives fail with a named error: ``PeerLostError`` or ``CollectiveTimeoutError``.

        Usage: ``with dm.guard("train step"): train_step(batch)``. An exception leaving it on one rank tells the
        peers at once (they raise ``PeerLostError`` naming this rank), so use it around work every rank must finish.
        """
        return self.watch.guard(label)

    def describe_rank(self, rank: int) -> str:
        """``rank 5 (batch 1, domain 0, model 1)``: a global rank with its mesh coordinates."""
        hit = (self.mesh.mesh == rank).nonzero() if hasattr(self, "mesh") else []
        return f"rank {rank}" + (f" ({', '.join(f'{n} {int(c)}' for n, c in zip(AXES, hit[0]))})" if len(hit) else "")

    def manual_seed(self, seed: int) -> int:
        """Seed torch's generators so every rank of a batch rank's domain and model groups draws the same numbers.

        Usage: ``dm.manual_seed(0)`` once after ``initialize``; returns this rank's seed.

        Batch rank ``b`` gets ``seed + b * 0x9E3779B97F4A7C15`` (mod 2**63; batch rank 0 gets ``seed``, as one process
        would), so batch ranks draw different masks while one sample's shards draw one realization (``F.dropout`` on a
        domain tensor draws the one-process mask, keeps this rank's rows). Domain ranks draw in one order.
        """
        mine = (int(seed) + self.axis_rank("batch") * 0x9E3779B97F4A7C15) % 2**63
        torch.manual_seed(mine)
        return mine

    # ------------------------------------------------------------------ per-axis views

    def _axis(self, axis: str) -> DeviceMesh:
        try:
            return self._meshes[axis]
        except KeyError:
            grid = [name for name in self._meshes if name.startswith("domain_")]
            valid = ", ".join(repr(name) for name in (*AXES, *DERIVED_AXES, *grid))
            raise ValueError(f"unknown mesh axis {axis!r}; valid axes are {valid}") from None

    def axis_mesh(self, axis: str) -> DeviceMesh:
        """The 1-D mesh of this rank's group on ``axis`` (a base or derived axis)."""
        return self._axis(axis)

    def group(self, axis: str) -> dist.ProcessGroup:
        """This rank's process group on ``axis``."""
        group = self._groups.get(axis)
        if group is None:
            group = self._groups[axis] = self._axis(axis).get_group()
        return group

    @classmethod
    def group_of_epoch(cls, axis: str, epoch: int) -> dist.ProcessGroup:
        """The group on ``axis`` of the mesh numbered ``epoch`` (``dm.epoch``); raises once that mesh is gone.

        Usage: ``DistributedManager.group_of_epoch("domain", spec.comm.mesh_epoch)``
        """
        dm = cls._instance
        if dm is None or dm.epoch != epoch:
            raise RuntimeError(
                f"this domain tensor belongs to a mesh that DistributedManager.shutdown() has destroyed (mesh #{epoch}; "
                f"the current one is #{dm.epoch if dm else 'none'}); make domain tensors again on the current mesh "
                "(domain.shard / from_local)")
        return dm.group(axis)

    def axis_size(self, axis: str) -> int:
        """How many ranks share this rank's group on ``axis``."""
        return self._axis(axis).size()

    def axis_rank(self, axis: str) -> int:
        """This rank's index within its group on ``axis`` (its coordinate on a base axis)."""
        return self._axis(axis).get_local_rank()

    def axis_ranks(self, axis: str) -> list[int]:
        """The global ranks in this rank's group on ``axis``, ordered by axis index."""
        return dist.get_process_group_ranks(self.group(axis))

    @property
    def shape(self) -> dict[str, int]:
        """Axis sizes, e.g. ``{"batch": 2, "domain": 2, "model": 2}``."""
        return {name: self.axis_size(name) for name in AXES}

    @property
    def coordinates(self) -> dict[str, int]:
        """This rank's coordinate on each base axis, e.g. ``{"batch": 1, "domain": 0, "model": 1}``."""
        return {name: self.axis_rank(name) for name in AXES}

    @property
    def batch_domain_mesh(self) -> DeviceMesh:
        """1-D mesh over batch×domain: FSDP shards here; gradients average over batch and sum over domain."""
        return self._meshes["batch_domain"]

    def batch_domain_split(self, shard: int) -> DeviceMesh:
        """batch×domain as a 2-D (replicate, shard) mesh, ``shard`` consecutive ranks per shard group (HSDP, DDP).

        Made once per manager and shard size (making groups is a collective), forgotten by :meth:`shutdown`.
        Every rank must ask for the same splits in the same order.
        """
        mesh = self._batch_domain_splits.get(shard)
        if mesh is None:
            total = self.axis_size("batch_domain")
            if shard < 1 or total % shard:
                raise ValueError(f"shard={shard} must divide batch×domain={total}")
            options = group_options(self.backend, self.timeout)
            override = None if options is None else (self.backend, options)
            names = (f"bd_replicate{total // shard}", f"bd_shard{shard}")
            mesh = unflatten_mesh(self.batch_domain_mesh, (total // shard, shard), names, override)
            self._batch_domain_splits[shard] = mesh
        return mesh

    @property
    def world_mesh(self) -> DeviceMesh:
        """1-D mesh over every rank."""
        return self._meshes["world"]

    def __repr__(self) -> str:
        shape = ", ".join(f"{k}={v}" for k, v in self.shape.items())
        return (f"DistributedManager({shape}, rank={self.rank}/{self.world_size}, device={self.device}, "
                f"backend={self.backend!r}, launcher={self.launcher!r})")
