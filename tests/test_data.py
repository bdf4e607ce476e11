"""mesh3d.data: the global sample order resumes exactly on another mesh; each domain rank reads only its slab.

Pure-python properties of ``MeshSampler`` run under hypothesis; the train -> save -> resume on another
mesh tests run on pooled ranks in fp64 and compare every step's global sample ids and loss with the
uninterrupted run in this process.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from mesh3d.data import MeshDataLoader, MeshSampler, SlabDataset
from mesh3d.domain.io import NpyArray, read_rows
from profiles import examples

import data_helpers as dh


def _global_batches(n, g, ranks, *, tail="drop", seed=0, state=None, epochs=2):
    """Every global batch (ids, valid) the samplers of ``ranks`` batch ranks yield from ``state``, reassembled."""
    samplers = [MeshSampler(n, g, seed=seed, tail=tail, batch_ranks=ranks, batch_rank=b) for b in range(ranks)]
    if state is not None:
        for s in samplers:
            s.load_state_dict(state)
    out = []
    for _ in range(epochs):
        per_rank = [list(s) for s in samplers]
        local = g // ranks
        for step in range(len(per_rank[0]) // local):
            shares = [p[step * local:(step + 1) * local] for p in per_rank]
            out.append([shares[j % ranks][j // ranks] for j in range(g)])
    assert len({json.dumps(s.state_dict()) for s in samplers}) == 1  # the cursor is global
    return out


def test_each_epoch_has_its_own_order_from_the_seed_and_the_epoch():
    """Epoch e's order is torch.randperm(N) from seed + e (the documented rule, built here): a new order every epoch,
    the same for the same (seed, epoch), as the ranks hand it out over three epochs."""
    n, g, seed = 24, 4, 7
    want = [torch.randperm(n, generator=torch.Generator().manual_seed(seed + e)).tolist() for e in range(3)]
    assert len({tuple(w) for w in want}) == 3
    batches = _global_batches(n, g, 2, seed=seed, epochs=3)
    steps = n // g
    for e in range(3):
        assert sum(batches[e * steps:(e + 1) * steps], []) == want[e], e


sizes = st.tuples(st.integers(1, 40), st.integers(1, 4), st.integers(1, 4)).filter(lambda t: t[1] * t[2] <= t[0])


@settings(max_examples=examples(60), deadline=None)
@given(sizes, st.integers(0, 3), st.sampled_from(["drop", "pad"]))
def test_every_sample_once_per_epoch_and_the_order_ignores_the_mesh(shape, seed, tail):
    n, per_rank, ranks = shape
    g = per_rank * ranks
    one = _global_batches(n, g, 1, tail=tail, seed=seed)
    assert _global_batches(n, g, ranks, tail=tail, seed=seed) == one
    steps = n // g if tail == "drop" else -(-n // g)
    for epoch in range(2):
        batches = one[epoch * steps:(epoch + 1) * steps]
        order = MeshSampler(n, g, seed=seed, tail=tail, batch_ranks=1, batch_rank=0).epoch_order(epoch).tolist()
        seen = [i for b in batches for i in b]
        if tail == "drop":
            assert seen == order[: steps * g] and len(set(seen)) == len(seen)
        else:  # padded with the epoch's first samples: each sample valid exactly once
            assert seen[:n] == order and seen[n:] == order[: steps * g - n]
    s = MeshSampler(n, g, tail="pad", batch_ranks=1, batch_rank=0)
    last = s.batch_info(0, (steps - 1) * g) if tail == "pad" else None
    if last is not None:
        assert sum(last.valid) == n - (steps - 1) * g and last.valid == tuple(sorted(last.valid, reverse=True))


@settings(max_examples=examples(60), deadline=None)
@given(st.integers(2, 30), st.integers(1, 3), st.integers(1, 3), st.integers(1, 3), st.data())
def test_resume_at_any_point_on_other_batch_ranks_equals_uninterrupted(n, per_rank, ranks_a, ranks_b, data):
    g = per_rank * ranks_a * ranks_b
    if g > n:
        g = ranks_a * ranks_b
    assume(g <= n)
    whole = _global_batches(n, g, 1, epochs=3)
    stop = data.draw(st.integers(0, len(whole) - 1))
    # Run on mesh A through MeshDataLoader (cursor moves on delivery) for `stop` steps, save, resume on B.
    samplers = [MeshSampler(n, g, batch_ranks=ranks_a, batch_rank=b) for b in range(ranks_a)]
    loaders = [MeshDataLoader(list(range(n)), s) for s in samplers]
    taken = []
    while len(taken) < stop:
        for shares in zip(*loaders):
            taken.append([shares[j % ranks_a][j // ranks_a].item() for j in range(g)])
            if len(taken) == stop:
                break
    state = json.loads(json.dumps(loaders[0].state_dict()))
    assert all(ld.state_dict() == state for ld in loaders)
    rest = _global_batches(n, g, ranks_b, state=state, epochs=3)
    assert taken + rest[: len(whole) - stop] == whole


def test_the_cursor_counts_delivered_batches_not_prefetched_ones():
    sampler = MeshSampler(24, 4, batch_ranks=2, batch_rank=1)
    loader = MeshDataLoader(list(range(24)), sampler, num_workers=2, prefetch_factor=4)
    it = iter(loader)
    first = [next(it).tolist() for _ in range(2)]  # workers have fetched far more than 2 batches by now
    assert sampler.state_dict()["position"] == 8 and loader.last_batch.local_ids == tuple(first[1])
    resumed = MeshSampler(24, 4, batch_ranks=1, batch_rank=0)
    resumed.load_state_dict(loader.state_dict())
    rest = [next(it).tolist() for _ in range(4)]
    want = [list(resumed.batch_info(0, 8 + 4 * k).global_ids[1::2]) for k in range(4)]
    assert rest == want


def test_set_epoch_keeps_a_resumed_epoch_and_restarts_a_new_one():
    s = MeshSampler(12, 4, batch_ranks=1, batch_rank=0)
    it = iter(s)
    [next(it) for _ in range(4)]
    assert (s.epoch, s.position) == (0, 4)
    s.set_epoch(0)
    assert (s.epoch, s.position) == (0, 4)
    s.set_epoch(3)
    assert (s.epoch, s.position) == (3, 0)
    assert list(s) == s.epoch_order(3).tolist() and (s.epoch, s.position) == (4, 0)
    assert list(MeshSampler(5, 2, shuffle=False, batch_ranks=1, batch_rank=0)) == [0, 1, 2, 3]


@pytest.mark.parametrize("kwargs, message", [
    (dict(num_samples=0, global_batch_size=1), "num_samples=0"),
    (dict(num_samples=8, global_batch_size=6, batch_ranks=4, batch_rank=0), "multiple of 4 (e.g. 4 or 8)"),
    (dict(num_samples=3, global_batch_size=4), "tail='pad'"),
    (dict(num_samples=8, global_batch_size=2, tail="wrap"), "tail='wrap'"),
    (dict(num_samples=8, global_batch_size=2, batch_ranks=2), "both batch_ranks and batch_rank"),
    (dict(num_samples=8, global_batch_size=2, batch_ranks=2, batch_rank=2), "0 <= batch_rank < batch_ranks"),
])
def test_bad_arguments_say_what_would_be_right(kwargs, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        MeshSampler(**kwargs)


def test_bad_states_are_refused_before_anything_changes():
    s = MeshSampler(10, 2, seed=1, batch_ranks=1, batch_rank=0)
    good = s.state_dict()
    cases = {"num_samples": (11, "num_samples=11"), "seed": (2, "seed=2"), "shuffle": (False, "shuffle=False"),
             "position": (10, "past the epoch"), "epoch": (-1, "non-negative"), "version": (9, "version 9"),
             "format": ("x", "not a MeshSampler state")}
    for key, (value, message) in cases.items():
        with pytest.raises(ValueError, match=message):
            s.load_state_dict({**good, key: value})
        assert s.state_dict() == good
    other = MeshSampler(10, 4, seed=1, batch_ranks=2, batch_rank=0)  # another global batch continues the sequence
    other.load_state_dict({**good, "position": 8})
    assert (other.epoch, other.position) == (1, 0)  # 2 samples left cannot fill a batch of 4 (drop)
    with pytest.raises(TypeError, match="MeshDataLoader sets \\['batch_size'\\]"):
        MeshDataLoader(list(range(10)), s, batch_size=3)
    with pytest.raises(ValueError, match="built for 10"):
        MeshDataLoader(list(range(9)), s)


def test_npy_reader_reads_exactly_the_requested_rows(tmp_path):
    a = np.arange(4 * 3 * 7 * 5, dtype=np.float32).reshape(4, 3, 7, 5)
    np.save(tmp_path / "a.npy", a)
    arr = NpyArray(tmp_path / "a.npy")
    for key in [(2, slice(None), slice(2, 5)), (1,), (slice(1, 3),), (3, 1, slice(None), slice(1, 3)), (0, 0, 6, 4),
                (-1, slice(1, 1))]:
        before = arr.bytes_read
        got = arr[key]
        assert np.array_equal(got, a[key]) and got.shape == a[key].shape, key
        assert arr.bytes_read - before == a[key].nbytes, key
    with pytest.raises(IndexError, match="unit-step"):
        arr[0, ::2]


class _Recording:
    """An array-like that records the slices asked of it (what a zarr/h5py array would read)."""

    def __init__(self, array):
        self.array, self.shape, self.asked = array, array.shape, []

    def __getitem__(self, key):
        self.asked.append(key)
        return self.array[key]


def test_slab_dataset_asks_each_domain_rank_only_for_its_rows(tmp_path):
    paths = dh.write_dataset(str(tmp_path))
    x = np.load(paths["x"], mmap_mode="r")
    for parts in (1, 2, 4):
        sizes = (9,) if parts == 1 else (5, 4) if parts == 2 else (3, 3, 3, 0)
        rows = []
        for part in range(parts):
            rec = _Recording(x)
            ds = SlabDataset({"x": rec, "y": paths["y"]}, dim=2, domain=(parts, part))
            item = ds[7]
            assert rec.asked == [(7, slice(None), slice(sum(sizes[:part]), sum(sizes[:part + 1])))]
            assert ds.bytes_read == sizes[part] * C_W_BYTES  # y's .npy: exactly this rank's rows
            assert torch.equal(item["x"], torch.from_numpy(np.array(x[7, :, sum(sizes[:part]):][:, :sizes[part]])))
            rows.append(item["y"])
        assert torch.equal(torch.cat(rows, dim=1), torch.from_numpy(np.load(paths["y"])[7]))
    local, sizes = read_rows(x, dim=1, parts=3, index=2, prefix=(0,))
    assert sizes == (3, 3, 3) and torch.equal(local, torch.from_numpy(np.array(x[0, :, 6:9])))


C_W_BYTES = dh.C * dh.W * 8


# ---------------------------------------------------------------- on pooled ranks
def _setup(shape, paths):
    from mesh3d import DistributedManager, Plan, parallelize

    DistributedManager.initialize(*shape)
    ds = SlabDataset(paths, dim=2)
    loader = MeshDataLoader(ds, MeshSampler(len(ds), dh.GLOBAL_BATCH, seed=3))
    model = parallelize(dh.field_net(), Plan(batch="fsdp"))
    return ds, loader, model, torch.optim.AdamW(model.parameters(), lr=dh.LR)


def _train_save_body(shape, paths, steps, path):
    from mesh3d import checkpoint

    ds, loader, model, opt = _setup(shape, paths)
    record = dh.train(model, opt, loader, ds, steps)
    checkpoint.save(path, model, opt, step=steps, data=loader)
    return record, ds.bytes_read, ds.sizes["x"]


def _resume_body(shape, paths, steps, path):
    from mesh3d import checkpoint

    ds, loader, model, opt = _setup(shape, paths)
    info = checkpoint.load(path, model, opt, data=loader)
    return dh.train(model, opt, loader, ds, steps), info.data, ds.bytes_read, ds.sizes["x"]


def _reference(paths, steps):
    ds = SlabDataset(paths, dim=2)
    loader = MeshDataLoader(ds, MeshSampler(len(ds), dh.GLOBAL_BATCH, seed=3))
    model = dh.field_net()
    return dh.train(model, torch.optim.AdamW(model.parameters(), lr=dh.LR), loader, ds, steps)


def _assert_same(got, want):
    assert [ids for ids, _ in got] == [ids for ids, _ in want]
    torch.testing.assert_close(torch.tensor([l for _, l in got]), torch.tensor([l for _, l in want]),
                               rtol=1e-10, atol=1e-12)


def _check_bytes(bytes_read, sizes, items):
    # Each item reads this rank's rows of x and of y, nothing else.
    assert bytes_read == 2 * items * sizes * C_W_BYTES


@pytest.mark.parametrize("world_a, shape_a, world_b, shape_b", [
    (4, (2, 2, 1), 3, (1, 3, 1)),     # batch 2 -> 1, domain 2 -> 3, world 4 -> 3
    (2, (1, 2, 1), 8, (4, 2, 1)),     # batch 1 -> 4, world 2 -> 8
    (8, (2, 4, 1), 1, (1, 1, 1)),     # an empty slab (9 rows over 4) -> one rank
])
def test_resume_on_another_mesh_continues_the_same_samples_and_losses(ranks, tmp_path, world_a, shape_a, world_b,
                                                                      shape_b):
    paths = dh.write_dataset(str(tmp_path))
    k, m = 3, 4  # 2 steps per epoch (10 samples, batch 4, drop): saved mid-epoch 1, resumed across epoch 2
    want = _reference(paths, k + m)
    path = str(tmp_path / "ck")
    for b, (record, nbytes, sizes) in enumerate(ranks.run(world_a, _train_save_body, shape_a, paths, k, path)):
        _assert_same(record, want[:k])
        domain_rank = b % shape_a[1]
        _check_bytes(nbytes, sizes[domain_rank], k * dh.GLOBAL_BATCH // shape_a[0])
    assert json.load(open(os.path.join(path, "index.json")))["data"]["position"] == 4
    for b, (record, data, nbytes, sizes) in enumerate(ranks.run(world_b, _resume_body, shape_b, paths, m, path)):
        assert (data["epoch"], data["position"], data["samples_seen"]) == (1, 4, 12)
        _assert_same(record, want[k:])
        _check_bytes(nbytes, sizes[b % shape_b[1]], m * dh.GLOBAL_BATCH // shape_b[0])


def _mismatch_body(path, seed):
    from mesh3d import DistributedManager, checkpoint

    DistributedManager.initialize(2, 1, 1)
    model = dh.field_net()
    loader = MeshDataLoader(list(range(dh.N)), MeshSampler(dh.N, dh.GLOBAL_BATCH, seed=seed))
    try:
        checkpoint.load(path, model, data=loader)
    except checkpoint.CheckpointError as err:
        return str(err), loader.state_dict()["position"]
    return None, None


def _save_plain_body(path):
    from mesh3d import DistributedManager, checkpoint

    DistributedManager.initialize(2, 1, 1)
    loader = MeshDataLoader(list(range(dh.N)), MeshSampler(dh.N, dh.GLOBAL_BATCH, seed=0))
    next(iter(loader))
    checkpoint.save(path, dh.field_net(), data=loader)


def test_a_data_state_that_cannot_continue_is_refused_on_every_rank(ranks, tmp_path):
    path = str(tmp_path / "ck")
    ranks.run(2, _save_plain_body, path)
    for message, position in ranks.run(2, _mismatch_body, path, 1):
        assert "seed=0 but this one has seed=1" in message and position == 0
    assert ranks.run(2, _mismatch_body, path, 0) == [(None, None)] * 2


def test_pad_marks_the_repeated_samples_of_the_last_batch():
    loaders = [MeshDataLoader(list(range(10)), MeshSampler(10, 4, tail="pad", batch_ranks=2, batch_rank=b))
               for b in range(2)]
    infos = []
    for _ in zip(*loaders):
        infos.append([ld.last_batch for ld in loaders])
    assert len(infos) == 3 and all(len(ld) == 3 for ld in loaders)
    last = infos[-1][0]
    order = loaders[0].mesh_sampler.epoch_order(0).tolist()
    assert last.global_ids == tuple(order[8:] + order[:2]) and last.valid == (True, True, False, False)
    assert [i.local_valid for i in infos[-1]] == [(True, False), (True, False)]
    assert loaders[0].state_dict()["epoch"] == 1 and loaders[0].state_dict()["samples_seen"] == 10


def test_checkpoint_manager_saves_and_restores_the_cursor_in_one_process(tmp_path):
    from mesh3d.checkpoint import CheckpointError, CheckpointManager

    manager = CheckpointManager(str(tmp_path / "ck"))
    loader = MeshDataLoader(list(range(10)), MeshSampler(10, 2, batch_ranks=1, batch_rank=0))
    it = iter(loader)
    next(it), next(it)
    manager.save(dh.field_net(), step=2, data=loader)
    again = MeshDataLoader(list(range(10)), MeshSampler(10, 2, batch_ranks=1, batch_rank=0))
    info = manager.load(dh.field_net(), data=again)
    assert info.data == loader.state_dict() == again.state_dict() and again.state_dict()["position"] == 4
    assert next(iter(again)).tolist() == next(it).tolist()
    with pytest.raises(CheckpointError, match="state_dict"):
        manager.save(dh.field_net(), step=3, data=object())
    manager.save(dh.field_net(), step=4)
    with pytest.raises(CheckpointError, match="no data state"):
        manager.load(dh.field_net(), data=again)


def _disagreeing_body(path):
    from mesh3d import DistributedManager, checkpoint

    dm = DistributedManager.initialize(2, 1, 1)
    loader = MeshDataLoader(list(range(dh.N)), MeshSampler(dh.N, dh.GLOBAL_BATCH))
    if dm.rank == 1:
        next(iter(loader))  # this rank consumed a batch the other did not: a bug the save must catch
    try:
        checkpoint.save(path, dh.field_net(), data=loader)
    except checkpoint.CheckpointError as err:
        return str(err), os.path.exists(path)
    return None, os.path.exists(path)


def test_ranks_holding_different_cursors_are_refused_at_save(ranks, tmp_path):
    for message, exists in ranks.run(2, _disagreeing_body, str(tmp_path / "ck")):
        assert "rank 1: its data state" in message and "differs from rank 0's" in message and not exists


def _read_body(path):
    from mesh3d import DistributedManager, domain

    DistributedManager.initialize(1, 3, 1)
    whole = torch.from_numpy(np.load(path))
    out = []
    for sizes in (None, (1, 6, 2)):
        from_path = domain.read(path, dim=1, sizes=sizes, prefix=(4,))
        from_memmap = domain.read(np.load(path, mmap_mode="r"), dim=2, sizes=sizes)
        want = domain.shard(whole[4], dim=1, sizes=sizes)
        out.append(torch.equal(from_path.to_local(), want.to_local())
                   and from_path.spec.sizes == want.spec.sizes
                   and torch.equal(from_memmap.to_local(), domain.shard(whole, dim=2, sizes=sizes).to_local())
                   and torch.equal(from_path.full_tensor().to_local(), whole[4]))
    try:
        domain.read(path, dim=3, prefix=(4,))
    except ValueError as err:
        out.append(str(err))
    return out


def test_domain_read_gives_the_shard_of_the_whole_tensor(ranks, tmp_path):
    paths = dh.write_dataset(str(tmp_path))
    for ok_default, ok_sizes, message in ranks.run(3, _read_body, paths["x"]):
        assert ok_default and ok_sizes and "dim=3 is out of range for the 3-D array" in message
