#!/usr/bin/env bash
# Train with torchrun.  ./run_train.sh [--config FILE] [--section.key value ...]
#   --help        every config key with its type, default and doc
#   NGPU / NPROC  ranks on this node (default: the GPU count, else 2 CPU ranks)
#   LOG_RANK      which local ranks print to the console (default 0; e.g. 0,1); every rank's
#                 output is kept in <run folder>/logs
#   MAX_RESTARTS  restarts of a failed worker group, each resuming from the last checkpoint
#                 (default 0; one node: with several, let the scheduler requeue the job)
#   NNODES, NODE_RANK, MASTER_ADDR, MASTER_PORT   multi-node (static rendezvous; name the run)
# Ctrl-C / SIGTERM: the step finishes, a checkpoint is written, exit 128+signal; twice: at once.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"
source scripts/env.sh

for arg in "$@"; do
    case "$arg" in -h | --help) exec "$PY" -m titanlite.preflight --help ;; esac
done

args=("$@")
case " $* " in
    *" --config "* | *" --config="*) ;;
    *) args=(--config train_configs/debug_model.toml "${args[@]}") ;;
esac

if [ -z "${NGPU:-}" ]; then
    NGPU=$( (nvidia-smi -L 2>/dev/null || true) | grep -c '^GPU' || true)
fi
if [ -z "${NPROC:-}" ]; then
    if [ "$NGPU" -gt 0 ]; then NPROC=$NGPU; else NPROC=2; fi
fi
NNODES=${NNODES:-1}
LOG_RANK=${LOG_RANK:-0}
MAX_RESTARTS=${MAX_RESTARTS:-0}

if [ "$NNODES" -gt 1 ]; then
    if [ "$MAX_RESTARTS" -gt 0 ]; then
        echo "titanlite: error: MAX_RESTARTS needs NNODES=1; with several nodes let the scheduler requeue the job (scripts/train.slurm does)" >&2
        exit 2
    fi
    rdzv=(--nnodes "$NNODES" --node_rank "${NODE_RANK:?set NODE_RANK for multi-node}"
          --master_addr "${MASTER_ADDR:?set MASTER_ADDR for multi-node}" --master_port "${MASTER_PORT:-29500}")
elif [ -n "${MASTER_PORT:-}" ]; then
    rdzv=(--nnodes 1 --master_addr "${MASTER_ADDR:-127.0.0.1}" --master_port "$MASTER_PORT")
else
    rdzv=(--standalone)  # a free port, so several runs can share a machine
fi
# CPU ranks share the cores; saying so also silences torchrun's OMP banner.
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-$(( $(nproc) / NPROC > 0 ? $(nproc) / NPROC : 1 ))}"
export PYTHONWARNINGS="${PYTHONWARNINGS:-ignore::FutureWarning,ignore::UserWarning:torchdata.stateful_dataloader.stateful_dataloader}"
# The launcher checks the config (one line, exit 2, before any worker), fixes the run folder,
# locks it, then runs torchrun's agent; see titanlite/launch.py.
exec "$PY" -m titanlite.launch "${rdzv[@]}" --nproc_per_node "$NPROC" --max-restarts "$MAX_RESTARTS" \
    --local-ranks-filter "$LOG_RANK" \
    -m titanlite.train "${args[@]}"
