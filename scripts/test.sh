#!/usr/bin/env bash
# Run the whole test suite (installs what it needs on first use). Extra arguments go to pytest.
#   scripts/test.sh                      # everything, on 2 worker processes
#   scripts/test.sh tests/test_manager.py -x
#   MESH3D_TEST_WORKERS=0 scripts/test.sh --shuffle 1234   # everything in one process, in exactly the seed's order
# NOTE: a whole run uses two pytest-xdist workers, each with its own rank pool (tests/README.md, "Workers"): about a
# third of a one-process run left the two cores idle (fault cells waiting out group timeouts, ranks waiting on
# sockets, launches), and two workers took the suite from 1817 s to 1402 s on the same 2-core machine and seed.
# A run naming tests or files, a collection, or one that says -n itself gets no workers from here.
set -euo pipefail
# shellcheck source=env.sh
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
cd "$ROOT"
# NOTE: bytecode for the checkout's own modules, written once here: where PYTHONDONTWRITEBYTECODE is set (as on the
# sandboxes and CI), every process the suite starts (ranks, launched examples, the console script) compiled each
# mesh3d, example and test module it imported from source again, about a second of CPU per process importing mesh3d.
# Python still checks each file against its source's time stamp, so an edited file is never run from stale bytecode.
"$PY" -m compileall -q mesh3d examples tests scripts > /dev/null || echo "test.sh: compileall failed; the tests run from source" >&2
workers="${MESH3D_TEST_WORKERS:-}"
if [ -z "$workers" ]; then
  workers=2
  for arg in "$@"; do
    case "$arg" in
      tests|tests/*|*.py|*::*|-n*|--numprocesses*|--co|--collect-only|-p|--pdb) workers=0 ;;
    esac
  done
fi
if [ "$workers" = 0 ]; then
  exec "$PY" -m pytest "$@"
fi
# NOTE: loadgroup: tests marked @pytest.mark.xdist_group(name) run on one worker, so a session fixture they share is
# built once (tests/test_plan_reality.py); the rest are spread as with the default scheduling.
exec "$PY" -m pytest -n "$workers" --dist loadgroup "$@"
