# Sourced by scripts/demo.sh and scripts/test.sh: makes a virtual environment (once) and installs
# mesh3d into it with the CPU build of torch pinned, so a fresh machine needs nothing else.
#   MESH3D_VENV  where the environment lives (default: .venv in the repository)
#   PYTHON       the interpreter that creates it (default: python3, must be >= 3.10)
#   TORCH_PIN    the torch to install (default torch==2.13.0, the local CPU wheel; the tested range
#                is printed by `mesh3d info`, e.g. TORCH_PIN=torch==2.14.1 MESH3D_VENV=.venv-214)
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${MESH3D_VENV:-$ROOT/.venv}"
PY="$VENV/bin/python"
# torch is pinned here (pyproject gives the tested floor only): an unpinned install would pull a
# multi-GB CUDA build on a CPU machine.
TORCH_PIN="${TORCH_PIN:-torch==2.13.0}"
# The static checks of scripts/lint.sh, pinned so every machine lints alike.
LINT_PINS="ruff==0.17.6 mypy==2.4.1 vulture==2.16 deptry==0.25.1"

if [ ! -x "$PY" ]; then
  "${PYTHON:-python3}" -c 'import sys; sys.exit(sys.version_info < (3, 10))' \
    || { echo "mesh3d needs Python >= 3.10 (set PYTHON=...)" >&2; exit 1; }
  echo "mesh3d: creating $VENV" >&2
  "${PYTHON:-python3}" -m venv "$VENV"
fi
_want="$( (cat "$ROOT/pyproject.toml" "$ROOT/scripts/env.sh"; echo "$TORCH_PIN") | sha256sum | cut -c1-16)"
if [ "$(cat "$VENV/.mesh3d-installed" 2>/dev/null)" != "$_want" ]; then
  echo "mesh3d: installing $TORCH_PIN, mesh3d[test,lightning,hf,zoo,weather,graph] and $LINT_PINS into $VENV" >&2
  # shellcheck disable=SC2086  # LINT_PINS is a list of requirements
  "$PY" -m pip install --quiet --disable-pip-version-check "$TORCH_PIN" -e "$ROOT[test,lightning,hf,zoo,weather,graph]" $LINT_PINS 2>&1 \
    | grep -v "^WARNING: Location" >&2 || true
  "$PY" -c "import mesh3d, torch, safetensors, einops, numpy, pytest, hypothesis, lightning, transformers, monai, diffusers, neuralop, x_transformers, perceiver_pytorch, x_unet, mlp_mixer_pytorch, conformer, local_attention, vector_quantize_pytorch, torch_geometric, pymetis, xarray, h5py, h5netcdf, matplotlib, sys; sys.version_info < (3, 11) or __import__('zarr')" \
    || { echo "mesh3d: installation into $VENV failed" >&2; exit 1; }
  echo "$_want" > "$VENV/.mesh3d-installed"
fi
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
