"""Shared pytest configuration: the multi-rank pool plugin (tests/rankpool), a clean process state around every
test, ``--shuffle SEED`` (or MESH3D_TEST_SHUFFLE=SEED) to run the suite in a shuffled order, and the hypothesis
profiles (HYPOTHESIS_PROFILE=ci, the default, or thorough) drawing from a seed that changes every run and is printed
in the header (``--hypothesis-seed SEED`` or MESH3D_HYPOTHESIS_SEED=SEED repeats a run's draws). See tests/README.md."""

from __future__ import annotations

import os
import random
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

from profiles import CI_EXAMPLES
from rankpool.state import ProcessState

pytest_plugins = ["rankpool.plugin", "durations"]

# ci: new examples every run (the run's seed, printed in the header), no deadline on two busy cores, no database.
settings.register_profile("ci", deadline=None, database=None, print_blob=True, max_examples=CI_EXAMPLES,
                          suppress_health_check=[HealthCheck.too_slow])
# thorough, by hand: as ci, with failures kept in .hypothesis/ and 10x the examples of every test.
settings.register_profile("thorough", deadline=None, print_blob=True, max_examples=10 * CI_EXAMPLES,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

# NOTE: every new c10d store connection (a process joining a group, torchrun's agent and workers) looks up its peer's
# name by reverse DNS, and the sandbox's resolver drops a query now and then: glibc then waits its default 5 s
# (mesh3d/faults/attach.py, CurrentWatch.connection). 1 s caps that wait for everything the suite starts; a test
# that asserts a duration would still fail at 1 s. Set before any process or resolver lookup exists.
os.environ.setdefault("RES_OPTIONS", "timeout:1 attempts:2")

SHUFFLE_ENV = "MESH3D_TEST_SHUFFLE"
HYPOTHESIS_SEED_ENV = "MESH3D_HYPOTHESIS_SEED"


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config: pytest.Config) -> None:
    """Give hypothesis this run's seed (before its plugin reads ``--hypothesis-seed``): the option's, else
    MESH3D_HYPOTHESIS_SEED's, else a new one. Every hypothesis test draws from it; the header prints it."""
    if config.getoption("hypothesis_seed", None) is None:
        config.option.hypothesis_seed = os.environ.get(HYPOTHESIS_SEED_ENV) or str(random.SystemRandom().getrandbits(31))
    # NOTE: pytest-xdist's workers (scripts/test.sh starts two) are started after this and inherit the environment:
    # every worker draws from the seed the header prints, not one of its own
    os.environ[HYPOTHESIS_SEED_ENV] = str(config.option.hypothesis_seed)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--shuffle", metavar="SEED", type=int, default=None,
                     help=f"run the tests in an order shuffled with SEED, across and within files (or set {SHUFFLE_ENV})")


def _shuffle_seed(config: pytest.Config) -> int | None:
    seed = config.getoption("--shuffle")
    if seed is None and os.environ.get(SHUFFLE_ENV):
        try:
            seed = int(os.environ[SHUFFLE_ENV])
        except ValueError:
            raise pytest.UsageError(f"{SHUFFLE_ENV}={os.environ[SHUFFLE_ENV]!r} must be an integer seed") from None
    return seed


def pytest_report_header(config: pytest.Config) -> str | None:
    seed = _shuffle_seed(config)
    profile = settings.get_current_profile_name()
    order = (f"shuffled with seed {seed} (--shuffle {seed} repeats it)" if seed is not None else "as collected") + \
        ", the tests of tests/heaviest.txt first"
    drawn = config.getoption("hypothesis_seed", None)
    return (f"mesh3d: test order {order}; hypothesis profile {profile!r}, seed {drawn} "
            f"(--hypothesis-seed {drawn} or {HYPOTHESIS_SEED_ENV}={drawn} repeats its draws)")


def _heaviest() -> frozenset[str]:
    """The node ids of tests/heaviest.txt (``scripts/suite_times.py`` writes it from a whole run)."""
    path = Path(__file__).with_name("heaviest.txt")
    if not path.exists():
        return frozenset()
    return frozenset(line for line in path.read_text().splitlines() if line and not line.startswith("#"))


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """With a seed, shuffle every collected test (files interleaved, and tests within each file); then the tests
    tests/heaviest.txt names go first, in that shuffled order.

    NOTE: two workers take tests from one order; a run whose last test is a 100 s example left the other worker idle
    that long. Heavy first, the run ends on short tests. Every order is still one that any test must pass in.
    """
    seed = _shuffle_seed(config)
    if seed is not None:
        random.Random(seed).shuffle(items)
    heavy = _heaviest()
    items.sort(key=lambda item: item.nodeid not in heavy)  # stable: each part keeps its order


@pytest.fixture(scope="session")
def _clean_process_state() -> ProcessState:
    state = ProcessState.capture(whole_process=False)
    state.restore()  # the first test starts from the same state as every later one
    return state


@pytest.fixture(autouse=True)
def _restore_process_state(_clean_process_state: ProcessState) -> Iterator[None]:
    """What a single-process test leaves behind (the manager, a pending save, torch's settings, seeds) is undone
    after it, as the pool's ranks do after every body (rankpool/state.py)."""
    yield
    _clean_process_state.restore()
