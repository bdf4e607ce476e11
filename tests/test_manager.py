"""DistributedManager on real gloo ranks: shapes, coordinates, per-axis groups, errors, lifecycle."""

from __future__ import annotations

import io
import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mesh3d.mesh_shape import AXES, divisors
from profiles import examples

WORLD_SIZES = [1, 2, 4, 8]


def all_requests(world):
    """Every (batch, domain, model) that multiplies to ``world``, with -1 in each place too."""
    for batch in divisors(world):
        for domain in divisors(world // batch):
            shape = (batch, domain, world // (batch * domain))
            yield shape, shape
            for place in range(3):
                request = list(shape)
                request[place] = -1
                yield tuple(request), shape


def expected_axis_ranks(shape, rank, axis):
    """Global ranks that share every coordinate but ``axis`` with ``rank`` (row-major layout)."""
    b, d, m = shape
    coords = (rank // (d * m), (rank // m) % d, rank % m)
    varying = {"batch": [0], "domain": [1], "model": [2], "batch_domain": [0, 1], "world": [0, 1, 2]}[axis]
    ranges = [range(n) if i in varying else [coords[i]] for i, n in enumerate(shape)]
    return [x * d * m + y * m + z for x, y, z in itertools.product(*ranges)]


def _check_requests(requests):
    """On every rank: build each mesh, check it, and shut it down again."""
    import torch
    import torch.distributed as dist

    from mesh3d import DistributedManager

    report = []
    for request, shape in requests:
        dm = DistributedManager.initialize(*request)
        rank = dist.get_rank()
        assert tuple(dm.mesh.shape) == shape and dm.mesh.mesh_dim_names == AXES
        assert dm.shape == dict(zip(AXES, shape))
        b, d, m = shape
        assert dm.coordinates == {"batch": rank // (d * m), "domain": (rank // m) % d, "model": rank % m}
        for axis in (*AXES, "batch_domain", "world"):
            expected = expected_axis_ranks(shape, rank, axis)
            assert dm.axis_ranks(axis) == expected, (axis, request)
            assert dm.axis_size(axis) == len(expected)
            assert dm.axis_rank(axis) == expected.index(rank)
            # A collective on the axis's group reaches exactly that axis's ranks.
            gathered = [torch.zeros(1) for _ in expected]
            dist.all_gather(gathered, torch.tensor([float(rank)]), group=dm.group(axis))
            assert [int(t.item()) for t in gathered] == expected, (axis, request)
        report.append((request, dm.coordinates))
        DistributedManager.shutdown()
    return report


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_every_mesh_shape_and_inferred_axis(ranks, world):
    requests = list(all_requests(world))
    results = ranks.run(world, _check_requests, requests)
    assert len(results) == world and all(len(r) == len(requests) for r in results)


def _check_mixed(requests, world):
    """Valid requests build their mesh; invalid ones raise ValueError here, before any collective."""
    from mesh3d import DistributedManager
    from mesh3d.mesh_shape import resolve_mesh_shape

    outcomes = []
    for request in requests:
        try:
            expected = resolve_mesh_shape(world, *request)
        except ValueError:
            expected = None
        try:
            dm = DistributedManager.initialize(*request)
        except ValueError as err:
            assert expected is None, (request, err)
            assert f"world size {world}" in str(err)
            outcomes.append("refused")
            continue
        assert tuple(dm.mesh.shape) == expected
        DistributedManager.shutdown()
        outcomes.append(expected)
    return outcomes


size = st.sampled_from([-1, -1, 0, 1, 1, 2, 2, 3, 4, 8])


@settings(max_examples=examples(12), deadline=None)
@given(st.lists(st.tuples(size, size, size), min_size=1, max_size=6))
def test_hypothesis_requests_agree_on_every_rank(ranks, requests):
    outcomes = ranks.run(8, _check_mixed, requests, 8, timeout=60)
    assert all(o == outcomes[0] for o in outcomes), "every rank must reach the same verdict"


def _errors_on_every_rank():
    from mesh3d import DistributedManager

    messages = []
    for request in [(3, 1, 1), (2, 2, 1), (-1, -1, 1), (0, 2, 2)]:
        try:
            DistributedManager.initialize(*request)
        except ValueError as err:
            messages.append(str(err))
    try:
        DistributedManager()
    except RuntimeError as err:
        messages.append(str(err))
    return messages


def test_errors_are_raised_on_every_rank(ranks):
    # A check behind a collective would leave ranks waiting: the pool's timeout bounds that hang (no speed limit).
    results = ranks.run(8, _errors_on_every_rank, timeout=120)
    for messages in results:
        assert len(messages) == 5
        assert "batch=3 does not divide world size 8" in messages[0] and "1, 2, 4, 8" in messages[0]
        assert "make a mesh of 4 ranks" in messages[1] and "batch=4" in messages[1]
        assert "at most one axis size may be -1" in messages[2]
        assert "batch=0 is not a valid axis size" in messages[3]
        assert "call DistributedManager.initialize" in messages[4]


def _lifecycle():
    import torch.distributed as dist

    from mesh3d import DistributedManager

    first = DistributedManager.initialize(batch=2, domain=2, model=1)
    assert DistributedManager() is first
    assert DistributedManager.initialize(batch=-1, domain=2, model=1) is first, "same sizes return the singleton"
    try:
        DistributedManager.initialize(batch=1, domain=2, model=2)
        raise AssertionError("different sizes must raise")
    except RuntimeError as err:
        assert "already initialized with (batch, domain, model)=(2, 2, 1)" in str(err)
    try:
        first.group("tensor")
        raise AssertionError("unknown axis must raise")
    except ValueError as err:
        assert "'batch', 'domain', 'model', 'batch_domain', 'world'" in str(err)
    DistributedManager.shutdown()
    assert not DistributedManager.is_initialized()
    assert dist.is_initialized(), "a default group the user created must survive shutdown"
    second = DistributedManager.initialize(batch=1, domain=1, model=4)
    assert second is not first and second.coordinates["model"] == dist.get_rank()
    assert (second.backend, second.device.type, second.launcher) == ("gloo", "cpu", "existing")
    return True


def test_reinitialize_after_shutdown(ranks):
    assert ranks.run(4, _lifecycle) == [True] * 4


def _collective_times_out():
    import torch
    import torch.distributed as dist

    from mesh3d import DistributedManager

    dm = DistributedManager.initialize(batch=1, domain=1, model=2, timeout=2)
    if dm.rank == 1:
        # Never joins rank 0's collective on the model group, but stays until it is over: a rank that left would
        # shut its groups down, and rank 0 would see a closed connection instead of its timeout.
        dist.barrier()  # the pool's own group (its timeout is minutes)
        return None
    try:
        dist.all_reduce(torch.ones(1), group=dm.group("model"))
    except RuntimeError as err:
        return str(err)
    finally:
        dist.barrier()
    raise AssertionError("the all_reduce should have timed out")


def test_mesh_groups_use_the_managers_timeout(ranks):
    """The model group gives up after the manager's 2 s, as gloo's own message says; with gloo's default
    (30 minutes) rank 0 would still be waiting when the pool's 60 s run out (a RankTimeout)."""
    message = ranks.run(2, _collective_times_out, timeout=60)[0]
    assert "Timed out waiting 2000ms" in message, message


def _log_lines():
    import logging

    import torch.distributed as dist

    from mesh3d import DistributedManager
    from mesh3d.log import configure_logging, get_logger

    stream = io.StringIO()
    handler = configure_logging(logging.INFO, stream=stream)
    DistributedManager.initialize(batch=2, domain=2, model=2)
    log = get_logger("mesh3d.test")
    log.info("hello")
    log.info_rank0("only once")
    logging.getLogger("mesh3d.plain").info("plain logger")
    logging.getLogger("mesh3d").removeHandler(handler)
    return dist.get_rank(), stream.getvalue()


def test_log_records_carry_rank_and_coordinates(ranks):
    for rank, text in ranks.run(8, _log_lines):
        tag = f"rank {rank} b{rank // 4} d{(rank // 2) % 2} m{rank % 2}"
        assert f"[{tag}] INFO mesh3d.test: hello" in text
        assert f"[{tag}] INFO mesh3d.plain: plain logger" in text
        assert ("only once" in text) == (rank == 0)
