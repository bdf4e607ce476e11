"""mesh3d's main demo: one model on all three axes beside one process; checkpoint, resume on another mesh, export.

``scripts/demo.sh`` runs the three phases in order (8 CPU ranks, then 4, then one process)::

    torchrun --nproc-per-node 8 examples/demo_3d.py train  --out runs/demo   # mesh (batch 2, domain 2, model 2)
    torchrun --nproc-per-node 4 examples/demo_3d.py resume --out runs/demo   # mesh (batch 1, domain 2, model 2)
    python examples/demo_3d.py export --out runs/demo                        # no launcher: HF safetensors + summary

The model learns one explicit step of the heat equation on a periodic 2-D field (a toy weather/CFD
surrogate). ``FieldNet`` is ConvNeXt-like: a depthwise 5x5 conv mixes space, GroupNorm takes global
statistics, and a channel MLP (Linear on channels-last) mixes channels. On the mesh:

* **batch** (FSDP2): each batch rank trains on its own samples of the global batch;
* **domain**: each sample's rows are split over the domain ranks, unevenly (``domain.shard``); the
  convs exchange halos, GroupNorm reduces its statistics over the whole field;
* **model** (tensor parallel): the channel MLP is colwise/rowwise over the model ranks.

Rank 0 also trains the same weights (mesh-independent initialization) in one process on the whole
global batch, and every step prints both losses. The resume phase loads the checkpoint onto a mesh
of another shape and must continue exactly like the uninterrupted one-process run; the export
phase coalesces the final checkpoint into one ``model.safetensors`` and loads it into a plain model.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from mesh3d import DistributedManager, Plan, checkpoint, domain, parallelize
from mesh3d.parallel.init import capture_init_specs, materialize

CHANNELS, FIELD, GLOBAL_BATCH, LR = 2, 30, 4, 3e-3
TRAIN_STEPS, RESUME_STEPS = 4, 3
#: Tolerance of the parallel loss vs the one-process loss (relative). fp32: the two differ only in
#: summation order (halo convs, GroupNorm statistics, reduce-scatter), a few ulps per op.
RTOL = 1e-4


class Block(nn.Module):
    def __init__(self, width: int, hidden: int) -> None:
        super().__init__()
        self.mix = nn.Conv2d(width, width, 5, padding=2, groups=width, padding_mode="circular")
        self.norm = nn.GroupNorm(1, width)
        self.up, self.down = nn.Linear(width, hidden), nn.Linear(hidden, width)

    def forward(self, x):
        h = self.norm(self.mix(x)).permute(0, 2, 3, 1)           # channels-last for the channel MLP
        return x + self.down(F.gelu(self.up(h))).permute(0, 3, 1, 2)


class FieldNet(nn.Module):
    def __init__(self, width: int = 16, hidden: int = 64, depth: int = 2) -> None:
        super().__init__()
        self.stem = nn.Conv2d(CHANNELS, width, 3, padding=1, padding_mode="circular")
        self.blocks = nn.ModuleList(Block(width, hidden) for _ in range(depth))
        self.head = nn.Conv2d(width, CHANNELS, 1)

    def forward(self, x):
        h = self.stem(x)
        for block in self.blocks:
            h = block(h)
        return x + self.head(h)                                   # predicts the next state


PLAN = Plan(batch="fsdp", model={"blocks.*.up": "colwise", "blocks.*.down": "rowwise"})


def global_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Smooth random periodic fields and their next state under one explicit heat-equation step."""
    g = torch.Generator().manual_seed(100 + step)
    k = torch.arange(1, 4, dtype=torch.float32)
    grid = torch.linspace(0, 2 * torch.pi, FIELD + 1)[:-1]
    amp = torch.randn(GLOBAL_BATCH, CHANNELS, 3, 3, generator=g)
    modes = torch.einsum("bcij,iy,jx->bcyx", amp, torch.sin(k[:, None] * grid), torch.cos(k[:, None] * grid))
    lap = sum(modes.roll(s, d) for s in (1, -1) for d in (2, 3)) - 4 * modes
    return modes, modes + 0.2 * lap


def one_process_twin(specs) -> tuple[nn.Module, torch.optim.Optimizer]:
    """The very weights the mesh got (same seed, mesh-independent init), in one process."""
    with torch.device("meta"):
        twin = FieldNet()
    materialize(twin, specs, seed=0, init_fn=None, device=torch.device("cpu"))
    return twin, torch.optim.AdamW(twin.parameters(), lr=LR)


