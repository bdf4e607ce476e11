"""The documentation, run as written (tests/doc_blocks.py says how blocks are found and marked).

* Every ``python`` block of README.md and docs/ runs in a world of one, or on the ranks its marker asks for, on the
  rank pool, in a scratch directory; a block that is not self-contained says why in a marker in the Markdown source.
* Every ``mesh3d`` command of their shell blocks (``mesh3d plan``/``check`` on the examples, ``mesh3d ckpt`` on a
  checkpoint saved here as ``ckpt/step-100`` and ``ckpt/step-1000``, ``mesh3d info``) runs, optional ``[arguments]``
  left out and given; where the page shows its output, the first line and the verdict are in what it prints. They
  call ``mesh3d.cli.main``, the function the console script runs, in this process (a subprocess per command spent
  about 3 s importing torch); the installed console script itself runs ``mesh3d info``. Usage lines with placeholders
  (``MODULE:FACTORY``) are skipped.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from unittest import mock

import pytest
import torch

from doc_blocks import ROOT, SHELL, doc_blocks, is_synopsis, stray_markers, variants
from launch_helpers import clean_env

BLOCKS = doc_blocks()
PYTHON = [b for b in BLOCKS if b.lang == "python" and b.not_run is None]


def _distinct_commands() -> list[tuple]:
    """Each documented command once (README's ``mesh3d check`` line is docs/plan.md's too), where a page shows its
    output if one does."""
    found: dict[str, tuple] = {}
    for b in BLOCKS:
        if b.lang in SHELL and b.not_run is None:
            for command, output in b.commands():
                key = " ".join(command.split())
                if not is_synopsis(command) and (key not in found or output and not found[key][2]):
                    found[key] = (b, command, output)
    return list(found.values())


COMMANDS = _distinct_commands()
#: The console script ``pip install`` put beside this interpreter (the venv's ``bin/``; CI installs the checkout).
CONSOLE_SCRIPT = Path(sys.executable).with_name("mesh3d")



def test_doc_markers_are_well_formed_and_every_skipped_block_says_why():
    assert stray_markers() == []
    for block in BLOCKS:
        if block.not_run is not None:
            assert len(block.not_run.split()) >= 3, (block.where, block.not_run)
    assert len(PYTHON) >= 4, [b.where for b in PYTHON]                 # the runner finds blocks at all
    assert {b.ranks for b in PYTHON} >= {1, 4, 8}, [(b.where, b.ranks) for b in PYTHON]


def _run_block(code: str, where: str, workdir: str) -> str:
    os.chdir(workdir)  # the pool puts the working directory back after the body
    exec(compile(code, where, "exec"), {"__name__": "__main__"})
    return "ok"


@pytest.mark.parametrize("block", PYTHON, ids=[b.where for b in PYTHON])
def test_python_block_runs_as_written(ranks, tmp_path, block):
    assert ranks.run(block.ranks, _run_block, block.text, block.where, str(tmp_path), timeout=300) == ["ok"] * block.ranks


def _save_checkpoints(root: str) -> None:
    """A small FSDP model's checkpoint after one step, saved on 2 ranks as the docs' ``ckpt/step-100`` and 1000."""
    from torch import nn

    from mesh3d import DistributedManager, Plan, checkpoint, parallelize

    DistributedManager.initialize(batch=2, domain=1, model=1)
    torch.manual_seed(0)
    model = parallelize(nn.Sequential(nn.Linear(6, 10), nn.ReLU(), nn.Linear(10, 3)), Plan(batch="fsdp"))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(4, 6)).square().mean().backward()
    opt.step()
    for step in (100, 1000):
        checkpoint.save(os.path.join(root, "ckpt", f"step-{step}"), model, opt, step=step)


# NOTE: session, not module: the suite runs shuffled across files, and pytest ends a module's fixtures whenever the
# next test is another file's (the checkpoints were saved again for nearly every documented command).
@pytest.fixture(scope="session")
def workdir(ranks, tmp_path_factory) -> Path:
    """A directory where the documented relative paths exist: ``examples/`` (a link to the checkout's) and
    ``ckpt/step-100``, ``ckpt/step-1000``."""
    root = tmp_path_factory.mktemp("docs-run")
    (root / "examples").symlink_to(ROOT / "examples")
    ranks.run(2, _save_checkpoints, str(root), timeout=120)
    return root


def _normalized(line: str) -> str:
    """A printed line with its timings left out (``..., 2.0 s``) and spaces collapsed."""
    return re.sub(r"\s+", " ", re.sub(r"\d+(\.\d+)? s\b", "<t> s", line)).strip()


def _in_process(argv: list[str], workdir: Path) -> tuple[int, str, str]:
    """``mesh3d.cli.main(argv[1:])`` in ``workdir``: its exit status and what it printed (``mesh3d check``'s ranks fork
    from this process's forkserver, the rank pool's). ``mesh3d plan`` simulates its domain classes in this process:
    forking pytest's (tests/README.md: its threads may hold locks) hung a whole run once (tests/test_plan_fanout.py
    forks on a rank)."""
    from mesh3d.cli import main
    from mesh3d.planner import cli as plan_cli

    out, err, cwd = io.StringIO(), io.StringIO(), os.getcwd()
    os.chdir(workdir)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), \
                mock.patch.object(plan_cli, "default_workers", lambda: 1):
            try:
                code = main(argv[1:])
            except SystemExit as exc:  # argparse's exit for a bad argument
                code = exc.code if isinstance(exc.code, int) else 1
    finally:
        os.chdir(cwd)
    return code, out.getvalue(), err.getvalue()


@pytest.mark.parametrize(("block", "command", "output"), COMMANDS,
                         ids=[f"{b.where}:{' '.join(c.split()[:3])}" for b, c, _ in COMMANDS])
def test_documented_command_runs(workdir, block, command, output):
    for argv in variants(command):
        shutil.rmtree(workdir / "export", ignore_errors=True)  # coalesce writes a new directory each time
        code, stdout, stderr = _in_process(argv, workdir)
        assert code == 0, (block.where, argv, stdout[-3000:], stderr[-3000:])
        printed = {_normalized(line) for line in stdout.splitlines()}
        shown = [line for line in output[:1] + [o for o in output if o.startswith("verdict:")] if line.strip()]
        for line in shown:
            assert _normalized(line) in printed, (block.where, argv, line, stdout[-3000:])


def test_the_installed_console_script_runs_a_documented_command(workdir):
    assert CONSOLE_SCRIPT.exists(), f"no console script at {CONSOLE_SCRIPT}: install the checkout (scripts/test.sh does)"
    assert "mesh3d info" in {" ".join(c.split()) for _, c, _ in COMMANDS}
    done = subprocess.run([str(CONSOLE_SCRIPT), "info"], cwd=workdir, env=clean_env(), capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0 and "torch" in done.stdout, (done.stdout[-3000:], done.stderr[-3000:])
