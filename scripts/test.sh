#!/usr/bin/env bash
# Run the whole test suite; sets up .venv (with test dependencies) first. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh dev
# Datasets beside the checkout (a development or CI machine's shared/data: tiny Shakespeare, CIFAR-10 JPEGs)
# are found through $MOGA_DATA, unless the caller already points it elsewhere.
if [ -z "${MOGA_DATA:-}" ] && [ -d ../shared/data ]; then
    export MOGA_DATA="$(cd ../shared/data && pwd)"
fi
exec .venv/bin/python -m pytest "$@"
