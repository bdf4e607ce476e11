"""One rank of a small training job that is preempted or killed and resumes: what tests/test_preempt.py launches.

    python tests/preempt_job.py preempt OUT       # 2 plain processes (RANK, WORLD_SIZE, MASTER_ADDR/PORT set)
    python tests/preempt_job.py resume OUT
    torchrun --standalone --nproc-per-node 2 --max-restarts 2 tests/preempt_job.py restart OUT

Mesh (batch 1, domain 2): FSDP over the two domain ranks, a domain-sharded conv, GroupNorm over the whole field, a
``MeshDataLoader`` and a ``CheckpointManager``; fp64.

* ``preempt``: SIGUSR1 is the stop signal; rank 1 sends it to itself during step 2 (the scheduler's warning, to one
  rank only). ``manager.maybe_save`` saves step 3 at the next boundary, with the data cursor, and exits with 75.
* ``resume``: continues from the latest checkpoint to step ``STEPS``.
* ``restart`` (under torchrun --max-restarts): saves every 2 steps; in the first attempt rank 1 is SIGKILLed in the
  middle of writing the step-4 checkpoint; torchrun restarts both ranks, which resume from the latest complete
  checkpoint (step 2, not the partial step 4) and finish.

Rank 0 logs each step's loss to ``OUT/losses.jsonl`` and the final parameters to ``OUT/final-<mode>.safetensors``.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn
from torch.utils.data import Dataset

from mesh3d import DistributedManager, Plan, domain, parallelize
from mesh3d.checkpoint import CheckpointManager
from mesh3d.data import MeshDataLoader, MeshSampler

from exit_scenarios import TinyField

SAMPLES, GLOBAL_BATCH, LR, STEPS = 16, 2, 1e-2, 6


#: A conv that needs halos, GroupNorm over the whole field, and a channel MLP (the exit scenarios' model).
Field = TinyField


class FieldData(Dataset):
    """Sample ``i``: a (2, 9, 6) field and a target, drawn from a generator seeded with ``i`` (fp64)."""

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(1000 + i)
        x = torch.randn(2, 9, 6, generator=g, dtype=torch.float64)
        return {"x": x, "y": torch.roll(x, 1, 1) - 0.5 * x}


def loader() -> MeshDataLoader:
    return MeshDataLoader(FieldData(), MeshSampler(SAMPLES, global_batch_size=GLOBAL_BATCH, seed=0))


def step(model: nn.Module, opt: torch.optim.Optimizer, batch: dict[str, torch.Tensor], sharded: bool) -> float:
    x, y = batch["x"], batch["y"]
    if sharded:
        x, y = domain.shard(x, dim=2), domain.shard(y, dim=2)
    loss = F.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return float(loss.detach())


def training(mode: str, out: Path) -> None:
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    dm = DistributedManager.initialize(batch=1, domain=2, timeout=120,
                                       stop_signals=("SIGUSR1",) if mode == "preempt" else None)
    torch.set_default_dtype(torch.float64)
    with torch.device("meta"):
        model = Field()
    model = parallelize(model, Plan(batch="fsdp"), seed=0)
    opt, data = torch.optim.AdamW(model.parameters(), lr=LR), loader()
    manager = CheckpointManager(out / "ckpt", keep_last=3)
    info = manager.load(model, opt, data=data)
    done = 0 if info is None else info.step
    for batch in data:
        if mode == "preempt" and done == 2 and dm.rank == 1:
            os.kill(os.getpid(), signal.SIGUSR1)
        loss = step(model, opt, batch, sharded=True)
        done += 1
        if dm.rank == 0:
            with open(out / "losses.jsonl", "a") as f:
                f.write(json.dumps({"mode": mode, "attempt": attempt, "step": done - 1, "loss": loss}) + "\n")
        if mode == "restart":
            if done % 2 == 0:
                kill = attempt == 0 and done == 4 and dm.rank == 1
                manager.save(model, opt, step=done, data=data,
                             stage_hook=(lambda s: os.kill(os.getpid(), signal.SIGKILL) if s == "mid_shard" else None)
                             if kill else None)
        else:
            manager.maybe_save(model, opt, step=done, data=data)  # preempt: saves and exits with status 75 here
        if done == STEPS:
            break
    state = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().contiguous()
             for k, v in model.state_dict().items()}
    if dm.rank == 0:
        save_file(state, str(out / f"final-{mode}.safetensors"))
    DistributedManager.shutdown()


if __name__ == "__main__":
    training(sys.argv[1], Path(sys.argv[2]))
