#!/usr/bin/env bash
# The tests that need torchvision (role plans and depth scaling on torchvision's ResNets).
# torchvision's PyPI wheel does not load beside the CPU build of torch that scripts/setup.sh installs
# ("operator torchvision::nms does not exist"), so these run in a second environment, .venv-vision,
# with a matching pair. In .venv they skip with that reason.
set -euo pipefail
cd "$(dirname "$0")/.."
PAIR="${MOGA_VISION_SPEC:-torch==2.14.1 torchvision==0.29.1}"
if [ ! -x .venv-vision/bin/python ]; then
    python3 -m venv .venv-vision
fi
VPY=.venv-vision/bin/python
export PIP_DISABLE_PIP_VERSION_CHECK=1
if ! "$VPY" -c 'import torchvision' 2>/dev/null; then
    echo "[test-vision] installing $PAIR (a CUDA build of several GB where no CPU build is at hand)"
    if ! "$VPY" -m pip install -q $PAIR; then
        echo "[test-vision] SKIPPED: could not install $PAIR here; the torchvision tests did not run" >&2
        exit 0
    fi
fi
"$VPY" -m pip install -q -e ".[cli]" pytest pytest-timeout
exec "$VPY" -m pytest -q tests/test_roles.py tests/test_depth.py -k "torchvision or resnet" "$@"
