"""The staged gloo transport (mesh3d/staged_gloo), its logic on CPU ranks: ``FakeDeviceCopies`` stands in for a GPU
(float64 tensors are its "device" tensors), so every collective and send/recv of them goes through host buffers as a
CUDA tensor's would. Checked against plain gloo on the same ranks (results), the fake's log (order), its buffer count
(reuse), and whole training steps on staged meshes against one process (scripts/gpu_rank_checks.py, the GPU checks)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from mesh3d import DistributedManager
from launch_helpers import run
from mesh3d.staged_gloo import STAGED, STAGED_BACKEND
from staged_gloo_fakes import FakeDeviceCopies

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
from gpu_rank_checks import Context, rank_checks  # noqa: E402

#: ``all_gather_single`` / ``reduce_scatter_single`` in torch 2.13, the older names before.
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _ops(rank: int, world: int):
    """(name, fn(group, data) -> outputs to compare, ranks whose outputs are defined) for every op the group serves."""
    def a2a(g, data):
        ins = [(rank + j) % 3 + 1 for j in range(world)]   # rank r sends (r + j) % 3 + 1 rows to rank j
        outs = [(i + rank) % 3 + 1 for i in range(world)]
        out = torch.empty(sum(outs), 2, dtype=torch.float64)
        dist.all_to_all_single(out, data(sum(ins), 2), outs, ins, group=g)
        return [out]

    def ring(g, data):
        x, head, y, got = data(4, 3), torch.tensor([rank, 7]), torch.empty(4, 3, dtype=torch.float64), torch.empty(2, dtype=torch.int64)
        ops = [dist.P2POp(dist.isend, head, (rank + 1) % world, g), dist.P2POp(dist.isend, x, (rank + 1) % world, g),
               dist.P2POp(dist.irecv, got, (rank - 1) % world, g), dist.P2POp(dist.irecv, y, (rank - 1) % world, g)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        return [y, got]

    def pairs(g, data):
        t = data(6)
        (dist.send if rank % 2 == 0 else dist.recv)(t, rank + 1 if rank % 2 == 0 else rank - 1, group=g)
        return [t]

    def each(fn):
        def run(g, data):
            t = data(5)
            fn(t, g)
            return [t]
        return run

    every = list(range(world))
    return [
        ("all_reduce", each(lambda t, g: dist.all_reduce(t, group=g)), every),
        ("all_reduce max", each(lambda t, g: dist.all_reduce(t, op=dist.ReduceOp.MAX, group=g)), every),
        ("all_reduce, requires grad", each(lambda t, g: dist.all_reduce(t.requires_grad_(), group=g)), every),
        ("broadcast", each(lambda t, g: dist.broadcast(t, src=1, group=g)), every),
        ("reduce", each(lambda t, g: dist.reduce(t, dst=2 % world, group=g)), [2 % world]),
        ("all_gather", lambda g, data: (lambda outs: (dist.all_gather(outs, data(3), group=g), outs)[1])(
            [torch.empty(3, dtype=torch.float64) for _ in range(world)]), every),
        ("all_gather_single", lambda g, data: (lambda out: (_ALL_GATHER(out, data(2, 3), group=g), [out])[1])(
            torch.empty(2 * world, 3, dtype=torch.float64)), every),
        ("reduce_scatter_single", lambda g, data: (lambda out: (_REDUCE_SCATTER(out, data(3 * world), group=g), [out])[1])(
            torch.empty(3, dtype=torch.float64)), every),
        ("reduce_scatter", lambda g, data: (lambda out: (dist.reduce_scatter(out, [data(2) for _ in range(world)], group=g),
                                                         [out])[1])(torch.empty(2, dtype=torch.float64)), every),
        ("all_to_all_single uneven", a2a, every),
        ("gather", lambda g, data: (lambda outs: (dist.gather(data(2), outs, dst=0, group=g), outs)[1])(
            [torch.empty(2, dtype=torch.float64) for _ in range(world)] if rank == 0 else None), [0]),
        ("scatter", lambda g, data: (lambda out: (dist.scatter(out, [data(2) for _ in range(world)] if rank == 1 else None,
                                                               src=1, group=g), [out])[1])(torch.empty(2, dtype=torch.float64)), every),
        ("batch_isend_irecv ring, int64 header", ring, every),
        ("send/recv", pairs, every),
        ("funcol all_reduce", lambda g, data: [funcol.wait_tensor(funcol.all_reduce(data(4), "sum", g))], every),
        ("funcol all_gather", lambda g, data: [funcol.wait_tensor(funcol.all_gather_tensor(data(2, 2), 0, g))], every),
        ("funcol reduce_scatter", lambda g, data: [funcol.wait_tensor(funcol.reduce_scatter_tensor(data(world * 2), "sum", 0, g))],
         every),
        ("funcol all_to_all", lambda g, data: [funcol.wait_tensor(funcol.all_to_all_single(data(world, 2), None, None, g))],
         every),
        ("all_gather_object", lambda g, data: (lambda objs: (dist.all_gather_object(objs, {"r": rank}, group=g),
                                                             [torch.tensor([o["r"] for o in objs])])[1])([None] * world), every),
    ]


def _collectives_body():
    """Each op on the plain gloo group and on a staged one, from the same data: outputs equal, and each staged."""
    rank, world = dist.get_rank(), dist.get_world_size()
    fake = FakeDeviceCopies()
    with STAGED.using(fake):
        staged = dist.new_group(backend=STAGED.register())
    assert type(staged).__name__ == "StagedGlooGroup" and dist.get_backend(staged) == STAGED_BACKEND
    differ, unstaged = [], []
    for i, (name, op, defined) in enumerate(_ops(rank, world)):
        outputs, logged = [], 0
        for group in (dist.group.WORLD, staged):
            seed = [100 * i]

            def data(*shape):
                seed[0] += 1
                return torch.randn(*shape, generator=torch.Generator().manual_seed(seed[0] + 10000 * rank), dtype=torch.float64)
            logged = len(fake.log)
            outputs.append(op(group, data))
        if rank in defined and not all(torch.equal(a, b) for a, b in zip(*outputs)):
            differ.append(name)
        if name != "all_gather_object" and not any(step == "post" for step, _ in fake.log[logged:]):
            unstaged.append(name)  # the fake logs "post" only for an op that staged something
    dist.barrier(group=staged)
    dist.destroy_process_group(staged)
    return differ, unstaged


def test_every_collective_and_send_recv_through_host_buffers_equals_plain_gloo(ranks):
    for differ, unstaged in ranks.run(4, _collectives_body):
        assert differ == []
        assert unstaged == []


def _exchange(group, rank: int, fake: FakeDeviceCopies) -> None:
    peer = 1 - rank
    x, y = torch.full((8,), float(rank), dtype=torch.float64), torch.empty(8, dtype=torch.float64)
    for work in dist.batch_isend_irecv([dist.P2POp(dist.isend, x, peer, group), dist.P2POp(dist.irecv, y, peer, group)]):
        work.wait()
    assert y.tolist() == [float(peer)] * 8


def _order_and_reuse_body():
    rank, peer = dist.get_rank(), 1 - dist.get_rank()
    fake = FakeDeviceCopies()
    with STAGED.using(fake):
        group = dist.new_group(backend=STAGED.register())
    out: dict = {}
    # one all-reduce: to host after the caller's mark, then gloo, then back to the device at wait()
    fake.log.clear()
    t = torch.full((3,), rank + 1.0, dtype=torch.float64)
    stats = (STAGED.stats.bytes_to_host, STAGED.stats.bytes_to_device)
    work = dist.all_reduce(t, group=group, async_op=True)
    out["posted"], out["t at post"] = list(fake.log), t.tolist()
    work.wait()
    out["waited"], out["t"] = list(fake.log), t.tolist()
    out["bytes"] = (STAGED.stats.bytes_to_host - stats[0], STAGED.stats.bytes_to_device - stats[1])
    # send: copied to the host at the post (a later write is not sent); recv: written at wait()
    fake.log.clear()
    if rank == 0:
        x = torch.full((4,), 7.0, dtype=torch.float64)
        work = dist.isend(x, 1, group=group)
        x.fill_(-1.0)
        work.wait()
        dist.barrier()  # the plain group: rank 1 looks at y once this send is done
    else:
        y = torch.zeros(4, dtype=torch.float64)
        work = dist.irecv(y, 0, group=group)
        dist.barrier()
        out["y before wait"] = y.tolist()  # the device tensor is written at wait(), in the caller's stream order
        work.wait()
        out["y"] = y.tolist()
    out["p2p"] = [step for step, _ in fake.log]
    # host tensors (int64 here) go to gloo as they are
    fake.log.clear()
    plain = STAGED.stats.plain_ops
    ints = torch.arange(3)
    dist.all_reduce(ints, group=group)
    out["ints"], out["ints logged"], out["plain ops"] = ints.tolist(), list(fake.log), STAGED.stats.plain_ops - plain
    # reuse: the same exchange five times makes host buffers once
    made = []
    for _ in range(5):
        _exchange(group, rank, fake)
        made.append(fake.made)
    out["made per round"] = made
    # a buffer whose copy back is still in flight is not reused; once it finished, it is
    fake.hold_fences = True
    _exchange(group, rank, fake)
    held = fake.made
    _exchange(group, rank, fake)
    out["made while held"] = fake.made - held
    fake.finish_copies()
    fake.hold_fences = False
    after = fake.made
    _exchange(group, rank, fake)
    out["made after finish"] = fake.made - after
    out["peer"] = peer
    dist.destroy_process_group(group)
    return out


def test_staging_order_buffer_reuse_and_the_staging_decision(ranks):
    r0, r1 = ranks.run(2, _order_and_reuse_body)
    for out in (r0, r1):
        # posted: mark on the caller's stream, device -> host after it, then gloo; wait: gloo, host -> device after
        # the same mark (the caller's current stream then waits on that copy)
        assert out["posted"] == [("mark", 1), ("to_host", "allreduce"), ("to_host", 1), ("post", "allreduce")]
        assert out["waited"][4:] == [("wait", "allreduce"), ("to_device", "allreduce"), ("to_device", 1)]
        assert out["t at post"] == [2.0 - out["peer"]] * 3 and out["t"] == [3.0] * 3  # written at wait(), not before
        assert out["bytes"] == (24, 24)
        assert out["ints"] == [0, 2, 4] and out["ints logged"] == [] and out["plain ops"] == 1
        assert out["made per round"] == [out["made per round"][0]] * 5 and out["made per round"][0] > 0
        assert out["made while held"] == 1  # the recv buffer is still being copied back: a new one
        assert out["made after finish"] == 0
    assert r0["p2p"] == ["mark", "to_host", "to_host", "post", "wait"]            # a send: nothing comes back
    assert r1["p2p"] == ["mark", "post", "wait", "to_device", "to_device"]       # a recv: nothing goes out
    assert r1["y before wait"] == [0.0] * 4 and r1["y"] == [7.0] * 4              # the value at the post, not -1


def _stack_body(checks: list[str], folder: str):
    """The GPU checks on staged meshes whose float64 tensors all go through host buffers; each against one process."""
    fake = FakeDeviceCopies()
    results: dict[str, str] = {}
    with STAGED.using(fake):
        before = STAGED.stats.staged_ops
        for shape in ((1, 2, 1), (2, 1, 1), (1, 1, 2)):
            DistributedManager.initialize(*shape, backend="gloo_staged")
            ran = rank_checks(checks if shape == (1, 2, 1) else ["compose"], Context(torch.device("cpu"), folder, "aot_eager"))
            results.update({(f"compose {shape}" if k == "compose" else k): v for k, v in ran.items() if k != "staging"})
            DistributedManager.shutdown()
    steps = {step for step, _ in fake.log}
    return results, STAGED.stats.staged_ops - before, steps


def test_training_on_staged_meshes_equals_one_process(ranks, tmp_path):
    checks = ["manager", "domain", "unet", "ring", "compile", "compose", "async_save"]
    for results, staged_ops, steps in ranks.run(2, _stack_body, checks, str(tmp_path), timeout=300):
        assert {k: v for k, v in results.items() if not v.startswith("PASS")} == {}
        assert len(results) == len(checks) + 2
        assert staged_ops > 100 and {"to_host", "post", "wait", "to_device"} <= steps


def test_gpu_ranks_script_runs_its_own_ranks_and_names_a_killed_one(tmp_path):
    """``gpu_check.py --ranks 2``'s launcher on CPU: a fresh job whose default group is staged, the manager check,
    and a rank that SIGKILLs itself named by its peer; the report lands in gpu_ranks_2.json."""
    out = run(["scripts/gpu_check.py", "--ranks", "2", "--device", "cpu", "--checks", "manager,kill", "--out", str(tmp_path)],
              timeout=240)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    report = json.loads((tmp_path / "gpu_ranks_2.json").read_text())
    assert list(report["checks"]) == ["manager", "kill"] and report["ranks"] == 2
    assert report["checks"]["manager"].startswith("PASS (gloo_staged on cpu, 2 ranks")
    assert report["checks"]["kill"].startswith("PASS (PeerLostError named rank 1 (batch 0, domain 1, model 0)")
    assert "manager                  PASS" in out.stdout
