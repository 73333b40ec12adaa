#!/usr/bin/env bash
# Run Tandem's default application (sets up .venv first when it is missing):
# serve_config.yaml on http://127.0.0.1:8000 (OpenAI API at /v1).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
[ "$(cat .venv/.tandem-ready 2>/dev/null)" = 2 ] || bash scripts/setup.sh  # missing, or from an older set-up
# Serve's controller every 1 s, not 0.1 s: its idle work slows the model on a small CPU node (README)
export RAY_SERVE_CONTROL_LOOP_INTERVAL_S="${RAY_SERVE_CONTROL_LOOP_INTERVAL_S:-1}"
exec .venv/bin/serve run serve_config.yaml "$@"
