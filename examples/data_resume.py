"""Train a 3-D field model on slabs read from .npy files, save, and resume exactly on another mesh.

Usage::

    torchrun --nproc-per-node 4 examples/data_resume.py train  --root runs/slabs --mesh 2,2,1 --steps 3
    torchrun --nproc-per-node 3 examples/data_resume.py resume --root runs/slabs --mesh 1,3,1 --steps 4

Each domain rank reads only its depth slab of every sample (``SlabDataset`` over ``.npy`` files on
disk, read with ``pread``: the script prints the bytes each rank read). ``MeshSampler`` fixes one
global sample order per epoch from the seed; ``checkpoint.save(..., data=loader)`` stores its
cursor as JSON. ``resume`` loads it on a mesh with another batch size, domain size and world size
and continues the *same* global batches: on rank 0 it prints the global sample ids and the loss of
each step beside those of the uninterrupted run (computed here in one process), and exits non-zero
unless they are equal (fp64).
"""

from __future__ import annotations

import argparse
import os

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from _runs import fresh_output
from mesh3d import DistributedManager, Plan, checkpoint, parallelize
from mesh3d.data import MeshDataLoader, MeshSampler, SlabDataset

N, DEPTH, SIDE, GLOBAL_BATCH, SEED, LR = 10, 10, 6, 4, 7, 0.02   # 2 steps per epoch (10 samples, drop the tail)


def write_dataset(root: str) -> dict[str, str]:
    """(N, 1, D, H, W) noisy fields and their one-step diffusion, as fp64 .npy files."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((N, 1, DEPTH, SIDE, SIDE))
    y = x + 0.1 * sum(np.roll(x, s, a) - x for a in (2, 3, 4) for s in (1, -1))
    paths = {"x": os.path.join(root, "x.npy"), "y": os.path.join(root, "y.npy")}
    for name, array in (("x", x), ("y", y)):
        np.save(paths[name] + ".tmp.npy", array)
        os.replace(paths[name] + ".tmp.npy", paths[name])
    return paths


def field_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv3d(1, 4, 3, padding=1, padding_mode="circular"), nn.Tanh(),
                         nn.Conv3d(4, 1, 3, padding=1)).double()


def run_steps(model, loader, dataset, steps: int, batch_group=None, batch_ranks: int = 1) -> list[tuple[list[int], float]]:
    """``steps`` AdamW steps; per step the global sample ids (gathered from the batches) and the global loss."""
    opt = model.optimizer
    out: list[tuple[list[int], float]] = []
    while len(out) < steps:
        for batch in loader:
            local_ids = batch["index"]
            batch = dataset.to_domain(batch) if batch_group is not None else batch
            loss = F.mse_loss(model(batch["x"]), batch["y"])
            loss.backward()
            opt.step()
            opt.zero_grad()
            value = loss.detach()
            value = value.to_local().clone() if hasattr(value, "to_local") else value
            ids = local_ids
            if batch_ranks > 1:
                dist.all_reduce(value, group=batch_group)
                value /= batch_ranks
                parts = [torch.empty_like(local_ids) for _ in range(batch_ranks)]
                dist.all_gather(parts, local_ids, group=batch_group)
                ids = torch.stack(parts, dim=1).reshape(-1)  # rank b holds positions b, b+B, ... of the batch
            out.append((ids.tolist(), float(value)))
            if len(out) == steps:
                break
    return out


def uninterrupted(paths: dict[str, str], steps: int) -> list[tuple[list[int], float]]:
    """The same training in this one process, never interrupted: one batch rank, one domain rank."""
    dataset = SlabDataset(paths, dim=2, domain=(1, 0))
    loader = MeshDataLoader(dataset, MeshSampler(N, GLOBAL_BATCH, seed=SEED, batch_ranks=1, batch_rank=0))
    model = field_model()
    model.optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    return run_steps(model, loader, dataset, steps)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", choices=["train", "resume"])
    parser.add_argument("--root", required=True, help="where the dataset and the checkpoint live")
    parser.add_argument("--mesh", default="2,2,1", help="batch,domain,model")
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()

    dm = DistributedManager.initialize(*(int(v) for v in args.mesh.split(",")))
    paths = {"x": os.path.join(args.root, "x.npy"), "y": os.path.join(args.root, "y.npy")}
    if args.mode == "train" and dm.rank == 0:  # the others wait at the barrier below
        fresh_output(args.root, "examples/data_resume.py", ["x.npy", "y.npy", "ckpt"])  # a rerun: afresh
        write_dataset(args.root)
    dist.barrier()

    dataset = SlabDataset(paths, dim=2)                    # this rank's depth rows of each sample, nothing else
    loader = MeshDataLoader(dataset, MeshSampler(len(dataset), GLOBAL_BATCH, seed=SEED), num_workers=0)
    model = parallelize(field_model(), Plan(batch="fsdp"))
    model.optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    ckpt = os.path.join(args.root, "ckpt")
    done = 0
    if args.mode == "resume":
        info = checkpoint.load(ckpt, model, model.optimizer, data=loader)
        done = info.step
        if dm.rank == 0:
            print(f"resumed step {done} on mesh {tuple(dm.mesh.shape)} at epoch {info.data['epoch']}, position "
                  f"{info.data['position']} of the global order", flush=True)
    nb = dm.axis_size("batch")
    record = run_steps(model, loader, dataset, args.steps, dm.group("batch"), nb)
    if args.mode == "train":
        checkpoint.save(ckpt, model, model.optimizer, step=args.steps, data=loader)
    sizes = dataset.sizes["x"]
    print(f"rank {dm.rank} (domain rank {dm.axis_rank('domain')} of {sizes}) read {dataset.bytes_read} bytes, "
          f"{dataset.bytes_read / (2 * len(record) * GLOBAL_BATCH // nb * DEPTH * SIDE * SIDE * 8):.3f} of its samples",
          flush=True)
    ok = True
    if dm.rank == 0:
        want = uninterrupted(paths, done + args.steps)[done:]
        for step, ((ids, loss), (ref_ids, ref_loss)) in enumerate(zip(record, want), start=done):
            same = ids == ref_ids and abs(loss - ref_loss) <= 1e-10 * abs(ref_loss)
            ok &= same
            print(f"step {step} ids {ids} loss {loss:.12f} | uninterrupted ids {ref_ids} loss {ref_loss:.12f}"
                  f"{'' if same else '  <-- DIFFERS'}", flush=True)
        print(f"mesh {tuple(dm.mesh.shape)}: {'MATCHES the uninterrupted run' if ok else 'DIFFERS from the uninterrupted run'}")
    flag = torch.tensor(int(ok))
    dist.broadcast(flag, src=0)
    DistributedManager.shutdown()
    return 0 if int(flag) else 1


if __name__ == "__main__":
    raise SystemExit(main())
