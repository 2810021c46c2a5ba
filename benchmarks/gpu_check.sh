#!/usr/bin/env bash
# The one prepared device call: run it as `bash benchmarks/gpu_check.sh` on a machine with a GPU.
# 1) every Triton kernel against its torch reference, timed against the bytes it must move;
# 2) decode step times (full KV vs draft on a compressed cache vs verify) on a Llama-3-8B-shaped model;
# 3) the vLLM connector: a 1B random-weight Llama served with and without it, identical outputs, latency.
# Each part runs even if the other fails; JSON lands in $OUT (or results/gpu/).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
DEST=${OUT:-results/gpu}
mkdir -p "$DEST"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$DEST/gpu.txt"
timeout 330 "$PY" benchmarks/gpu_kernels_check.py --json > "$DEST/kernels.json" || echo "kernel check failed: rc=$?"
timeout 200 "$PY" benchmarks/gpu_step_time.py --json > "$DEST/step_time.json" || echo "step time failed: rc=$?"
timeout 240 "$PY" benchmarks/gpu_vllm_check.py --json > "$DEST/vllm.json" || echo "vllm check failed: rc=$?"
tail -c 3000 "$DEST/kernels.json"; cat "$DEST/step_time.json" "$DEST/vllm.json"
