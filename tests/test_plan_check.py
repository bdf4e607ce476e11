"""``mesh3d check``: a zoo model is reported equal to one process on the default uneven meshes (and its checkpoint
loads bitwise on every other mesh); a planted wrong rule is reported DIFFERENT; refused ops are named with their
fix; the command line launches its local ranks once for every mesh."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from plan_models import Flips

from mesh3d.cli import main
from mesh3d.domain.dispatch.registry import RULES
from mesh3d.domain.dispatch.step import Step
from mesh3d import Plan
from mesh3d.planner import InputSpec, JobMesh, plan_job
from mesh3d.planner.exercise import exercise_of, perturb_zero_parameters, zero_at_init
from mesh3d.planner.spec import load_spec
from mesh3d.planner.check import CheckSpec, check_on_rank
from mesh3d.planner.check_run import check_model, uneven_sizes


def _pool(ranks, body=None):
    return lambda world, fn, *args: ranks.run(world, body or fn, *args, timeout=300)


def test_uneven_sizes_keep_the_model_s_granularity():
    assert uneven_sizes(32, 2, 4) == (20, 12) and uneven_sizes(16, 3, 4) == (8, 4, 4) and uneven_sizes(17, 2, 1) == (9, 8)
    assert uneven_sizes(8, 3, 4) == (8, 0, 0)  # fewer windows than ranks: empty shards


def test_a_zoo_model_is_reported_equal_on_the_default_meshes(ranks):
    pytest.importorskip("monai")
    from zoo.models import ZOO

    entry = ZOO["monai.UNet"]
    report = check_model(CheckSpec(entry.build, None, InputSpec(entry.shape, dims=(entry.dim,))), runner=_pool(ranks))
    print(report.table())
    assert [m.mesh for m in report.meshes] == ["1,2,1", "1,3,1", "2,2,1"]
    assert report.equal and all(m.verdict == "equal" for m in report.meshes)
    assert all(len(m.diffs) == 2 + len(list(entry.build().parameters())) for m in report.meshes)
    assert report.meshes[0].sizes == [[12, 4]] and report.meshes[1].sizes == [[8, 4, 4]]  # uneven, at its factor 4
    assert report.meshes[0].checkpoint.startswith("saved")
    assert all(m.checkpoint.startswith("loaded bitwise") for m in report.meshes[1:])


_ORIGINAL_CONV2D = RULES.get(F.conv2d)


def _halo_free_conv2d(input, weight, bias=None, stride=1, padding=0, dilation=1, groups=1):
    """A wrong rule: stride-1 convolutions computed on the local rows alone, as if the neighbours' rows were zeros."""
    if stride not in (1, (1, 1)):
        return _ORIGINAL_CONV2D(input, weight, bias, stride, padding, dilation, groups)
    return Step(lambda x: F.conv2d(x, weight, bias, stride, padding, dilation, groups), (input,), out=input.spec)


def _check_with_a_wrong_rule(*args):
    RULES.register(F.conv2d, _halo_free_conv2d, override=True)
    try:
        return check_on_rank(*args)
    finally:
        RULES.register(F.conv2d, _ORIGINAL_CONV2D, override=True)


def test_a_planted_wrong_rule_is_reported_different(ranks):
    spec = CheckSpec("plan_models:conv_stack", None, InputSpec((1, 2, 16, 8)))
    report = check_model(spec, [JobMesh(1, (2,), 1)], runner=_pool(ranks, _check_with_a_wrong_rule))
    print(report.table())
    mesh = report.meshes[0]
    assert mesh.verdict == "DIFFERENT" and not report.equal
    assert mesh.diffs["output"] > 1e-3 and mesh.diffs["grad stem.weight"] > 1e-3
    assert "NOT equal" in report.table()


def test_ops_that_would_be_refused_are_named_with_their_fix_before_anything_runs():
    def no_ranks(*_):
        raise AssertionError("a mesh with refused ops must not start ranks")

    report = check_model(CheckSpec(Flips, None, InputSpec((1, 2, 8, 8))), [JobMesh(1, (2,), 1)], runner=no_ranks)
    mesh = report.meshes[0]
    assert mesh.verdict == "refused" and set(mesh.refused) == {"torch.renorm", "torch.msort"}
    assert "Call .full_tensor() first, or register a rule" in report.table()


def test_the_command_line_checks_on_local_ranks_started_once(capsys):
    code = main(["check", "plan_models:conv_stack", "--input", "1x2x16x8", "--meshes", "1,2,1", "2,1,1", "--json"])
    report = json.loads(capsys.readouterr().out)
    assert code == 0 and report["equal"] and report["passed"] and not report["degenerate"], report
    assert report["exercised"]["zero_grads"] == [] and not report["exercised"]["is_input"]   # a healthy model
    assert [m["checkpoint"].split(" (")[0] for m in report["meshes"]] == ["saved", "loaded bitwise"]
    with pytest.raises(SystemExit) as refused:   # the parser refuses it, before anything is imported
        main(["check", "plan_models:conv_stack", "--input", "1x2x16x8", "--meshes", "pipe=2"])
    assert refused.value.code == 2 and "unknown axis 'pipe'" in capsys.readouterr().err


