#!/usr/bin/env bash
# Run the whole test suite; sets up .venv (with test dependencies) first. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh dev
# Datasets in shared/data beside the checkout (tiny Shakespeare, CIFAR-10 JPEGs, where a CI runner provides them)
# are found through $MOGA_DATA, unless the caller already points it elsewhere.
if [ -z "${MOGA_DATA:-}" ] && [ -d ../shared/data ]; then
    export MOGA_DATA="$(cd ../shared/data && pwd)"
fi
exec .venv/bin/python -m pytest "$@"
