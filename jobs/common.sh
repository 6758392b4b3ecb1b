# shellcheck shell=bash
# jobs/common.sh: the logic shared by the mpicube batch scripts. It is sourced,
# not run:
#
#   source "$REPO_DIR/jobs/common.sh"
#   mpc_setup slurm|pbs|local   # find the venv, the rank count, the launcher
#   mpc_check_world             # is the MPI world as large as the allocation?
#   mpc_run "$@"                # train with --resume; requeue/resubmit on 75
#
# A scheduler script sets its defaults in the variables below (each one can be
# overridden from the environment, e.g. `N_LAYER=12 sbatch jobs/slurm_8gpu.sh`)
# before it calls mpc_setup.
#
#   RUN_DIR        run folder (--out); relative paths are relative to REPO_DIR
#   DATA           token shards (--data); empty: mpicube's built-in corpus
#   LAYOUT DTYPE DEVICE                                    default 3d float32 gpu
#   N_LAYER N_HEAD N_EMBD SEQ_LEN BATCH_SIZE STEPS LR WARMUP     the model, the run
#   DP             data-parallel replicas (--dp): ranks = DP x PP x q^3 for the
#                  3-D layout; unset means mpicube's default of 1
#   PP PP_SCHEDULE VIRTUAL_STAGES GRAD_ACCUM   pipeline stages (--pp), their
#                  schedule (--pp-schedule), chunks per stage (--virtual-stages)
#                  and micro-batches (--grad-accum); unset: mpicube's defaults
#   CKPT_EVERY     steps between checkpoints (--ckpt-every)
#   EXTRA_ARGS     more `mpicube train` options, appended last (so they win)
#   TIME_LIMIT     seconds for --time-limit; PBS computes it from the walltime
#   TIME_MARGIN    PBS: seconds of walltime kept back for the final checkpoint
#                  and the resubmission (default 300)
#   MAX_RESUBMITS  stop the requeue chain after this many restarts (default 100)
#   VENV           virtual environment (default REPO_DIR/.venv); its bin/ goes
#                  first on PATH
#   LAUNCHER       the whole launch prefix, replacing the default one, e.g.
#                  "srun --mpi=pmix" or "mpiexec -n 64 --ppn 4"
#   SRUN_ARGS      extra srun options (Slurm), e.g. --mpi=pmix
#   MPIEXEC_ARGS   extra mpiexec options (PBS, local)
#   SKIP_PROBE=1   skip the world-size check
# EXTRA_ARGS, LAUNCHER, SRUN_ARGS and MPIEXEC_ARGS are split on whitespace.
# Needs bash 4.4 or newer.
#
# Exit statuses of `mpicube train` and what the scripts make of them (the
# job's exit status, as the scheduler records it):
#   0   training finished (all --steps done): 0
#   2   bad input (one `error:` line), 3 training diverged: 2, 3; no resubmission
#   74  the run directory failed (a full disk, a read-only file system; one
#       `error:` line naming the file, after an attempt to checkpoint): 74; no
#       resubmission, since the next job would fail the same way
#   75  stopped early on SIGTERM/SIGUSR1 or --time-limit, after writing a
#       checkpoint: requeue (Slurm) or resubmit (PBS) and continue; the job
#       ends with 75 when MAX_RESUBMITS stops the chain (and with 1 when the
#       run made no progress: a chain that would loop)
#   76  no progress: a rank stopped, died or was cut off for --collective-timeout
#       seconds (one `error:` line names it); the last checkpoint is intact: 76;
#       no resubmission (a lost node is for a person to look at; resume by hand)
#   any other (1 internal error; a launcher's own status such as srun's 137
#       after it killed the other ranks of an aborted job): 1; no resubmission
# The scripts' own failures (no venv, a wrong MPI world size) exit 1 too.
#
# Stopping early: SIGUSR1 to the batch shell (Slurm's --signal=B:USR1@N,
# `scancel --signal=USR1 --batch`, PBS's `qsig -s USR1`) is passed on to the
# ranks through the launcher, which forwards it, as soon as this launch of
# mpicube is up; SIGUSR1 sent to the ranks directly (--signal=USR1@N without
# B:, `scancel --signal=USR1`) needs no help. SIGTERM is left alone: it comes
# with the scheduler's kill at the time limit or from scancel/qdel, when the
# job must not be requeued; mpicube still checkpoints on it if it has time.
#
# GPUs: run one rank per GPU and let every rank see all of its node's GPUs.
# mpicube picks its device itself (--device gpu): the node-local rank, from an
# MPI_COMM_TYPE_SHARED split, modulo the number of visible devices. So do not
# hide GPUs from the ranks (no --gpus-per-task / --gpu-bind=single:1, no
# CUDA_VISIBLE_DEVICES wrapper); the probe warns when ranks see fewer GPUs than
# there are ranks on a node.

