#!/usr/bin/env bash
# The first run on a machine with a GPU, in at most 8 minutes: the CUDA-relevant tests, MOGA's CUDA steps against
# the CPU's, `moga bench optimizer --device cuda`, a short bf16 `moga train` of MOGA against AdamW (tokens/s), FSDP2 on one GPU with a DCP
# resume, and host syncs per optimizer step. Every step has its own time limit; one that fails is reported
# and the rest still run. It writes summary.txt (and each step's log) into the output directory.
#
#   bash scripts/gpu-check.sh [OUT_DIR]          (default: $OUT, else ./gpu-check)
#   GPU_CHECK_STEPS="tests syncs" bash scripts/gpu-check.sh DIR   (some steps only: tests kernel syncs bench train fsdp)
#
# It needs python with torch and moga's cli extra (its steps run `moga train` and `moga bench`). Where some
# are missing and there is no network (pydantic, on an image that has torch, typer, rich, numpy and pyyaml),
# carry them as wheels in ./.whl (or $GPU_CHECK_WHEELS): made on a machine with a network by
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
#       pydantic pydantic-core annotated-types typing-inspection
# and installed here into a temporary directory, never into the system.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT_DIR="${1:-${OUT:-gpu-check}}"
mkdir -p "$OUT_DIR"
OUT_DIR="$(cd "$OUT_DIR" && pwd)"
SUMMARY="$OUT_DIR/summary.txt"
PY="${PYTHON:-python3}"
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
START=$SECONDS
BUDGET=${GPU_CHECK_BUDGET_S:-470}
: > "$SUMMARY"
say() { echo "$*" | tee -a "$SUMMARY"; }
STEPS=" ${GPU_CHECK_STEPS:-kernel tests syncs bench train fsdp} "
for s in $STEPS; do
    case $s in kernel|tests|syncs|bench|train|fsdp) ;;
        *) echo "gpu-check: unknown step '$s' in GPU_CHECK_STEPS (kernel tests syncs bench train fsdp)"; exit 2 ;;
    esac
done
want() { [[ "$STEPS" == *" $1 "* ]]; }

WHEELS="${GPU_CHECK_WHEELS:-.whl}"
if compgen -G "$WHEELS/*.whl" > /dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$WORK/site" "$WHEELS"/*.whl \
        || { say "gpu-check: installing the wheels in $WHEELS failed"; exit 1; }
fi
export PYTHONPATH="$PWD/src${WORK:+:$WORK/site}${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1 CUBLAS_WORKSPACE_CONFIG=:4096:8 MOGA_CACHE="$WORK/cache"

if ! "$PY" scripts/gpu_check.py precheck > "$WORK/precheck" 2>&1; then
    say "$(tail -n 1 "$WORK/precheck")"
    exit 2
fi
say "gpu-check $(date -u +%FT%TZ): $(cat "$WORK/precheck")"
FAILED=0

# step NAME LIMIT_S LOG COMMAND...: runs within its limit (and what is left of the budget), records the outcome
step() {
    local name=$1 limit=$2 log=$3; shift 3
    local left=$((BUDGET - (SECONDS - START)))
    if [ "$left" -lt 20 ]; then say "$name: SKIPPED (time budget spent)"; FAILED=1; return 1; fi
    [ "$limit" -gt "$left" ] && limit=$left
    local t0=$SECONDS rc=0
    timeout --kill-after=5 "$limit" "$@" >> "$log" 2>&1 || rc=$?
    local status="ok"
    [ $rc -ne 0 ] && status="FAILED (exit $rc$([ $rc -eq 124 ] && echo ", past its ${limit}s limit"))" && FAILED=1
    say "$name: $status in $((SECONDS - t0))s (log: $(basename "$log"))"
    return $rc
}

# 0. MOGA's row and col steps on CUDA against the CPU's, and the compiled step (not dispatched) against both
want kernel && {
step "kernel" 60 "$OUT_DIR/kernel.json" "$PY" scripts/gpu_check.py kernel
"$PY" scripts/gpu_check.py lines "$OUT_DIR/kernel.json" | tee -a "$SUMMARY"
}

