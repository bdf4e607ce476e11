"""The axis-size rule: inference, and errors that name the sizes, the world and what would work."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from mesh3d.mesh_shape import divisors, resolve_mesh_shape


@st.composite
def valid_request(draw):
    world = draw(st.sampled_from([1, 2, 3, 4, 6, 8, 12, 16, 64]))
    batch = draw(st.sampled_from(divisors(world)))
    domain = draw(st.sampled_from(divisors(world // batch)))
    model = world // (batch * domain)
    sizes = [batch, domain, model]
    inferred = draw(st.sampled_from([None, 0, 1, 2]))
    request = list(sizes)
    if inferred is not None:
        request[inferred] = -1
    return world, tuple(sizes), tuple(request)


@given(valid_request())
def test_valid_sizes_resolve_to_a_mesh_of_the_world(case):
    world, sizes, request = case
    assert resolve_mesh_shape(world, *request) == sizes
    assert math.prod(resolve_mesh_shape(world, *request)) == world


@given(st.integers(1, 64), st.integers(1, 64), st.integers(1, 64), st.integers(1, 64))
def test_any_product_mismatch_is_refused(world, batch, domain, model):
    if batch * domain * model == world:
        assert resolve_mesh_shape(world, batch, domain, model) == (batch, domain, model)
    else:
        with pytest.raises(ValueError, match=f"world size {world}"):
            resolve_mesh_shape(world, batch, domain, model)


def test_default_is_all_batch():
    assert resolve_mesh_shape(8) == (8, 1, 1)


def test_non_divisor_lists_valid_sizes():
    with pytest.raises(ValueError) as info:
        resolve_mesh_shape(4, batch=3, domain=1, model=1)
    message = str(info.value)
    assert "batch=3 does not divide world size 4" in message
    assert "1, 2, 4" in message


def test_mismatched_product_suggests_fixes():
    with pytest.raises(ValueError) as info:
        resolve_mesh_shape(8, batch=2, domain=2, model=1)
    message = str(info.value)
    assert "make a mesh of 4 ranks, which does not match world size 8" in message
    assert "batch=4" in message and "domain=4" in message and "model=2" in message
    assert "-1" in message


@pytest.mark.parametrize("bad", [0, -2, 2.0, "2", True, None])
def test_invalid_sizes_are_named(bad):
    with pytest.raises(ValueError, match="domain="):
        resolve_mesh_shape(4, batch=-1, domain=bad, model=1)


def test_two_inferred_axes_are_refused():
    with pytest.raises(ValueError, match="at most one axis size may be -1"):
        resolve_mesh_shape(8, batch=-1, domain=-1, model=2)


def test_inference_needs_a_divisible_rest():
    with pytest.raises(ValueError, match="cannot infer batch"):
        resolve_mesh_shape(8, batch=-1, domain=4, model=4)


@pytest.mark.parametrize("world, asked", [(3, (2, 2, 2)), (12, (2, 2, 2)), (8, (3, 1, 1)), (8, (-1, 4, 4)),
                                          (3, (-1, 2, 2)), (7, (2, 1, 1)), (8, (1, 1, 1))])
def test_a_mesh_that_does_not_fit_the_world_says_what_to_launch_and_which_meshes_fit(world, asked):
    """The launch the asked mesh needs (torchrun --nproc-per-node N) and the meshes that fit the launched world; every
    mesh the message offers is one resolve_mesh_shape takes on that world."""
    import math
    import re

    with pytest.raises(ValueError) as info:
        resolve_mesh_shape(world, *asked)
    message = str(info.value)
    needed = math.prod(s for s in asked if s != -1)
    if needed == 1:
        assert "run one process" in message, message
    else:
        assert f"torchrun --nproc-per-node {needed}" in message, message
        assert ("a multiple of" in message) == (-1 in asked), message
    offered = re.findall(r"batch=(\d+), domain=(\d+), model=(\d+)\)", message)
    singles = re.findall(r"on \d+ use ((?:\w+=\d+(?: or )?)+)", message)
    assert offered or singles, message
    for b, d, m in offered:
        assert resolve_mesh_shape(world, int(b), int(d), int(m)) == (int(b), int(d), int(m))
    for fix in (singles[0].split(" or ") if singles else []):
        name, value = fix.split("=")
        sizes = dict(zip(("batch", "domain", "model"), asked)) | {name: int(value)}
        assert resolve_mesh_shape(world, **sizes)