MPC_EXIT_PREEMPTED=75
MPC_EXIT_IO=74
MPC_EXIT_NO_PROGRESS=76

# Variables written to RUN_DIR/job-env.sh so that a resubmitted PBS job runs
# with exactly the settings of the first one.
MPC_VARS=(REPO_DIR VENV RUN_DIR DATA LAYOUT DTYPE DEVICE N_LAYER N_HEAD N_EMBD
  SEQ_LEN BATCH_SIZE STEPS LR WARMUP DP PP PP_SCHEDULE VIRTUAL_STAGES GRAD_ACCUM
  CKPT_EVERY EXTRA_ARGS TIME_LIMIT
  TIME_MARGIN MAX_RESUBMITS LAUNCHER SRUN_ARGS MPIEXEC_ARGS SKIP_PROBE WALLTIME
  OMP_NUM_THREADS)

mpc_log() { echo "[mpicube job $(date '+%F %T')] $*"; }

# A stop request can arrive at any moment, even before mpc_setup: the trap is
# set as this file is sourced. bash runs a trap only between commands, so the
# launcher runs in the background while the shell waits for it (mpc_launch).
MPC_STOP=0     # 1: SIGUSR1 came and has not been passed on to the ranks yet
MPC_TRAPS=0    # how many signals this shell has trapped
mpc_on_usr1() {
  MPC_STOP=1
  MPC_TRAPS=$((MPC_TRAPS + 1))
  mpc_log "got SIGUSR1: the ranks will checkpoint and stop (passed on once mpicube is up)"
}
trap mpc_on_usr1 USR1
mpc_die() {
  echo "[mpicube job] error: $*" >&2
  exit 1
}

