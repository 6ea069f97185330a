#!/usr/bin/env bash
# The GPU path in one command (< 10 minutes on one GPU): speed, memory, no host sync, bf16 accuracy.
#   scripts/gpu_check.sh [--smoke] [--out DIR] [--only SECTION ...]     (see scripts/gpu_check.py)
# --smoke runs every section on the CPU with tiny shapes; CI runs it so the script cannot rot.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source scripts/env.sh
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-$(nproc)}"
exec "$PY" scripts/gpu_check.py "$@"
