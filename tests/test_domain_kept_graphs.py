"""Graph calls on a one-rank domain answered from a kept layout (``dispatch.kept``, ``kept_steps.layout_rule``): a
gather, a row of the edge list, a cat, an element-wise op, a Linear or a reduction on one rank is torch's call on the
shards (the rank's items are all the items, in their global order), laid out as the rule laid out the signature's
first call.

Checked against references the path did not build: a MeshGraphNet (gathers, cat along the features, ``index_add_``,
LayerNorm) trained 3 Adam steps at one rank against one process in fp64 and bitwise against the path off, the path
answering most of its calls; masks over the edges, whose kept items follow from their values, each answered afresh
(two masks of one count, then a gather by the kept edges); the calls the path leaves to the dispatcher (a count, a
draw) and graphs on two ranks, where the rules read the edges' values on every call.
"""

from __future__ import annotations

import copy

import torch

from graph_models import MeshGraphNet, uneven_partition

D64 = torch.float64


def _graph(n_ranks: int, seed: int):
    from mesh3d import DistributedManager, domain, graphs

    DistributedManager.initialize(batch=1, domain=n_ranks)
    mesh = graphs.channel_mesh(8, 5)
    edges = torch.from_numpy(mesh.edges)
    part = uneven_partition(mesh.num_nodes, n_ranks, seed)
    g = graphs.Graph(edges, part)
    return mesh.num_nodes, edges, part, g, domain.edge_index(g)


def _training_body():
    from mesh3d import DistributedManager, domain
    from mesh3d.domain.dispatch.kept import KEPT

    n, edges, part, g, ei = _graph(1, 3)
    e = edges.shape[1]
    torch.manual_seed(3)
    ref = MeshGraphNet(3, 2, 2).double()
    kept, walked = copy.deepcopy(ref), copy.deepcopy(ref)
    data = [(torch.randn(n, 3, dtype=D64), torch.randn(e, 2, dtype=D64), torch.randn(n, 2, dtype=D64))
            for _ in range(3)]
    opts = [torch.optim.Adam(m.parameters(), lr=0.01) for m in (ref, kept, walked)]
    worst = {"kept against one process": 0.0, "kept against dispatcher": 0.0}
    hits = 0
    for x, ea, t in data:
        y_ref = ref(x, ea, edges)
        loss_ref = torch.nn.functional.mse_loss(y_ref, t)
        loss_ref.backward()
        before = KEPT.hits
        y = kept(domain.shard_nodes(x, part), domain.shard_edges(ea, g), ei)
        loss = torch.nn.functional.mse_loss(y, domain.shard_nodes(t, part))
        loss.backward()
        hits += KEPT.hits - before
        with KEPT.off():
            y_w = walked(domain.shard_nodes(x, part), domain.shard_edges(ea, g), ei)
            loss_w = torch.nn.functional.mse_loss(y_w, domain.shard_nodes(t, part))
            loss_w.backward()
        pairs = [(y.full_tensor().to_local(), y_ref), (loss.full_tensor().to_local(), loss_ref)]
        pairs += [(q.grad, p.grad) for p, q in zip(ref.parameters(), kept.parameters())]
        worst["kept against one process"] = max(worst["kept against one process"],
                                                max(float((a - b).detach().abs().max()) for a, b in pairs))
        same = [(y.full_tensor().to_local(), y_w.full_tensor().to_local())]
        same += [(q.grad, w.grad) for q, w in zip(kept.parameters(), walked.parameters())]
        worst["kept against dispatcher"] = max(worst["kept against dispatcher"],
                                               max(float((a - b).detach().abs().max()) for a, b in same))
        for o in opts:
            o.step()
            o.zero_grad()
    params = [(p, q, w) for p, q, w in zip(ref.parameters(), kept.parameters(), walked.parameters())]
    worst["params against one process"] = max(float((p - q).abs().max()) for p, q, _ in params)
    worst["params against dispatcher"] = max(float((q - w).abs().max()) for _, q, w in params)
    DistributedManager.shutdown()
    return worst, hits


def test_a_graph_model_at_one_rank_is_kept_and_trains_equal_to_one_process(ranks):
    [(worst, hits)] = ranks.run(1, _training_body, timeout=180)
    assert worst["kept against one process"] < 1e-10 and worst["params against one process"] < 1e-10, worst
    assert worst["kept against dispatcher"] == 0.0 and worst["params against dispatcher"] == 0.0, worst
    # gathers, rows of the edge list, cats, Linears, LayerNorms, SiLUs and the loss of 3 steps, answered kept
    assert hits > 60, hits


def _masks_body():
    from mesh3d import DistributedManager, domain
    from mesh3d.domain.dispatch.kept import KEPT

    n, edges, part, g, ei = _graph(1, 5)
    x = torch.randn(n, 4, dtype=D64)
    xs = domain.shard_nodes(x, part)
    e = edges.shape[1]
    keep_a = torch.arange(e) % 3 != 0
    keep_b = keep_a.roll(1)  # as many edges kept, others
    out = {}
    for name, keep in (("a", keep_a), ("b", keep_b), ("a again", keep_a), ("b again", keep_b)):
        mask = domain.shard_edges(keep, g)
        before = KEPT.hits
        chosen = ei[:, mask]
        masked_hits = KEPT.hits - before
        want = edges[:, keep]
        out[name] = (bool(torch.equal(chosen.full_tensor().to_local(), want)),
                     bool(torch.equal(xs[chosen[0]].full_tensor().to_local(), x[want[0]])), masked_hits)
    DistributedManager.shutdown()
    return out


def test_a_mask_over_the_edges_is_answered_afresh_on_every_call(ranks):
    [out] = ranks.run(1, _masks_body, timeout=120)
    for name, (edges_equal, gather_equal, masked_hits) in out.items():
        assert edges_equal and gather_equal, (name, out)
        assert masked_hits == 0, (name, out)  # its items follow from its values: never kept


def _left_to_the_dispatcher_body():
    import torch.distributed as dist

    from mesh3d import DistributedManager, domain
    from mesh3d.domain.dispatch.kept import KEPT

    n_ranks = dist.get_world_size()
    n, edges, part, g, ei = _graph(n_ranks, 7)
    x = torch.randn(n, 4, dtype=D64)
    xs = domain.shard_nodes(x, part)
    out = {}
    calls = {"gather": lambda: xs[ei[0]], "index_add": lambda: torch.index_add(xs, 0, ei[1], xs[ei[0]]),
             "bincount": lambda: torch.bincount(ei[1], minlength=n)}
    for name, call in calls.items():
        want = call().full_tensor().to_local()
        before = KEPT.hits
        got = [call().full_tensor().to_local() for _ in range(2)]
        out[name] = (all(torch.equal(a, want) for a in got), KEPT.hits - before)
    DistributedManager.shutdown()
    return out


def test_counts_and_graphs_on_two_ranks_take_the_dispatcher(ranks):
    [one] = ranks.run(1, _left_to_the_dispatcher_body, timeout=120)
    assert all(equal for equal, _ in one.values()), one
    # on one rank a gather and an index_add are kept (2 calls, the row of the edge list too); a count is not
    assert one["gather"][1] == 4 and one["index_add"][1] >= 4 and one["bincount"][1] == 2, one  # ei[1] is kept
    for rank in ranks.run(2, _left_to_the_dispatcher_body, timeout=120):
        assert all(equal for equal, _ in rank.values()), rank
        assert all(hits == 0 for _, hits in rank.values()), rank  # the rules read the edges' values on every call
