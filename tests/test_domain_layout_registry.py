"""The registered layouts (``mesh3d.domain.dispatch.layout_registry``): every sharded ``Layout`` is one registered
object, and what the dispatcher, the operator cases and ``full_tensor`` do follows from it.

Single process for the registry's own contract; the rank pool for the dispatcher reading it: an op on a graph tensor
and a slab together takes the graph's rule, a graph operator of ``torch.ops`` takes its torch function's graph rule,
and the refusals name the layout the registration names (2 ranks, uneven, an empty part)."""

from __future__ import annotations

import pytest
import torch

from mesh3d import DistributedManager, domain, graphs
from mesh3d.domain.dispatch.layout_registry import LAYOUTS, LayoutRegistry, RegisteredLayout
from mesh3d.domain.dispatch.registry import RuleTable, op_name


def test_every_sharded_layout_is_registered_once_with_its_own_table():
    sharded = {kind for kind in domain.Layout if kind is not domain.Layout.REPLICATED}
    assert {entry.layout for entry in LAYOUTS} == sharded
    assert len({id(entry.rules) for entry in LAYOUTS}) == len(LAYOUTS)
    assert LAYOUTS.of(domain.Layout.REPLICATED) is None
    assert LAYOUTS.priority[domain.Layout.REPLICATED] == 0
    kinds = {entry.layout: entry.priority for entry in LAYOUTS}
    assert kinds[domain.Layout.GRAPH] > kinds[domain.Layout.BLOCKS] == kinds[domain.Layout.TOKENS] > \
        kinds[domain.Layout.STRIDED] > kinds[domain.Layout.SLAB] > 0


def test_a_second_registration_or_a_non_positive_priority_is_refused():
    registry = LayoutRegistry()
    entry = LAYOUTS.of(domain.Layout.SLAB)
    registry.register(entry)
    with pytest.raises(ValueError, match="registered already"):
        registry.register(entry)
    with pytest.raises(ValueError, match="must be positive"):
        LayoutRegistry().register(RegisteredLayout(domain.Layout.GRAPH, "graphs", 0, entry.rules, entry.refusal,
                                                   entry.full_tensor))
    assert RuleTable is type(entry.rules)


def _graph_and_slab(world: int):
    DistributedManager.initialize(batch=1, domain=world)
    owner = [1, 0, 1, 1, 0, 1, 1] if world == 2 else [0] * 7  # interleaved owners
    part = graphs.Partition(owner, world)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(7, 3, dtype=torch.float64, generator=g)
    slab = domain.shard(torch.randn(2, 3, 6, dtype=torch.float64, generator=g), dim=2, sizes=(6, 0)[:world])
    return x, domain.shard_nodes(x, part), slab


def _body(world: int):
    x, nodes, slab = _graph_and_slab(world)
    out = {}
    # the graph's refusal text comes from its registration, whatever function reached it
    for name, call in (("cumsum", lambda: torch.cumsum(nodes, 0)),
                       ("aten_cumsum", lambda: torch.ops.aten.cumsum.default(nodes, 0))):
        try:
            call()
            out[name] = "ran"
        except NotImplementedError as e:
            out[name] = str(e)
    # an ATen operator on a graph tensor: its torch function's graph rule (a sum over the nodes), one-process answer
    out["aten_sum"] = float(torch.ops.aten.sum.default(nodes).to_local())
    out["sum"] = float(x.sum())
    # ... and one ruled for graphs alone (torch.bincount): before graphs were registered beside the others, the
    # operator was refused as having no rule anywhere
    ids = domain.shard_nodes(torch.tensor([2, 0, 5, 2, 2, 1, 0]), nodes.spec.items)
    counts = torch.ops.aten.bincount.default(ids)
    out["bincount"] = (counts.full_tensor() if counts.spec.layout is not domain.Layout.REPLICATED else counts).to_local()
    whole = nodes.full_tensor()
    out["whole"] = bool(torch.equal(whole.to_local(), x)) and whole.spec.layout is domain.Layout.REPLICATED
    out["replicated_whole_is_itself"] = whole.full_tensor() is whole
    out["slab_whole"] = tuple(slab.full_tensor().shape)
    DistributedManager.shutdown()
    return out


@pytest.mark.parametrize("world", [1, 2])
def test_the_dispatcher_reads_the_registration(ranks, world):
    for out in ranks.run(world, _body, world):
        assert out["cumsum"].startswith("torch.cumsum has no rule for graph layouts"), out
        assert "has no rule for graph layouts" in out["aten_cumsum"] or "has no domain rule" in out["aten_cumsum"], out
        assert abs(out["aten_sum"] - out["sum"]) < 1e-12, out
        assert torch.equal(out["bincount"], torch.bincount(torch.tensor([2, 0, 5, 2, 2, 1, 0]))), out
        assert out["whole"] and out["replicated_whole_is_itself"], out
        assert out["slab_whole"] == (2, 3, 6), out
    assert op_name(torch.cumsum) == "torch.cumsum"
