"""Starting real launchers from tests: a clean environment, and a retry when a rendezvous port was taken.

Usage::

    out = run(["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4", "examples/x.py"])
    assert out.returncode == 0, out.stderr

    def start(port):                       # processes started by hand (SLURM-style), one port for all
        return [([sys.executable, "job.py"], clean_env(MASTER_PORT=str(port), SLURM_PROCID=str(r))) for r in range(2)]
    for done in run_on_free_port(start):
        assert done.returncode == 0, done.stderr

Where one node will do, let torchrun pick the port (``--standalone``: its store binds port 0).
Where a port must be chosen before the processes start (SLURM variables, Lightning's own launcher,
``slurm_job.py --simulate``), another process may bind it between the choice and the bind: the
rank that hosts the store then fails with EADDRINUSE and the others wait for a store that never
comes. ``run_on_free_port`` sees that in the output, stops every process it started and starts
them again on another port (at most ``ATTEMPTS`` times).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

#: How often a launch is tried when its port was taken meanwhile.
ATTEMPTS = 3
#: What the store's server prints when its port is taken (torch's DistNetworkError names the errno).
PORT_TAKEN = "EADDRINUSE"
#: Seconds an attempt may take before it counts as hung (a bound on a hang, not a speed limit).
DEFAULT_TIMEOUT_S = 300.0
_POLL_S = 0.2

#: Variables of an enclosing launcher that must not leak into the launches a test starts.
_LAUNCHER_VARS = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"}


def clean_env(**extra: str) -> dict[str, str]:
    """This environment without any launcher's variables, one thread per process, mesh3d importable."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "TORCHELASTIC_")) and k not in _LAUNCHER_VARS}
    env.update({"OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), **extra})  # PYTHONPATH may be extended
    return env


def free_port() -> int:
    """A port that was free a moment ago (another process may take it before ours binds it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_on_free_port(start: Callable[[int], list[tuple[list[str], dict[str, str]]]],
                     timeout: float = DEFAULT_TIMEOUT_S) -> list[subprocess.CompletedProcess]:
    """Start the processes ``start(port)`` describes (argv, env) and wait for all; one result per process.

    Started again on another port when one of them says its port was taken (EADDRINUSE). A process still
    running after ``timeout`` seconds (a hang) is killed with its children and the test fails, showing the output.
    """
    for _ in range(ATTEMPTS):
        done, port_taken = _attempt(start(free_port()), timeout)
        if not port_taken:
            return done
    return done


def run(args: list[str], timeout: float = DEFAULT_TIMEOUT_S, **env: str) -> subprocess.CompletedProcess:
    """``python *args`` from the repository root in a clean environment plus ``env``; started again on EADDRINUSE.

    For commands that choose a port themselves (Lightning's launcher, ``slurm_job.py --simulate``): a port
    taken meanwhile makes them fail the same way, and a new attempt chooses another.
    """
    return run_on_free_port(lambda _port: [([sys.executable, *args], clean_env(**env))], timeout)[0]


def _attempt(specs: list[tuple[list[str], dict[str, str]]],
             timeout: float) -> tuple[list[subprocess.CompletedProcess], bool]:
    """Run the processes to the end; stop them all as soon as any says its port was taken (then True)."""
    with tempfile.TemporaryDirectory(prefix="mesh3d-launch-") as logs:
        procs, paths = [], []
        for i, (argv, env) in enumerate(specs):
            out, err = os.path.join(logs, f"{i}.out"), os.path.join(logs, f"{i}.err")
            paths.append((out, err))
            with open(out, "w") as out_file, open(err, "w") as err_file:
                # Its own process group: a launcher and the workers it started can be stopped together.
                procs.append(subprocess.Popen(argv, env=env, cwd=ROOT, stdout=out_file, stderr=err_file,
                                              start_new_session=True))
        deadline = time.monotonic() + timeout
        port_taken = hung = False
        while any(p.poll() is None for p in procs):
            # NOTE: the rank that hosts the store fails at once; the others would wait for it until their
            # own timeout (10 minutes), and a launcher waits for its workers: stop everything now.
            port_taken = any(PORT_TAKEN in _read(out) + _read(err) for out, err in paths)
            hung = time.monotonic() > deadline
            if port_taken or hung:
                for p in procs:
                    if p.poll() is None:
                        os.killpg(p.pid, signal.SIGKILL)
                break
            time.sleep(_POLL_S)
        for p in procs:
            p.wait()
        done = [subprocess.CompletedProcess(p.args, p.returncode, _read(out), _read(err))
                for p, (out, err) in zip(procs, paths)]
    if hung:
        raise AssertionError(f"the launch did not finish within {timeout} s (a hang); each process's output:\n" +
                             "\n".join(f"--- {d.args}\n{d.stdout[-3000:]}\n{d.stderr[-3000:]}" for d in done))
    return done, port_taken or any(d.returncode != 0 and PORT_TAKEN in d.stdout + d.stderr for d in done)


def _read(path: str) -> str:
    with open(path, errors="replace") as f:
        return f.read()
