#!/usr/bin/env bash
# Every benchmark, each against the best alternative measured in the same run; JSON + PNG plots
# land in docs/benchmarks/ (see docs/benchmarks.md). About 20 minutes on a 2-core CPU box.
#   scripts/bench_all.sh
#   QUICK=1 scripts/bench_all.sh      # smaller sizes, ~3 minutes (a smoke run; do not publish its figures)
set -euo pipefail
# shellcheck source=env.sh
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
cd "$ROOT"
"$PY" -m pip install -q -e ".[bench]"            # matplotlib, for the plots (not a core dependency)
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
if [ "${QUICK:-0}" = 1 ]; then
  p=(--rounds 5 --warmup 1); d=(--size 256 --domains 1 2 4); c=(--size-mb 256); l=(--rounds 1 --steps 5)
  b=(--size 256 --steps 3 --rounds 1); h=(--sides 32 128 --iters 50); a=(--seq 1024 --steps 1)
  s=(--repeats 2 --out /tmp/startup_quick.json); g=(--sides 8 40 --steps 5 --rounds 1 --out /tmp/graph_one_rank_quick.json)
else
  p=(); d=(--domains 1 2 4 8); c=(--size-mb 1024); l=(); b=(); h=(); a=(); s=(); g=()
fi
echo "== 1/5 parallelize vs hand-written fully_shard + parallelize_module (4 ranks)"
"$PY" scripts/bench_parallelize.py --nproc 4 "${p[@]}"
echo "== 2/5 the same on 8 ranks"
"$PY" scripts/bench_parallelize.py --nproc 8 --batch 4 --out docs/benchmarks/parallelize_8ranks.json "${p[@]}"
echo "== 3/5 domain parallelism: halo bytes, time vs gathering the input, activation memory"
"$PY" scripts/bench_domain.py "${d[@]}"
echo "== 3b/5 blocks vs slabs at D=4, and the halo exchange on blocks: one round vs one pass per grid dim"
"$PY" scripts/bench_blocks.py "${b[@]}"
"$PY" scripts/bench_halo_rounds.py "${h[@]}"
echo "== 3c/5 attention over the domain: ring vs gather vs Ulysses at D = 1, 2, 4 (memory, time, causal balance)"
"$PY" scripts/bench_attention.py "${a[@]}"
echo "== 4/5 checkpoint: mesh3d vs torch.distributed.checkpoint vs raw safetensors"
"$PY" scripts/bench_checkpoint.py "${c[@]}"
echo "== 4b/5 load_pretrained vs DCP's HuggingFaceStorageReader (4 ranks, 256 MB)"
"$PY" scripts/bench_pretrained.py
echo "== 5/5 Lightning: MeshStrategy vs ModelParallelStrategy (4 ranks, Lightning's launcher)"
"$PY" scripts/bench_lightning.py "${l[@]}"
echo "== faults: time to a named error for each fault cell (kill, raise, hang x 6 points; 3 ranks)"
"$PY" scripts/bench_faults.py --repeats "$([ "${QUICK:-0}" = 1 ] && echo 1 || echo 3)" > /dev/null
echo "== forecasts: peak memory per rank at D = 4 vs one process (721 x 1440 x 70; 2 and 60 leads), store writes vs np.save"
if [ "${QUICK:-0}" = 1 ]; then
  "$PY" scripts/bench_forecast.py --lat 181 --lon 360 --json /tmp/forecast_quick.json
else
  "$PY" scripts/bench_forecast.py --leads 10 --repeat 3
  "$PY" scripts/bench_forecast.py --leads 60 --json docs/benchmarks/forecast_60.json
  "$PY" scripts/bench_forecast.py --raw --json docs/benchmarks/forecast_raw.json
fi
echo "== planner: mesh3d plan at 4096 ranks vs simulating every domain rank, and its scaling check"
"$PY" scripts/bench_plan.py
echo "== start-up: a fresh rank against import torch, and an autograd Function call routed or not"
"$PY" scripts/bench_startup.py "${s[@]}"
echo "== graphs at domain=1: a MeshGraphNet step against plain torch, kept answers on and off"
"$PY" scripts/bench_graph_one_rank.py "${g[@]}"
if "$PY" -c 'import sys, torch; sys.exit(not torch.cuda.is_available())'; then
  echo "== GPU: the nccl/CUDA paths on one GPU and a 1 GB checkpoint vs DCP"
  "$PY" scripts/gpu_check.py --out docs/benchmarks
  echo "== GPU: 2 and 3 ranks sharing the GPU over staged gloo (the multi-rank CUDA paths)"
  "$PY" scripts/gpu_check.py --ranks 2 --out docs/benchmarks
  "$PY" scripts/gpu_check.py --ranks 3 --out docs/benchmarks
fi
ls -l docs/benchmarks/
"$PY" scripts/bench_report.py