def train(model, opt, twin, twin_opt, steps: range, dm: DistributedManager, log) -> list[dict]:
    nb, b = dm.axis_size("batch"), dm.axis_rank("batch")
    per_rank = GLOBAL_BATCH // nb
    sizes = uneven_sizes(dm.axis_size("domain"))
    rows = []
    for step in steps:
        t0 = time.perf_counter()
        x, y = global_batch(step)
        mine = slice(b * per_rank, (b + 1) * per_rank)
        xs, ys = domain.shard(x[mine], dim=2, sizes=sizes), domain.shard(y[mine], dim=2, sizes=sizes)
        loss = F.mse_loss(model(xs), ys)                  # this batch rank's mean, on every domain rank
        loss.backward()                                   # FSDP: grads averaged over batch, summed over domain
        opt.step()
        opt.zero_grad()
        shown = loss.detach().to_local().clone()
        dist.all_reduce(shown, group=dm.group("batch"))
        row = {"step": step, "loss": float(shown) / nb, "seconds": time.perf_counter() - t0}
        if twin is not None:
            ref = F.mse_loss(twin(x), y)
            ref.backward()
            twin_opt.step()
            twin_opt.zero_grad()
            row["one_process"] = ref.item()
            row["rel_diff"] = abs(row["loss"] - row["one_process"]) / row["one_process"]
            log(f"step {step}  loss {row['loss']:.6f}  one-process {row['one_process']:.6f}  "
                f"rel diff {row['rel_diff']:.1e}  ({row['seconds']:.2f} s)")
        rows.append(row)
    return rows


def uneven_sizes(n_domain: int) -> tuple[int, ...] | None:
    """Rows per domain rank: deliberately uneven (the first rank gets 4 more) to show it does not matter."""
    if n_domain == 1:
        return None
    base = (FIELD - 4) // n_domain
    sizes = [base] * n_domain
    sizes[0] += FIELD - sum(sizes)
    return tuple(sizes)


