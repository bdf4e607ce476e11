"""Idioms of hand-written message passing on graph layouts (issue 65), each against the same code in one process in
fp64, forward and backward, on 2 and 3 ranks: partitions uneven, with an empty part, whose owners interleave along
the node ids (a random assignment, and a Hilbert cut of a mesh numbered in grid order, not along the curve).

Rows of the edge list (tuple unpacking, unbind, split / chunk and back to 1-D, slices, .long() / .int()) keep their
endpoint; pieces along features stay graph tensors; bincount (node tensors or a replicated whole), unique, degrees by
scatter_add_ / index_add_ of ones, where / nonzero (global positions) and three-argument where; sums into the sources
at 3 ranks; a reduction other than a sum into the sources and loops over items refused by name on every rank; the
halo rows of ``NodeDataset`` where owners interleave.
"""

from __future__ import annotations

import warnings

import numpy as np
import torch

from graph_models import uneven_partition

TOL = 1e-10


def _cases(d: int):
    """(name, partition, points, edges) on a channel mesh numbered in grid order: uneven, interleaved owners."""
    from mesh3d import graphs

    mesh = graphs.channel_mesh(8, 5)
    n = mesh.num_nodes
    cut = n // 5
    hilbert = (cut, 0, n - cut) if d == 3 else (cut, n - cut)
    parts = [("random", uneven_partition(n, d, 11 + d, empty=0 if d == 3 else None)),
             ("hilbert", graphs.sfc_partition(mesh.points, d, sizes=hilbert))]
    if d == 2:  # every node on rank 1: rank 0 holds nothing
        parts.append(("random-empty", uneven_partition(n, d, 13, empty=0)))
    return [(name, part, mesh.edges) for name, part in parts]


def _on_each_case(seed: int):
    """The domain over every rank, then per case of ``_cases``: (name, partition, edges, graph, the edge list whole,
    the edge list as a domain tensor), torch seeded with ``seed`` before each case's draws."""
    import torch.distributed as dist

    from mesh3d import DistributedManager, domain, graphs

    DistributedManager.initialize(batch=1, domain=dist.get_world_size())
    for name, part, edges in _cases(dist.get_world_size()):
        g = graphs.Graph(edges, part)
        torch.manual_seed(seed)
        yield name, part, edges, g, torch.from_numpy(edges), domain.edge_index(g)


def _interleaved(part) -> bool:
    """Owners change along the ids more often than contiguous runs would."""
    return int(np.count_nonzero(np.diff(part.owner))) > part.parts - 1


def _whole(t: torch.Tensor) -> torch.Tensor:
    from mesh3d.domain.core.specs import Layout

    if t.spec.layout is Layout.GRAPH:
        return t.full_tensor().to_local()
    return t.to_local()


def _err(a: torch.Tensor, b: torch.Tensor) -> float:
    """Integers: 0 when equal; floats: the largest difference relative to the largest value (at least 1)."""
    from domain_cases import max_err

    if a.dtype != b.dtype:
        return float("inf")
    if not a.is_floating_point():
        return 0.0 if torch.equal(a, b) else float("inf")
    scale = max(1.0, float(b.abs().max())) if b.numel() else 1.0  # relative to the values' size
    return max_err(a.double(), b.double()) / scale


def _rows(ei, how: str):
    """The edge list's two rows, as model code writes it."""
    if how == "unpack":
        src, dst = ei
    elif how == "unbind":
        src, dst = ei.unbind(0)
    elif how == "torch.unbind":
        src, dst = torch.unbind(ei)
    elif how == "split":
        s, d = ei.split(1)
        src, dst = s.squeeze(0), d.view(-1)
    elif how == "chunk":
        s, d = ei.chunk(2)
        src, dst = s.flatten(), d.squeeze(0)
    elif how == "torch.split":
        s, d = torch.split(ei, 1)
        src, dst = s.view(-1), d.flatten()
    elif how == "slices":
        src, dst = ei[:1].squeeze(), ei[1:].reshape(-1)
    else:  # "long": graph.edge_index.long() of a data object
        class Data:
            edge_index = ei
        src, dst = Data().edge_index.long()
    return src, dst


