"""A SLURM job that survives preemption: srun starts the ranks, a requeued job resumes from the latest checkpoint.

On a cluster (see ``examples/slurm_job.sbatch``)::

    sbatch examples/slurm_job.sbatch          # runs: srun python examples/slurm_job.py --steps 200

On this machine, with the variables srun would set (SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID,
SLURM_JOB_NODELIST, SLURM_JOB_ID), no torchrun and no SLURM needed::

    python examples/slurm_job.py --simulate 4 --steps 6 --preempt-at 4   # "preempted" after step 4
    python examples/slurm_job.py --simulate 4 --steps 6                  # the requeued job resumes at step 4

``DistributedManager.initialize`` reads SLURM's variables itself (rank, world size, the first node
of the node list as the rendezvous host, a port derived from the job id), so the same script runs
under ``srun``, under ``torchrun`` or as one plain process. Each rank trains an FSDP + tensor
parallel MLP on its part of the global batch; ``CheckpointManager`` writes ``root/step-N``
checkpoints atomically every ``--save-every`` steps, keeps the last two and moves a ``latest``
pointer only after a checkpoint is complete, so a job killed at any moment resumes from a whole
checkpoint. At the end rank 0 replays the whole run in one process and checks the weights.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import uuid

import torch
import torch.nn.functional as F
from torch import nn

from _runs import whole
from mesh3d import PREEMPTED_EXIT_CODE, DistributedManager, Plan, global_mean_loss, parallelize
from mesh3d.checkpoint import CheckpointManager
from mesh3d.parallel.init import capture_init_specs, materialize

PER_RANK, DIM, LR = 4, 32, 1e-2


def make_model() -> nn.Module:
    return nn.Sequential(nn.Linear(DIM, 4 * DIM), nn.GELU(), nn.Linear(4 * DIM, DIM), nn.Tanh(), nn.Linear(DIM, 1))


PLAN = Plan(batch="fsdp", model={"0": "colwise", "2": "rowwise"})


def global_batch(step: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    x = torch.randn(n, DIM, generator=g)
    return x, torch.sin(x[:, :4].sum(1, keepdim=True))


def run_rank(args) -> None:
    dm = DistributedManager.initialize(batch=-1, domain=1, model=args.model)
    say = print if dm.rank == 0 else (lambda *a, **k: None)
    say(f"launcher {dm.launcher}: {dm.world_size} ranks, mesh {dm.shape}", flush=True)
    with torch.device("meta"):
        model = make_model()
    specs = capture_init_specs(model)
    model = parallelize(model, PLAN, seed=0)             # the same weights on any mesh, from the seed
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    manager = CheckpointManager(args.root, keep_last=2)
    info = manager.load(model, opt)                       # None on a fresh start
    start = 0 if info is None else info.step
    say("fresh start" if info is None else f"resumed from {manager.latest()} (step {start})", flush=True)

    nb, b = dm.axis_size("batch"), dm.axis_rank("batch")
    last = min(args.steps, args.preempt_at or args.steps)
    for step in range(start, last):
        x, y = global_batch(step, nb * PER_RANK)
        mine = slice(b * PER_RANK, (b + 1) * PER_RANK)
        loss = global_mean_loss(F.mse_loss(model(x[mine]), y[mine], reduction="sum"), PER_RANK)
        loss.backward()
        opt.step()
        opt.zero_grad()
        say(f"step {step} loss {loss.item():.6f}", flush=True)
        stop = dm.should_stop()  # a stop signal on any rank (the sbatch file: --signal=USR1@120, MESH3D_STOP_SIGNALS)
        if stop or (step + 1) % args.save_every == 0 or step + 1 == last:
            manager.save(model, opt, step=step + 1)
            say(f"  saved {manager.path_for(step + 1)}", flush=True)
        if stop:
            say(f"stop signal: saved step {step + 1}; exiting with {PREEMPTED_EXIT_CODE} for the job to requeue", flush=True)
            DistributedManager.shutdown()
            sys.exit(PREEMPTED_EXIT_CODE)
    if start >= last:  # a job run again after it got this far: nothing to redo
        say(f"steps 0-{last - 1} are done already (the checkpoint is at step {start}): nothing to train", flush=True)
    if last < args.steps:
        if start < last:
            say(f"preempted after step {last - 1} (simulated); requeue the job to resume", flush=True)
    else:
        with torch.no_grad():  # a collective: every rank gathers, rank 0 checks
            weights = [whole(p) for p in model.parameters()]
        if dm.rank == 0:
            check_against_one_process(weights, specs, nb, args.steps)
    DistributedManager.shutdown()


def check_against_one_process(weights: list[torch.Tensor], specs, nb: int, steps: int) -> None:
    """Replay every step in one process from the same seed: the weights must match (fp32, 1e-5)."""
    with torch.device("meta"):
        twin = make_model()
    materialize(twin, specs, seed=0, init_fn=None, device=torch.device("cpu"))
    opt = torch.optim.AdamW(twin.parameters(), lr=LR)
    for step in range(steps):
        x, y = global_batch(step, nb * PER_RANK)
        F.mse_loss(twin(x), y).backward()
        opt.step()
        opt.zero_grad()
    diff = max(float((w - q.detach()).abs().max()) for w, q in zip(weights, twin.parameters()))
    verdict = "MATCHES" if diff <= 1e-5 else "DIFFERS from"
    print(f"final weights vs one uninterrupted process: max abs diff {diff:.1e}: {verdict} one process", flush=True)
    if diff > 1e-5:
        raise SystemExit(1)


def simulate(args) -> int:
    """Start ``--simulate`` copies of this script with the variables ``srun -n N`` would set."""
    job_id = str(uuid.uuid4().int % 100000)
    procs = []
    for rank in range(args.simulate):
        env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR")}
        env.update(SLURM_PROCID=str(rank), SLURM_NTASKS=str(args.simulate), SLURM_LOCALID=str(rank), SLURM_NODEID="0",
                   SLURM_JOB_NODELIST="localhost", SLURM_JOB_ID=job_id, OMP_NUM_THREADS="1")
        argv = list(sys.argv[1:])
        i = argv.index("--simulate")
        del argv[i:i + 2]
        procs.append(subprocess.Popen([sys.executable, os.path.abspath(__file__), *argv], env=env))
    return max(p.wait() for p in procs)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", default="runs/slurm_job/ckpt", help="checkpoint root (shared by requeued jobs)")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--save-every", type=int, default=2)
    parser.add_argument("--model", type=int, default=2, help="model axis size")
    parser.add_argument("--preempt-at", type=int, default=None, help="stop after this many steps (a simulated preemption)")
    parser.add_argument("--simulate", type=int, default=None, help="start N local ranks with srun's variables")
    args = parser.parse_args()
    if args.simulate:
        return simulate(args)
    run_rank(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
