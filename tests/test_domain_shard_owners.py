"""The bookkeeping behind every wrapper domain tensor's fast path: which live wrapper a plain shard belongs to
(``core.shard_owners``), and a slab spec's hash, computed once and never carried to another process.

The marks of dead shards are swept in bulk rather than dropped one by one (a callback per dying shard cost a Python
call on every op): the table stays bounded, a live mark survives every sweep, and a dead one never answers for a
tensor that took its id."""

from __future__ import annotations

import dataclasses
import gc
import pickle

import torch

from mesh3d.domain.core.group import DomainComm
from mesh3d.domain.core.shard_owners import ShardOwners
from mesh3d.domain.core.specs import DomainSpec


class _Owner:
    """Anything a weak reference can point at stands in for a wrapper tensor here."""


def test_the_marks_of_dead_shards_are_swept_and_live_ones_survive_every_sweep():
    owners = ShardOwners()
    live = [(torch.zeros(1), _Owner()) for _ in range(10)]
    for shard, owner in live:
        owners.mark(shard, owner)
    for _ in range(30_000):  # each shard dies at once: its mark stays until the table doubles
        owners.mark(torch.zeros(1), _Owner())
    assert len(owners) <= 2 * 4096 + 1, len(owners)
    for shard, owner in live:
        assert owners.owner(shard) is owner and owners.marked(shard)


def test_a_dead_shards_mark_answers_nothing_for_a_tensor_that_took_its_id():
    owners = ShardOwners()
    keep = _Owner()
    shard = torch.zeros(3)
    gone = id(shard)
    owners.mark(shard, keep)
    del shard
    gc.collect()
    reused = None
    pool = []
    for _ in range(10_000):  # NOTE: CPython hands a freed object's memory to the next of its size
        t = torch.zeros(3)
        if id(t) == gone:
            reused = t
            break
        pool.append(t)
    assert reused is not None, "no new tensor took the dead shard's id: the case was not reached"
    assert owners.owner(reused) is None and not owners.marked(reused)
    assert owners.fresh(reused)


def test_an_owner_that_died_leaves_its_shard_marked_but_ownerless():
    owners = ShardOwners()
    shard, owner = torch.zeros(2), _Owner()
    owners.mark(shard, owner)
    del owner
    gc.collect()
    assert owners.marked(shard) and owners.owner(shard) is None and not owners.fresh(shard)


def test_a_slab_specs_hash_is_its_fields_hash_and_is_not_pickled():
    comm = DomainComm("domain", (0, 1, 2), 1)
    spec = DomainSpec(2, (3, 4, 5), comm, 1)
    fields = (spec.dim, spec.sizes, spec.comm, spec.outer)
    assert hash(spec) == hash(fields) == hash(spec)  # computed once, then read back
    equal = DomainSpec(2, (3, 4, 5), comm, 1)
    assert equal == spec and hash(equal) == hash(spec) and {spec: 1}[equal] == 1
    assert hash(dataclasses.replace(spec, sizes=(4, 4, 4))) != hash(spec)
    # NOTE: a string's hash differs between processes: a hash carried in a pickle would be another process's
    state = pickle.loads(pickle.dumps(spec)).__dict__
    assert "_hash" not in state and state["sizes"] == (3, 4, 5)
    assert pickle.loads(pickle.dumps(spec)) == spec


def test_a_call_torch_answers_with_its_input_answers_the_domain_tensor_itself():
    """``x.double()`` of a float64 ``x``, ``x.contiguous()``, ``x.to(x.dtype)`` are ``x`` in torch: the domain tensor
    itself, on the dispatcher's first call and from kept answers after, so a write into the result is a write into
    ``x``."""
    from mesh3d import domain

    xs = domain.shard(torch.zeros(4, 3, dtype=torch.float64), dim=0) + 0.0  # NOTE: a shard of its own, no view
    for _ in range(3):
        for same in (xs.double(), xs.contiguous(), xs.to(torch.float64), xs.type_as(xs)):
            assert same is xs
    xs.double().add_(1.0)
    assert float(xs.sum()) == 12.0
