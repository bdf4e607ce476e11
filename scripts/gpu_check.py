#!/usr/bin/env python
"""GPU check: mesh3d's nccl/CUDA paths on one GPU, each against the same work done without mesh3d.

The test suite runs on CPU (gloo); this script is for a machine with a GPU. It runs a world of one
on nccl (no launcher needed) and checks, printing one line each and exiting 1 if any fails:

* the manager picks nccl and ``cuda:LOCAL_RANK`` and builds its three axes;
* ``parallelize`` (FSDP + "replicate" TP styles on a size-1 model axis) trains like the plain model;
* a domain tensor on CUDA (conv, GroupNorm, loss) equals the plain computation;
* a checkpoint of CUDA state saves, verifies, loads into a fresh parallelized model and coalesces;
* ``async_save`` of CUDA state holds the state queued before the call, not what is queued after it returns;
* ``load_pretrained`` of a bf16 safetensors file lands, cast to fp32, in FSDP shards on the GPU;
* ``MeshStrategy`` fits a LightningModule on ``accelerator="gpu"`` like plain Lightning (if installed);
* ``torch.compile`` (Inductor) of a U-Net and a strided stack on a domain tensor trains like eager plain torch;
* ``mesh3d plan``'s step peak within 0.9-1.1 of the measured one for the cases of issue 49
  (``scripts/gpu_plan_check.py``: the U-Net, the decoder in fp32 and ``PLAN_BF16``, a 2-D conv stack in fp32 and
  FSDP bf16; planned and measured MiB per case in the JSON under ``plan_vs_measured``);
* attention on the fused CUDA kernels (issue 50, ``scripts/gpu_attention_check.py``): a loopback ring equal to SDPA
  (fp64 to 1e-12; fp32, bf16, fp16 as close as SDPA itself; plain, causal, band mask, bias, GQA, window; uneven
  blocks and an empty one), one ring block's forward + backward against fused SDPA's (time and peak memory, bf16
  and fp32, L = 4096 and 16384, against issue 50's targets), and unchanged Hugging Face ViT, Swin, GPT-2 and Llama
  at D=1 through ``domain.shard`` against plain, eager and compiled, fp32 and bf16 (JSON under ``attention``;
  ``--docs docs/benchmarks.md`` writes its section there);

and times, on the GPU, a 1 GB checkpoint save/load against ``torch.distributed.checkpoint``, and the compile rows
of ``bench_compile.py`` at D=1 (``scripts/gpu_compile.py``: compiled domain against compiled plain, with and
without CUDA graphs; compile time, graph breaks, recompiles, peak memory).

With ``--ranks N`` it runs the multi-rank checks instead: N ranks of its own share the GPU over staged gloo
(``scripts/gpu_ranks.py``: domain stack, U-Net, ring attention, compile at D=N, FSDP + TP + domain, async_save, a
killed rank named), writing gpu_ranks_N.json.

Usage::

    python scripts/gpu_check.py                 # writes gpu_check.json beside --out
    python scripts/gpu_check.py --out /tmp/gpu  --ckpt-mb 1024 --compile-repeats 100
    python scripts/gpu_check.py --ranks 2 && python scripts/gpu_check.py --ranks 3      # several ranks on one GPU
    python scripts/gpu_check.py --only attention --docs docs/benchmarks.md               # issue 50's part, ~4 minutes
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import shutil
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch
import safetensors.torch
import torch.nn.functional as F
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from gpu_attention_check import markdown as attention_markdown, run as run_attention  # noqa: E402
from gpu_compile import check_compiled_equals_eager, host_overhead, time_compile  # noqa: E402
from gpu_plan_check import run_cases  # noqa: E402
from gpu_ranks import ORDER as RANK_CHECKS, launch_ranks  # noqa: E402

from mesh3d import DistributedManager, Plan, checkpoint, domain, parallelize  # noqa: E402

RESULTS: dict[str, str] = {}


def check(name):
    def deco(fn):
        def run(*args):
            try:
                detail = fn(*args)
                RESULTS[name] = f"PASS {detail or ''}".strip()
            except Exception:  # noqa: BLE001 - every failure is reported, the next check still runs
                traceback.print_exc()
                RESULTS[name] = "FAIL " + traceback.format_exc().strip().splitlines()[-1]
            print(f"{name:<28} {RESULTS[name]}", flush=True)
        return run
    return deco


def mlp(width: int = 256) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, width), nn.GELU(), nn.Linear(width, width), nn.GELU(), nn.Linear(width, 8))


@check("manager on nccl")
def check_manager(dm: DistributedManager) -> str:
    assert dm.backend == "nccl", dm.backend
    assert dm.device == torch.device("cuda", torch.cuda.current_device()), dm.device
    assert dm.mesh.mesh_dim_names == ("batch", "domain", "model") and dm.mesh.device_type == "cuda"
    return f"{dm}"


@check("parallelize == plain")
def check_parallelize(dm: DistributedManager) -> str:
    plain = mlp().cuda()
    model = parallelize(copy.deepcopy(plain), Plan(batch="fsdp", model={"0": "replicate", "2": "replicate"}))
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (plain, model)]
    g = torch.Generator(device="cuda").manual_seed(1)
    worst = 0.0
    for _ in range(3):
        x, y = torch.randn(32, 64, device="cuda", generator=g), torch.randn(32, 8, device="cuda", generator=g)
        losses = []
        for m, opt in zip((plain, model), opts):
            loss = F.mse_loss(m(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        worst = max(worst, abs(losses[0] - losses[1]) / abs(losses[0]))
    for (name, p), q in zip(plain.named_parameters(), model.parameters()):
        q = q.full_tensor() if hasattr(q, "full_tensor") else q
        torch.testing.assert_close(q, p, rtol=1e-4, atol=1e-6, msg=name)
    return f"(3 AdamW steps, max loss rel diff {worst:.1e})"


@check("domain tensor on cuda")
def check_domain(dm: DistributedManager) -> str:
    torch.manual_seed(2)
    net = nn.Sequential(nn.Conv2d(3, 8, 5, padding=2, padding_mode="circular"), nn.GroupNorm(2, 8), nn.SiLU(),
                        nn.Conv2d(8, 3, 3, stride=2, padding=1)).cuda().double()
    x = torch.randn(2, 3, 33, 20, device="cuda", dtype=torch.float64)
    ref = net(x)
    out = net(domain.shard(x, dim=2)).full_tensor().to_local()
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-12)
    assert out.is_cuda
    return "(conv 5x5 circular, GroupNorm, strided conv; fp64 equal)"


@check("checkpoint of cuda state")
def check_checkpoint(dm: DistributedManager, tmp: str) -> str:
    model = parallelize(mlp().cuda(), Plan(batch="fsdp"))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(4, 64, device="cuda")).sum().backward()
    opt.step()
    path = checkpoint.save(os.path.join(tmp, "ck"), model, opt, step=1)
    checkpoint.verify(path)
    fresh = parallelize(mlp(width=256).cuda(), Plan(batch="fsdp"), seed=9)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-3)
    info = checkpoint.load(path, fresh, fresh_opt)
    for (name, p), q in zip(model.state_dict().items(), fresh.state_dict().values()):
        assert torch.equal(p.full_tensor(), q.full_tensor()), name
    out = checkpoint.coalesce(path, os.path.join(tmp, "hf"))
    return f"(step {info.step}, read {info.bytes_read} of {info.bytes_needed} bytes needed; coalesced {out})"


def _whole(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone() for k, v in model.state_dict().items()}


@check("async_save of cuda state")
def check_async_save(dm: DistributedManager, tmp: str) -> str:
    """The accelerator path of ``async_save`` (pinned buffer, copies queued on the current stream): an update still
    queued behind a slow kernel when the call starts is in the checkpoint; one queued right after it returns is not."""
    device = dm.device
    model = parallelize(mlp(width=2048).to(device), Plan(batch="fsdp"))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(4, 64, device=device)).sum().backward()
    opt.step()
    expected = {k: 2 * v for k, v in _whole(model).items()}
    if device.type == "cuda":
        torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time: the doubling below is still queued when the save starts
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(2)
        handle = checkpoint.async_save(os.path.join(tmp, "async"), model, opt, step=2)
        for p in model.parameters():  # after the call returns: must not reach the checkpoint
            p.add_(1)
    path = handle.wait()
    checkpoint.verify(path)
    fresh = parallelize(mlp(width=2048).to(device), Plan(batch="fsdp"), seed=9)
    info = checkpoint.load(path, fresh)
    got = _whole(fresh)
    for name, want in expected.items():
        assert torch.equal(got[name], want), f"{name}: the checkpoint does not hold the state at the call"
    return f"(step {info.step}; {len(expected)} tensors equal the state queued before the call, not after)"


@check("load_pretrained onto cuda")
def check_load_pretrained(dm: DistributedManager, tmp: str) -> str:
    """The accelerator path of ``load_pretrained`` (pinned read buffer, copy to the device) into FSDP shards, with a
    bf16 file cast to the model's fp32."""
    source = mlp(width=512)
    file = os.path.join(tmp, "pretrained.safetensors")
    safetensors.torch.save_file({k: v.to(torch.bfloat16).contiguous() for k, v in source.state_dict().items()}, file)
    model = parallelize(mlp(width=512).to(dm.device), Plan(batch="fsdp"), seed=5)
    info = checkpoint.load_pretrained(file, model, dtype=torch.float32)
    got = _whole(model)
    for name, value in source.state_dict().items():
        want = value.to(torch.bfloat16).float().to(dm.device)
        assert torch.equal(got[name], want), f"{name} differs from the file"
    return f"({len(info.loaded)} tensors, {len(info.cast)} cast BF16->F32, read buffer {info.read_buffer_bytes} bytes)"


