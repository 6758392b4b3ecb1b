#!/usr/bin/env python3
"""A one-node Slurm cluster in a folder: to try the scripts in jobs/ on a
laptop and to test them in CI under a real scheduler.

    sudo python3 tools/slurm_cluster.py install        # Debian/Ubuntu packages, if missing
    sudo python3 tools/slurm_cluster.py up /tmp/slurm  # prints: export SLURM_CONF=/tmp/slurm/slurm.conf
    sudo python3 tools/slurm_cluster.py down /tmp/slurm

Everything the cluster writes (configuration, state, spool, logs, pid files,
its own munge key and socket) stays in the folder, so it never touches a
system Slurm or munge, and two clusters on one machine do not meet (each
picks free ports). The daemons run as root: slurmd has to start jobs as the
user who submitted them. Only the standard library is used, so CI can run
`install` before the project's venv exists.

Choices that make it work on a container or VM without systemd or cgroups,
and make requeued jobs come back in seconds rather than minutes:

- SlurmctldHost and NodeName are `hostname -s` (both daemons check it), the
  address is 127.0.0.1 so no DNS is needed;
- proctrack/linuxproc, task/none, no accounting: nothing needs cgroups;
- the node declares CPUS (default 8) whatever the machine has, with
  SlurmdParameters=config_overrides, so an 8-rank job runs on 2 cores; and 8
  count-only GPUs, so the scripts' --gpus-per-node requests are accepted;
- job ids start at a random number: MPICH names its shared-memory segments
  after the PMI job (job id and step), and one left behind by a killed step
  would be joined by the next cluster's step of the same id;
- AuthInfo cred_expire=10 (the smallest Slurm takes is 5) and one-second
  scheduler intervals: a requeued job starts again after about 6 s instead of
  the default 135 s (Slurm waits for the old credentials to expire).
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

PACKAGES = ["slurmctld", "slurmd", "slurm-client", "munge"]
# The programs the cluster needs, with the package that brings each one.
PROGRAMS = {"slurmctld": "slurmctld", "slurmd": "slurmd", "sbatch": "slurm-client", "munged": "munge"}
SBIN = ["/usr/sbin", "/sbin"]     # daemons live here; a non-root PATH may lack it


class ClusterError(RuntimeError):
    """The cluster could not be installed, started or stopped; the message says why."""


def which(program: str):
    found = shutil.which(program)
    if found:
        return found
    for folder in SBIN:
        path = Path(folder) / program
        if path.exists():
            return str(path)
    return None


def missing_programs() -> list:
    return [p for p in PROGRAMS if which(p) is None]


def install(quiet: bool = False) -> None:
    """Install Debian's Slurm and munge packages when a program is missing.

    Needs root and apt-get; anything else raises ClusterError, so a CI that
    cannot install fails instead of skipping the Slurm tests."""
    missing = missing_programs()
    if not missing:
        return
    packages = sorted({PROGRAMS[p] for p in missing})
    if os.geteuid() != 0:
        raise ClusterError(f"{', '.join(missing)} not installed, and installing {' '.join(packages)} "
                           "needs root: run `sudo python3 tools/slurm_cluster.py install`")
    if shutil.which("apt-get") is None:
        raise ClusterError(f"{', '.join(missing)} not installed and there is no apt-get: install "
                           f"Slurm ({' '.join(PACKAGES)}) with this system's package manager")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    for cmd in (["apt-get", "update", "-q"],
                ["apt-get", "install", "-y", "-q", "--no-install-recommends", *PACKAGES]):
        if not quiet:
            print("+", " ".join(cmd), flush=True)
        proc = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        if proc.returncode != 0:
            tail = "\n".join(proc.stdout.splitlines()[-20:])
            raise ClusterError(f"`{' '.join(cmd)}` failed with status {proc.returncode}:\n{tail}")
    still = missing_programs()
    if still:
        raise ClusterError(f"installed {' '.join(PACKAGES)} but {', '.join(still)} still not found")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# srun's own input variables outside SLURM_* (SRUN_ARGS and such belong to the jobs).
SRUN_INPUT = {"SRUN_CPUS_PER_TASK", "SRUN_EXPORT_ENV"}


def client_env(conf: Path, base: dict = None) -> dict:
    """The environment for Slurm commands on this cluster: SLURM_CONF set, and
    no Slurm variables inherited from an outer job (a test run inside a real
    allocation must not submit into it)."""
    env = {k: v for k, v in (os.environ if base is None else base).items()
           if not k.startswith(("SLURM_", "SBATCH_", "SALLOC_")) and k not in SRUN_INPUT}
    env["SLURM_CONF"] = str(conf)
    env["PATH"] = os.pathsep.join([env.get("PATH", "")] + SBIN)
    return env


SLURM_CONF = """\
# A one-node test cluster written by tools/slurm_cluster.py; everything lives in {root}.
ClusterName=mpicubetest
FirstJobId={first_job_id}
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={root}/munge/munge.sock,cred_expire=10
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.pid
SlurmctldLogFile={root}/log/slurmctld.log
SlurmdLogFile={root}/log/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
TmpFS={root}/tmp
PlugStackConfig={root}/plugstack.conf
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SwitchType=switch/none
MpiDefault=pmi2
MailProg=/bin/true
SchedulerType=sched/backfill
SchedulerParameters=bf_interval=1,sched_interval=1
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
SlurmdParameters=config_overrides
GresTypes=gpu
NodeName={host} NodeAddr=127.0.0.1 CPUs={cpus} Gres=gpu:{gpus} State=UNKNOWN
PartitionName=test Nodes={host} Default=YES MaxTime=INFINITE State=UP
"""


class Cluster:
    """A Slurm cluster of one node whose files all live under ``root``.

    ``up()`` writes the configuration and starts munged, slurmctld and slurmd;
    ``down()`` cancels what is left of the jobs and stops the three daemons.
    A Cluster made on the folder of a running one (e.g. by ``down`` in another
    process) finds the daemons through their pid files."""

    def __init__(self, root, cpus: int = 8, gpus: int = 8):
        self.root = Path(root).resolve()
        self.conf = self.root / "slurm.conf"
        self.cpus, self.gpus = cpus, gpus
        self.host = socket.gethostname().split(".")[0]

    # --- commands --------------------------------------------------------------
    def env(self, base: dict = None) -> dict:
        return client_env(self.conf, base)

    def run(self, *cmd, check: bool = True, timeout: float = 30) -> subprocess.CompletedProcess:
        """A Slurm command on this cluster, its output as text."""
        proc = subprocess.run([str(c) for c in cmd], env=self.env(), capture_output=True, text=True,
                              timeout=timeout)
        if check and proc.returncode != 0:
            raise ClusterError(f"`{' '.join(map(str, cmd))}` failed ({proc.returncode}): "
                               f"{proc.stderr.strip() or proc.stdout.strip()}")
        return proc

    # --- bring up --------------------------------------------------------------
    def up(self, timeout: float = 60) -> "Cluster":
        if os.geteuid() != 0:
            raise ClusterError("the test cluster's daemons run as root (slurmd starts jobs as their user): "
                               "run this as root, e.g. with sudo")
        missing = missing_programs()
        if missing:
            raise ClusterError(f"{', '.join(missing)} not installed: run `python3 tools/slurm_cluster.py install`")
        if self._alive("slurmctld") or self._alive("slurmd"):
            raise ClusterError(f"a cluster is already running in {self.root}: `down` it first")
        for sub in ("state", "spool", "log", "tmp", "munge"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        self.root.chmod(0o755)                   # jobs of other users read the configuration
        (self.root / "tmp").chmod(0o1777)
        (self.root / "plugstack.conf").write_text("")
        # Slurm drops GPUs without device files: links to /dev/null stand in for them.
        (self.root / "dev").mkdir(exist_ok=True)
        for i in range(self.gpus):
            (self.root / f"dev/gpu{i}").symlink_to("/dev/null")
        (self.root / "gres.conf").write_text(f"Name=gpu File={self.root}/dev/gpu[0-{self.gpus - 1}]\n")
        self.conf.write_text(SLURM_CONF.format(root=self.root, host=self.host, cpus=self.cpus, gpus=self.gpus,
                                               ctld_port=free_port(), slurmd_port=free_port(),
                                               first_job_id=random.randrange(1000, 60_000_000)))
        try:
            self._start_munge()
            self._start("slurmctld", "-i", "-f", self.conf)
            self._start("slurmd", "-f", self.conf)
            self._wait_idle(timeout)
        except BaseException:
            self.down()
            raise
        return self

    def _start_munge(self) -> None:
        """A private munged with a fresh key: the system's munge (if any) is left alone."""
        m = self.root / "munge"
        m.chmod(0o755)
        key = m / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o600)
        self._daemon("munged", [which("munged"), "--force", f"--socket={m}/munge.sock", f"--key-file={key}",
                                f"--pid-file={m}/munged.pid", f"--log-file={m}/munged.log",
                                f"--seed-file={m}/munged.seed"])
        self._wait(lambda: (m / "munge.sock").exists(), 10, "munged did not create its socket")

    def _start(self, daemon: str, *args) -> None:
        self._daemon(daemon, [which(daemon), *map(str, args)])
        self._wait(lambda: self._alive(daemon), 15, f"{daemon} did not start")

    def _daemon(self, name: str, cmd: list) -> None:
        proc = subprocess.run(cmd, env=self.env(), capture_output=True, text=True, timeout=30)
        if proc.returncode != 0:
            raise ClusterError(f"{name} failed to start ({proc.returncode}): {proc.stderr.strip()}\n"
                               + self.log_tail(name))

    def _wait_idle(self, timeout: float) -> None:
        def idle():
            proc = self.run("sinfo", "-h", "-o", "%t", check=False, timeout=15)
            state = proc.stdout.strip().rstrip("*~#")
            if proc.returncode == 0 and state in ("drain", "inval", "down"):
                reason = self.run("sinfo", "-h", "-R", "-o", "%E", check=False).stdout.strip()
                raise ClusterError(f"the node is {state}: {reason}\n{self.log_tail('slurmd')}")
            return proc.returncode == 0 and state == "idle"

        self._wait(idle, timeout, "the node did not become idle")

    def _wait(self, ready, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not ready():
            if time.monotonic() > deadline:
                raise ClusterError(f"{what} within {timeout:g}s\n{self.log_tail('slurmctld')}{self.log_tail('slurmd')}")
            time.sleep(0.2)

    # --- tear down -------------------------------------------------------------
    def down(self, timeout: float = 30) -> None:
        """Cancel every job still here, then stop slurmd, slurmctld and munged."""
        if self._alive("slurmctld"):
            self.run("scancel", "--full", "--state=PENDING,RUNNING,SUSPENDED,REQUEUED,REQUEUE_HOLD",
                     "--user", str(os.geteuid()), check=False)
            self.run("scancel", "--full", "--user", str(os.geteuid()), check=False)
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                left = self.run("squeue", "-h", "-o", "%i", check=False)
                if left.returncode != 0 or not left.stdout.strip():
                    break
                time.sleep(0.5)
        for daemon in ("slurmd", "slurmctld", "munged"):
            self._stop(daemon, timeout)

    def _pid_file(self, daemon: str) -> Path:
        return self.root / ("munge/munged.pid" if daemon == "munged" else f"{daemon}.pid")

    def _pid(self, daemon: str):
        try:
            return int(self._pid_file(daemon).read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return None

    def _alive(self, daemon: str) -> bool:
        pid = self._pid(daemon)
        if pid is None:
            return False
        try:
            with open(f"/proc/{pid}/stat") as f:
                return f.read().rsplit(")", 1)[1].split()[0] != "Z"
        except (OSError, IndexError):
            return False

    def _stop(self, daemon: str, timeout: float) -> None:
        pid = self._pid(daemon)
        if pid is None or not self._alive(daemon):
            return
        for sig, wait in ((signal.SIGTERM, timeout), (signal.SIGKILL, 5)):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                return
            deadline = time.monotonic() + wait
            while self._alive(daemon) and time.monotonic() < deadline:
                time.sleep(0.1)
            if not self._alive(daemon):
                return

    def log_tail(self, daemon: str, lines: int = 15) -> str:
        path = self.root / ("munge/munged.log" if daemon == "munged" else f"log/{daemon}.log")
        try:
            text = path.read_text(errors="replace").splitlines()[-lines:]
        except OSError:
            return ""
        return f"--- {path}\n" + "\n".join(text) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("install", help="install Debian's slurmctld, slurmd, slurm-client and munge if missing")
    up = sub.add_parser("up", help="start a one-node cluster whose files live in DIR")
    up.add_argument("dir")
    up.add_argument("--cpus", type=int, default=8, help="CPUs the node declares (default 8)")
    down = sub.add_parser("down", help="cancel its jobs and stop the cluster in DIR")
    down.add_argument("dir")
    args = parser.parse_args(argv)
    try:
        if args.command == "install":
            install()
            print("slurm: " + ", ".join(f"{p} {which(p)}" for p in PROGRAMS))
        elif args.command == "up":
            cluster = Cluster(args.dir, cpus=args.cpus).up()
            print(f"# a one-node Slurm ({cluster.host}, {cluster.cpus} CPUs) is up; for its commands:")
            print(f"export SLURM_CONF={cluster.conf}")
        else:
            Cluster(args.dir).down()
    except ClusterError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
