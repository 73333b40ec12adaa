#!/usr/bin/env bash
# Run the whole test suite (sets up .venv first when it is missing).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
[ "$(cat .venv/.tandem-ready 2>/dev/null)" = 2 ] || bash scripts/setup.sh  # missing, or from an older set-up
[ -x .venv/bin/mkdocs ] || .venv/bin/python -m pip install -q -e ".[test,docs]"  # a .venv from before the docs extra
.venv/bin/python -c "import playwright" 2>/dev/null || .venv/bin/python -m pip install -q -e ".[test,docs]"  # or the browser tests' driver
# The playground's tests drive Debian's chromium (tests/browser.py); install it where it is missing.
if ! command -v chromium >/dev/null; then
  sudo=""; [ "$(id -u)" = 0 ] || sudo="sudo"
  $sudo apt-get update -qq && DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq chromium >/dev/null
fi
# The docs site first, strictly: a broken link, a missing page or a stale reference table fails the suite.
site="$(mktemp -d)"
NO_MKDOCS_2_WARNING=1 .venv/bin/mkdocs build --strict --quiet --site-dir "$site"
rm -rf "$site"
# the 15 slowest tests at the end of every run: the suite must stay well inside CI's 90 minutes
exec .venv/bin/python -m pytest -q --durations=15 "$@"