@check("lightning MeshStrategy gpu")
def check_lightning(dm: DistributedManager) -> str:
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    from mesh3d.lightning import MeshStrategy

    class Lit(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = mlp()

        def training_step(self, batch, batch_idx):
            return F.mse_loss(self.net(batch[0]), batch[1])

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

        def train_dataloader(self):
            g = torch.Generator().manual_seed(3)
            data = TensorDataset(torch.randn(48, 64, generator=g), torch.randn(48, 8, generator=g))
            # Under a distributed strategy Lightning shuffles training data with a DistributedSampler;
            # giving both runs that sampler (one replica) gives them the same order.
            return DataLoader(data, batch_size=16, sampler=DistributedSampler(data, 1, 0, shuffle=True, seed=0))

    kw = dict(accelerator="gpu", devices=1, max_epochs=1, logger=False, enable_progress_bar=False,
              enable_model_summary=False, enable_checkpointing=False)
    kw["precision"] = "64-true"  # fp64: any difference beyond rounding is a bug, not TF32 or AdamW noise
    plain, meshed = Lit(), Lit()
    pl.Trainer(**kw).fit(plain)
    pl.Trainer(strategy=MeshStrategy(plan=Plan(batch="fsdp")), **kw).fit(meshed)
    # Lightning moves a single-device model back to the CPU when fit ends; the sharded one stays.
    worst = max(float((q.full_tensor().cpu() - p.cpu()).detach().abs().max())
                for p, q in zip(plain.parameters(), meshed.parameters()))
    assert worst < 1e-12, f"parameters differ from plain Lightning by up to {worst:.3e}"
    return f"(3 steps fp64, max parameter diff {worst:.1e} vs plain Lightning)"


@check("compiled == eager on cuda")
def check_compile(dm: DistributedManager) -> str:
    return check_compiled_equals_eager(dm.device)


@check("plan vs measured peak")
def check_plan(dm: DistributedManager, rows: list) -> str:
    """Every case of gpu_plan_check planned within 0.9-1.1 of its measured step peak (never more than 10 % under)."""
    torch.cuda.empty_cache()
    rows.extend(run_cases(dm.device))
    bad = [r for r in rows if not 0.9 <= r.get("ratio", 0.0) <= 1.1]
    assert not bad, "outside 0.9-1.1: " + "; ".join(f"{r['case']}: {r.get('ratio', r.get('error'))}" for r in bad)
    return "(" + ", ".join(f"{r['case']} {r['ratio']:.3f}" for r in rows) + ")"


def time_checkpoint(tmp: str, megabytes: int) -> dict:
    """mesh3d vs torch.distributed.checkpoint: save and load of FSDP state on the GPU (world of one)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    layers = max(1, megabytes // 64)  # 4096 x 4096 fp32 = 64 MiB each
    build = lambda: parallelize(nn.Sequential(*(nn.Linear(4096, 4096, bias=False) for _ in range(layers))).cuda(),
                                Plan(batch="fsdp"))
    model = build()
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    out: dict = {"state_bytes": nbytes}

    def timed(fn) -> float:
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        return time.perf_counter() - start

    for rep in range(3):  # best of three: the first pass also warms the page cache and allocator
        m_path, d_path = os.path.join(tmp, f"m{rep}"), os.path.join(tmp, f"d{rep}")
        t = {
            "save_mesh3d": timed(lambda: checkpoint.save(m_path, model)),
            "save_dcp": timed(lambda: dcp.save(get_model_state_dict(model), checkpoint_id=d_path)),
        }
        target = build()
        t["load_mesh3d"] = timed(lambda: checkpoint.load(m_path, target))

        def dcp_load():
            sd = get_model_state_dict(target)
            dcp.load(sd, checkpoint_id=d_path)
            set_model_state_dict(target, sd)

        t["load_dcp"] = timed(dcp_load)
        for k, v in t.items():
            out[k] = min(out.get(k, float("inf")), v)
        shutil.rmtree(m_path)
        shutil.rmtree(d_path)
    out["ratios"] = {"save_mesh3d_vs_dcp": out["save_dcp"] / out["save_mesh3d"],
                     "load_mesh3d_vs_dcp": out["load_dcp"] / out["load_mesh3d"]}
    return out


DOCS_BEGIN, DOCS_END = "<!-- gpu_attention_check: begin -->", "<!-- gpu_attention_check: end -->"


def write_docs_section(path: str, section: str) -> None:
    """Put ``section`` between the attention markers of ``path`` (docs/benchmarks.md, "On a GPU")."""
    text = Path(path).read_text()
    if DOCS_BEGIN not in text or DOCS_END not in text:
        raise ValueError(f"{path} has no {DOCS_BEGIN} ... {DOCS_END} region to write the attention figures into")
    head, rest = text.split(DOCS_BEGIN, 1)
    Path(path).write_text(head + DOCS_BEGIN + "\n" + section + rest[rest.index(DOCS_END):])


def check_attention(dm: DistributedManager, report: dict, docs: str | None) -> None:
    """Issue 50's checks (``gpu_attention_check.run``): each of its checks becomes a line of this run's."""
    where = f"{torch.cuda.get_device_name()} (torch {torch.__version__})"
    try:
        part = run_attention(dm.device)
    except Exception:  # noqa: BLE001 - reported like any check
        traceback.print_exc()
        RESULTS["attention"] = "FAIL " + traceback.format_exc().strip().splitlines()[-1]
        return
    RESULTS.update(part["checks"])
    part["markdown"] = attention_markdown(part, where)
    report["attention"] = part
    if docs:
        write_docs_section(docs, part["markdown"])


def _write(folder: str, report: dict) -> None:
    Path(folder).mkdir(parents=True, exist_ok=True)
    (Path(folder) / "gpu_check.json").write_text(json.dumps(report, indent=1))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=".", help="folder for gpu_check.json")
    parser.add_argument("--ckpt-mb", type=int, default=1024, help="state size of the checkpoint timing")
    parser.add_argument("--compile-repeats", type=int, default=100, help="timed steps per compile row, alternated")
    # ---- several ranks on one GPU (scripts/gpu_ranks.py)
    parser.add_argument("--ranks", type=int, default=1, help="N > 1: the multi-rank checks, N ranks sharing the GPU")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"), help="with --ranks: cpu runs the logic")
    parser.add_argument("--checks", default=",".join(RANK_CHECKS), help="with --ranks: which, comma-separated")
    parser.add_argument("--only", choices=("attention",), help="run only issue 50's attention checks")
    parser.add_argument("--docs", help="write the attention figures into this file's marked region")
    args = parser.parse_args()
    if args.ranks > 1:
        if args.device == "cuda" and not torch.cuda.is_available():
            print("no CUDA device: --ranks runs on a GPU machine (--device cpu runs its logic on CPU)")
            return 1
        report = launch_ranks(args.ranks, args.device, args.checks.split(","), args.out)
        return 0 if all(v.startswith("PASS") for v in report["checks"].values()) else 1
    if not torch.cuda.is_available():
        print("no CUDA device: this check is for a GPU machine (the test suite covers CPU/gloo)")
        return 1
    dm = DistributedManager.initialize()
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}, nccl {torch.cuda.nccl.version()}")
    if args.only == "attention":
        report = {"torch": torch.__version__, "device": torch.cuda.get_device_name(), "checks": RESULTS}
        check_attention(dm, report, args.docs)
        _write(args.out, report)
        DistributedManager.shutdown()
        return 0 if all(v.startswith("PASS") for v in RESULTS.values()) else 1
    plan_rows: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        check_manager(dm)
        check_plan(dm, plan_rows)  # first: a fresh allocator, as a job's first steps see it
        check_parallelize(dm)
        check_domain(dm)
        check_checkpoint(dm, tmp)
        check_async_save(dm, tmp)
        check_load_pretrained(dm, tmp)
        check_lightning(dm)
        check_compile(dm)
        report = {"torch": torch.__version__, "device": torch.cuda.get_device_name(), "checks": RESULTS,
                  "plan_vs_measured": plan_rows}
        _write(args.out, report)  # after each stage: a run cut short still leaves what it measured
        timing = time_checkpoint(tmp, args.ckpt_mb)
    gb = timing["state_bytes"] / 1e9
    print(f"checkpoint timing ({gb:.2f} GB of FSDP state on the GPU, best of 3): "
          + ", ".join(f"{k} {v:.2f} s" for k, v in timing.items() if k.startswith(("save", "load")))
          + "; ratios (>1: mesh3d faster) " + ", ".join(f"{k} {v:.2f}" for k, v in timing["ratios"].items()))
    report["checkpoint_timing"] = timing
    _write(args.out, report)
    print(f"compile rows (D=1, {args.compile_repeats} alternated steps each, medians):", flush=True)
    report["compile_d1"] = time_compile(dm.device, args.compile_repeats)
    _write(args.out, report)
    report["compile_d1_host_overhead"] = host_overhead(dm.device, 10 * args.compile_repeats)
    _write(args.out, report)
    check_attention(dm, report, args.docs)
    _write(args.out, report)
    DistributedManager.shutdown()
    failed = [k for k, v in RESULTS.items() if v.startswith("FAIL")]
    print(f"{len(RESULTS) - len(failed)} passed, {len(failed)} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
