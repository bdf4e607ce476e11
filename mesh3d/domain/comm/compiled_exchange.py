"""The domain exchange as one custom op (``mesh3d::exchange_rows``), so ``torch.compile`` carries it in its graph.

Usage (inside ``exchange.py``; not called directly)::

    received = exchange_rows(sends, like, dims, send_peers, recv_peers, recv_lengths, comm_id)

Under ``torch.compile`` a halo exchange cannot be traced (``batch_isend_irecv`` and the peers' header round
are Python and gloo calls), and breaking the graph at every exchange would cost two frames per halo. Wrapped as a
``torch.library.custom_op`` it is opaque to Dynamo and Inductor: the graph holds one call per exchange, whose
fake implementation knows the received shapes from the plan alone, and the real implementation is the eager one,
header check and all (compile_anchors.md, design (c): torch's flex context parallel does the same). Its
autograd is the caller's: ``gather_rows`` runs the op forward and the reversed op backward, and Dynamo traces
both through the autograd function.

NOTE: a custom op takes tensors, ints and lists of them, not a ``DomainComm``. ``COMMS`` interns each comm under a
small int that the graph holds as a constant; the comm is plain, hashable data, so its key is stable for the
process's life.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from mesh3d._torch_private import constant_in_compiled_graphs, keep_in_program_order

__all__ = ["COMMS", "EAGER_EXCHANGE", "comm_key", "exchange_rows", "received_shape"]


class _Interned:
    """Hashable objects under small int keys (a custom op's arguments are ints, not objects)."""

    def __init__(self) -> None:
        self._keys: dict[Any, int] = {}
        self._objects: list[Any] = []

    def key(self, obj: Any) -> int:
        at = self._keys.get(obj)
        if at is None:
            at = self._keys[obj] = len(self._objects)
            self._objects.append(obj)
        return at

    def __getitem__(self, key: int) -> Any:
        return self._objects[key]


class _EagerExchange:
    """The eager exchange the op runs: ``run(comm_fields, outgoing, incoming)``, set by ``mesh3d.domain.comm.exchange``.

    NOTE: a slot rather than an import, so this module (imported by ``exchange``) does not import it back.
    """

    run: Callable[[Any, list, list], None] | None = None


COMMS = _Interned()
EAGER_EXCHANGE = _EagerExchange()


@constant_in_compiled_graphs
def comm_key(axis: str | None, ranks: tuple[int, ...], index: int, mesh_epoch: int) -> int:
    """The key in ``COMMS`` of the domain comm with these fields, interned for real while Dynamo traces.

    NOTE: fields, not the comm object: Dynamo guards on a constant call's object arguments by identity, and each
    ``domain.shard`` makes a new (equal) comm, which would recompile every step. Traced rather than called, the
    interning would be a side effect replayed after the graph, whose exchange op looks the key up first.
    """
    return COMMS.key((axis, ranks, index, mesh_epoch))


def received_shape(like: torch.Tensor, dims: Sequence[int], lengths: Sequence[int]) -> list[int]:
    """``like``'s shape with ``lengths[k]`` along ``dims[k]``: the shape of a message received.

    Usage: ``received_shape(local, (2,), (3,))  # three rows of local's other dims``
    """
    shape = list(like.shape)
    for d, n in zip(dims, lengths):
        shape[d] = n
    return shape


def _per_peer(lengths: list[int], width: int) -> list[list[int]]:
    return [lengths[i:i + width] for i in range(0, len(lengths), width)]


@torch.library.custom_op("mesh3d::exchange_rows", mutates_args=())
def exchange_rows(sends: list[torch.Tensor], like: torch.Tensor, dims: list[int], send_peers: list[int],
                  recv_peers: list[int], recv_lengths: list[int], comm_id: int) -> list[torch.Tensor]:
    """Send ``sends[i]`` to domain index ``send_peers[i]``; from each ``recv_peers[j]`` receive a message shaped like
    ``like`` but ``recv_lengths[j * len(dims) + k]`` long along ``dims[k]``. Returns them in ``recv_peers`` order."""
    incoming = [(peer, like.new_empty(received_shape(like, dims, lengths)))
                for peer, lengths in zip(recv_peers, _per_peer(recv_lengths, len(dims)))]
    assert EAGER_EXCHANGE.run is not None, "mesh3d.domain.comm.exchange sets the transport on import"
    EAGER_EXCHANGE.run(COMMS[comm_id], [(peer, s.contiguous()) for peer, s in zip(send_peers, sends)], incoming)
    return [buf for _, buf in incoming]


@exchange_rows.register_fake
def _(sends, like, dims, send_peers, recv_peers, recv_lengths, comm_id):
    return [like.new_empty(received_shape(like, dims, lengths)) for lengths in _per_peer(recv_lengths, len(dims))]


# NOTE: every rank posts its exchanges in program order; without an effect Inductor may reorder two exchanges that
# share no data (the ranks would then pair different messages), or drop one whose result this rank does not read.
keep_in_program_order(exchange_rows)
