#!/bin/bash
# mpicube on PBS: 3-D tensor parallelism on a 2x2x2 cube = 8 GPUs
# (2 nodes x 4 GPUs, one MPI rank per GPU), checkpointing and
# resubmitting itself until the run is done.
#
# Submit from the repository root (PBS passes no arguments to the script: put
# extra `mpicube train` options in EXTRA_ARGS):
#     qsub jobs/pbs_8gpu.sh
#     qsub -v "DATA=/scratch/shards,RUN_DIR=runs/my-run,EXTRA_ARGS=--steps 2000" jobs/pbs_8gpu.sh
#
# Edit before the first run:
#   - #PBS lines: -A (account/project) and -q (queue) (delete one '#' to
#     enable them), walltime, ncpus. With 8 GPUs per node use
#     select=1:ngpus=8:mpiprocs=8. Torque: -l nodes=2:ppn=4:gpus=4.
#   - "site setup" below: the module loads for CUDA and for the MPI that
#     mpi4py was built against, and the venv if it is not <repo>/.venv.
#     Make the venv once, on a login node, after the same module loads:
#         make install-site-mpi && .venv/bin/pip install -e '.[gpu]'
#   - the run settings below, or their environment variables.
#
# GPUs: every rank must see all GPUs of its node; mpicube picks one by its
# node-local rank (--device gpu). Do not wrap ranks in a script that sets
# CUDA_VISIBLE_DEVICES to one GPU.
#
# Restarts: each launch runs `mpicube train --resume --out $RUN_DIR`, which
# continues from the run's newest checkpoint (or starts fresh). PBS sends no
# warning before the walltime kill, so the script passes --time-limit: the
# walltime left minus TIME_MARGIN=300 s for the last checkpoint. mpicube then
# writes a checkpoint and exits 75, and the script submits itself again (its
# settings saved in $RUN_DIR/job-env.sh, to start after this job ends).
# Exit 0 means finished; any other status is a failure and is not resubmitted.
# Variables and details: jobs/common.sh.
#
#PBS -N mpicube-3d-8
#PBS -S /bin/bash
#PBS -l select=2:ncpus=32:ngpus=4:mpiprocs=4
#PBS -l place=scatter:excl
#PBS -l walltime=04:00:00
#PBS -j oe
#PBS -r y
##PBS -A CHANGE_ME
##PBS -q CHANGE_ME

# ---- site setup ----------------------------------------------------------------------------
# module load cuda/12 openmpi       # the MPI that mpi4py in the venv was built against
# export VENV=/path/to/venv         # default: <repo>/.venv
# export LAUNCHER="mpiexec -n 8 --ppn 4"   # if the default mpiexec line does not fit

set -euo pipefail
REPO_DIR=${REPO_DIR:-${PBS_O_WORKDIR:-$PWD}}
[[ -f $REPO_DIR/jobs/common.sh ]] || REPO_DIR=$REPO_DIR/..  # submitted from jobs/
MPC_SELF=jobs/pbs_8gpu.sh  # PBS runs a copy of this file; resubmit the original
# shellcheck source=jobs/common.sh
source "$REPO_DIR/jobs/common.sh"

# ---- the run: a 2x2x2 cube, one rank per GPU ---------------------------------------
# 3-D layout divisibility: BATCH_SIZE by q^2=4, N_EMBD by q^2=4, N_HEAD by q=2.
# Every value can be overridden from the environment.
# About 4.8 GB per GPU (mostly activations); `mpicube info --layout 3d -n 8` with
# the same sizes prints the sharding plan, traffic and memory per rank.
: "${RUN_DIR:=runs/3d-8gpu}"
: "${DATA:=}"  # token shards from `mpicube prepare`; empty: the built-in corpus
: "${N_LAYER:=12}" "${N_HEAD:=16}" "${N_EMBD:=1024}" "${SEQ_LEN:=1024}" "${BATCH_SIZE:=16}"
: "${STEPS:=20000}" "${LR:=6e-4}" "${WARMUP:=500}" "${CKPT_EVERY:=500}"
: "${LAYOUT:=3d}" "${DTYPE:=float32}" "${DEVICE:=gpu}"
: "${TIME_MARGIN:=300}"

mpc_setup pbs
mpc_check_world
mpc_run "$@"
