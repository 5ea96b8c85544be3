#!/usr/bin/env bash
# Create or reuse .venv in the checkout and install everything the project needs.
# Usage: scripts/setup.sh [dev]    (the library and the `moga` command, moga[cli]; "dev" adds the test dependencies)
# Idempotent: a stamp of pyproject.toml + this script skips pip when nothing changed.
set -euo pipefail
cd "$(dirname "$0")/.."
extra="${1:-}"
PY="${PYTHON:-python3}"
# torch is installed first and pinned: where pip is configured with a local wheel directory holding the CPU
# build, the pin selects it; a looser spec would pull a multi-GB CUDA build. Override with MOGA_TORCH_SPEC.
TORCH_SPEC="${MOGA_TORCH_SPEC:-torch==2.13.0}"

if [ ! -x .venv/bin/python ]; then
    "$PY" -c 'import sys; assert sys.version_info >= (3, 10), "moga needs Python >= 3.10"'
    "$PY" -m venv .venv
fi
VPY=.venv/bin/python
export PIP_DISABLE_PIP_VERSION_CHECK=1

stamp=".venv/.moga-setup-${extra:-base}"
want="$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -d' ' -f1)"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
    exit 0
fi

if ! "$VPY" -c 'import torch' 2>/dev/null; then
    echo "[setup] installing $TORCH_SPEC"
    "$VPY" -m pip install -q "$TORCH_SPEC"
fi
if [ "$extra" = "dev" ]; then target=".[dev]"; else target=".[cli]"; fi
echo "[setup] installing moga ($target)"
"$VPY" -m pip install -q -e "$target"
# GPT-2's BPE ranks ship inside openai-whisper; --no-deps avoids its heavy dependencies.
"$VPY" -m pip install -q --no-deps openai-whisper \
    || echo "[setup] note: openai-whisper (GPT-2 BPE ranks) not installed; BPE tokenization will be unavailable"

# Fashion-MNIST comes from Debian's dataset-fashion-mnist; best effort, never fatal.
FMNIST_DIR=/usr/share/datasets/fashion-mnist
if [ ! -d "$FMNIST_DIR" ]; then
    if [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null; then
        echo "[setup] installing dataset-fashion-mnist with apt-get"
        (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq dataset-fashion-mnist >/dev/null) \
            || echo "[setup] note: apt-get could not install dataset-fashion-mnist; runs fall back to scikit-learn's digits"
    else
        echo "[setup] note: Fashion-MNIST not found at $FMNIST_DIR. Install Debian's dataset-fashion-mnist," \
             "or put the four *-ubyte.gz IDX files in a directory and pass data.root=DIR. Runs fall back to digits."
    fi
fi
# The fused C++ kernel builds once per source and toolchain (minutes on 2 cores): build it now, so that
# the demo and the first MOGA(model) do not pay it. Best effort: without a compiler moga uses kernel="torch".
echo "[setup] building the fused C++ kernel (python -m moga.kernels.build)"
"$VPY" -m moga.kernels.build >/dev/null 2>&1 \
    || echo "[setup] note: the C++ kernel did not build; moga steps in torch ops (python -m moga.kernels.build shows why)"
echo "$want" > "$stamp"
