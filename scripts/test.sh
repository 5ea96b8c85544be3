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
# Two pytest workers (pytest-xdist) by default, one per core of the 2-core machines the suite is sized for; each
# test still runs whole in one worker. MOGA_TEST_WORKERS=0 runs in this process (-n 0), as does an -n of your own.
exec .venv/bin/python -m pytest -n "${MOGA_TEST_WORKERS:-2}" --dist worksteal "$@"
