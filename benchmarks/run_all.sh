#!/usr/bin/env bash
# Reproduce the default side-by-side table + plots and the cost-model table (2-core CPU: ~15 min).
#   bash benchmarks/run_all.sh            # results/side_by_side/<stamp>/ and results/cost_model/<stamp>/
# Extra arguments go to side_by_side.py (e.g. --prompts 3 --new-tokens 64).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}   # 2 shared cores: more threads stall on OpenMP barriers
start=$(date +%s)
"$PY" benchmarks/side_by_side.py "$@"
latest=$(ls -td results/side_by_side/*/ | head -1)
"$PY" benchmarks/cost_model.py --measured "${latest}results.json"
echo "run_all: $(( $(date +%s) - start )) s; side-by-side results in ${latest}" >&2
