"""The ``mesh3d`` console script."""

from __future__ import annotations

import subprocess
import sys

import pytest

import mesh3d
from launch_helpers import clean_env
from mesh3d.cli import main
from mesh3d.environment import environment_report


def test_version(capsys):
    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0
    assert capsys.readouterr().out.strip() == f"mesh3d {mesh3d.__version__}"


def test_info_reports_torch_backends_and_launcher(capsys, monkeypatch):
    import torch

    for var in ("RANK", "WORLD_SIZE", "SLURM_PROCID", "SLURM_NTASKS"):
        monkeypatch.delenv(var, raising=False)
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert torch.__version__ in out and "gloo" in out and "none (rank 0 of 1" in out


def test_info_explains_a_misconfigured_launcher(monkeypatch):
    monkeypatch.setenv("RANK", "zero")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert "misconfigured: environment variable RANK='zero' is not an integer" in environment_report()["launcher"]


def test_console_script_entry_point_runs():
    out = subprocess.run([sys.executable, "-m", "mesh3d.cli", "--version"], env=clean_env(), capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0 and out.stdout.startswith("mesh3d ")


def test_no_command_prints_help(capsys):
    assert main([]) == 2
    assert "info" in capsys.readouterr().out


def test_info_prints_the_tested_torch_range_whose_floor_pyproject_declares(monkeypatch):
    import re
    from pathlib import Path

    import torch

    from mesh3d.environment import TESTED_TORCH

    line = environment_report()["tested torch"]
    assert line.startswith(f"{TESTED_TORCH[0]} to {TESTED_TORCH[1]} (")
    assert "inside" in line  # the suite runs on a torch it claims
    pyproject = (Path(__file__).resolve().parents[1] / "pyproject.toml").read_text()
    floor = re.search(r'"torch>=([0-9.]+)"', pyproject).group(1)
    assert TESTED_TORCH[0].startswith(floor)
    monkeypatch.setattr(torch, "__version__", "2.1.0")
    assert "OUTSIDE" in environment_report()["tested torch"]


def _fresh(*argv: str) -> subprocess.CompletedProcess:
    """The console script's code in a new interpreter, printing which heavy modules it imported."""
    code = ("import sys, runpy\nsys.argv = ['mesh3d', *sys.argv[1:]]\n"
            "try:\n    code = runpy.run_module('mesh3d.cli', run_name='__main__')\nexcept SystemExit as e:\n    code = e.code\n"
            "print('IMPORTED', *sorted(m for m in ('torch', 'torch._dynamo', 'torch._inductor', 'mesh3d.manager') "
            "if m in sys.modules), file=sys.stderr)\nsys.exit(code)")
    return subprocess.run([sys.executable, "-c", code, *argv], env=clean_env(), capture_output=True, text=True,
                          timeout=120)


def test_version_and_help_import_no_torch_and_info_no_compiler_stack():
    for argv in (["--version"], ["--help"], ["plan", "--help"], ["check", "--help"]):
        out = _fresh(*argv)
        assert out.returncode == 0, out.stderr
        assert out.stderr.strip().splitlines()[-1] == "IMPORTED", (argv, out.stderr)
    info = _fresh("info")
    assert info.returncode == 0 and "torch" in info.stdout
    assert info.stderr.strip().splitlines()[-1] == "IMPORTED torch", info.stderr   # no torch._dynamo, no manager


@pytest.mark.parametrize("argv, says", [
    (["plan", "nonexist.py:f", "--input", "1x1x8x8"], "'nonexist.py' does not exist"),
    (["plan", "nonexist_module_x:f", "--input", "1x1x8x8", "--world", "2"], "no module named 'nonexist_module_x'"),
    (["plan", "plan_models:nope", "--input", "1x1x8x8", "--world", "2"], "plan_models has no 'nope'; it has"),
    (["plan", "plan_models:conv_stack", "--input", "1xax8", "--world", "2"], "'1xax8' is not a shape"),
    (["plan", "plan_models:conv_stack", "--input", "1x2x16x8", "--world", "2", "--device-memory", "lots"],
     "'lots' is not an amount of memory"),
    (["check", "plan_models:conv_stack", "--input", "1x2x16x8", "--shard-dims", "9"], "out of range"),
    (["check", "plan_models:_LLAMA", "--input", "1x2x16x8"], "must name a function returning an nn.Module"),
    (["explain", "nonexist_module_x:f", "nonexist_module_x:p"], "no module named 'nonexist_module_x'"),
    (["ckpt", "inspect", "/nonexistent/ckpt"], "/nonexistent/ckpt"),
])
def test_a_bad_argument_is_one_line_not_a_traceback(argv, says, capsys):
    try:
        code = main(argv)                        # an exception would escape here (the console script's traceback)
    except SystemExit as done:                   # the parser's own refusal
        code = done.code
    lines = capsys.readouterr().err.strip().splitlines()
    assert code in (1, 2) and len(lines) == 1, lines
    assert lines[0].startswith(f"mesh3d {argv[0]}: error: ") and says in lines[0], lines[0]


@pytest.mark.parametrize("argv, says", [
    (["check", "plan_models:conv_stack", "--input", "1x3xfoo"], "argument --input: '1x3xfoo' is not a shape"),
    (["check", "plan_models:conv_stack"], "the following arguments are required: --input"),
    (["plan", "plan_models:conv_stack"], "give --input SHAPE"),
    (["plan", "plan_models:conv_stack", "--input", "1x1x8x8", "--domain", "2xq"], "'2xq' is not an axis size"),
    (["check", "plan_models:conv_stack", "--input", "1x1x8x8", "--meshes", "1,2"], "give three sizes"),
    (["check", "plan_models:conv_stack", "--input", "1x1x8x8", "--dtype", "flaot32"], "invalid choice: 'flaot32'"),
    (["forecast", "m.py:f", "ck", "ds", "--out", "o", "--init", "0", "--leads", "2"], "'m.py' does not exist"),
])
def test_arguments_are_checked_before_torch_or_the_model_is_imported(argv, says):
    """A typo answers at once (it took about 70 s on a loaded machine: torch and the model were imported first)."""
    out = _fresh(*argv)
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2 and lines[-1] == "IMPORTED", out.stderr     # no torch
    assert len(lines) == 2 and lines[0].startswith(f"mesh3d {argv[0]}: error: ") and says in lines[0], lines


def test_help_marks_the_required_arguments():
    out = _fresh("check", "--help")
    usage = " ".join(out.stdout.split("options:")[0].split())
    assert "--input SHAPE" in usage and "[--input SHAPE]" not in usage, usage


def test_a_rank_importing_the_manager_and_domain_loads_no_compiler_stack_and_no_dtensor():
    """Every rank, launcher and example imports these: Dynamo's Python half, the tracing stack (sympy) and DTensor took
    2.5 s of each such process (4.6-4.9 s against torch's own 2.1-2.3 s, a 2-core AMD EPYC, 2026-12-07). They load
    where they are used: a ``torch.compile``, FSDP2 or tensor parallelism, the checkpointer."""
    code = ("import sys\nfrom mesh3d import DistributedManager, domain\nDistributedManager.initialize(batch=1, domain=1)\n"
            "x = domain.shard(__import__('torch').ones(4, 3), dim=0)\nassert float((x * 2).sum()) == 24.0\n"
            "print('IMPORTED', *sorted(m for m in ('torch._dynamo', 'torch.distributed.tensor', 'sympy') "
            "if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], env=clean_env(), capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "IMPORTED", out.stdout


def test_a_domain_tensor_alive_at_exit_leaves_no_error_behind():
    """A script that ends with a domain tensor in a reference cycle (collected while the interpreter tears its modules
    down) and no ``shutdown()``: the process hooks came out with an import there, which printed "Exception ignored
    ... sys.meta_path is None" at the end of every such script and of every pytest worker (2026-12-07)."""
    code = ("import torch\nfrom mesh3d import DistributedManager, domain\nDistributedManager.initialize(batch=1, domain=1)\n"
            "class Holder: pass\nh = Holder()\nh.x, h.me = domain.shard(torch.ones(4, 3), dim=0), h\n"
            "print(float((h.x * 2).sum()))")
    out = subprocess.run([sys.executable, "-c", code], env=clean_env(), capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "24.0", (out.stdout, out.stderr)
    assert "Exception ignored" not in out.stderr and "Traceback" not in out.stderr, out.stderr
