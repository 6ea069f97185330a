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

die() { echo "titanlite: error: $*" >&2; exit 2; }
# whole_number NAME VALUE MIN [MAX]: the environment variable NAME holds a whole number in range
whole_number() {
    [[ "$2" =~ ^[0-9]+$ ]] || die "$1 is '$2'; set it to a whole number (see the top of run_train.sh)"
    (( 10#$2 >= $3 )) || die "$1 is $2; it must be >= $3"
    [ -z "${4:-}" ] || (( 10#$2 <= $4 )) || die "$1 is $2; it must be <= $4"
}

if [ -z "${NGPU:-}" ]; then
    NGPU=$( (nvidia-smi -L 2>/dev/null || true) | grep -c '^GPU' || true)
fi
whole_number NGPU "$NGPU" 0
if [ -z "${NPROC:-}" ]; then
    if [ "$NGPU" -gt 0 ]; then NPROC=$NGPU; else NPROC=2; fi
fi
NNODES=${NNODES:-1}
LOG_RANK=${LOG_RANK:-0}
MAX_RESTARTS=${MAX_RESTARTS:-0}
whole_number NPROC "$NPROC" 1
whole_number NNODES "$NNODES" 1
whole_number MAX_RESTARTS "$MAX_RESTARTS" 0
[ -z "${MASTER_PORT:-}" ] || whole_number MASTER_PORT "$MASTER_PORT" 1 65535
IFS=, read -ra shown <<< "$LOG_RANK"
[ "${#shown[@]}" -gt 0 ] || die "LOG_RANK is empty; name the local ranks that print, e.g. 0 or 0,1"
for r in "${shown[@]}"; do
    whole_number "LOG_RANK (a local rank; NPROC=$NPROC)" "$r" 0 $(( NPROC - 1 ))
done

if [ "$NNODES" -gt 1 ]; then
    if [ "$MAX_RESTARTS" -gt 0 ]; then
        die "MAX_RESTARTS needs NNODES=1; with several nodes let the scheduler requeue the job (scripts/train.slurm does)"
    fi
    [ -n "${NODE_RANK:-}" ] || die "NNODES=$NNODES needs NODE_RANK (this node's index, 0 to $(( NNODES - 1 ))) and MASTER_ADDR"
    whole_number NODE_RANK "$NODE_RANK" 0 $(( NNODES - 1 ))
    [ -n "${MASTER_ADDR:-}" ] || die "NNODES=$NNODES needs MASTER_ADDR (node 0's address)"
    rdzv=(--nnodes "$NNODES" --node_rank "$NODE_RANK" --master_addr "$MASTER_ADDR" --master_port "${MASTER_PORT:-29500}")
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
