#!/usr/bin/env bash
# Run the whole test suite (installs what it needs on first use). Extra arguments go to pytest.
#   scripts/test.sh                      # everything
#   scripts/test.sh tests/test_manager.py -x
set -euo pipefail
# shellcheck source=env.sh
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
cd "$ROOT"
exec "$PY" -m pytest "$@"
