"""scripts/env.sh (sourced by the README's two commands, scripts/demo.sh and scripts/test.sh, under
``set -euo pipefail``) against a stand-in ``python`` whose ``-m pip`` prints what we choose and takes as long as we
choose: no network, seconds. The stand-in writes its pid and what it was asked to install, so the tests see whether
an install ran, finished, or was left behind."""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

#: A venv's python: ``-m pip install ...`` prints $PIP_SAYS, sleeps $PIP_SLEEPS and exits $PIP_EXIT; ``-c CODE`` (the
#: import check) succeeds.
STAND_IN = """#!/usr/bin/env bash
if [ "$1" = -m ] && [ "$2" = pip ]; then
  echo $$ > "$STAND_IN_DIR/pip.pid"
  echo "$@" >> "$STAND_IN_DIR/pip.calls"
  printf '%b' "${PIP_SAYS:-}"
  sleep "${PIP_SLEEPS:-0}"
  exit "${PIP_EXIT:-0}"
fi
exit 0
"""


def _venv(tmp_path: Path) -> Path:
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    python = venv / "bin" / "python"
    python.write_text(STAND_IN)
    python.chmod(python.stat().st_mode | stat.S_IXUSR)
    return venv


def _env(tmp_path: Path, venv: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MESH3D_", "PIP_"))}
    env.update(MESH3D_VENV=str(venv), STAND_IN_DIR=str(tmp_path), MESH3D_PROGRESS_EVERY="1", **extra)
    return env


def _source(who: str, env: dict[str, str], **kw) -> subprocess.Popen:
    """``source scripts/env.sh`` as demo.sh (``who="demo"``) or test.sh does, under ``set -euo pipefail``."""
    script = f'set -euo pipefail; MESH3D_FOR={who}; source "{ROOT}/scripts/env.sh"; echo "env.sh done"'
    return subprocess.Popen(["bash", "-c", script], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, **kw)


def _finish(proc: subprocess.Popen) -> tuple[int, str]:
    out, err = proc.communicate(timeout=60)
    return proc.returncode, out + err


def _markers(venv: Path) -> list[str]:
    path = venv / ".mesh3d-installed"
    return path.read_text().split() if path.exists() else []


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.parametrize("says", ["Requirement already satisfied: torch==2.13.0\n", ""])
def test_progress_lines_while_pip_prints_nothing_the_loop_matches(tmp_path, says):
    """The bug of issue 62: grep finding no "Collecting ..." line yet ended the script silently under pipefail (the
    first progress line came 15 s in, so the 15 s loop died every time pip was slower than that)."""
    venv = _venv(tmp_path)
    code, out = _finish(_source("test", _env(tmp_path, venv, PIP_SAYS=says, PIP_SLEEPS="3")))
    assert code == 0, out
    assert "env.sh done" in out and "mesh3d: installing... " in out and "mesh3d: installed in" in out, out
    assert len(_markers(venv)) == 1


def test_the_readme_commands_in_either_order_install_once_each(tmp_path):
    """demo then tests: the test set is installed on top; tests then demo: the demo finds the test set, which holds
    its own, and installs nothing; a rerun installs nothing."""
    first, second = _venv(tmp_path / "a"), _venv(tmp_path / "b")
    for venv, order in ((first, ("demo", "test")), (second, ("test", "demo"))):
        for who in order:
            code, out = _finish(_source(who, _env(venv.parent, venv, PIP_SAYS="Collecting torch\n")))
            assert code == 0, out
        calls = (venv.parent / "pip.calls").read_text().splitlines()
        # the test set adds torch-harmonics without its requirements, in a second pip call of its own
        no_deps = [c for c in calls if "--no-deps" in c]
        assert len(calls) == (3 if order[0] == "demo" else 2) and len(no_deps) == 1, calls
        assert no_deps[0].endswith("--no-deps torch-harmonics==0.9.3") and calls[-1] == no_deps[0], calls
        code, out = _finish(_source("test", _env(venv.parent, venv)))
        assert code == 0 and "installing" not in out, out
        assert len((venv.parent / "pip.calls").read_text().splitlines()) == len(calls)


def test_an_interrupted_install_leaves_no_pip_behind_and_the_next_run_completes(tmp_path):
    venv = _venv(tmp_path)
    proc = _source("test", _env(tmp_path, venv, PIP_SLEEPS="60"))
    pid_file = tmp_path / "pip.pid"
    deadline = time.monotonic() + 30
    while not pid_file.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    pip = int(pid_file.read_text())
    os.kill(proc.pid, signal.SIGINT)  # Ctrl-C reaches the script's shell
    code, out = _finish(proc)
    assert code != 0, out
    deadline = time.monotonic() + 10
    while _alive(pip) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(pip), "pip still running after its script was interrupted"
    assert _markers(venv) == []  # the install did not finish: the next run installs again
    code, out = _finish(_source("test", _env(tmp_path, venv)))
    assert code == 0 and "mesh3d: installed in" in out, out
    assert len(_markers(venv)) == 1


def test_a_failing_install_shows_pips_output_and_fails(tmp_path):
    venv = _venv(tmp_path)
    code, out = _finish(_source("test", _env(tmp_path, venv, PIP_SAYS="ERROR: No matching distribution found\n",
                                             PIP_EXIT="1")))
    assert code == 1 and "ERROR: No matching distribution found" in out and "installation into" in out, out
    assert _markers(venv) == []