HOWS = ("unpack", "unbind", "torch.unbind", "split", "chunk", "torch.split", "slices", "long")


def _layer(x, e, ei, lin, how):
    """A message-passing layer: edge features cut along features, a mean at the destinations (local only when ``dst``
    still knows it is the destinations), a sum into the sources."""
    src, dst = _rows(ei, how)
    e0, e1 = e.unbind(-1)
    ea, _ = e.chunk(2, dim=-1)
    msg = lin(torch.cat([x[src], x[dst], ea], -1)) * e1.unsqueeze(-1)
    mean = msg.new_zeros(x.shape).scatter_reduce(0, dst.view(-1, 1).expand_as(msg), msg, "mean", include_self=False)
    back = x.new_zeros(x.shape).index_add_(0, src, msg * e0.unsqueeze(-1))
    return x + mean + back


def _rows_body():
    from domain_cases import domain_sum
    from mesh3d import domain

    out = []
    for name, part, edges, g, ep, ei in _on_each_case(3):
        n, e_count = part.n, edges.shape[1]
        lin = torch.nn.Linear(7, 3).double()
        x = torch.randn(n, 3, dtype=torch.float64)
        e = torch.randn(e_count, 2, dtype=torch.float64)
        worst, endpoints = 0.0, []
        for how in HOWS:
            src, dst = _rows(ei, how)
            endpoints.append((how, src.spec.endpoint, dst.spec.endpoint, src.ndim, dst.ndim))
            xr, er = x.clone().requires_grad_(), e.clone().requires_grad_()
            y_ref = _layer(xr, er, ep, lin, how)
            y_ref.pow(2).sum().backward()
            ref_grads = [p.grad.clone() for p in lin.parameters()]
            lin.zero_grad()
            xs = domain.shard_nodes(x, part).requires_grad_()
            es = domain.shard_edges(e, g).requires_grad_()
            y = _layer(xs, es, ei, lin, how)
            y.pow(2).sum().backward()
            worst = max(worst, _err(_whole(y), y_ref.detach()), _err(_whole(xs.grad), xr.grad),
                        _err(_whole(es.grad), er.grad),
                        *(_err(domain_sum(p.grad), r) for p, r in zip(lin.parameters(), ref_grads)))
            lin.zero_grad()
        int_rows = [(r.spec.endpoint, r.dtype) for r in (ei.int()[0], ei[1].int(), ei.long()[1], ei[0].long())]
        out.append((name, _interleaved(part), part.counts, worst, endpoints, int_rows))
    return out


def test_rows_of_the_edge_list_as_model_code_takes_them(ranks):
    for world in (2, 3):
        results = ranks.run(world, _rows_body, timeout=120)
        for name, interleaved, counts, worst, endpoints, int_rows in results[0]:
            assert interleaved or name == "random-empty", (name, counts)  # that one: every node on one rank
            assert worst < TOL, (world, name, counts, worst)
            assert all(e == (how, 0, 1, 1, 1) for e, how in zip(endpoints, HOWS)), endpoints
            assert int_rows == [(0, torch.int32), (1, torch.int32), (1, torch.int64), (0, torch.int64)]
        assert any(0 in counts for _, _, counts, *_ in results[0])  # an empty part at each world size


