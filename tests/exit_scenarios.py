"""Short multi-rank scripts that end without ``DistributedManager.shutdown()``, run as real processes.

Used by tests/test_clean_exit.py and scripts/exit_soak.py (issue: the process aborted at exit with
"terminate called without an active exception"). One rank per process::

    torchrun --standalone --nproc-per-node 2 tests/exit_scenarios.py collective OUT
    MESH3D_EXIT_STORE=/tmp/store RANK=r WORLD_SIZE=4 python tests/exit_scenarios.py mixed OUT

Scenarios:
* ``collective``: the manager makes the default group (torchrun); an all-reduce is the last thing before exit.
* ``mixed``: 4 ranks, mesh (batch 1, domain 2, model 2): FSDP over batch x domain, tensor parallel on model,
  a domain-sharded conv; one AdamW step; a background save left pending at exit (its writer is slowed on
  purpose). Rank 0 writes the one-process twin's parameters to ``OUT/twin.safetensors`` to compare with.
* ``raise``: like ``collective``, then every rank raises ``RuntimeError("planned failure")``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn

from mesh3d import DistributedManager, Plan, checkpoint, domain, parallelize
from mesh3d.parallel.init import capture_init_specs, materialize


class TinyField(nn.Module):
    """A conv that needs halos, GroupNorm over the whole field, and a channel MLP for tensor parallelism."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 4, 3, padding=1)
        self.norm = nn.GroupNorm(1, 4)
        self.up, self.down = nn.Linear(4, 8), nn.Linear(8, 2)

    def forward(self, x):
        h = self.norm(self.conv(x)).permute(0, 2, 3, 1)
        return self.down(F.gelu(self.up(h))).permute(0, 3, 1, 2).contiguous()


def _join() -> DistributedManager:
    store = os.environ.get("MESH3D_EXIT_STORE")
    if store:  # a group the script makes itself (no port): the manager builds its mesh on it
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=int(os.environ["RANK"]),
                                world_size=int(os.environ["WORLD_SIZE"]))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    return DistributedManager.initialize(batch=1, domain=2, model=world // 2)


def collective(out: Path) -> None:
    _join()
    total = torch.ones(3)
    dist.all_reduce(total)
    print(f"rank {dist.get_rank()} sum {int(total.sum())}", flush=True)


def mixed(out: Path) -> None:
    dm = _join()
    torch.set_default_dtype(torch.float64)
    with torch.device("meta"):
        model = TinyField()
    specs = capture_init_specs(model)
    model = parallelize(model, Plan(batch="fsdp", model={"up": "colwise", "down": "rowwise"}), seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(1, 2, 9, 6, generator=g), torch.randn(1, 2, 9, 6, generator=g)
    sizes = (5, 4)
    F.mse_loss(model(domain.shard(x, dim=2, sizes=sizes)), domain.shard(y, dim=2, sizes=sizes)).backward()
    opt.step()
    if dm.rank == 0:
        with torch.device("meta"):
            twin = TinyField()
        materialize(twin, specs, seed=0, init_fn=None, device=torch.device("cpu"))
        twin_opt = torch.optim.AdamW(twin.parameters(), lr=1e-2)
        F.mse_loss(twin(x), y).backward()
        twin_opt.step()
        save_file({k: v.detach().contiguous() for k, v in twin.state_dict().items()}, str(out / "twin.safetensors"))
    checkpoint.async_save(out / "ckpt", model, opt, step=1,
                          stage_hook=lambda stage: time.sleep(0.3) if stage == "staged" else None)
    print(f"rank {dm.rank} returned with the save pending", flush=True)


def failing(out: Path) -> None:
    collective(out)
    raise RuntimeError("planned failure")


SCENARIOS = {"collective": collective, "mixed": mixed, "raise": failing}
#: The abort's signature in a rank's output (and its exit status: -6, SIGABRT).
ABORT_MARKERS = ("terminate called", "Fatal Python error", "SIGABRT")


@dataclass
class Launch:
    """One run of a scenario: each rank's exit status and output (torchrun: one combined status and output)."""

    returncodes: list[int]
    output: str

    @property
    def aborted(self) -> bool:
        return any(code in (-6, 134) for code in self.returncodes) or any(m in self.output for m in ABORT_MARKERS)


def launch(scenario: str, world: int, out: Path, *, torchrun: bool, timeout_s: float = 180) -> Launch:
    """Run ``scenario`` on ``world`` fresh processes: under ``torchrun --standalone`` (the launcher picks its port;
    the manager makes the default group), or as plain processes joining through a file store (no port at all)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "TORCHELASTIC_", "MASTER_"))}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(Path(__file__).resolve().parents[1]),
                                                                  env.get("PYTHONPATH", "")]))
    script = [str(Path(__file__).resolve()), scenario, str(out)]
    if torchrun:
        done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                               str(world), *script], env=env, capture_output=True, text=True, timeout=timeout_s)
        return Launch([done.returncode], done.stdout + done.stderr)
    store = tempfile.NamedTemporaryFile(prefix="mesh3d-exit-store-", delete=False).name
    os.unlink(store)  # the file store makes it; it must not exist beforehand
    procs = [subprocess.Popen([sys.executable, *script], env={**env, "MESH3D_EXIT_STORE": store, "RANK": str(r),
                                                               "WORLD_SIZE": str(world), "LOCAL_RANK": str(r)},
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(world)]
    try:
        outputs = [p.communicate(timeout=timeout_s)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    return Launch([p.returncode for p in procs], "".join(f"--- rank {r}\n{o}" for r, o in enumerate(outputs)))


if __name__ == "__main__":
    SCENARIOS[sys.argv[1]](Path(sys.argv[2]))
