"""``mesh3d plan --graph`` sizes a graph job from its partition (nodes, edges, halo rows and bytes per rank), and
``mesh3d check --graph`` holds a graph model to one process on uneven meshes (and a checkpoint across them)."""

from __future__ import annotations

import json

import numpy as np

from graph_models import make_gnn

from mesh3d.cli import main
from mesh3d.planner import InputSpec
from mesh3d.planner.check import CheckSpec
from mesh3d.planner.check_run import check_model
from mesh3d.planner.graph_job import load_graph, partition_graph, plan_graph


def test_plan_of_a_graph_job_counts_halo_rows_and_bytes_per_rank_from_the_partition(capsys):
    from mesh3d import graphs

    graph = load_graph("icosahedral:3")
    job = plan_graph(graph, 4, features=64, layers=8, dtype_bytes=2)
    part = partition_graph(graph, 4)
    halo = graphs.Graph(graph.edge_index, part).halo_counts(part)
    assert job.nodes == 642 and [r["nodes"] for r in job.ranks] == list(part.counts)
    assert [r["halo_rows"] for r in job.ranks] == list(halo) and sum(halo) > 0
    assert all(r["halo_bytes_per_layer"] == r["halo_rows"] * 64 * 2 < r["gather_all_bytes_per_layer"] for r in job.ranks)
    assert sum(r["edges"] for r in job.ranks) == graph.edge_index.shape[1]
    # A batch of 3 graphs sends 3 rows per halo node: bytes and activations grow with it, rows and counts do not
    # (issue 65: a planner ignoring the batch size passed with batch 1 alone).
    batched = plan_graph(graph, 4, features=64, layers=8, dtype_bytes=2, batch=3)
    for one, three, rows in zip(job.ranks, batched.ranks, halo):
        assert three["halo_rows"] == one["halo_rows"] == rows
        assert three["halo_bytes_per_layer"] == rows * 64 * 2 * 3 == 3 * one["halo_bytes_per_layer"]
        assert three["activation_bytes_per_layer"] == 3 * one["activation_bytes_per_layer"] > 0
    assert main(["plan", "graph_models:make_gnn", "--graph", "icosahedral:3", "--domain", "4", "--features", "64",
                 "--layers", "8", "--dtype", "bfloat16", "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["ranks"] == job.ranks and printed["dtype_bytes"] == 2
    assert main(["plan", "graph_models:make_gnn", "--graph", "channel:20x8", "--domain", "3", "--partition", "bfs"]) == 0
    assert "graph job:" in capsys.readouterr().out
    assert main(["plan", "graph_models:make_gnn", "--graph", "icosahedral:x", "--domain", "2"]) == 2
    assert "write icosahedral:R" in capsys.readouterr().err


def _pool(ranks):
    return lambda world, fn, *args: ranks.run(world, fn, *args, timeout=300)


def test_check_holds_a_graph_model_to_one_process_on_uneven_meshes(ranks):
    report = check_model(CheckSpec(make_gnn, None, InputSpec((162, 3)), graph="icosahedral:2"), runner=_pool(ranks))
    print(report.table())
    assert [m.mesh for m in report.meshes] == ["1,2,1", "1,3,1", "2,2,1"]
    assert report.equal and all(m.verdict == "equal" for m in report.meshes), report.table()
    assert all(len(set(m.sizes[0])) > 1 for m in report.meshes)  # uneven partitions
    assert np.isfinite(max(report.meshes[0].diffs.values()))
