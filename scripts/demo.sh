#!/usr/bin/env bash
# The main job; sets up .venv first. Extra arguments go to `moga demo`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/moga demo "$@"