def _counting_body():
    from mesh3d import domain

    out = []
    for name, part, edges, g, ep, ei in _on_each_case(5):
        n, e_count = part.n, edges.shape[1]
        w64, w32 = torch.randn(e_count, dtype=torch.float64), torch.randn(e_count)
        w16, wint = w32.half(), torch.randint(0, 4, (e_count,))
        labels = torch.randint(0, 5, (n,))
        x = torch.randn(n, 3, dtype=torch.float64).mul(2).round()
        dom = {"ei": ei, "w_dom": domain.shard_edges(w64, g), "labels": domain.shard_nodes(labels, part),
               "x": domain.shard_nodes(x, part)}
        one = {"ei": ep, "w_dom": w64, "labels": labels, "x": x}
        checks = {  # name: (function of the inputs, the layout expected: nodes of the partition or replicated)
            "bincount(dst)": (lambda t: torch.bincount(t["ei"][1]), "nodes"),
            "dst.bincount(minlength=n)": (lambda t: t["ei"][1].bincount(minlength=n), "nodes"),
            "bincount(src)": (lambda t: torch.bincount(t["ei"][0]), "nodes"),
            "bincount(src, minlength=n)": (lambda t: torch.bincount(t["ei"][0], minlength=n), "nodes"),
            "bincount(dst, graph weights)": (lambda t: torch.bincount(t["ei"][1], t["w_dom"]), "nodes"),
            "bincount(src, graph weights)": (lambda t: torch.bincount(t["ei"][0], weights=t["w_dom"]), "nodes"),
            "bincount(src, f64 weights)": (lambda t: torch.bincount(t["ei"][0], w64), "nodes"),
            "bincount(dst, f32 weights)": (lambda t: torch.bincount(t["ei"][1], w32), "nodes"),
            "bincount(src, f16 weights)": (lambda t: torch.bincount(t["ei"][0], w16), "nodes"),
            "bincount(src, int weights)": (lambda t: torch.bincount(t["ei"][0], wint), "nodes"),
            "bincount(dst.int())": (lambda t: torch.bincount(t["ei"][1].int()), "nodes"),
            "bincount(src, minlength=n+4)": (lambda t: torch.bincount(t["ei"][0], minlength=n + 4), "replicated"),
            "bincount(dst of fewer edges)": (lambda t: torch.bincount(t["ei"][:, t["ei"][1] < n - 3][1]), "replicated"),
            "bincount(src of fewer edges, weights)": (
                lambda t: (lambda m: torch.bincount(t["ei"][0][m], t["w_dom"][m]))(t["ei"][1] < n - 3), None),
            "bincount(no edges)": (lambda t: torch.bincount(t["ei"][:, t["ei"][0] < 0][1]), "replicated"),
            "bincount(no edges, minlength=n)": (lambda t: torch.bincount(t["ei"][:, t["ei"][0] < 0][0], minlength=n),
                                                "nodes"),
            "bincount(node labels)": (lambda t: torch.bincount(t["labels"]), "replicated"),
            "unique(src)": (lambda t: torch.unique(t["ei"][0]), "replicated"),
            "unique(src, sorted=False)": (lambda t: torch.unique(t["ei"][0], sorted=False), "replicated"),
            "unique(ei, inverse, counts)": (
                lambda t: torch.unique(t["ei"], return_inverse=True, return_counts=True), None),
            "dst.unique(counts)": (lambda t: t["ei"][1].unique(return_counts=True), None),
            "unique(float nodes, inverse)": (lambda t: torch.unique(t["x"], return_inverse=True), None),
            "unique(labels, counts)": (lambda t: torch.unique(t["labels"], return_counts=True), None),
            "unique(no edges, inverse, counts)": (
                lambda t: torch.unique(t["ei"][:, t["ei"][0] < 0], return_inverse=True, return_counts=True), None),
        }
        errors, layouts = {}, {}
        for key, (f, layout) in checks.items():
            got, want = f(dom), f(one)
            got, want = (got, want) if isinstance(want, tuple) else ((got,), (want,))
            errors[key] = max(_err(_whole(a), b) for a, b in zip(got, want))
            first = got[0]
            kind = "nodes" if first.spec.layout.value == "graph" and first.spec.items == part else first.spec.layout.value
            layouts[key] = (kind, layout)
        inverse = torch.unique(dom["ei"], return_inverse=True)[1]
        with domain.count_traffic() as quiet:
            ei[1].bincount(minlength=n)
        with domain.count_traffic() as one_int:
            torch.bincount(ei[1])
        out.append((name, errors, layouts, inverse.spec.items == ei.spec.items and inverse.spec.dim == 1,
                    quiet.bytes_sent, one_int.bytes_sent))
    return out


