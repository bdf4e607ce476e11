"""The ``mesh3d`` console script."""

from __future__ import annotations

import subprocess
import sys

import pytest

import mesh3d
from launch_helpers import clean_env
from mesh3d.cli import environment_report, main


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

    from mesh3d.cli import TESTED_TORCH

    line = environment_report()["tested torch"]
    assert line.startswith(f"{TESTED_TORCH[0]} to {TESTED_TORCH[1]} (")
    assert "inside" in line  # the suite runs on a torch it claims
    pyproject = (Path(__file__).resolve().parents[1] / "pyproject.toml").read_text()
    floor = re.search(r'"torch>=([0-9.]+)"', pyproject).group(1)
    assert TESTED_TORCH[0].startswith(floor)
    monkeypatch.setattr(torch, "__version__", "2.1.0")
    assert "OUTSIDE" in environment_report()["tested torch"]
