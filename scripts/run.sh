#!/usr/bin/env bash
# Run Tandem's main job (sets up .venv first when it is missing): for now, the offline example.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
[ -f .venv/.tandem-ready ] || bash scripts/setup.sh
exec .venv/bin/python examples/offline.py "$@"
