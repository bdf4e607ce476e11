"""Simulate independent domain classes in forked processes, one share each: ``mesh3d plan`` on every core.

Each class's simulation is a pure function of its domain index (meta tensors, no process group), so a child
forked after the first simulation (which also checks that splicing is exact) runs its share and sends back the
plain ``RankSim`` records; the downsampling probe that keys the classes runs in a child beside that first
simulation. Any failure in a child is raised here; a child that dies leaves its work to this process: the figures
never depend on the split, only the time does.

Usage: ``sims = run_each(sim.run, [3, 5, 7, 9], workers=2)``; ``later = Forked(fn); ...; later.result()``
"""

from __future__ import annotations

import gc
import os
# NOTE: pickle carries values only between this process and the child it forked, through a pipe only the two hold:
# never a file, never a checkpoint (those stay pickle-free).
import pickle
import signal
import sys
from collections.abc import Callable, Sequence
from typing import Generic, TypeVar

import torch

from mesh3d.planner.simulate import RankSim

__all__ = ["Forked", "default_workers", "run_each"]

T = TypeVar("T")


def default_workers() -> int:
    """The cores this process may run on, at most 4 (the classes of one job seldom keep more busy)."""
    try:
        return max(1, min(4, len(os.sched_getaffinity(0))))
    except AttributeError:  # NOTE: no affinity call (macOS): os.cpu_count is the next best guess
        return max(1, min(4, os.cpu_count() or 1))


class Forked(Generic[T]):
    """``fn()`` computed in a forked child while this process goes on; ``result()`` is its value.

    The child's error is raised by ``result()`` as its own type; a child that died, or whose value or error cannot
    be pickled, has ``fn`` run here instead, so the value never depends on the fork. Where the OS cannot fork, ``fn``
    runs at ``result()``. ``cancel()`` kills and reaps the child (an error here must not leave it behind).

    Usage: ``later = Forked(lambda: probe(model)); ...; value = later.result()``
    """

    def __init__(self, fn: Callable[[], T]) -> None:
        self._fn = fn
        self._child: tuple[int, int] | None = None
        if not hasattr(os, "fork"):
            return
        sys.stdout.flush()
        sys.stderr.flush()
        read, write = os.pipe()
        # NOTE: the child never collects this process's garbage: a gloo process group left in a reference cycle (a
        # job's or a notebook's earlier run) waits in its destructor on threads a forked child does not have, and
        # the child, collecting it, hung for good (seen in a whole test run: `mesh3d plan` in a process that had
        # used gloo). Frozen, what exists now is left out of the child's collections; the parent thaws at once.
        parent = os.getpid()
        gc.freeze()
        try:
            pid = os.fork()
        finally:
            if os.getpid() == parent:
                gc.unfreeze()
        if pid == 0:  # pragma: no cover - the child ends in os._exit
            os.close(read)
            _child(write, fn)
        os.close(write)
        self._child = (read, pid)

    def result(self) -> T:
        got: object = None
        if self._child is not None:
            read, pid = self._child
            self._child = None
            with os.fdopen(read, "rb") as inp:
                data = inp.read()
            _, status = os.waitpid(pid, 0)
            if data and os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0:
                got = pickle.loads(data)  # noqa: S301 - our own child's value, through a pipe only we hold
        if isinstance(got, _Failed):
            raise got.error
        return got.value if isinstance(got, _Done) else self._fn()

    def cancel(self) -> None:
        if self._child is not None:
            read, pid = self._child
            self._child = None
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            os.close(read)


class _Done:
    def __init__(self, value: object) -> None:
        self.value = value


class _Failed:
    def __init__(self, error: BaseException) -> None:
        self.error = error


def _child(write: int, fn: Callable[[], object]) -> None:
    """In the forked child: compute, send the value (or the error), and leave without cleanup."""
    try:
        # NOTE: one intra-op thread, so nothing in the child enters an OpenMP pool the parent had started
        torch.set_num_threads(1)
        payload: object = _Done(fn())
    except BaseException as err:  # noqa: BLE001 - handed to the parent, which raises it
        payload = _Failed(err)
    try:
        data = pickle.dumps(payload)
    except Exception:  # noqa: BLE001 - a value or error that cannot be pickled: the parent computes it itself
        data = b""
    with os.fdopen(write, "wb") as out:
        out.write(data)
    os._exit(0)


def run_each(run: Callable[[int], RankSim], indices: Sequence[int], workers: int) -> dict[int, RankSim]:
    """``{i: run(i)}`` for every index, the last ``workers - 1`` shares in forked children (``Forked``).

    Usage: ``sims = run_each(sim.run, [3, 5, 7, 9], workers=2)``
    """
    if workers <= 1 or len(indices) < 2:
        return {i: run(i) for i in indices}
    shares = [list(indices[k::workers]) for k in range(min(workers, len(indices)))]
    children = [Forked(lambda share=share: {i: run(i) for i in share}) for share in shares[1:]]
    try:
        done = {i: run(i) for i in shares[0]}
    except BaseException:
        for child in children:  # NOTE: this process's own error wins; no child is left behind
            child.cancel()
        raise
    results: list[dict[int, RankSim] | BaseException] = []
    for child in children:
        try:
            results.append(child.result())
        except BaseException as err:  # noqa: BLE001 - every child is reaped before the first error is raised
            results.append(err)
    for got in results:
        if isinstance(got, BaseException):
            raise got
        done.update(got)
    return {i: done[i] for i in indices}
