"""What a test can leave behind in a process, and putting it back, so that no test depends on the order of the suite.

The pool's ranks run many test bodies each (``rankpool.worker``), and the pytest process runs the
single-process tests one after another (``conftest.py``): both capture the state once, clean, and
restore it after every test.

Usage::

    clean = ProcessState.capture(whole_process=True)   # once, before the first test (False: pytest's process)
    ...                                 # a test
    clean.restore()                     # as captured; raises if a test left what cannot be undone

What is restored: mesh3d's per-process state (a background save still being written, the manager
and its groups, the domain op journal, open traffic counters, rules registered by a test, DTensor's
caches), torch's global settings (default dtype and device, grad and anomaly mode, deterministic
algorithms, float32 matmul precision, intra-op threads, dynamo's compiled code, the RNG seed), the
RNG seeds of ``random`` and NumPy, the ``mesh3d.*`` loggers, and with ``whole_process=True`` (the
pool's ranks; in its own process pytest owns these: its log capture, monkeypatch, warnings capture)
every other logger, the environment variables, the working directory, ``sys.path`` and the warnings
filters.
"""

from __future__ import annotations

import logging
import os
import random
import sys
import time
import warnings
from dataclasses import dataclass, field

import torch

from mesh3d import DistributedManager
from mesh3d.meta_builds import forget_device_blind_caches
from mesh3d._torch_private import clear_dtensor_caches
from mesh3d.checkpoint.agree import AgreedPlans
from mesh3d.checkpoint.inflight import IN_FLIGHT
from mesh3d.domain.comm.divergence import JOURNAL
from mesh3d.domain.comm.exchange import TrafficCounter
from mesh3d.domain.dispatch.layout_registry import LAYOUTS

__all__ = ["ProcessState"]

#: Every test starts from this seed (a test that seeds nothing draws the same numbers in any order).
SEED = 0
#: Seconds a test's background save may still take to finish before the cleanup gives up (a hang bound).
_SAVE_WAIT_S = 120.0


@dataclass
class _LoggerState:
    level: int
    handlers: list
    propagate: bool
    disabled: bool

    @classmethod
    def of(cls, logger: logging.Logger) -> _LoggerState:
        return cls(logger.level, list(logger.handlers), logger.propagate, logger.disabled)

    def apply(self, logger: logging.Logger) -> None:
        if logger.level != self.level:  # NOTE: setLevel clears every logger's cache: only where it changed
            logger.setLevel(self.level)
        if logger.handlers != self.handlers:
            logger.handlers[:] = self.handlers
        logger.propagate, logger.disabled = self.propagate, self.disabled


@dataclass
class ProcessState:
    """A snapshot of the global state tests may change (see the module docstring)."""

    whole_process: bool
    num_threads: int
    float32_matmul_precision: str
    loggers: dict[str, _LoggerState]
    rules: dict[str, dict] = field(default_factory=dict)
    environ: dict[str, str] = field(default_factory=dict)
    cwd: str = ""
    sys_path: list[str] = field(default_factory=list)
    warning_filters: list = field(default_factory=list)

    @classmethod
    def capture(cls, whole_process: bool) -> ProcessState:
        manager = logging.Logger.manager
        loggers = {name: _LoggerState.of(lg) for name, lg in manager.loggerDict.items() if isinstance(lg, logging.Logger)}
        loggers[""] = _LoggerState.of(logging.getLogger())
        state = cls(whole_process, torch.get_num_threads(), torch.get_float32_matmul_precision(), loggers,
                    rules={name: table.snapshot() for name, table in _RULE_TABLES.items()})
        if whole_process:
            state.environ, state.cwd, state.sys_path = dict(os.environ), os.getcwd(), list(sys.path)
            state.warning_filters = list(warnings.filters)
        return state

    def restore(self) -> None:
        """Put everything back as captured; raise (after restoring the rest) if a test left a save unfinished."""
        problems = _finish_mesh3d(self.rules)
        _restore_torch(self.num_threads, self.float32_matmul_precision)
        random.seed(SEED)
        if "numpy" in sys.modules:
            sys.modules["numpy"].random.seed(SEED)
        self._restore_logging()
        if self.whole_process:
            os.environ.clear()
            os.environ.update(self.environ)
            os.chdir(self.cwd)
            sys.path[:] = self.sys_path
            warnings.resetwarnings()
            warnings.filters.extend(self.warning_filters)
        if problems:
            raise RuntimeError("a test left state that could not be reset: " + "; ".join(problems))

    def _restore_logging(self) -> None:
        manager = logging.Logger.manager
        for name, logger in list(manager.loggerDict.items()):
            ours = name == "mesh3d" or name.startswith("mesh3d.")
            if not isinstance(logger, logging.Logger) or not (ours or self.whole_process):
                continue
            if name in self.loggers:
                self.loggers[name].apply(logger)
            elif ours:  # made by a test: back to a plain child logger
                _LoggerState(logging.NOTSET, [], True, False).apply(logger)
        if self.whole_process:
            self.loggers[""].apply(logging.getLogger())


#: The op rule tables; a test may register (or override) a rule.
_RULE_TABLES = {table.name: table for table in LAYOUTS.tables()}


def _finish_mesh3d(rules: dict[str, dict]) -> list[str]:
    """Finish or forget what mesh3d keeps per process; what could not be finished, as problems."""
    problems = []
    # A background save the test did not wait for commits over the manager's groups: let it land first.
    handle, deadline = IN_FLIGHT.handle, time.monotonic() + _SAVE_WAIT_S
    while handle is not None and not handle.done() and time.monotonic() < deadline:
        time.sleep(0.01)
    if handle is not None and not handle.done():
        problems.append(f"the background save to {handle.path} was still being written after {_SAVE_WAIT_S:.0f} s")
    IN_FLIGHT.handle = None  # its outcome (even a failure) was the test's to see, not the next test's
    IN_FLIGHT.plans = AgreedPlans()
    DistributedManager.shutdown()
    JOURNAL.reset()
    TrafficCounter._active.clear()
    for name, table in _RULE_TABLES.items():
        table.restore(rules.get(name, {}))
    clear_dtensor_caches()
    forget_device_blind_caches()  # NOTE: a test that built a torch-harmonics model under torch.device("meta")
    return problems


def _restore_torch(num_threads: int, float32_matmul_precision: str) -> None:
    torch.set_default_dtype(torch.float32)
    torch.set_default_device(None)
    torch.set_grad_enabled(True)
    torch.autograd.set_detect_anomaly(False)
    torch.use_deterministic_algorithms(False)
    torch.set_float32_matmul_precision(float32_matmul_precision)
    if torch.get_num_threads() != num_threads:
        torch.set_num_threads(num_threads)
    if "torch._dynamo" in sys.modules:
        torch._dynamo.reset()
    torch.manual_seed(SEED)
