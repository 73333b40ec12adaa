#!/usr/bin/env bash
# Run the whole test suite (sets up .venv first when it is missing).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
[ -f .venv/.tandem-ready ] || bash scripts/setup.sh
exec .venv/bin/python -m pytest -q "$@"