# mpc_setup SCHEDULER: resolve paths, the allotted rank count NP and the
# launcher (array MPC_LAUNCH); create RUN_DIR.
mpc_setup() {
  MPC_SCHED=$1
  case $MPC_SCHED in slurm | pbs | local) ;; *) mpc_die "mpc_setup: unknown scheduler '$MPC_SCHED'" ;; esac
  [[ -n ${REPO_DIR:-} && -f $REPO_DIR/jobs/common.sh ]] ||
    mpc_die "REPO_DIR='${REPO_DIR:-}' is not the mpicube checkout (submit from the repository root or set REPO_DIR)"
  REPO_DIR=$(cd "$REPO_DIR" && pwd)

  # A resubmitted PBS job takes the settings of the job that submitted it.
  if [[ -n ${MPICUBE_JOB_ENV:-} ]]; then
    # shellcheck disable=SC1090
    source "$MPICUBE_JOB_ENV"
  fi

  : "${VENV:=$REPO_DIR/.venv}"
  if [[ -d $VENV/bin ]]; then
    PATH="$VENV/bin:$PATH"
    export PATH VIRTUAL_ENV=$VENV
  fi
  MPC_PYTHON=$(command -v python3) || mpc_die "python3 not found on PATH"
  MPC_MPICUBE=$(command -v mpicube) ||
    mpc_die "mpicube not found (looked in $VENV/bin and PATH): run 'make install-site-mpi' (cluster MPI) or 'make install' first, or set VENV"

  : "${LAYOUT:=3d}" "${DTYPE:=float32}" "${DEVICE:=gpu}"
  : "${CKPT_EVERY:=500}" "${TIME_MARGIN:=300}" "${MAX_RESUBMITS:=100}"
  : "${DATA:=}" "${EXTRA_ARGS:=}" "${TIME_LIMIT:=}" "${WALLTIME:=}"
  : "${SRUN_ARGS:=}" "${MPIEXEC_ARGS:=}" "${LAUNCHER:=}" "${SKIP_PROBE:=0}"
  [[ -n ${RUN_DIR:-} ]] || mpc_die "RUN_DIR is not set"

  local extra
  case $MPC_SCHED in
  slurm)
    NP=${SLURM_NTASKS:-${SLURM_NPROCS:-}}
    [[ -n $NP ]] || mpc_die "SLURM_NTASKS is not set: is this running inside an sbatch job with --ntasks?"
    MPC_JOB_ID=${SLURM_JOB_ID:-?}
    MPC_RESTARTS=${SLURM_RESTART_COUNT:-0}
    # Since Slurm 22.05 srun no longer inherits --cpus-per-task from sbatch.
    if [[ -n ${SLURM_CPUS_PER_TASK:-} ]]; then
      export SRUN_CPUS_PER_TASK=$SLURM_CPUS_PER_TASK
    fi
    : "${OMP_NUM_THREADS:=${SLURM_CPUS_PER_TASK:-1}}"
    read -r -a extra <<<"$SRUN_ARGS"
    MPC_LAUNCH=(srun --ntasks="$NP" "${extra[@]}")
    ;;
  pbs)
    [[ -n ${PBS_NODEFILE:-} && -r $PBS_NODEFILE ]] || mpc_die "PBS_NODEFILE is not readable: is this running inside a qsub job?"
    NP=$(grep -c . "$PBS_NODEFILE")
    MPC_JOB_ID=${PBS_JOBID:-?}
    MPC_RESTARTS=${MPICUBE_RESUBMITS:-0}
    [[ -n ${MPC_SELF:-} ]] || mpc_die "MPC_SELF (this script's path in the repository) is not set"
    : "${OMP_NUM_THREADS:=1}"
    read -r -a extra <<<"$MPIEXEC_ARGS"
    # -n and --hostfile are understood by MPICH/Intel MPI (Hydra), Open MPI and
    # Cray PALS; the node file lists each host once per rank (mpiprocs=).
    MPC_LAUNCH=(mpiexec -n "$NP" --hostfile "$PBS_NODEFILE" "${extra[@]}")
    ;;
  local)
    : "${NP:=8}"
    MPC_JOB_ID=local
    MPC_RESTARTS=0
    read -r -a extra <<<"$MPIEXEC_ARGS"
    MPC_LAUNCH=(mpiexec -n "$NP" "${extra[@]}")
    ;;
  esac
  [[ $NP =~ ^[1-9][0-9]*$ ]] || mpc_die "bad rank count NP='$NP'"
  if [[ $MPC_SCHED == local ]]; then
    local cores
    cores=$(nproc 2>/dev/null || echo 1)
    : "${OMP_NUM_THREADS:=$((cores / NP > 0 ? cores / NP : 1))}"
  fi
  export OMP_NUM_THREADS
  if [[ -n $LAUNCHER ]]; then
    read -r -a MPC_LAUNCH <<<"$LAUNCHER"
  fi

  cd "$REPO_DIR" || mpc_die "cannot cd to $REPO_DIR"
  mkdir -p "$RUN_DIR"
  RUN_DIR=$(cd "$RUN_DIR" && pwd)

  mpc_log "job $MPC_JOB_ID ($MPC_SCHED), restart $MPC_RESTARTS; $NP ranks; run folder $RUN_DIR"
  mpc_log "mpicube: $MPC_MPICUBE; launcher: ${MPC_LAUNCH[*]}"
}

# Python run under the launcher: rank 0 prints one line with the world size,
# the node count, the most ranks on one node and the fewest GPUs a rank sees
# (-1: CUDA_VISIBLE_DEVICES unset, i.e. all of the node's GPUs).
MPC_PROBE_PY='
import os, signal
signal.signal(signal.SIGUSR1, lambda *_: print("MPICUBE_PROBE_STOP", flush=True))
from mpi4py import MPI
world = MPI.COMM_WORLD
node = world.Split_type(MPI.COMM_TYPE_SHARED)
cvd = os.environ.get("CUDA_VISIBLE_DEVICES")
seen = 1 << 30 if cvd is None else len([d for d in cvd.split(",") if d.strip()])
nodes = world.allreduce(1 if node.Get_rank() == 0 else 0)
per_node = world.allreduce(node.Get_size(), op=MPI.MAX)
gpus = world.allreduce(seen, op=MPI.MIN)
if world.Get_rank() == 0:
    lib = MPI.Get_library_version().strip().splitlines()[0]
    print("MPICUBE_PROBE", world.Get_size(), nodes, per_node,
          -1 if gpus == 1 << 30 else gpus, lib, flush=True)