def test_bincount_and_unique_give_the_one_process_answer(ranks):
    for world in (2, 3):
        results = ranks.run(world, _counting_body, timeout=120)
        for rank, per_rank in enumerate(results):
            for name, errors, layouts, inverse_laid_out, quiet, one_int in per_rank:
                bad = {k: v for k, v in errors.items() if not v < TOL}
                assert not bad, (world, name, bad)
                wrong = {k: v for k, v in layouts.items() if v[1] is not None and v[0] != v[1]}
                assert not wrong, (world, name, wrong)
                assert inverse_laid_out
                assert quiet == 0  # minlength = the node count: the destinations' counts are local, no length to find
                assert one_int == 8 * (world - 1), one_int  # the largest id: one int64 to each peer


def _degree_body():
    from mesh3d import domain

    out = []
    for name, part, edges, g, ep, ei in _on_each_case(7):
        n, e_count = part.n, edges.shape[1]
        x = torch.randn(n, 3, dtype=torch.float64)

        def degrees(ei):
            src, dst = ei
            ones = torch.ones(e_count, dtype=torch.float64)
            return (torch.zeros(n, dtype=torch.float64).scatter_add_(0, src, ones),
                    torch.zeros(n, dtype=torch.float64).index_add_(0, dst, ones),
                    torch.zeros(n).index_add_(0, src, torch.ones(e_count)),
                    torch.zeros(n, dtype=torch.float64).scatter_add(0, dst, ones))

        def sums_into_sources(x, ei):
            src, dst = ei
            w = (x[src] * x[dst]).sum(-1)
            deg = torch.zeros(n, dtype=torch.float64).scatter_add_(0, src, torch.ones_like(w))
            norm = deg.clamp(min=1).pow(-0.5)
            msg = x[dst] * (w * norm[src] * norm[dst]).unsqueeze(-1)
            s1 = x.new_zeros(x.shape).index_add_(0, src, msg)
            s2 = torch.zeros(n, dtype=torch.float64).scatter_add(0, src, w)
            s3 = x.new_zeros(n).scatter_reduce(0, src, w.exp(), "sum", include_self=False)
            s4 = x.new_zeros(x.shape).scatter_add_(0, src.view(-1, 1).expand_as(msg), msg.sin())
            return s1 + (s2 * s3).unsqueeze(-1) + s4

        worst = max(_err(_whole(a), b) for a, b in zip(degrees(ei), degrees(ep)))
        layouts = all(t.spec.items == part for t in degrees(ei))
        xr = x.clone().requires_grad_()
        y_ref = sums_into_sources(xr, ep)
        y_ref.pow(2).sum().backward()
        xs = domain.shard_nodes(x, part).requires_grad_()
        y = sums_into_sources(xs, ei)
        y.pow(2).sum().backward()
        worst = max(worst, _err(_whole(y), y_ref.detach()), _err(_whole(xs.grad), xr.grad))
        out.append((name, part.counts, sum(g.halo_counts(part)), layouts, worst))
    return out


def test_degrees_and_sums_into_the_sources_are_exact(ranks):
    for world in (2, 3):
        for name, counts, halo, layouts, worst in ranks.run(world, _degree_body, timeout=120)[0]:
            assert layouts and (halo > 0 or name == "random-empty"), (world, name, counts)  # sums travel home
            assert worst < TOL, (world, name, counts, worst)


