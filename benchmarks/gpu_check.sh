#!/usr/bin/env bash
# The one prepared device call: `bash benchmarks/gpu_check.sh [PART ...]` on a machine with a GPU (default: all parts).
#   kernels  every Triton kernel against its torch reference, timed against the bytes it must move
#   step     decode step times (full KV vs draft on a compressed cache vs verify) on a Llama-3-8B-shaped model
#   serving  the serving scheduler: full KV vs VeriCache under an HBM budget, 32k-128k contexts, pinned PCIe reloads,
#            acceptance replayed from CPU traces (benchmarks/gpu_serving.py)
#   vllm     the vLLM connector: a 1B random-weight Llama served with and without it (needs vLLM on the machine)
# Each part runs even if another fails, under its own timeout (together < 600 s); JSON lands in $OUT (or results/gpu/).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
DEST=${OUT:-results/gpu}
PARTS=${*:-kernels step serving vllm}
mkdir -p "$DEST"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$DEST/gpu.txt"
for part in $PARTS; do
  case $part in
    kernels) timeout 170 "$PY" benchmarks/gpu_kernels_check.py --json > "$DEST/kernels.json" || echo "kernels: rc=$?" ;;
    step) timeout 90 "$PY" benchmarks/gpu_step_time.py --json > "$DEST/step_time.json" || echo "step: rc=$?" ;;
    serving) timeout 240 "$PY" benchmarks/gpu_serving.py --json > "$DEST/serving.json" || echo "serving: rc=$?" ;;
    vllm) timeout 80 "$PY" benchmarks/gpu_vllm_check.py --json > "$DEST/vllm.json" || echo "vllm: rc=$?" ;;
    *) echo "unknown part $part (kernels step serving vllm)" ;;
  esac
done
for f in "$DEST"/*.json; do echo "== $f"; tail -c 3000 "$f"; done
