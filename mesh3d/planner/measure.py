"""The same figures a plan predicts, measured on a real rank: storage bytes, collectives by axis, peak RSS growth.

Used by the tests that hold ``mesh3d plan`` to reality and by ``scripts/bench_plan.py``.

Usage::

    with CollectiveCounter(DistributedManager()) as comm, domain.count_traffic() as halo, PeakRss() as rss:
        loss = model(xs).sum(); loss.backward()
    comm.table(), halo.bytes_sent, rss.growth
    storage_bytes(p.to_local() for p in model.parameters())
"""

from __future__ import annotations

import ctypes
import gc
import statistics
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from mesh3d.manager import DistributedManager
from mesh3d._torch_private import TorchDispatchMode, disable_torch_function_subclass, storage_key

__all__ = ["CollectiveCounter", "PeakRss", "local_tensors", "storage_bytes"]

#: c10d ops (what FSDP2 calls) and functional collectives (what DTensor calls): name -> (kind, input arg, output arg)
_OPS: dict[str, tuple[str, int, int | None]] = {
    "c10d._allgather_base_.default": ("all_gather", 1, 0),
    "c10d._reduce_scatter_base_.default": ("reduce_scatter", 1, 0),
    "c10d.allreduce_.default": ("all_reduce", 0, None),
    "_c10d_functional.all_reduce.default": ("all_reduce", 0, None),
    "_c10d_functional.all_gather_into_tensor.default": ("all_gather", 0, None),
    "_c10d_functional.reduce_scatter_tensor.default": ("reduce_scatter", 0, None),
}


def _nbytes(t: Any) -> int:
    if isinstance(t, (list, tuple)):
        return sum(_nbytes(x) for x in t)
    return t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0


def local_tensors(tensors: Iterable[torch.Tensor | None]) -> list[torch.Tensor]:
    """The local shards of DTensors, plain tensors as they are; ``None`` skipped.

    Usage: ``local_tensors(p.grad for p in model.parameters())``
    """
    return [t.to_local() if isinstance(t, DTensor) else t for t in tensors if t is not None]


def storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (views and shared buffers counted once).

    Usage: ``storage_bytes(local_tensors(model.parameters()))``
    """
    seen: dict[int, int] = {}
    for t in tensors:
        storage = t.untyped_storage()
        seen[storage_key(storage)] = storage.nbytes()
    return sum(seen.values())


class CollectiveCounter(TorchDispatchMode):
    """Counts the collectives issued while active, by axis of the manager's mesh, kind and phase.

    Usage: ``with CollectiveCounter(dm) as c: step(); c.rows  # [(axis, kind, phase, sent, result), ...]``

    Axes are named as ``mesh3d plan`` names them: ``model``, ``domain``, ``batch×domain`` (FSDP), and for HSDP's
    and DDP's 2-D split ``batch×domain/shard(S)`` and ``batch×domain/replicate(R)``.
    """

    def __init__(self, dm: DistributedManager, shard: int | None = None) -> None:
        super().__init__()
        self.phase = "forward"
        self.rows: list[tuple[str, str, str, int, int]] = []
        groups = {"model": dm.group("model"), "domain": dm.group("domain"), "batch×domain": dm.group("batch_domain"),
                  "batch": dm.group("batch")}
        if shard is not None:
            split = dm.batch_domain_split(shard)
            total = dm.axis_size("batch_domain")
            groups[f"batch×domain/shard({shard})"] = split.get_group(1)
            groups[f"batch×domain/replicate({total // shard})"] = split.get_group(0)
        self._by_ranks = {tuple(dist.get_process_group_ranks(g)): axis for axis, g in groups.items()}
        self._by_name: dict[str, str] = {str(g.group_name): axis for axis, g in groups.items()}

    def _axis(self, group: Any) -> str:
        if isinstance(group, str):
            return self._by_name.get(group, f"group {group}")
        ranks = tuple(dist.get_process_group_ranks(dist.ProcessGroup.unbox(group)))
        return self._by_ranks.get(ranks, f"ranks {list(ranks)}")

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        spec = _OPS.get(str(func))
        if spec is not None:
            kind, src, dst = spec
            functional = str(func).startswith("_c10d_functional")
            group = args[-1] if functional else args[2 if kind != "all_reduce" else 1]
            sent = _nbytes(args[src])
            result = _nbytes(args[dst]) if dst is not None else sent
            if functional and kind == "all_gather":
                result = sent * int(args[1])
            elif functional and kind == "reduce_scatter":
                result = sent // int(args[2])
            self.rows.append((self._axis(group), kind, self.phase, sent, result))
        # NOTE: below the Python torch functions: an op on a wrapper domain tensor (a backward's gelu_backward) goes on
        # to its __torch_dispatch__, not back up to the rules, which answer torch functions, not ATen's backward ops
        with disable_torch_function_subclass():
            return func(*args, **kwargs)


#: glibc's mallopt parameter number, and the allocation size from which PeakRss gives each its own mapping
_M_MMAP_THRESHOLD = -3
_OWN_MAPPING_BYTES = 16 * 1024
_PR_SET_THP_DISABLE = 41


class PeakRss:
    """Peak resident memory growth of this process inside the block, in bytes (Linux; for CPU runs).

    Usage: ``PeakRss.follow_tensor_lifetimes()`` before the workload's first step, then
    ``with PeakRss() as rss: step(); rss.growth``

    So that the peak follows tensor lifetimes, allocations of 16 KiB and more get their own mappings (glibc's
    ``mallopt(M_MMAP_THRESHOLD)``; freed at once, instead of staying in malloc's heap), freed heap memory is
    returned first (``malloc_trim``), and the kernel's high-water mark is reset (``/proc/self/clear_refs``).
    The threshold stays set afterwards (glibc cannot restore its adaptive default).

    NOTE: set the threshold before the first step, not only at the window. Under glibc's adaptive default the
    first step's freed activations raise the threshold to their size and later ones land in malloc's heap;
    those heap chunks stay free afterwards and the measured step reuses them piecemeal, so its RSS peak grew
    10-35 MiB above the live bytes, by a different amount on each run, in a fresh 4-rank conv step of 52 MiB.
    The same holds for a process that ran other work before the threshold was set (its heap keeps what that
    work freed): measure in a fresh process.
    """

    def __init__(self) -> None:
        self.growth = 0
        self._start = 0

    @staticmethod
    def _status() -> tuple[int, int]:
        rss = hwm = 0
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    rss = int(line.split()[1]) * 1024
                elif line.startswith("VmHWM:"):
                    hwm = int(line.split()[1]) * 1024
        return rss, hwm

    @staticmethod
    def follow_tensor_lifetimes() -> None:
        """Give every allocation of 16 KiB or more its own mapping from now on, so that freeing returns it, and
        this process no transparent huge pages (where the kernel's setting is ``always``, a touched page of a
        mapping could count 2 MiB, or not, by what memory the machine has free)."""
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(_M_MMAP_THRESHOLD, _OWN_MAPPING_BYTES)
        libc.prctl(_PR_SET_THP_DISABLE, 1, 0, 0, 0)

    def __enter__(self) -> PeakRss:
        libc = ctypes.CDLL("libc.so.6")
        self.follow_tensor_lifetimes()
        gc.collect()
        libc.malloc_trim(0)
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset the peak (VmHWM) to the current RSS
        self._start = self._status()[0]
        return self

    def __exit__(self, *exc: object) -> None:
        self.growth = self._status()[1] - self._start

    @classmethod
    def of_steps(cls, step: Callable[[], object], repeats: int = 3,
                 before: Callable[[], object] | None = None) -> tuple[int, list[int]]:
        """The median peak growth of ``repeats`` runs of ``step`` (each after ``before``, outside the window), and
        every run's growth.

        Usage: ``growth, each = PeakRss.of_steps(lambda: loss_fn(model(x)).backward(), before=opt.zero_grad)``

        NOTE: one window is one sample of a process-wide figure: a 4-rank step in CI measured 7 MiB above its
        live bytes once (27 MiB planned, 34 measured) and a 1-rank U-Net 14 MiB below, in a full shuffled suite,
        while both read within 2 % alone. The median of three windows drops such a one-off.
        """
        each = []
        for _ in range(repeats):
            if before is not None:
                before()
            with cls() as peak:
                step()
            each.append(peak.growth)
        return int(statistics.median(each)), each
