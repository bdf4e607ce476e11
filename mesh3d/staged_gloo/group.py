"""``StagedGlooGroup``: a process group that runs gloo and moves device tensors through host buffers.

Every collective and point-to-point op a caller posts on the group (mesh3d's halo exchanges and ring, FSDP2's
all-gathers and reduce-scatters, DTensor's and the functional collectives, ``dist.*``) reaches one method here:
tensors gloo cannot use where they are (``copies.stages``: CUDA tensors) are copied to host buffers before the op,
gloo runs on the buffers, and the results are copied back at ``wait()`` (``StagedWork``). CPU tensors go to gloo
as they are. The group is made by torch through the backend ``gloo_staged`` (mesh3d/staged_gloo/transport.py).

Usage (through torch; the manager does this for ``initialize(backend="gloo", device="cuda")``)::

    group = dist.new_group(ranks, backend="gloo_staged")
    dist.all_reduce(cuda_tensor, group=group)            # staged through a pinned host buffer
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from mesh3d._torch_private import python_group_private_names
from mesh3d.staged_gloo.buffers import HostBuffers
from mesh3d.staged_gloo.work import StagedWork

__all__ = ["STAGED_BACKEND", "StagedGlooGroup"]

#: The backend name torch knows the staged transport by (``dist.get_backend(group)`` reads it).
STAGED_BACKEND = "gloo_staged"

_Post = Callable[[Callable[[Sequence[torch.Tensor]], list[torch.Tensor]]], list]


def _given(opts: Any) -> tuple:
    """The options argument to pass on: none (the backend's defaults) when the caller gave none."""
    return () if opts is None else (opts,)


def _flat(lists: Sequence[Sequence[torch.Tensor]]) -> list[torch.Tensor]:
    return [t for inner in lists for t in inner]


def _unique(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    seen: dict[int, torch.Tensor] = {}
    for t in tensors:
        seen.setdefault(id(t), t)
    return list(seen.values())


class StagedGlooGroup(dist.ProcessGroup):
    """A ``ProcessGroup`` over one gloo backend; see the module docstring. Made by torch, not by hand."""

    def __init__(self, gloo: Any, rank: int, size: int, pool: HostBuffers) -> None:
        super().__init__(rank, size)  # type: ignore[call-arg]  # the (rank, size) constructor, as torch's own tests
        self._gloo, self._pool = gloo, pool
        self._name = self._desc = ""

    # NOTE: the names torch's trampoline (PyProcessGroup) calls; a Python group keeps its own name and description.
    def getBackendName(self) -> str:  # noqa: N802
        return STAGED_BACKEND

    def setGroupName(self, name: str) -> None:  # noqa: N802
        self._name = name
        options = getattr(self._gloo, "options", None)  # gloo's own logs name the group (where torch has them)
        if options is not None:
            options.group_name = name

    def getGroupName(self) -> str:  # noqa: N802
        return self._name

    def setGroupDesc(self, desc: str) -> None:  # noqa: N802
        self._desc = desc

    def getGroupDesc(self) -> str:  # noqa: N802
        return self._desc

    def backend_for(self, device: torch.device | str | None = None) -> Any:
        """The gloo backend every device's ops go to (torch asks through ``group._get_backend(device)``)."""
        return self._gloo

    def __repr__(self) -> str:
        return f"StagedGlooGroup(rank={self.rank()}, size={self.size()})"

    # ------------------------------------------------------------------ the one staging path

    def _run(self, op: str, reads: Sequence[torch.Tensor], writes: Sequence[torch.Tensor], post: _Post) -> dist.Work:
        """Stage what gloo cannot take, ``post`` the gloo op(s) on host stand-ins, return the work that copies back."""
        copies, stats = self._pool.copies, self._pool.stats
        staged = [t for t in _unique([*reads, *writes]) if copies.stages(t)]
        if not staged:
            stats.plain_ops += 1
            works = post(list)
            return works[0] if len(works) == 1 else StagedWork(op, works, [], None, self._pool, [])
        stats.staged_ops += 1
        lent = {id(t): self._pool.take(t) for t in staged}
        host = {key: buf.view(t.shape) for key, buf, t in ((id(t), lent[id(t)], t) for t in staged)}
        after = copies.mark(staged)
        to_host = [(t, host[id(t)]) for t in _unique(reads) if id(t) in host]
        if to_host:
            copies.note("to_host", op)
            copies.to_host(to_host, after)
            stats.bytes_to_host += sum(t.numel() * t.element_size() for t, _ in to_host)
        copies.note("post", op)
        works = post(lambda ts: [host.get(id(t), t) for t in ts])
        back = [(host[id(t)], t) for t in _unique(writes) if id(t) in host]
        return StagedWork(op, works, back, after, self._pool, list(lent.values()))

    # ------------------------------------------------------------------ collectives
    # NOTE: torch calls each with its options object (``dist.*`` and the C++ trampoline both pass one); a direct
    # call without one gets gloo's defaults.

    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> dist.Work:  # type: ignore[override]
        return self._run("allreduce", tensors, tensors, lambda h: [self._gloo.allreduce(h(tensors), *_given(opts))])

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> dist.Work:
        return self._run("allreduce_coalesced", tensors, tensors,
                         lambda h: [self._gloo.allreduce_coalesced(h(tensors), *_given(opts))])

    def broadcast(self, tensors: list[torch.Tensor], opts: Any = None) -> dist.Work:  # type: ignore[override]
        return self._run("broadcast", tensors, tensors, lambda h: [self._gloo.broadcast(h(tensors), *_given(opts))])

    def reduce(self, tensors: list[torch.Tensor], opts: Any = None) -> dist.Work:  # type: ignore[override]
        return self._run("reduce", tensors, tensors, lambda h: [self._gloo.reduce(h(tensors), *_given(opts))])

    def allgather(self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any = None) -> dist.Work:  # type: ignore[override]
        return self._run("allgather", inputs, _flat(outputs),
                         lambda h: [self._gloo.allgather([h(o) for o in outputs], h(inputs), *_given(opts))])

    def allgather_coalesced(self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor],
                            opts: Any = None) -> dist.Work:
        return self._run("allgather_coalesced", inputs, _flat(outputs),
                         lambda h: [self._gloo.allgather_coalesced([h(o) for o in outputs], h(inputs), *_given(opts))])

    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> dist.Work:
        return self._run("all_gather_single", [input], [output],
                         lambda h: [self._gloo._allgather_base(*h([output]), *h([input]), *_given(opts))])

    def all_gather_single_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor],
                                    opts: Any = None) -> dist.Work:
        return self._run("all_gather_single_coalesced", inputs, outputs, lambda h: [
            self._gloo._allgather_base(o, i, *_given(opts)) for o, i in zip(h(outputs), h(inputs))])

    def reduce_scatter(self, outputs: list[torch.Tensor], inputs: list[list[torch.Tensor]],  # type: ignore[override]
                       opts: Any = None) -> dist.Work:
        return self._run("reduce_scatter", _flat(inputs), outputs,
                         lambda h: [self._gloo.reduce_scatter(h(outputs), [h(i) for i in inputs], *_given(opts))])

    def reduce_scatter_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> dist.Work:
        return self._run("reduce_scatter_single", [input], [output],
                         lambda h: [self._gloo._reduce_scatter_base(*h([output]), *h([input]), *_given(opts))])

    def reduce_scatter_single_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor],
                                        opts: Any = None) -> dist.Work:
        return self._run("reduce_scatter_single_coalesced", inputs, outputs, lambda h: [
            self._gloo._reduce_scatter_base(o, i, *_given(opts)) for o, i in zip(h(outputs), h(inputs))])

    def all_to_all_single(self, output: torch.Tensor, input: torch.Tensor, output_splits: list[int],
                          input_splits: list[int], opts: Any = None) -> dist.Work:
        return self._run("all_to_all_single", [input], [output], lambda h: [
            self._gloo.alltoall_base(*h([output]), *h([input]), output_splits, input_splits, *_given(opts))])

    def alltoall(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None) -> dist.Work:
        return self._run("alltoall", inputs, outputs, lambda h: [self._gloo.alltoall(h(outputs), h(inputs), *_given(opts))])

    def gather(self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any = None) -> dist.Work:  # type: ignore[override]
        return self._run("gather", inputs, _flat(outputs),
                         lambda h: [self._gloo.gather([h(o) for o in outputs], h(inputs), *_given(opts))])

    def scatter(self, outputs: list[torch.Tensor], inputs: list[list[torch.Tensor]], opts: Any = None) -> dist.Work:  # type: ignore[override]
        return self._run("scatter", _flat(inputs), outputs,
                         lambda h: [self._gloo.scatter(h(outputs), [h(i) for i in inputs], *_given(opts))])

    def barrier(self, opts: Any = None) -> dist.Work:
        return self._gloo.barrier(*_given(opts))

    # ------------------------------------------------------------------ point to point

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int = 0) -> dist.Work:
        return self._run("send", tensors, [], lambda h: [self._gloo.send(h(tensors), dst, tag)])

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int = 0) -> dist.Work:
        return self._run("recv", [], tensors, lambda h: [self._gloo.recv(h(tensors), src, tag)])

    def recv_anysource(self, tensors: list[torch.Tensor], tag: int = 0) -> dist.Work:
        return self._run("recv_anysource", [], tensors, lambda h: [self._gloo.recv_anysource(h(tensors), tag)])


python_group_private_names(StagedGlooGroup)
