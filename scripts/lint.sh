#!/usr/bin/env bash
# Static checks, run by .ci/run before the tests (fast: about a minute on two cores):
#   ruff (style, pyflakes, imports at the top), mypy on mesh3d/ (config in pyproject.toml), shellcheck on the
#   shell scripts (scripts/*.sh, .ci/run, examples/*.sbatch; settings in .shellcheckrc),
#   vulture (dead code in mesh3d/; tests, examples and scripts count as callers) and
#   deptry (declared dependencies vs imports). Versions are pinned in scripts/env.sh.
set -euo pipefail
# shellcheck source=env.sh
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
cd "$ROOT"
BIN="$(dirname "$PY")"
echo "lint: ruff" >&2
"$BIN/ruff" check .
echo "lint: shellcheck" >&2
"$BIN/shellcheck" scripts/*.sh .ci/run examples/*.sbatch
echo "lint: mypy mesh3d" >&2
"$BIN/mypy"
echo "lint: vulture (dead code)" >&2
dead="$("$BIN/vulture" mesh3d tests examples scripts scripts/vulture_whitelist.py --min-confidence 60 \
  --ignore-decorators "@register,@register_*,@torch.no_grad,@pytest.fixture,@staticmethod" \
  --ignore-names "forward,backward,setup_context" | grep '^mesh3d/' || true)"
if [ -n "$dead" ]; then
  echo "$dead"
  echo "lint: dead code in mesh3d/ (remove it, or add it to scripts/vulture_whitelist.py saying why)" >&2
  exit 1
fi
echo "lint: dependencies" >&2
NO_COLOR=1 "$BIN/deptry" .
echo "lint: ok" >&2