def build(dm: DistributedManager):
    with torch.device("meta"):
        model = FieldNet()
    specs = capture_init_specs(model)
    model = parallelize(model, PLAN, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    return model, opt, specs


def phase_train(args, out: Path) -> None:
    dm = DistributedManager.initialize(batch=args.batch, domain=args.domain, model=args.model)
    log = rank0_print
    log(f"[train] {dm.world_size} ranks, mesh {dm.shape}, field {FIELD}x{FIELD} "
        f"split into rows {uneven_sizes(dm.axis_size('domain'))}, global batch {GLOBAL_BATCH}")
    t0 = time.perf_counter()
    model, opt, specs = build(dm)
    twin, twin_opt = one_process_twin(specs) if dm.rank == 0 else (None, None)
    rows = train(model, opt, twin, twin_opt, range(TRAIN_STEPS), dm, log)
    t_save = time.perf_counter()
    checkpoint.save(out / "ckpt-train", model, opt, step=TRAIN_STEPS, extra={"mesh": dm.shape})
    t_end = time.perf_counter()
    if dm.rank == 0:
        size = sum(f.stat().st_size for f in (out / "ckpt-train").iterdir())
        log(f"[train] saved {out / 'ckpt-train'} ({size / 1e3:.1f} kB) in {t_end - t_save:.2f} s")
        _write(out / "train.json", {"mesh": dm.shape, "rows": rows, "seconds": t_end - t0,
                                   "save_seconds": t_end - t_save, "ckpt_bytes": size})
    DistributedManager.shutdown()


def phase_resume(args, out: Path) -> None:
    dm = DistributedManager.initialize(batch=args.batch, domain=args.domain, model=args.model)
    log = rank0_print
    log(f"[resume] {dm.world_size} ranks, mesh {dm.shape}: loading a checkpoint "
        "saved on another mesh")
    t0 = time.perf_counter()
    model, opt, specs = build(dm)
    info = checkpoint.load(out / "ckpt-train", model, opt)
    t_load = time.perf_counter() - t0
    read = torch.tensor([info.bytes_read, info.bytes_needed], dtype=torch.float64)
    dist.all_reduce(read)
    twin = twin_opt = None
    if dm.rank == 0:   # the uninterrupted one-process run, replayed up to the checkpoint
        twin, twin_opt = one_process_twin(specs)
        for step in range(info.step):
            x, y = global_batch(step)
            F.mse_loss(twin(x), y).backward()
            twin_opt.step()
            twin_opt.zero_grad()
    log(f"[resume] step {info.step} restored in {t_load:.2f} s; read {read[0] / 1e3:.1f} kB for "
        f"{read[1] / 1e3:.1f} kB needed (saved on mesh {info.extra['mesh']})")
    rows = train(model, opt, twin, twin_opt, range(info.step, info.step + RESUME_STEPS), dm, log)
    checkpoint.save(out / "ckpt-final", model, opt, step=info.step + RESUME_STEPS)
    if dm.rank == 0:
        from safetensors.torch import save_file

        save_file({n: p.detach().contiguous() for n, p in twin.state_dict().items()}, str(out / "one_process.safetensors"))
        _write(out / "resume.json", {"mesh": dm.shape, "rows": rows, "load_seconds": t_load,
                                    "bytes_read": float(read[0]), "bytes_needed": float(read[1]),
                                    "seconds": time.perf_counter() - t0})
    DistributedManager.shutdown()


def phase_export(args, out: Path) -> None:
    from safetensors.torch import load_file

    t0 = time.perf_counter()
    hf = out / "hf"
    files = checkpoint.coalesce(out / "ckpt-final", hf)
    exported = load_file(str(hf / files[0]))
    plain, twin = FieldNet(), FieldNet()
    keys = plain.load_state_dict(exported, strict=False)  # keys must be the plain model's own names
    want = load_file(str(out / "one_process.safetensors"))
    twin.load_state_dict(want)
    param_diff = max(float((exported[k] - want[k]).abs().max()) for k in want)
    x, y = global_batch(TRAIN_STEPS + RESUME_STEPS)       # a batch neither run has seen
    with torch.no_grad():
        plain_loss, twin_loss = F.mse_loss(plain(x), y).item(), F.mse_loss(twin(x), y).item()
    seconds = time.perf_counter() - t0
    train_rec, resume_rec = _read(out / "train.json"), _read(out / "resume.json")
    rows = train_rec["rows"] + resume_rec["rows"]
    worst = max(r["rel_diff"] for r in rows)
    checks = {
        f"every step's loss equals one process (rel diff <= {RTOL:g})": worst <= RTOL,
        "resumed run continues the uninterrupted one (same loss trajectory)": all(r["rel_diff"] <= RTOL for r in resume_rec["rows"]),
        "exported model.safetensors equals the one-process weights (max abs diff <= 1e-5)": param_diff <= 1e-5,
        "exported keys are the plain model's state-dict keys": not keys.missing_keys and not keys.unexpected_keys,
        "the exported plain model predicts like the one-process model (rel diff <= 1e-5)":
            abs(plain_loss - twin_loss) <= 1e-5 * twin_loss,
        "the loss went down": rows[-1]["loss"] < rows[0]["loss"],
    }
    print("\n=== mesh3d demo summary ===")
    print(f"train  on mesh {tuple(train_rec['mesh'].values())}: {len(train_rec['rows'])} steps, {train_rec['seconds']:.1f} s "
          f"(checkpoint {train_rec['ckpt_bytes'] / 1e3:.1f} kB written in {train_rec['save_seconds']:.2f} s)")
    print(f"resume on mesh {tuple(resume_rec['mesh'].values())}: loaded in {resume_rec['load_seconds']:.2f} s, read "
          f"{resume_rec['bytes_read'] / 1e3:.1f} kB of {resume_rec['bytes_needed'] / 1e3:.1f} kB needed; "
          f"{len(resume_rec['rows'])} more steps")
    print(f"export: {hf / files[0]} ({(hf / files[0]).stat().st_size / 1e3:.1f} kB) in {seconds:.2f} s; "
          f"plain model's loss on an unseen batch {plain_loss:.6f} (one process {twin_loss:.6f})")
    print(f"worst loss rel diff vs one process: {worst:.1e}; weights max abs diff: {param_diff:.1e}")
    for name, ok in checks.items():
        print(f"  [{'ok' if ok else 'FAIL'}] {name}")
    if not all(checks.values()):
        raise SystemExit(1)


def rank0_print(msg: str) -> None:
    if dist.get_rank() == 0:
        print(msg, flush=True)


def _write(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=1))


def _read(path: Path) -> dict:
    return json.loads(path.read_text())


#: What the phases write under --out, in the order they write it, and each phase's first.
OUTPUTS = ["ckpt-train", "train.json", "ckpt-final", "one_process.safetensors", "resume.json", "hf"]
PHASE_FIRST = {"train": "ckpt-train", "resume": "ckpt-final", "export": "hf"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("phase", choices=["train", "resume", "export"])
    parser.add_argument("--out", default="runs/demo", help="directory for checkpoints and results")
    parser.add_argument("--batch", type=int, default=-1)
    parser.add_argument("--domain", type=int, default=2)
    parser.add_argument("--model", type=int, default=2)
    args = parser.parse_args()
    out = Path(args.out)
    if int(os.environ.get("RANK", "0")) == 0:  # before the mesh exists: the other ranks write only after collectives
        # NOTE: imported here: examples/ is on sys.path when this file runs, not when tools import it by path.
        from _runs import fresh_output

        # A rerun of a phase replaces what that phase and the later ones wrote (checkpoints are never overwritten).
        fresh_output(out, "examples/demo_3d.py", OUTPUTS[OUTPUTS.index(PHASE_FIRST[args.phase]):],
                     known=OUTPUTS)
    {"train": phase_train, "resume": phase_resume, "export": phase_export}[args.phase](args, out)


if __name__ == "__main__":
    main()
