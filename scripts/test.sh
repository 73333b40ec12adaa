#!/usr/bin/env bash
# Run the whole test suite (sets up .venv first when it is missing).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
[ -f .venv/.tandem-ready ] || bash scripts/setup.sh
# the 15 slowest tests at the end of every run: the suite must stay well inside CI's 90 minutes
exec .venv/bin/python -m pytest -q --durations=15 "$@"
