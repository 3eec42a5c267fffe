#!/usr/bin/env bash
# Issue 14's benchmarks on a CUDA machine whose python3 has torch, transformers and TRL 1.16 (no network
# needed): gpufleet vs TRL on the `gpu` preset (Qwen2.5-0.5B's shapes, 16 completions/step, G 8, 64 tokens,
# beta 0.04) in fp32, then in bf16 autocast; each run first prints bench/gemm_peak.py's table at the
# step's shapes. Logs and results.json go to $OUT (default /tmp/gpufleet-gpu-bench).
#
#     bash bench/on_gpu.sh                 # STEPS=10 SEEDS=42,43 THREADS=8 SRC=src by default
set -u
OUT=${OUT:-/tmp/gpufleet-gpu-bench}
WORK=${WORK:-/tmp/gpufleet-gpu-work}
mkdir -p "$OUT" "$WORK"
export PYTHONUNBUFFERED=1 GPUFLEET_CACHE=${GPUFLEET_CACHE:-/tmp/gpufleet-cache}
cd "$(dirname "$0")/.."
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
common=(--src "${SRC:-src}" --preset gpu --device cuda --here --threads "${THREADS:-8}" --steps "${STEPS:-10}" --warmup 3 --startup-runs 0)
timeout "${FP32_LIMIT:-330}" python3 bench/vs_trl.py "${common[@]}" --seeds "${SEEDS:-42,43}" --out "$WORK/fp32" 2>&1 | tee "$OUT/fp32.log"
cp "$WORK/fp32/results.json" "$OUT/fp32-results.json" 2>/dev/null
timeout "${BF16_LIMIT:-200}" python3 bench/vs_trl.py "${common[@]}" --precision bf16 --seeds 42 --out "$WORK/bf16" 2>&1 | tee "$OUT/bf16.log"
cp "$WORK/bf16/results.json" "$OUT/bf16-results.json" 2>/dev/null
tail -n 40 "$WORK"/*/*.log > "$OUT/worker-logs.txt" 2>/dev/null
true
