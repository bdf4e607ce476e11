#!/usr/bin/env bash
# The main demo on 8 CPU processes (gloo), installing what it needs on first use.
#   scripts/demo.sh                 # 8 ranks on a (batch=2, domain=2, model=2) mesh
#   NPROC=4 scripts/demo.sh         # fewer ranks (the mesh adapts: batch is inferred)
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
cd "$ROOT"
NPROC="${NPROC:-8}"
if [ "$NPROC" = 8 ]; then sizes=(--batch 2 --domain 2 --model 2); else sizes=(--batch -1); fi
exec "$PY" -m torch.distributed.run --standalone --nproc-per-node "$NPROC" examples/mesh_table.py "${sizes[@]}"