# 1. the tests that touch the CUDA paths: the compiled kernel, compile(opt.step), AMP, fake CUDA tensors
TESTS=$(ls tests/kernels/test_compiled.py tests/optim/test_compile.py tests/optim/test_amp.py \
        tests/optim/test_fake*.py tests/*/test_fake*.py 2>/dev/null | sort -u)
if want tests; then
step "tests" 150 "$OUT_DIR/tests.log" "$PY" -m pytest -q -p no:cacheprovider $TESTS
tail -n 1 "$OUT_DIR/tests.log" | sed 's/^/  /' | tee -a "$SUMMARY"
fi

# 2. host syncs per step and CUDA against CPU, per optimizer
want syncs && {
step "syncs" 90 "$OUT_DIR/syncs.json" "$PY" scripts/gpu_check.py syncs
"$PY" scripts/gpu_check.py lines "$OUT_DIR/syncs.json" | tee -a "$SUMMARY"
}

# 3. the optimizer benchmark on the GPU
want bench && {
step "bench" 90 "$OUT_DIR/bench.json" "$PY" -m moga bench optimizer --device cuda --repeats 15 --json \
    --only torch-adamw-fused --only torch-muon --only moga-row-p2 --only moga-row-p2-nocheck \
    --only moga-row-p2-flag --only moga-col-q2 --only moga-muon --only moga-adamw-scaled
"$PY" - "$OUT_DIR/bench.json" <<'PY' | tee -a "$SUMMARY"
import json, sys
text = open(sys.argv[1]).read()
try:
    records = json.loads(text[text.index("["):])
except ValueError:
    sys.exit(0)
for r in records:
    print(f"  {r['name']}: {r['ms']:.3f} ms ({r['kernel']}), x adamw-fused {r.get('ms_vs_adamw_fused', float('nan')):.2f}")
PY
}

# 4. bf16 training, MOGA against AdamW, on one GPU
"$PY" scripts/gpu_check.py config "$WORK/train" > /dev/null
CONFIG="$WORK/train/config.yaml"
want train && for optim in moga adamw; do
    lr=$([ $optim = moga ] && echo 0.03125 || echo 0.001)
    if step "train-$optim" 60 "$OUT_DIR/train.log" "$PY" -m moga train "$CONFIG" optim.name=$optim optim.lr=$lr \
            -o "$WORK/run-$optim" -q; then
        "$PY" scripts/gpu_check.py tokens "$WORK/run-$optim" | sed "s/^/  $optim bf16: /" | tee -a "$SUMMARY"
    fi
done

# 5. FSDP2 on one GPU: an interrupted run resumed from its DCP checkpoint against the uninterrupted one
FSDP=(train.parallel=fsdp train.steps=12 train.deterministic=true optim.name=moga checkpoint.every=4)
TORCHRUN=("$PY" -m torch.distributed.run --standalone --nproc-per-node 1 -m moga train "$CONFIG")
want fsdp \
  && step "fsdp-whole" 60 "$OUT_DIR/fsdp.log" "${TORCHRUN[@]}" "${FSDP[@]}" -o "$WORK/fsdp-whole" -q \
  && step "fsdp-stop" 60 "$OUT_DIR/fsdp.log" "${TORCHRUN[@]}" "${FSDP[@]}" -o "$WORK/fsdp-parts" -q --stop-at 6 \
  && step "fsdp-resume" 60 "$OUT_DIR/fsdp.log" "${TORCHRUN[@]}" "${FSDP[@]}" -o "$WORK/fsdp-parts" -q \
  && step "fsdp-same" 30 "$OUT_DIR/fsdp.log" "$PY" scripts/gpu_check.py same "$WORK/fsdp-whole" "$WORK/fsdp-parts" \
  && tail -n 1 "$OUT_DIR/fsdp.log" | sed 's/^/  resumed vs whole: /' | tee -a "$SUMMARY"

say "gpu-check: $([ $FAILED -eq 0 ] && echo "all steps passed" || echo "some steps FAILED") in $((SECONDS - START))s"
exit $FAILED