def _where_body():
    from domain_cases import domain_sum
    from mesh3d import domain

    out = []
    for name, part, edges, g, ep, ei in _on_each_case(9):
        n, e_count = part.n, edges.shape[1]
        x = torch.randn(n, 3, dtype=torch.float64)
        e = torch.randn(e_count, 2, dtype=torch.float64)
        b = torch.randn(e_count, dtype=torch.float64)

        def positions(ei, e):
            src, dst = ei
            (kept,) = torch.where(src > dst)
            return (kept, ei[:, kept], e[kept], torch.nonzero(src > dst), (src > dst).nonzero(as_tuple=True)[0],
                    torch.argwhere(src > dst))

        got, want = positions(ei, domain.shard_edges(e, g)), positions(ep, e)
        worst = max(_err(_whole(a), w) for a, w in zip(got, want))
        same_layout = got[0].spec.items == ei[:, ei[0] > ei[1]].spec.items == got[2].spec.items

        def select(x, e, b, ei):
            src, dst = ei
            a = (x[src] * x[dst]).sum(-1)
            y = torch.where(src > dst, a, b) + torch.where(dst > src, e[:, 0], 0.5) * torch.where(a > 0, a, e[:, 1])
            return x.new_zeros(n).index_add_(0, dst, y)

        xr, er, br = x.clone().requires_grad_(), e.clone().requires_grad_(), b.clone().requires_grad_()
        y_ref = select(xr, er, br, ep)
        y_ref.pow(2).sum().backward()
        xs = domain.shard_nodes(x, part).requires_grad_()
        es, bs = domain.shard_edges(e, g).requires_grad_(), b.clone().requires_grad_()
        y = select(xs, es, bs, ei)
        y.pow(2).sum().backward()
        worst = max(worst, _err(_whole(y), y_ref.detach()), _err(_whole(xs.grad), xr.grad),
                    _err(_whole(es.grad), er.grad), _err(domain_sum(bs.grad), br.grad))
        out.append((name, part.counts, worst, same_layout))
    return out


def test_where_gives_global_positions_and_selects_element_wise(ranks):
    for world in (2, 3):
        for name, counts, worst, same_layout in ranks.run(world, _where_body, timeout=120)[0]:
            assert worst < TOL, (world, name, counts, worst)
            assert same_layout  # the positions lie where ei[:, mask] puts the kept edges


def _refusal_body():
    import torch.distributed as dist

    from mesh3d import DistributedManager, domain, graphs

    d = dist.get_world_size()
    DistributedManager.initialize(batch=1, domain=d)
    name, part, edges = _cases(d)[0]
    g = graphs.Graph(edges, part)
    n, f = part.n, 2
    x = domain.shard_nodes(torch.randn(n, f, dtype=torch.float64), part)
    ei = domain.edge_index(g)
    src, dst = ei
    msg = x[dst]
    wide = src.view(-1, 1).expand_as(msg)

    def loop_over_edges():
        return [(s, t) for s, t in ei.t()]

    calls = {
        "for s, d in ei.t()": loop_over_edges,
        "list(ei.T)": lambda: list(ei.T),
        "list(x)": lambda: list(x),
        "x.unbind(0)": lambda: x.unbind(0),
        "x.split(2)": lambda: x.split(2),
        "torch.chunk(x, 2)": lambda: torch.chunk(x, 2),
        "unique(dim)": lambda: torch.unique(ei, dim=1),
        "where(2-D mask)": lambda: torch.where(x > 0),
        "mean into sources": lambda: x.new_zeros(x.shape).scatter_reduce(0, wide, msg, "mean"),
        "mean_ into sources": lambda: x.new_zeros(x.shape).scatter_reduce_(0, wide, msg, "mean", include_self=False),
        "amax into sources": lambda: x.new_zeros(n).scatter_reduce(0, src, msg[:, 0], "amax", include_self=False),
        "prod into plain sources": lambda: torch.ones(n, dtype=torch.float64).scatter_reduce_(0, src, msg[:, 0], "prod"),
        # NOTE: the plain edge list (domain.edge_index forgotten) and PyG's readout by a batch vector: an untyped
        # AttributeError before
        "index_add_ by a plain index": lambda: torch.zeros_like(x).index_add_(0, torch.from_numpy(edges[1]), msg),
        "scatter_add_ by a plain batch": lambda: x.new_zeros(1, f).scatter_add_(
            0, torch.zeros(n, 1, dtype=torch.long).expand(n, f), x),
        "argsort(dst) for CSR": lambda: torch.argsort(dst),
        "index_reduce_ mean": lambda: x.new_zeros(x.shape).index_reduce_(0, dst, msg, "mean"),
    }
    messages = {}
    for key, call in calls.items():
        try:
            call()
            messages[key] = None
        except (NotImplementedError, ValueError, RuntimeError) as err:
            messages[key] = str(err)
    # NOTE: the ranks told each other of each refusal; the notices that landed were held and waited for again at
    # shutdown, where gloo timed them out and closed the pairs: every rank warned that peers missed the barrier
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        DistributedManager.shutdown()
    messages["shutdown warnings"] = [str(w.message) for w in caught]
    return messages


