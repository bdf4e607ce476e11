"""Domain parallelism: shard each sample spatially over the ``domain`` mesh axis; unchanged models run on it.

Usage::

    from mesh3d import domain
    xs = domain.shard(x, dim=2)          # or domain.scatter(x, dim=2, src=0)
    xs = domain.read("x.npy", dim=2)     # or read only this rank's rows from storage
    y = model(xs)                        # nn.Conv2d, GroupNorm, pooling, interpolate ... on shards
    loss = (y * y).mean()                # the one-process value on every domain rank
    loss.backward()                      # then sum parameter grads over the domain group

The layers under this package, each importing only those below it (docs/architecture.md):
``core`` (what a domain tensor is) < ``comm`` (rows between ranks) < ``halo`` (window rows) < ``layouts``
(blocks, token grids) < ``dispatch`` (a torch call to its rule) < ``attention`` < ``ops`` (the rules).
See docs/domain.md.
"""

from mesh3d.domain import ops  # noqa: F401  (registers the op rules)
from mesh3d.domain.api import domain_comm, from_local, full_tensor, redistribute, scatter, shard
from mesh3d.domain.comm.divergence import JOURNAL, DomainDivergenceError
from mesh3d.domain.comm.exchange import NOTICES, count_traffic
from mesh3d.domain.comm.peer_lost import DomainPeerLostError
from mesh3d.domain.core.connected import connected_zeros
from mesh3d.domain.core.group import LIVE_COMMS
from mesh3d.domain.core.plan_cache import PLAN_CACHES
from mesh3d.domain.core.specs import BlockSpec, DomainSpec, GraphSpec, Layout, TokenSpec
from mesh3d.domain.core.split import aligned_sizes, balanced_sizes, split_sizes
from mesh3d.domain.core import wrapped  # noqa: F401  (the private wrapper switch's maker, issue 64)
from mesh3d.domain.core.tensor import DomainTensor
from mesh3d.domain.dispatch.compile_guards import guard_filter
from mesh3d.domain.dispatch.dispatcher import dispatch as _dispatch
from mesh3d.domain.dispatch.elementwise_plan import ELEMENTWISE_PLANS
from mesh3d.domain.dispatch.kept import KEPT
from mesh3d.domain.dispatch.query_answers import QUERIES, WRAPPED_QUERIES
from mesh3d.domain.dispatch.registry import register
from mesh3d.domain.dispatch.step import Combining, Entering, Moved, Partial, Resplit, Rows, Step, whole_operand
from mesh3d.domain.graph import edge_index, nodes_from_local, nodes_from_tokens, shard_edges, shard_nodes, tokens_from_nodes
from mesh3d.domain.halo.overlap import window_overlap
from mesh3d.domain.halo.windows import Extended, Window, plan_window
from mesh3d.domain.io import NpyArray, read
from mesh3d.domain.ops.custom import CustomRule, elementwise, local, whole_dim, window
from mesh3d.domain.ops.idioms import positions
from mesh3d.domain.ops.tokens.attention import neighbourhood_attention
from mesh3d.domain.probe import downsampling_factor
from mesh3d.domain.process_hooks import PROCESS_HOOKS
from mesh3d.manager import DistributedManager
# NOTE: last, so ``domain.attention`` is the function: importing the ``attention`` sub-package above bound its name.
from mesh3d.domain.attention.modes import attention, attention_mode

DomainTensor._dispatcher = staticmethod(_dispatch)
DomainTensor._queries = QUERIES
wrapped.WrappedDomainTensor._queries = WRAPPED_QUERIES
wrapped.WrappedDomainTensor._dispatcher = staticmethod(KEPT.dispatch)
DomainTensor._gather_whole = staticmethod(full_tensor)
# NOTE: the op journal's running fingerprint belongs to one mesh; a new mesh starts a new history.
DistributedManager.on_shutdown(JOURNAL.reset)
# Plans made for a mesh go with it (they hold its specs and comms).
DistributedManager.on_shutdown(PLAN_CACHES.clear)
DistributedManager.on_shutdown(ELEMENTWISE_PLANS.forget)
DistributedManager.on_shutdown(KEPT.forget)
# Notices to peers still in flight are given their chance to land before the groups go.
DistributedManager.on_teardown(NOTICES.settle)
# torch changed for the process (Function.apply routed, compiled graphs taking domain tensors, checkpoints recomputed as
# their forward ran) only while a domain tensor can exist: from the first DomainComm to the last (process_hooks.py).
LIVE_COMMS.watch(on_first=PROCESS_HOOKS.install, on_none=PROCESS_HOOKS.remove)

__all__ = [
    "BlockSpec",
    "CustomRule",
    "DomainDivergenceError",
    "DomainPeerLostError",
    "DomainSpec",
    "DomainTensor",
    "Combining",
    "Entering",
    "Extended",
    "GraphSpec",
    "Layout",
    "Moved",
    "NpyArray",
    "Partial",
    "Resplit",
    "Rows",
    "Step",
    "TokenSpec",
    "Window",
    "aligned_sizes",
    "attention",
    "attention_mode",
    "balanced_sizes",
    "connected_zeros",
    "count_traffic",
    "domain_comm",
    "downsampling_factor",
    "edge_index",
    "elementwise",
    "from_local",
    "full_tensor",
    "guard_filter",
    "local",
    "neighbourhood_attention",
    "nodes_from_local",
    "nodes_from_tokens",
    "plan_window",
    "positions",
    "read",
    "redistribute",
    "register",
    "scatter",
    "shard",
    "shard_edges",
    "shard_nodes",
    "split_sizes",
    "tokens_from_nodes",
    "whole_dim",
    "whole_operand",
    "window",
    "window_overlap",
]
