#!/usr/bin/env bash
# Run the whole test suite; sets up .venv (with test dependencies) first.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh dev
exec .venv/bin/python -m pytest "$@"
