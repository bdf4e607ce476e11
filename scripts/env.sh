# Sourced by scripts/demo.sh and scripts/test.sh: makes a virtual environment (once) and installs
# mesh3d into it with the CPU build of torch pinned, so a fresh machine needs nothing else.
#   MESH3D_VENV  where the environment lives (default: .venv in the repository)
#   PYTHON       the interpreter that creates it (default: python3, must be >= 3.10)
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${MESH3D_VENV:-$ROOT/.venv}"
PY="$VENV/bin/python"
# torch is pinned here (not in pyproject, which needs only torch>=2.6): an unpinned install
# would pull a multi-GB CUDA build on a CPU machine.
TORCH_PIN="torch==2.13.0"

if [ ! -x "$PY" ]; then
  "${PYTHON:-python3}" -c 'import sys; sys.exit(sys.version_info < (3, 10))' \
    || { echo "mesh3d needs Python >= 3.10 (set PYTHON=...)" >&2; exit 1; }
  echo "mesh3d: creating $VENV" >&2
  "${PYTHON:-python3}" -m venv "$VENV"
fi
_want="$(cat "$ROOT/pyproject.toml" "$ROOT/scripts/env.sh" | sha256sum | cut -c1-16)"
if [ "$(cat "$VENV/.mesh3d-installed" 2>/dev/null)" != "$_want" ]; then
  echo "mesh3d: installing $TORCH_PIN and mesh3d[test,lightning,hf] into $VENV" >&2
  "$PY" -m pip install --quiet --disable-pip-version-check "$TORCH_PIN" -e "$ROOT[test,lightning,hf]" 2>&1 \
    | grep -v "^WARNING: Location" >&2 || true
  "$PY" -c "import mesh3d, torch, safetensors, einops, numpy, pytest, hypothesis, lightning, transformers" \
    || { echo "mesh3d: installation into $VENV failed" >&2; exit 1; }
  echo "$_want" > "$VENV/.mesh3d-installed"
fi
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
