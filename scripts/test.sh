#!/usr/bin/env bash
# The test command (what .ci/run calls): installs what is missing, lints, runs the suite.
#   scripts/test.sh [pytest args]      e.g. scripts/test.sh -k loss -x
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source scripts/env.sh dev
"$PY" -m ruff check .
"$PY" -m ruff format --check .
# the layer order in pyproject.toml ([tool.importlinter]): no module imports from a layer above
"$PY" -c "import sys; from importlinter.cli import lint_imports_command; sys.exit(lint_imports_command())" --no-cache
# pytest exits 5 when it collects no test: that is a failure here, never hidden.
# Two workers (pytest-xdist; each test file whole in one, tests/conftest.py): alone the
# suite keeps two cores busy about 60% of the time (its runs wait on process starts, timers and
# each other). A later -n wins: scripts/test.sh -n 0 runs in this process.
exec "$PY" -m pytest -n 2 "$@"
