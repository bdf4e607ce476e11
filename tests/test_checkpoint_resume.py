"""Train -> save -> load on a different mesh -> train equals the uninterrupted one-process run.

fp64 throughout: AdamW divides by sqrt(v) + eps, and fp32 summation-order noise near eps
would move weights by ~1e-4 and hide real bugs. Parallel runs reduce gradients in a
different order than one process, so the comparison is allclose with rtol=1e-10,
atol=1e-12 (fp64 noise is ~1e-15 relative; a wrong optimizer moment or step count moves
values by >1e-3).
"""

from __future__ import annotations

import os

import torch

from ckpt_helpers import Net, build, full_state, make_optimizer, shutdown, train_steps

STEPS, SPLIT = 5, 2


def _train_and_save(root: str, config: str) -> None:
    from mesh3d import checkpoint

    model, opt = build(config, seed=3)
    train_steps(model, opt, range(SPLIT))
    checkpoint.save(os.path.join(root, f"resume-{config}"), model, opt, step=SPLIT, extra={"next_batch": SPLIT})
    shutdown()


def _load_and_continue(root: str, source: str, config: str) -> dict[str, torch.Tensor]:
    from mesh3d import checkpoint

    model, opt = build(config, seed=77)  # different init: everything must come from the checkpoint
    info = checkpoint.load(os.path.join(root, f"resume-{source}"), model, opt, in_place=True)
    train_steps(model, opt, range(info.extra["next_batch"], STEPS))
    state = full_state(model, opt)
    shutdown()
    return state


def _reference() -> dict[str, torch.Tensor]:
    torch.manual_seed(3)
    model = Net().double()
    with torch.no_grad():
        model.counts.add_(3)
    opt = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1)
    train_steps(model, opt, range(STEPS))
    return full_state(model, opt)


def test_train_save_reshard_resume_equals_uninterrupted(ranks, tmp_path):
    root = str(tmp_path)
    want = _reference()
    ranks.run(4, _train_and_save, root, "fsdp_tp4")     # FSDP(batch=2) x TP 2, _StridedShard
    ranks.run(2, _train_and_save, root, "ddp2")         # plain replicas
    cases = [(8, "fsdp_tp4", "hsdp_tp8"), (2, "fsdp_tp4", "fsdp_d2"), (4, "ddp2", "hsdp4"), (2, "ddp2", "tp2")]
    for world, source, target in cases:
        states = ranks.run(world, _load_and_continue, root, source, target)
        for rank_state in states:
            assert set(rank_state) == set(want)
            for key in want:
                torch.testing.assert_close(rank_state[key], want[key], rtol=1e-10, atol=1e-12,
                                           msg=lambda m: f"{source}->{target} {key}: {m}")
    # And in this plain process (no process group): load and continue.
    model = Net().double()
    opt = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1)
    from mesh3d import checkpoint

    info = checkpoint.load(os.path.join(root, "resume-fsdp_tp4"), model, opt)
    assert info.step == SPLIT
    train_steps(model, opt, range(SPLIT, STEPS))
    got = full_state(model, opt)
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=1e-10, atol=1e-12)
    # The step counts really moved on (a dropped optimizer state would restart them at 0).
    assert float(got["optimizer.up.weight.step"]) == STEPS


def _other_optimizers(root: str, phase: str) -> dict[str, dict[str, torch.Tensor]]:
    """SGD (momentum, nesterov) and Adam: save on FSDP(2), reload on TP(2), continue."""
    from mesh3d import checkpoint

    states = {}
    for kind in ("sgd", "adam"):
        if phase == "save":
            model, opt = build("fsdp_b2", seed=3, optim=kind)
            train_steps(model, opt, range(SPLIT))
            checkpoint.save(os.path.join(root, f"opt-{kind}"), model, opt, step=SPLIT)
        else:
            model, opt = build("tp2", seed=8, optim=kind)
            checkpoint.load(os.path.join(root, f"opt-{kind}"), model, opt)
            train_steps(model, opt, range(SPLIT, STEPS))
            states[kind] = full_state(model, opt)
        shutdown()
    return states


def test_sgd_momentum_and_adam_resume_across_meshes(ranks, tmp_path):
    ranks.run(2, _other_optimizers, str(tmp_path), "save")
    results = ranks.run(2, _other_optimizers, str(tmp_path), "load")
    for kind in ("sgd", "adam"):
        torch.manual_seed(3)
        model = Net().double()
        with torch.no_grad():
            model.counts.add_(3)
        opt = make_optimizer(model, kind)
        train_steps(model, opt, range(STEPS))
        want = full_state(model, opt)
        assert any(k.endswith("momentum_buffer" if kind == "sgd" else "exp_avg_sq") for k in want)
        for states in results:
            assert set(states[kind]) == set(want)
            for key in want:
                torch.testing.assert_close(states[kind][key], want[key], rtol=1e-10, atol=1e-12,
                                           msg=lambda m: f"{kind} {key}: {m}")


def test_loading_into_a_model_with_gradients_and_no_optimizer_state_restores_both(tmp_path):
    """A backward before the load (a warm-up step, a sanity check) used to leave torch's optimizer template empty,
    and the loaded optimizer state was read into the parameters themselves: silently wrong weights."""
    from mesh3d import checkpoint

    for make_opt in (lambda ps: torch.optim.AdamW(ps, lr=0.1), lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9)):
        torch.manual_seed(0)
        saved = torch.nn.Linear(4, 3).double()
        opt = make_opt(saved.parameters())
        saved(torch.randn(2, 4, dtype=torch.float64)).sum().backward()
        opt.step()
        path = str(tmp_path / f"ck-{type(opt).__name__}")
        checkpoint.save(path, saved, opt, step=1)
        torch.manual_seed(1)
        target = torch.nn.Linear(4, 3).double()
        target_opt = make_opt(target.parameters())
        target(torch.randn(2, 4, dtype=torch.float64)).sum().backward()
        grads = [p.grad.clone() for p in target.parameters()]
        checkpoint.load(path, target, target_opt)
        for a, b, g in zip(saved.parameters(), target.parameters(), grads):
            assert torch.equal(a, b) and torch.equal(b.grad, g)
            assert all(torch.equal(opt.state[a][k], target_opt.state[b][k]) for k in opt.state[a])
