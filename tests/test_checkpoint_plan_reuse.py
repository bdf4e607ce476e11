"""Repeat saves reuse the agreed boxes (one small all-gather instead of the JSON agreement) only while
every rank's structure is unchanged; bad input on a repeat save still raises on every rank at the call.
And the host snapshot of a background save is a bitwise copy, split over threads or not.
"""

from __future__ import annotations

import os

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ckpt_helpers import build, full_state, shutdown, train_steps
from mesh3d import checkpoint
from mesh3d.checkpoint import CheckpointError
from mesh3d.checkpoint import staging as staging_module
from mesh3d.checkpoint.comm import _FIRST_BYTES, allgather_json
from mesh3d.checkpoint.staging import _REPROBE_EVERY, HostStaging, _KernelChoice, _split
from profiles import examples


class _Cursor:
    def __init__(self, position: int) -> None:
        self.position = position

    def state_dict(self) -> dict:
        return {"position": self.position}


def _repeat_saves(root: str) -> dict:
    import mesh3d.checkpoint.agree as agree_module
    from mesh3d.checkpoint.agree import AgreedPlans
    from mesh3d.checkpoint.inflight import IN_FLIGHT

    IN_FLIGHT.plans = AgreedPlans()  # every rank alike: forget what earlier tests on this pool agreed
    full_agreements = [0]
    real_step = agree_module.collective_step

    def counting(*args, **kwargs):
        full_agreements[0] += 1
        return real_step(*args, **kwargs)

    agree_module.collective_step = counting
    seen: dict = {"full": [], "errors": [], "equal": []}

    def run(label: str, fn) -> None:
        before = full_agreements[0]
        try:
            fn()
        except CheckpointError as err:
            seen["errors"].append(str(err))
        seen["full"].append((label, full_agreements[0] - before))

    try:
        rank = torch.distributed.get_rank()
        model, opt = build("fsdp_tp4", seed=4)
        train_steps(model, opt, range(1))
        path = lambda name: os.path.join(root, name)  # noqa: E731
        run("first", lambda: checkpoint.save(path("a"), model, opt, step=1, data=_Cursor(1)))
        want = full_state(model, opt)
        handle = checkpoint.async_save(path("b"), model, opt, step=2, data=_Cursor(2))
        seen["full"].append(("async repeat", full_agreements[0]))
        train_steps(model, opt, range(1, 3))  # changes everything while b is written
        handle.wait()
        run("model only", lambda: checkpoint.save(path("c"), model))
        run("optimizer again", lambda: checkpoint.save(path("d"), model, opt))
        run("data differs", lambda: checkpoint.async_save(path("e"), model, opt, data=_Cursor(rank)).wait())
        run("path exists", lambda: checkpoint.save(path("a"), model, opt))
        moved = full_state(model, opt)
        run("repeat after errors", lambda: checkpoint.async_save(path("f"), model, opt, step=6).wait())
        shutdown()
        hsdp, hsdp_opt = build("hsdp4", seed=9)
        run("other mesh", lambda: checkpoint.save(path("g"), hsdp, hsdp_opt))
        hsdp_state = full_state(hsdp, hsdp_opt)
        shutdown()
        for name, expected in (("b", want), ("f", moved), ("g", hsdp_state)):
            fresh, fresh_opt = build("fsdp_tp4", seed=77)
            checkpoint.load(path(name), fresh, fresh_opt)
            got = full_state(fresh, fresh_opt)
            seen["equal"].append((name, all(torch.equal(got[k], expected[k]) for k in expected)))
            shutdown()
    finally:
        agree_module.collective_step = real_step
    seen["listing"] = sorted(os.listdir(root))
    return seen


def test_repeat_saves_reuse_the_agreed_boxes_only_while_nothing_changed(ranks, tmp_path):
    for seen in ranks.run(4, _repeat_saves, str(tmp_path), timeout=180):
        assert seen["full"] == [("first", 1), ("async repeat", 1), ("model only", 1), ("optimizer again", 1),
                                ("data differs", 1), ("path exists", 1), ("repeat after errors", 0),
                                ("other mesh", 1)], seen["full"]
        data_error, exists_error = seen["errors"]
        assert "rank 1: its data state {'position': 1} differs from rank 0's {'position': 0}" in data_error
        assert "already exists" in exists_error
        assert seen["equal"] == [("b", True), ("f", True), ("g", True)]
        assert seen["listing"] == ["a", "b", "c", "d", "f", "g"]  # no staging directory left behind


_FIRST = 16 * 1024  # comm._FIRST_BYTES (checked below)
#: Each rank's payload length (bytes of text), per all-gather: all small, around the first all-gather's size, some long.
_LENGTHS = ((0, 5, 17), (_FIRST - 100, _FIRST - 40, 3), (1, 3 * _FIRST, 0), (2 * _FIRST, 2 * _FIRST + 2, _FIRST))


def _gather_payloads_of_many_lengths() -> list:
    rank = torch.distributed.get_rank()
    results = []
    real, calls = torch.distributed.all_gather, [0]

    def counting(*args, **kwargs):
        calls[0] += 1
        return real(*args, **kwargs)

    torch.distributed.all_gather = counting
    try:
        for lengths in _LENGTHS:
            calls[0] = 0
            mine = {"rank": rank, "text": "x" * lengths[rank]}
            results.append((allgather_json(mine), calls[0]))
    finally:
        torch.distributed.all_gather = real
    return results


