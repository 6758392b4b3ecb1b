#!/bin/bash
# mpicube on Slurm: 512 GPUs as 8 replicas x 8 pipeline stages x a 2x2x2
# 3-D cube (128 nodes x 4 GPUs, one MPI rank per GPU; dp x pp x tp with tp
# innermost), checkpointing and requeueing itself until the run is done.
#
# Why a pipeline (mpicube info -n 512 --pipelines --ranks-per-node 4 with
# this model): one 8x8x8 cube holds 6.4 GB per rank (4 micro-batches) but
# sends 63 GB per rank and step across nodes of 4 GPUs (18 GB on nodes of
# 8); dp 8 x pp 8 x 2x2x2, interleaved 1F1B with 2 chunks per stage and 8
# micro-batches, holds 20 GB and sends 7.4 GB (0.97 GB on nodes of 8), for a
# 30 % bubble. DP=1 PP=1 GRAD_ACCUM=1 runs the 8x8x8 cube.
#
# Submit from the repository root (mpicube options after the script are
# passed to `mpicube train`):
#     sbatch jobs/slurm_512gpu.sh
#     DATA=/scratch/shards RUN_DIR=runs/my-run sbatch jobs/slurm_512gpu.sh --steps 2000
#
# Edit before the first run:
#   - #SBATCH lines: --account and --partition (delete one '#' to enable
#     them), --time. With 8 GPUs per node use --nodes=64
#     --ntasks-per-node=8 --gpus-per-node=8 (--ntasks stays 512).
#     Older Slurm without --gpus-per-node: --gres=gpu:4.
#   - "site setup" below: the module loads for CUDA and for the MPI that
#     mpi4py was built against, and the venv if it is not <repo>/.venv.
#     Make the venv once, on a login node, after the same module loads:
#         make install-site-mpi && .venv/bin/pip install -e '.[gpu]'
#   - the run settings below, or their environment variables.
#
# GPUs: every rank must see all GPUs of its node; mpicube picks one by its
# node-local rank (--device gpu). Do not add --gpus-per-task or --gpu-bind.
#
# Restarts: each launch runs `mpicube train --resume --out $RUN_DIR`, which
# continues from the run's newest checkpoint (or starts fresh). 300 s before
# the time limit (give or take the 30 s between Slurm's checks) Slurm sends
# SIGUSR1 to this shell ("B:"), which passes it on to the ranks as soon as
# mpicube is up, so even a signal that comes early is not lost; mpicube
# writes a checkpoint and exits 75, and this script requeues the job (same
# id, log appended, SLURM_RESTART_COUNT one higher). To preempt by hand:
# `scancel --signal=USR1 --batch JOBID` (or without --batch, to the ranks).
# Exit 0 means finished, 75 stopped without requeueing (MAX_RESUBMITS); any
# other status is a failure (2 bad input, 3 diverged, 1 other) and is not
# requeued.
# Variables and details: jobs/common.sh.
#
#SBATCH --job-name=mpicube-3d-512
#SBATCH --nodes=128
#SBATCH --ntasks=512
#SBATCH --ntasks-per-node=4
#SBATCH --gpus-per-node=4
#SBATCH --cpus-per-task=8
#SBATCH --time=12:00:00
#SBATCH --signal=B:USR1@300
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --output=%x-%j.out
##SBATCH --account=CHANGE_ME
##SBATCH --partition=CHANGE_ME

# ---- site setup ----------------------------------------------------------------------------
# module load cuda/12 openmpi       # the MPI that mpi4py in the venv was built against
# export VENV=/path/to/venv         # default: <repo>/.venv
# export SRUN_ARGS=--mpi=pmix       # if the MPI probe below reports a world of 1

set -euo pipefail
REPO_DIR=${REPO_DIR:-${SLURM_SUBMIT_DIR:-$PWD}}
[[ -f $REPO_DIR/jobs/common.sh ]] || REPO_DIR=$REPO_DIR/..  # submitted from jobs/
# shellcheck source=jobs/common.sh
source "$REPO_DIR/jobs/common.sh"

# ---- the run: dp 8 x pp 8 x a 2x2x2 cube, one rank per GPU --------------------------------
# 3-D layout divisibility on the 2x2x2 cube: BATCH_SIZE / (DP x GRAD_ACCUM) by q^2=4, N_EMBD by
# q^2=4, N_HEAD by q=2 (DP=1 PP=1 GRAD_ACCUM=1, the 8x8x8 cube, needs 64, 64 and 8).
# Memory and traffic per rank: the header's figures; `mpicube info -n 512 --pipelines
# --ranks-per-node 4` with the same sizes prints them for every arrangement.
# Every value can be overridden from the environment.
: "${RUN_DIR:=runs/3d-512gpu}"
: "${DATA:=}"  # token shards from `mpicube prepare`; empty: the built-in corpus
: "${N_LAYER:=32}" "${N_HEAD:=64}" "${N_EMBD:=4096}" "${SEQ_LEN:=1024}" "${BATCH_SIZE:=256}"
: "${STEPS:=20000}" "${LR:=1.5e-4}" "${WARMUP:=2000}" "${CKPT_EVERY:=200}"
: "${LAYOUT:=3d}" "${DTYPE:=float32}" "${DEVICE:=gpu}"
: "${DP:=8}" "${PP:=8}" "${PP_SCHEDULE:=interleaved}" "${VIRTUAL_STAGES:=2}" "${GRAD_ACCUM:=8}"

mpc_setup slurm
mpc_check_world
mpc_run "$@"