'

# mpc_check_world: launch the probe on all NP ranks and stop the job unless it
# sees one MPI world of NP ranks. A launcher that does not speak the PMI of
# mpi4py's MPI starts NP singletons, each rank 0 of a world of 1.
mpc_check_world() {
  if [[ $SKIP_PROBE == 1 ]]; then
    mpc_log "SKIP_PROBE=1: world-size check skipped"
    return 0
  fi
  local -a cmd=("${MPC_LAUNCH[@]}" "$MPC_PYTHON" -c "$MPC_PROBE_PY")
  if command -v timeout >/dev/null; then
    cmd=(timeout 600 "${cmd[@]}")
  fi
  local out status=0
  out=$("${cmd[@]}" 2>&1) || status=$?
  if [[ $out == *MPICUBE_PROBE_STOP* ]]; then
    MPC_STOP=1
    mpc_log "the ranks got SIGUSR1 during the MPI probe: mpicube will be asked to checkpoint and stop"
  fi
  local lines
  lines=$(grep -o 'MPICUBE_PROBE ' <<<"$out" | wc -l)
  if ((status != 0 || lines == 0)); then
    printf '%s\n' "$out" >&2
    mpc_die "the MPI probe failed (status $status): '${MPC_LAUNCH[*]} python3 -c \"from mpi4py import MPI\"' does not run. Check the module loads and that mpi4py in $VENV imports on the compute nodes."
  fi
  if ((lines > 1)); then
    printf '%s\n' "$out" | head -n 5 >&2
    mpc_die "the launcher started $lines processes that each see an MPI world of 1 (every one is rank 0): the launcher and mpi4py's MPI do not talk to each other. Build mpi4py against this machine's MPI (make install-site-mpi after loading its module), or pick the PMI, e.g. SRUN_ARGS=--mpi=pmix (or pmi2), or use the MPI's own mpiexec via LAUNCHER."
  fi
  local _tag world nodes per_node gpus lib
  read -r _tag world nodes per_node gpus lib < <(grep -o 'MPICUBE_PROBE .*' <<<"$out")
  if [[ $world != "$NP" ]]; then
    mpc_die "MPI world size is $world but the scheduler allotted $NP ranks: fix the launcher (LAUNCHER, SRUN_ARGS, MPIEXEC_ARGS) or the job's task count"
  fi
  mpc_log "MPI world: $world ranks on $nodes node(s), up to $per_node per node; $lib"
  if [[ $DEVICE == gpu && $gpus != -1 ]] && ((gpus < per_node)); then
    mpc_log "warning: a rank sees only $gpus GPU(s) (CUDA_VISIBLE_DEVICES) while $per_node ranks share a node. mpicube picks GPU (node-local rank mod visible GPUs): fine if each rank was given its own GPU, otherwise ranks share one. Prefer --gpus-per-node without per-task GPU binding."
  fi
}

