"""Save on one mesh, resume on another, export to Hugging Face, check the export.

Usage (any world sizes; the second run may differ from the first)::

    torchrun --nproc-per-node 8 examples/checkpoint_reshard.py save   /tmp/ck --mesh 2,2,2
    torchrun --nproc-per-node 4 examples/checkpoint_reshard.py resume /tmp/ck --mesh 2,1,2
    python examples/checkpoint_reshard.py check /tmp/ck

``save`` trains 3 AdamW steps (TP on the model axis, FSDP on batch x domain) and saves
``/tmp/ck/step-00000003``; ``resume`` loads it on a different mesh, trains 2 more steps and
saves step 5; ``check`` coalesces step 5 to ``/tmp/ck/hf`` (one process, no launcher) and
compares it with the parameters that ``resume`` gathered, printing ``coalesced == trained``. A phase run again
replaces what it and the later phases wrote under the root (which the first run marked as the example's own).
"""

from __future__ import annotations

import argparse
import os

import safetensors.torch
import torch
from torch import nn

from _runs import fresh_output, whole


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(13, 8)
        self.up = nn.Linear(8, 16)
        self.down = nn.Linear(16, 8)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(self.emb(idx))))


def build(mesh: tuple[int, int, int]):
    from mesh3d import DistributedManager, Plan, parallelize

    dm = DistributedManager.initialize(*mesh)
    torch.manual_seed(0)
    tp = {"up": "colwise", "down": "rowwise"} if dm.axis_size("model") > 1 else {}
    model = parallelize(Net().double(), Plan(model=tp, units=["emb", "up", "down"]))  # TP, then FSDP units, root last
    return model, torch.optim.AdamW(model.parameters(), lr=0.05)


def train(model, opt, steps: range) -> None:
    for step in steps:
        idx = torch.randint(0, 13, (6,), generator=torch.Generator().manual_seed(step))
        model(idx).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()


#: What the phases write under root, in the order they write it, and each phase's first. Without step 5 (and with
#: ``latest`` still naming it) the manager finds step 3 again: a rerun of resume resumes from the saved step 3.
OUTPUTS = ["step-00000003", "latest", "step-00000005", "trained.safetensors", "hf"]
PHASE_FIRST = {"save": "step-00000003", "resume": "step-00000005", "check": "hf"}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("phase", choices=["save", "resume", "check"])
    parser.add_argument("root")
    parser.add_argument("--mesh", default="-1,1,1", help="batch,domain,model")
    args = parser.parse_args()
    from mesh3d import DistributedManager, checkpoint
    from mesh3d.checkpoint import CheckpointManager

    manager = CheckpointManager(args.root, keep_last=2)
    if int(os.environ.get("RANK", "0")) == 0:  # before the mesh exists: the other ranks write only after collectives
        # A rerun of a phase replaces what that phase and the later ones wrote (checkpoints are never overwritten).
        fresh_output(args.root, "examples/checkpoint_reshard.py", OUTPUTS[OUTPUTS.index(PHASE_FIRST[args.phase]):],
                     known=OUTPUTS)
    if args.phase == "check":
        out = os.path.join(args.root, "hf")
        checkpoint.coalesce(manager.latest(), out)
        got = safetensors.torch.load_file(os.path.join(out, "model.safetensors"))
        want = safetensors.torch.load_file(os.path.join(args.root, "trained.safetensors"))
        same = got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
        print(f"coalesced == trained: {same} ({len(got)} tensors)")
        raise SystemExit(0 if same else 1)
    model, opt = build(tuple(int(x) for x in args.mesh.split(",")))
    if args.phase == "save":
        train(model, opt, range(3))
        manager.save(model, opt, step=3)
    else:
        info = manager.load(model, opt)
        print(f"rank {DistributedManager().rank}: resumed step {info.step} saved on mesh {info.mesh}")
        train(model, opt, range(info.step, 5))
        manager.save(model, opt, step=5)
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        full = {k: whole(v).clone() for k, v in get_model_state_dict(model).items()}  # a collective on every rank
        if DistributedManager().rank == 0:
            safetensors.torch.save_file(full, os.path.join(args.root, "trained.safetensors"))
    DistributedManager.shutdown()


if __name__ == "__main__":
    main()
