#!/usr/bin/env bash
# Issue 37's figures on a CUDA machine in one call (no network needed), or the same script at small shapes on
# the CPU (DEVICE=cpu, to check it before a GPU is lent). Each part has its own time limit, so one that
# overruns leaves the others their time; logs and JSON go to $OUT (default /tmp/gpufleet-gpu-bench).
#
#     bash bench/on_gpu.sh                     # PARTS="tests decode update step" by default
#     DEVICE=cpu bash bench/on_gpu.sh          # the same table at small shapes, here
#     PARTS="decode" DECODE_ARGS="--models qwen2.5-1.5b --rows 256" bash bench/on_gpu.sh
#     PARTS="step" STEP_ARGS="--torch-compile" bash bench/on_gpu.sh       # gpufleet's layers compiled
#
# Parts: tests (the CUDA tests of the decoder), decode (bench/gpu_decode.py: ms per decode step against the
# memory-bandwidth limit, bf16, 0.5B and 1.5B shapes, 16/64/256 rows, prompt 256, 512 new tokens; HF's generate
# at 64 rows beside it), update (bench/gpu_update.py: forward + backward of 8 x 1,024 tokens against the bf16
# matmul peak: autocast, FSDP2 mixed precision, Liger's kernels), step (bench/vs_trl.py --preset gpu-long:
# gpufleet's whole step vs TRL 1.16's at 64 completions x 512 tokens in bf16, with the plan's memory against the
# measured peak), profile (bench/gpu_step_profile.py: one step of that job under the torch profiler, each phase's
# host and GPU time, then the kernels), gpu (the older `gpu` preset: 16 x 64 tokens, fp32 and bf16).
# Python packages the machine lacks (TRL, transformers 5.23, pydantic, liger-kernel ...) travel as wheels in
# .whl/ (bench/README.md says which) and are installed into /tmp/site first.
set -u
DEVICE=${DEVICE:-cuda}
OUT=${OUT:-/tmp/gpufleet-gpu-bench}
WORK=${WORK:-/tmp/gpufleet-gpu-work}
mkdir -p "$OUT" "$WORK"
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 GPUFLEET_CACHE=${GPUFLEET_CACHE:-/tmp/gpufleet-cache} OUT
if [ "$DEVICE" = cuda ]; then
    PY=${PY:-python3}
    if ls .whl/*.whl >/dev/null 2>&1; then
        $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
        export PYTHONPATH=/tmp/site:$PWD/src
    else
        export PYTHONPATH=$PWD/src
    fi
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
    PARTS=${PARTS:-tests decode update step}
else
    PY=${PY:-.venv/bin/python}
    PARTS=${PARTS:-decode update}
fi
$PY -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
for part in $PARTS; do
    echo "=== $part ($(date -u +%H:%M:%S))"
    case $part in
    tests)
        timeout "${TESTS_LIMIT:-150}" $PY -m pytest -q -x -p no:cacheprovider -k cuda tests/test_graphdecode.py \
            tests/test_gpuattention.py 2>&1 | tail -n 15 | tee "$OUT/tests.log" ;;
    decode)
        timeout "${DECODE_LIMIT:-300}" $PY bench/gpu_decode.py --device "$DEVICE" ${DECODE_ARGS:-} 2>&1 | tee "$OUT/decode.log" ;;
    update)
        timeout "${UPDATE_LIMIT:-100}" $PY bench/gpu_update.py --device "$DEVICE" ${UPDATE_ARGS:-} 2>&1 | tee "$OUT/update.log" ;;
    step)
        timeout "${STEP_LIMIT:-240}" $PY bench/vs_trl.py --src src --preset gpu-long --device "$DEVICE" --here \
            --threads 8 --steps "${STEPS:-4}" --warmup "${WARMUP:-2}" --startup-runs 0 --precision bf16 --seeds 42 \
            ${STEP_ARGS:-} --out "$WORK/long" 2>&1 | tee "$OUT/step.log"
        grep -h "memory/\|Error\|error" "$WORK"/long/*.log 2>/dev/null | tail -n 12 | tee -a "$OUT/step.log"
        for m in $(find "$WORK/long" -name metrics.jsonl); do  # gpufleet's phases, per step (s)
            $PY -c 'import json,sys; [print("[phases]", {k.split("/")[1]: round(v, 3) for k, v in r.items() if k.startswith("timing/") and k.count("/") == 1 and v}, "step", round(r["step_time"], 3)) for r in map(json.loads, open(sys.argv[1]))]' "$m"
        done 2>&1 | tee -a "$OUT/step.log" ;;
    profile)
        timeout "${PROFILE_LIMIT:-150}" $PY bench/gpu_step_profile.py --device "$DEVICE" ${PROFILE_ARGS:-} 2>&1 \
            | tee "$OUT/profile.log" ;;
    gpu)
        common=(--src src --preset gpu --device "$DEVICE" --here --threads 8 --steps "${STEPS:-10}" --warmup 3 --startup-runs 0)
        timeout "${FP32_LIMIT:-330}" $PY bench/vs_trl.py "${common[@]}" --seeds 42 --out "$WORK/fp32" 2>&1 | tee "$OUT/fp32.log"
        timeout "${BF16_LIMIT:-200}" $PY bench/vs_trl.py "${common[@]}" --precision bf16 --seeds 42 --out "$WORK/bf16" 2>&1 | tee "$OUT/bf16.log" ;;
    esac
done
true