def test_json_all_gather_takes_payloads_of_any_length_in_one_or_two_collectives(ranks):
    assert _FIRST_BYTES == _FIRST
    for results in ranks.run(3, _gather_payloads_of_many_lengths):
        assert len(results) == len(_LENGTHS)
        for lengths, (gathered, collectives) in zip(_LENGTHS, results):
            assert gathered == [{"rank": r, "text": "x" * n} for r, n in enumerate(lengths)]
            # the JSON around the text adds under 30 bytes: a payload fits the first all-gather iff its text does
            assert collectives == (1 if max(lengths) < _FIRST_BYTES - 30 else 2), (lengths, collectives)


def test_snapshot_is_a_bitwise_copy_with_either_kernel_split_over_threads_or_not(monkeypatch):

    torch.manual_seed(0)
    tensors = {
        "f64": torch.randn(301, 7, dtype=torch.float64),
        "bf16": torch.randn(1000).to(torch.bfloat16),
        "i64": torch.randint(-2**62, 2**62, (513,)),
        "bool": torch.rand(77) > 0.5,
        "transposed": torch.randn(9, 31).t(),  # not contiguous: copied by copy_
        "empty": torch.empty(0, 5),
        "scalar": torch.tensor(3.5),
        "param": torch.nn.Parameter(torch.randn(64)),
    }
    staging = HostStaging()
    threads = torch.get_num_threads()
    used = []
    try:
        for kernel in ("copy_", "memmove"):
            monkeypatch.setattr(staging.kernels, "next", lambda kernel=kernel: used.append(kernel) or kernel)
            for parallel_from, n_threads in ((2**40, 1), (1, 3)):
                monkeypatch.setattr(staging_module, "_PARALLEL_BYTES", parallel_from)
                torch.set_num_threads(n_threads)
                for name in tensors:
                    if name != "param":
                        tensors[name].add_(1) if tensors[name].dtype != torch.bool else tensors[name].logical_not_()
                copies, event = staging.snapshot(tensors)
                assert event is None
                for name, t in tensors.items():
                    assert copies[name].shape == t.shape and copies[name].dtype == t.dtype
                    assert torch.equal(copies[name], t.detach()), (kernel, name)
                    if t.numel():
                        assert copies[name].data_ptr() != t.data_ptr()
                with torch.no_grad():
                    tensors["param"].add_(1.0)  # the copy does not follow the source
                assert not torch.equal(copies["param"], tensors["param"].detach())
    finally:
        torch.set_num_threads(threads)
    assert used == ["copy_", "copy_", "memmove", "memmove"]  # each snapshot ran the kernel it was given


def test_the_faster_kernel_is_chosen_and_the_other_timed_again_now_and_then():
    choice = _KernelChoice()
    seconds = {"copy_": 2.0, "memmove": 1.0}  # memmove is faster here
    ran = []
    for _ in range(3 * _REPROBE_EVERY):
        name = choice.next()
        ran.append(name)
        choice.record(name, seconds[name], 100)
    assert ran[:2] == ["copy_", "memmove"]  # each timed once first
    # then the faster, and the slower re-timed every _REPROBE_EVERY-th copy
    assert [i for i, name in enumerate(ran) if name == "copy_"] == [0, _REPROBE_EVERY, 2 * _REPROBE_EVERY]
    seconds["copy_"] = 0.5  # the load changed: copy_ is faster now; its next re-timing finds it
    for _ in range(_REPROBE_EVERY + 2):
        name = choice.next()
        choice.record(name, seconds[name], 100)
    assert choice.next() == "copy_" and choice.seconds_per_byte == {"copy_": 0.005, "memmove": 0.01}


@settings(max_examples=examples(60), deadline=None)
@given(st.lists(st.tuples(st.integers(0, 1000), st.sampled_from([torch.uint8, torch.bfloat16, torch.float32,
                                                                  torch.float64])), min_size=1, max_size=8),
       st.integers(1, 6))
def test_split_copies_every_byte_once_in_balanced_parts(sizes, parts):
    pieces = [(torch.empty(n, dtype=dtype), torch.empty(n, dtype=dtype)) for n, dtype in sizes]
    cut = _split(pieces, parts)

    def byte_ranges(which: int, pieces) -> list[tuple[int, int]]:
        return sorted((p[which].data_ptr() + i, p[which].data_ptr() + i + 1) for p in pieces
                      for i in range(p[which].numel() * p[which].element_size()))

    flat = [p for part in cut for p in part]
    for which in (0, 1):  # every destination and every source byte exactly once
        assert byte_ranges(which, flat) == byte_ranges(which, [p for p in pieces if p[1].numel()])
    assert all(d.dtype == s.dtype and d.numel() == s.numel() for d, s in flat)
    total = sum(n * torch.empty(0, dtype=dtype).element_size() for n, dtype in sizes)
    share = -(-total // parts)
    assert len(cut) <= parts
    assert all(sum(s.numel() * s.element_size() for _, s in part) < share + 8 for part in cut)  # at most one element over
