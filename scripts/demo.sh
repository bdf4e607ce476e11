#!/usr/bin/env bash
# The main demo on CPU processes (gloo), installing what it needs on first use (torch and mesh3d's core only:
# no extras, no test or lint tools; scripts/test.sh adds those): one model on all three axes, trained on 8 ranks
# beside one process, checkpointed, resumed on a 4-rank mesh of another shape, and exported to one Hugging Face
# model.safetensors.
#   scripts/demo.sh                          # results under runs/demo
#   OUT=/tmp/d scripts/demo.sh               # elsewhere
#   MESH3D_EXTRAS=weather scripts/demo.sh    # also install extras other examples need (weather, lightning, hf)
set -euo pipefail
MESH3D_FOR=demo  # read by env.sh
# shellcheck source=env.sh
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
cd "$ROOT"
OUT="${OUT:-runs/demo}"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"   # 8 ranks on a few cores: one thread each
run() { "$PY" -m torch.distributed.run --standalone --nproc-per-node "$1" examples/demo_3d.py "${@:2}" --out "$OUT"; }
start=$SECONDS
echo "== 1/3 train: 8 ranks, mesh (batch 2, domain 2, model 2), FSDP + uneven domain shards + TP, beside one process"
run 8 train --batch 2 --domain 2 --model 2
echo "== 2/3 resume: 4 ranks, mesh (batch 1, domain 2, model 2), from the checkpoint saved on (2, 2, 2)"
run 4 resume --batch 1 --domain 2 --model 2
echo "== 3/3 export: one process, no launcher: coalesce to $OUT/hf/model.safetensors and check it"
"$PY" examples/demo_3d.py export --out "$OUT"
echo "demo finished in $((SECONDS - start)) s"
echo "next: the other examples (README.md, 'Examples'); examples/weather.py needs the weather extra and" \
     "examples/lightning_3d.py the lightning one: MESH3D_EXTRAS=weather,lightning scripts/demo.sh adds them to $VENV"
