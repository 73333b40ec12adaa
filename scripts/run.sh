#!/usr/bin/env bash
# Run Tandem's default application (sets up .venv first when it is missing):
# serve_config.yaml on http://127.0.0.1:8000 (OpenAI API at /v1).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
[ -f .venv/.tandem-ready ] || bash scripts/setup.sh
exec .venv/bin/serve run serve_config.yaml "$@"
