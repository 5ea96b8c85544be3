#!/usr/bin/env bash
# The gap's trend in width on one GPU, in under 10 minutes (docs/reproductions.md, "The gap's trend in width"):
# row(2) against the orthogonalized step on the hidden matrices, every other role MOGA's default, each tuned,
# built-in GPT at widths 512-4096 and its llama style at 512-2048, 300 steps of 32 x 128 tokens, bf16.
# Needs python with torch only (moga from src/; no pydantic, no transformers, no network). The text: put
# tinyshakespeare.txt in $MOGA_DATA (or pass --text through GPU_GAP_ARGS); without it a generated corpus stands in.
#
#   bash scripts/gpu-gap.sh [OUT_DIR]          (default: $OUT, else ./gpu-gap)
#
# Then, on a machine with moga installed: python -m moga.experiments.reproduce.gap cells OUT_DIR/gap-cells.json
set -uo pipefail
cd "$(dirname "$0")/.."
OUT_DIR="${1:-${OUT:-gpu-gap}}"
mkdir -p "$OUT_DIR"
PY="${PYTHON:-python3}"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
"$PY" scripts/gpu_check.py precheck || exit 2
# shellcheck disable=SC2086
"$PY" scripts/gpu_gap.py plan ${GPU_GAP_ARGS:-} | tee "$OUT_DIR/plan.jsonl"
# shellcheck disable=SC2086
timeout --kill-after=10 "${GPU_GAP_LIMIT_S:-580}" "$PY" scripts/gpu_gap.py run "$OUT_DIR" --budget-s 540 \
    ${GPU_GAP_ARGS:-} 2>&1 | tee "$OUT_DIR/run.log"
exit "${PIPESTATUS[0]}"
