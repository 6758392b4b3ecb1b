#!/usr/bin/env bash
# mpicube on one machine: 3-D tensor parallelism with plain mpiexec, NP ranks
# (default 8 = a 2x2x2 cube). NP must be a cube (1, 8, 27, 64) for LAYOUT=3d.
#
#     jobs/local.sh                       # 8 ranks, small model
#     NP=27 jobs/local.sh --steps 50      # options after the script go to `mpicube train`
#     DATA=data/shards RUN_DIR=runs/mine jobs/local.sh
#
# It uses <repo>/.venv (`make install`: mpi4py with the MPICH wheel, whose
# mpiexec comes first on PATH) unless VENV points elsewhere. More ranks than
# cores is fine with MPICH; Open MPI needs MPIEXEC_ARGS=--oversubscribe.
# DEVICE defaults to gpu when nvidia-smi sees a GPU and CuPy imports (pip
# install -e '.[gpu]'), else cpu; each rank takes GPU (node-local rank mod
# GPU count). The model is sized for the cube: N_EMBD = 32 q^2,
# N_HEAD = 4 q, BATCH_SIZE = 2 q^2; set these variables to change it.
#
# Like the batch scripts it checks the MPI world size first and trains with
# --resume: a run stopped early (status 75, e.g. after SIGTERM or
# TIME_LIMIT=seconds) continues from its newest checkpoint when the same
# command is run again. Variables and details: jobs/common.sh.
set -euo pipefail
REPO_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
source "$REPO_DIR/jobs/common.sh"

: "${NP:=8}" "${LAYOUT:=3d}" "${DTYPE:=float32}"
[[ $NP =~ ^[1-9][0-9]*$ ]] || mpc_die "NP='$NP' is not a positive rank count"
q=1
if [[ $LAYOUT == 3d ]]; then
  while ((q * q * q < NP)); do q=$((q + 1)); done
  ((q * q * q == NP)) || mpc_die "NP=$NP is not a cube; --layout 3d needs q^3 ranks (1, 8, 27, 64, ...)"
fi
if [[ -z ${DEVICE:-} ]]; then
  DEVICE=cpu
  python=$( (PATH="${VENV:-$REPO_DIR/.venv}/bin:$PATH" command -v python3) || true)
  if command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1 &&
    [[ -n $python ]] && "$python" -c 'import cupy' 2>/dev/null; then
    DEVICE=gpu
  fi
fi
: "${RUN_DIR:=runs/local-$LAYOUT-np$NP}"
: "${N_LAYER:=4}" "${N_HEAD:=$((4 * q))}" "${N_EMBD:=$((32 * q * q))}" "${SEQ_LEN:=64}"
: "${BATCH_SIZE:=$((2 * q * q))}" "${STEPS:=200}" "${LR:=1e-3}" "${WARMUP:=20}" "${CKPT_EVERY:=50}"

mpc_setup local
mpc_check_world
mpc_run "$@"