# mpc_latest_step: the step of the newest checkpoint RUN_DIR/ckpt/step_NNNNNNNN,
# or -1 when there is none.
mpc_latest_step() {
  local d n best=-1
  for d in "$RUN_DIR"/ckpt/step_*; do
    n=${d##*/step_}
    [[ -d $d && $n =~ ^[0-9]+$ ]] || continue
    n=$((10#$n))
    ((n > best)) && best=$n
  done
  echo "$best"
}

# mpc_hms_seconds [[D:]H:]M:]S -> seconds
mpc_hms_seconds() {
  local IFS=: field total=0
  for field in $1; do
    [[ $field =~ ^[0-9]+$ ]] || return 1
    total=$((total * 60 + 10#$field))
  done
  echo "$total"
}

# mpc_pbs_time_limit: seconds mpicube may train in this PBS job: the requested
# walltime (WALLTIME, PBS_WALLTIME or qstat) less what this script has used and
# TIME_MARGIN. PBS gives no warning signal before the walltime kill.
mpc_pbs_time_limit() {
  local wt=$WALLTIME seconds
  [[ -n $wt ]] || wt=${PBS_WALLTIME:-}
  if [[ -z $wt ]] && command -v qstat >/dev/null; then
    wt=$(qstat -f "$PBS_JOBID" 2>/dev/null | awk -F'= *' '/Resource_List.walltime/ {print $2; exit}')
  fi
  [[ -n $wt ]] || mpc_die "cannot tell this job's walltime (no PBS_WALLTIME, qstat gave none): set WALLTIME=HH:MM:SS or TIME_LIMIT=seconds"
  seconds=$(mpc_hms_seconds "$wt") || mpc_die "cannot read walltime '$wt'"
  echo $((seconds - SECONDS - TIME_MARGIN))
}

# mpc_train_args: the `mpicube train` options of this job (array MPC_ARGS).
mpc_train_args() {
  MPC_ARGS=(train --layout "$LAYOUT" --dtype "$DTYPE" --device "$DEVICE")
  local pair var
  for pair in n-layer:N_LAYER n-head:N_HEAD n-embd:N_EMBD seq-len:SEQ_LEN \
    batch-size:BATCH_SIZE steps:STEPS lr:LR warmup:WARMUP dp:DP pp:PP pp-schedule:PP_SCHEDULE \
    virtual-stages:VIRTUAL_STAGES grad-accum:GRAD_ACCUM; do
    var=${pair#*:}
    if [[ -n ${!var:-} ]]; then
      MPC_ARGS+=("--${pair%%:*}" "${!var}")
    fi
  done
  [[ -z $DATA ]] || MPC_ARGS+=(--data "$DATA")
  MPC_ARGS+=(--out "$RUN_DIR" --resume --ckpt-every "$CKPT_EVERY")
}

# mpc_run [ARGS...]: train (ARGS and then EXTRA_ARGS appended), then act on the
# exit status: 0 done, 75 requeue/resubmit, else fail. Does not return.
mpc_run() {
  mpc_train_args
  local -a extra
  read -r -a extra <<<"$EXTRA_ARGS"
  MPC_ARGS+=("$@" "${extra[@]}")

  local limit=$TIME_LIMIT
  if [[ -z $limit && $MPC_SCHED == pbs ]]; then
    limit=$(mpc_pbs_time_limit) || exit 1
    ((limit >= 60)) || mpc_die "only ${limit}s left for training after TIME_MARGIN=${TIME_MARGIN}s: ask for a longer walltime"
  fi
  [[ -z $limit ]] || MPC_ARGS+=(--time-limit "$limit")

  local before
  before=$(mpc_latest_step)
  mpc_log "latest checkpoint: $([[ $before == -1 ]] && echo none || echo "step $before")"
  mpc_log "running: ${MPC_LAUNCH[*]} mpicube $(printf '%q ' "${MPC_ARGS[@]}")"

  local status=0
  mpc_launch "${MPC_LAUNCH[@]}" "$MPC_MPICUBE" "${MPC_ARGS[@]}" || status=$?
  case $status in
  0)
    mpc_log "training finished"
    exit 0
    ;;
  "$MPC_EXIT_PREEMPTED") ;;
  2 | 3)
    mpc_log "mpicube failed with status $status ($([[ $status == 2 ]] && echo 'bad input' || echo 'training diverged')); not resubmitting"
    exit "$status"
    ;;
  "$MPC_EXIT_IO")
    mpc_log "mpicube failed with status $status (the run folder $RUN_DIR could not be written or read: see the error line); not resubmitting"
    exit "$status"
    ;;
  "$MPC_EXIT_NO_PROGRESS")
    mpc_log "mpicube failed with status $status (no progress: a rank stopped or was cut off; see its error line); not resubmitting"
    exit "$status"
    ;;
  *)
    # When one rank fails alone, mpicube aborts the job and the launcher
    # reports the ranks it killed (srun: 137) rather than the rank's status:
    # every failure other than 2, 3, 74 and 76 leaves the job with status 1.
    mpc_log "mpicube failed with status $status; not resubmitting (job exit status 1)"
    exit 1
    ;;
  esac

  local after
  after=$(mpc_latest_step)
  mpc_log "mpicube stopped early (status 75); latest checkpoint: step $after"
  if ((after <= before)); then
    mpc_die "no new checkpoint since this job started (step $before before, $after now): not resubmitting, a chain that makes no progress would loop"
  fi
  case $MPC_SCHED in
  slurm) mpc_requeue_slurm ;;
  pbs) mpc_resubmit_pbs ;;
  local) mpc_log "run the same command again to resume from step $after" ;;
  esac
  exit "$MPC_EXIT_PREEMPTED"
}

# mpc_file_id FILE: its inode and modification time ("" if absent).
mpc_file_id() { stat -c '%i %y' "$1" 2>/dev/null || true; }