def test_loops_over_items_and_other_reductions_into_the_sources_are_refused_by_name(ranks):
    results = ranks.run(3, _refusal_body, timeout=60)
    assert all(r == results[0] for r in results)  # every rank, the same words
    m = results[0]
    assert m.pop("shutdown warnings") == [], m
    assert all(v is not None for v in m.values()), [k for k, v in m.items() if v is None]
    loop = "along the item dim {} of a graph tensor (a Python loop over its items"
    assert m["for s, d in ei.t()"].startswith("torch.Tensor.unbind " + loop.format(0))
    assert m["list(ei.T)"].startswith("torch.Tensor.unbind " + loop.format(0))
    assert m["list(x)"].startswith("torch.Tensor.unbind " + loop.format(0)) and ".full_tensor()" in m["list(x)"]
    assert m["x.unbind(0)"].startswith("torch.Tensor.unbind " + loop.format(0))
    assert m["x.split(2)"].startswith("torch.Tensor.split " + loop.format(0))
    assert m["torch.chunk(x, 2)"].startswith("torch.chunk " + loop.format(0))
    assert m["unique(dim)"].startswith("torch.unique(dim=1) of a graph tensor")
    assert m["where(2-D mask)"].startswith("torch.where(condition) of a 2-D graph tensor")
    for key, op in (("mean into sources", "torch.scatter_reduce(reduce='mean')"),
                    ("mean_ into sources", "torch.Tensor.scatter_reduce_(reduce='mean')"),
                    ("amax into sources", "torch.scatter_reduce(reduce='amax')"),
                    ("prod into plain sources", "torch.Tensor.scatter_reduce_(reduce='prod')")):
        assert m[key].startswith(f"{op} with a reduction other than a sum into nodes of other ranks"), m[key]
    assert "aggregate at the destinations with index_add_ or scatter_reduce" in m["argsort(dst) for CSR"]
    assert m["index_reduce_ mean"].startswith("torch.Tensor.index_reduce_ has no rule for graph layouts") and \
        "scatter_reduce_" in m["index_reduce_ mean"]
    for key, op in (("index_add_ by a plain index", "torch.Tensor.index_add_"),
                    ("scatter_add_ by a plain batch", "torch.Tensor.scatter_add_")):
        assert m[key].startswith(f"{op}: the index of an aggregation over a graph must be a row of its edge list") \
            and "h.sum(0)" in m[key], m[key]


def test_node_dataset_puts_halo_rows_in_the_halo_order_where_owners_interleave():
    from mesh3d import graphs
    from mesh3d.data import NodeDataset

    mesh = graphs.channel_mesh(16, 8)
    n, d = mesh.num_nodes, 4
    whole = np.random.default_rng(1).standard_normal((2, n, 2)).astype(np.float32)
    shuffled = 0
    for part in (uneven_partition(n, d, 17, empty=1), graphs.sfc_partition(mesh.points, d, sizes=(n // 2, 0, n // 8,
                                                                                                    n - n // 2 - n // 8))):
        assert _interleaved(part)
        g = graphs.Graph(mesh.edges, part)
        for rank in range(d):
            ds = NodeDataset({"x": whole}, part, rank=rank, halo=g)
            halo = g.halo(part, rank).halo_ids
            order = np.argsort(halo, kind="stable")
            shuffled += int(not np.array_equal(order[order], np.arange(len(order))))  # not its own inverse
            sample = ds[1]
            assert torch.equal(sample["x"], torch.from_numpy(whole[1, part.items(rank)]))
            assert torch.equal(sample["x_halo"], torch.from_numpy(whole[1, halo])), (rank, halo)
    assert shuffled >= 4, shuffled  # halos whose sort permutation is not its own inverse: which one is used matters