def test_a_rank_that_fails_is_reported_not_raised(ranks):
    spec = CheckSpec("plan_models:conv_stack", None, InputSpec((1, 2, 16, 8), dtype=torch.float32))
    results = ranks.run(2, check_on_rank, spec, JobMesh(1, (2,), 1), ((9, 8),), None, None, 30.0)
    assert all(r["status"] == "error" and "sum to 17 but the sharded dim has length 16" in r["error"] for r in results)


#: examples/weather.py's SFNO, by path: its head is zero-initialised, so it starts as the identity (x + 0)
_WEATHER = str(Path(__file__).resolve().parents[1] / "examples" / "weather.py") + ":model"


def test_a_check_that_exercises_nothing_is_degenerate_and_fails_until_the_zero_head_is_perturbed(ranks):
    # on the example's own 2x2 (lat x lon) layout: its SHT's pencils (and the move back to blocks) plan and run
    spec = CheckSpec(_WEATHER, None, InputSpec((1, 4, 33, 64)))
    report = check_model(spec, [JobMesh(1, (2, 2), 1)], runner=_pool(ranks))
    print(report.table())
    assert report.equal and report.degenerate and not report.passed
    found = report.exercised
    assert found.is_input and found.zero_at_init == ["head.weight", "head.bias"]
    assert len(found.zero_grads) == found.parameters - 2 and "head.weight" not in found.zero_grads
    table = report.table()
    assert "WARNING: this check exercises little of the model" in table and "--perturb-zero-init" in table
    assert "DEGENERATE" in table
    row = next(line for line in table.splitlines() if line.strip().startswith("1,2x2,1"))
    assert row.endswith("equal, DEGENERATE"), table   # no mesh row says plain "equal" above the verdict
    accepted = check_model(spec, [JobMesh(1, (2, 2), 1)], runner=_pool(ranks), allow_degenerate=True)
    assert accepted.degenerate and accepted.passed
    assert "equal (accepted degenerate)" in accepted.table()

    perturbed = check_model(CheckSpec(_WEATHER, None, InputSpec((1, 4, 33, 64)), perturb_zero_init=True),
                            [JobMesh(1, (2,), 1)], runner=_pool(ranks))
    print(perturbed.table())
    assert perturbed.passed and not perturbed.degenerate
    assert perturbed.exercised.zero_grads == [] and perturbed.exercised.perturbed == ["head.weight", "head.bias"]
    assert all(v > 0 for k, v in perturbed.meshes[0].diffs.items() if k.startswith("grad "))  # compared, not 0 vs 0


def test_the_weather_example_plans_on_its_own_2x2_layout():
    job = plan_job(load_spec(_WEATHER), Plan(batch="fsdp"), JobMesh.resolve(8, 2, (2, 2), 1), InputSpec((1, 4, 33, 64)))
    assert not job.refused and job.classes


class _Ignores(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(3))

    def forward(self, x):
        return self.w * 2


def test_exercise_finds_an_output_that_ignores_the_input_and_zero_gradients():
    model = _Ignores().double()
    x, other = torch.randn(3, dtype=torch.float64), torch.randn(3, dtype=torch.float64)
    y = model(x)
    y.sum().backward()
    found = exercise_of(model, x, y, model, other, [], [])
    assert found.ignores_input and found.degenerate and found.zero_grads == []
    healthy = torch.nn.Linear(3, 3).double()
    y = healthy(x)
    (y * torch.randn(3, dtype=torch.float64)).sum().backward()
    assert not exercise_of(healthy, x, y, healthy, other, [], []).degenerate
    zero = torch.nn.Linear(4, 2)
    torch.nn.init.zeros_(zero.weight)
    assert zero_at_init(zero) == ["weight"] and zero_at_init(torch.nn.Linear(2, 2)) == []
    assert perturb_zero_parameters(zero) == ["weight"] and zero.weight.std() > 0.1


def test_a_model_file_importing_its_sibling_loads_as_python_would_run_it(tmp_path, monkeypatch):
    """``path/file.py:factory`` sees the file's own folder on the path, as ``python path/file.py`` does
    (examples/meshgraphnet.py imports examples/_runs.py: its documented ``mesh3d check`` failed without it)."""
    import sys

    monkeypatch.setattr(sys, "path", list(sys.path))  # what load_spec adds goes with the test
    folder = tmp_path / "models"
    folder.mkdir()
    (folder / "_sibling_helpers.py").write_text("WIDTH = 5\n")
    (folder / "net.py").write_text("import torch\nfrom _sibling_helpers import WIDTH\n\n\n"
                                   "def make():\n    return torch.nn.Linear(WIDTH, 2)\n")
    monkeypatch.chdir(tmp_path)
    assert load_spec("models/net.py:make")().in_features == 5