# mpc_alive PID: whether the process runs (not gone, not a zombie).
mpc_alive() {
  local stat
  stat=$(cat "/proc/$1/stat" 2>/dev/null) || return 1
  stat=${stat##*) }
  [[ ${stat%% *} != Z ]]
}

# mpc_launch CMD...: run the launcher in the background and wait for it,
# passing SIGUSR1 on to it (MPICH's mpiexec, srun and Open MPI's mpirun all
# forward SIGUSR1 to the ranks); returns its exit status. A rank that gets
# SIGUSR1 before mpicube has installed its handler dies of it, so a request is
# held back until this launch is up: rank 0 rewrites RUN_DIR/config.json after
# every rank has passed its handler (the setup's first collectives).
mpc_launch() {
  local config=$RUN_DIR/config.json before status traps interrupted=
  before=$(mpc_file_id "$config")
  "$@" &
  local child=$!
  while :; do
    if ((MPC_STOP)) && [[ $(mpc_file_id "$config") != "$before" ]]; then
      MPC_STOP=0
      if kill -USR1 "$child" 2>/dev/null; then
        mpc_log "passed SIGUSR1 on to the ranks through $1"
      fi
    fi
    if ((MPC_STOP)) && mpc_alive "$child"; then
      sleep 0.5 # mpicube is not up yet
      continue
    fi
    traps=$MPC_TRAPS
    status=0
    wait "$child" || status=$?
    # A trapped signal interrupts `wait` (status 128+n) while the child runs
    # on; wait again. (Had the child ended just then with that very status,
    # the second wait finds no child: 127.)
    if ((status == 127)) && [[ -n $interrupted ]]; then
      status=$interrupted
    elif ((traps != MPC_TRAPS && status > 128)); then
      interrupted=$status
      continue
    fi
    return "$status"
  done
}

# Slurm: put this same job (same id, same script and arguments) back in the
# queue; --requeue in the header allows it, --open-mode=append keeps the log.
mpc_requeue_slurm() {
  if ((MPC_RESTARTS >= MAX_RESUBMITS)); then
    mpc_log "MAX_RESUBMITS=$MAX_RESUBMITS restarts reached: not requeueing; resubmit by hand to continue"
    return 0
  fi
  # Logged before the call: a successful requeue makes slurmctld cancel this
  # batch step at once, so nothing after `scontrol requeue` is sure to run.
  mpc_log "requeueing job $SLURM_JOB_ID; it resumes from the latest checkpoint"
  if ! scontrol requeue "$SLURM_JOB_ID"; then
    mpc_log "scontrol requeue failed: submit the script again to resume"
  fi
}

# PBS: submit this script again, to start after this job ends. Its settings go
# through RUN_DIR/job-env.sh; a counter limits the chain. MPC_SELF is the
# script's path relative to REPO_DIR (PBS runs a spooled copy, $0 is useless).
mpc_resubmit_pbs() {
  if ((MPC_RESTARTS >= MAX_RESUBMITS)); then
    mpc_log "MAX_RESUBMITS=$MAX_RESUBMITS resubmissions reached: not resubmitting; qsub again by hand to continue"
    return 0
  fi
  local env_file=$RUN_DIR/job-env.sh v
  {
    echo "# settings of the PBS job chain in this folder, written by jobs/common.sh"
    for v in "${MPC_VARS[@]}"; do
      printf 'export %s=%q\n' "$v" "${!v:-}"
    done
  } >"$env_file"
  [[ $env_file != *,* ]] || mpc_die "RUN_DIR must not contain a comma (qsub -v)"
  # Logged before the call, like the Slurm requeue (qsub does not end this
  # job, but a site's submit filter or a walltime kill may come first).
  mpc_log "resubmitting $MPC_SELF to resume after this job (restart $((MPC_RESTARTS + 1)))"
  local id
  if id=$(qsub -W depend=afterany:"$PBS_JOBID" \
    -v "MPICUBE_RESUBMITS=$((MPC_RESTARTS + 1)),MPICUBE_JOB_ENV=$env_file" \
    "$REPO_DIR/$MPC_SELF"); then
    mpc_log "submitted $id to resume after this job"
  else
    mpc_log "qsub failed: run 'cd $REPO_DIR && qsub $MPC_SELF' to resume"
  fi
}
