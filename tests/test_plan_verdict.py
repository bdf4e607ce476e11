"""The plan's verdict (will it fit, with a stated margin for what is not modeled) and its compact memory table."""

from __future__ import annotations

import json

import pytest
import torch

from plan_models import ConvStack, transformer

from mesh3d import Plan
from mesh3d.planner import InputSpec, JobMesh, plan_job
from mesh3d.planner.report import RankClass
from mesh3d.planner.verdict import judge

GiB, MiB = 2**30, 2**20


def _klass(peak: int, count: int = 1, rank: int = 0, axes: tuple[str, ...] = ()) -> RankClass:
    return RankClass(count, str(rank), [rank], {}, {"peak": peak}, {}, [{"axis": a} for a in axes],
                     {"messages": {"forward": 0, "backward": 0}}, {})


@pytest.mark.parametrize("device_memory, status", [(None, "unknown"), (80 * GiB, "fits"), (40 * GiB + GiB, "tight"),
                                                   (39 * GiB, "does not fit")])
def test_the_verdict_adds_the_stated_margin_to_the_worst_class(device_memory, status):
    """CUDA: 1 GiB of context and libraries, 512 MiB per NCCL communicator, 10 % of the peak for fragmentation."""
    classes = [_klass(30 * GiB, 3, 0), _klass(40 * GiB, 5, 7)]
    v = judge(classes, device="cuda", device_memory=device_memory, communicators=2)
    margin = GiB + 2 * 512 * MiB + 4 * GiB
    assert v["status"] == status and v["worst_class"] == 1 and v["peak"] == 40 * GiB
    assert v["margin"]["total"] == margin and v["needed"] == 40 * GiB + margin
    assert v["line"].startswith("verdict: ") and "class 1 (5 ranks, e.g. rank 7)" in v["line"]
    assert "NCCL buffers 2 x 512.0 MiB" in v["margin_line"] and "margin 6.0 GiB = 46.0 GiB" in v["line"]
    if status == "does not fit":
        assert v["over"] == [1] and "1 of 2 classes (5 ranks) need more" in v["line"]  # class 0: 30 + 5 GiB fit
    fixed = judge(classes, device="cuda", device_memory=device_memory, communicators=2, margin=GiB)
    assert fixed["needed"] == 41 * GiB and "1.0 GiB, as given (--margin)" in fixed["margin_line"]


def test_on_the_cpu_the_margin_is_fragmentation_only():
    v = judge([_klass(10 * GiB)], device="cpu", device_memory=None, communicators=3)
    assert v["margin"]["total"] == GiB  # 10 % of the peak


def test_the_report_opens_with_the_verdict_and_prints_classes_with_equal_rows_once():
    """A transformer at D=4 with uneven FSDP shards: many classes, few distinct memory rows. Every class is in exactly
    one row, the row's rank count is its classes' sum, and the verdict names the class with the largest peak."""
    job = plan_job(transformer, Plan(), JobMesh.resolve(24, 6, 4, 1), InputSpec((2, 40), torch.int64, (1,)),
                   device_memory=80 * GiB)
    lines = job.table().splitlines()
    assert lines[0] == job.verdict["line"] and lines[0].startswith("verdict: FITS in 80.0 GiB")
    assert "  " + job.verdict["margin_line"] in lines
    worst = max(range(len(job.classes)), key=lambda i: job.classes[i].memory["peak"])
    assert job.verdict["peak"] == job.classes[worst].memory["peak"]
    start = next(i for i, line in enumerate(lines) if line.startswith("memory per rank")) + 2
    rows = [line.split() for line in lines[start:lines.index("", start)]]
    seen = [int(i) for row in rows for part in row[0].split(",")
            for i in range(int(part.split("-")[0]), int(part.split("-")[-1]) + 1)]
    assert sorted(seen) == list(range(len(job.classes)))
    assert len(rows) < len(job.classes)
    for row in rows:
        members = [i for part in row[0].split(",") for i in range(int(part.split("-")[0]), int(part.split("-")[-1]) + 1)]
        assert int(row[1]) == sum(job.classes[i].count for i in members)
    assert sum(int(row[1]) for row in rows) == 24


def test_the_command_line_takes_a_fixed_margin_and_reports_the_verdict_in_json(capsys):
    from mesh3d.cli import main

    args = ["plan", "plan_models:conv_stack", "--world", "4", "--domain", "2", "--input", "1x2x32x16",
            "--device-memory", "1KiB", "--margin", "1GiB", "--json"]
    assert main(args) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["verdict"]["status"] == "does not fit" and doc["verdict"]["margin"] == {"fixed": GiB, "total": GiB}
    assert any("cuDNN" in a for a in doc["assumptions"])
    with pytest.raises(SystemExit) as refused:  # the parser's own refusal, before anything is planned
        main(args[:-1] + ["--margin", "lots"])
    assert refused.value.code == 2 and "not an amount of memory" in capsys.readouterr().err


def test_a_cpu_plan_states_its_kernels_and_a_plan_without_collectives_needs_no_nccl():
    job = plan_job(lambda: ConvStack(width=4, depth=1), Plan(batch=None), JobMesh.resolve(1, 1, 1, 1),
                   InputSpec((1, 2, 16, 16)), device="cuda")
    assert job.verdict["margin"]["nccl buffers"] == 0 and job.verdict["margin"]["cuda context and libraries"] == GiB
    cpu = plan_job(lambda: ConvStack(width=4, depth=1), Plan(batch=None), JobMesh.resolve(1, 1, 1, 1),
                   InputSpec((1, 2, 16, 16)), device="cpu")
    assert any("oneDNN" in a for a in cpu.assumptions)
