#!/usr/bin/env bash
# Train with torchrun.  ./run_train.sh [--config FILE] [--section.key value ...]
#   relative paths (the config's, the flags') mean the folder you run it from
#   --help        every config key with its type, default and doc
#   --rehearse W  rehearse the run as one rank of W on this machine: per-rank memory, compute,
#                 traffic and diagnostics cost, no training (README: "Plan a cluster run")
#   NGPU / NPROC  ranks on this node (default: the GPU count, else 2 CPU ranks)
#   LOG_RANK      which local ranks print to the console (default 0; e.g. 0,1); every rank's
#                 output is kept in <run folder>/logs
#   MAX_RESTARTS  restarts of a failed worker group, each resuming from the last checkpoint
#                 (default 0; one node: with several, let the scheduler requeue the job)
#   NNODES, NODE_RANK, MASTER_ADDR, MASTER_PORT   multi-node (static rendezvous; name the run)
# Ctrl-C / SIGTERM: the step finishes, a checkpoint is written, exit 128+signal; twice: at once.
set -euo pipefail
caller="$PWD"  # relative paths in the words below mean this folder (config/command_line.py)
cd "$(dirname "${BASH_SOURCE[0]}")"
source scripts/env.sh

# The words go to Python untouched: which config applies (the default
# train_configs/debug_model.toml, one --config), --rehearse W and every override are read in one
# place, titanlite/config/command_line.py. The launcher reads NGPU, NPROC, NNODES, NODE_RANK,
# MASTER_ADDR, MASTER_PORT, LOG_RANK, MAX_RESTARTS (titanlite/components/run/torchrun.py: one
# line, exit 2, if one is wrong), checks the config, fixes the run folder, locks it, then runs
# torchrun's agent: titanlite/launch.py.
exec "$PY" -m titanlite.launch --from-env --caller-cwd "$caller" "$@"
