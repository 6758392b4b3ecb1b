"""Run a case script under the hostile-input limits, watching what it opens.

``run_watched`` runs ``python SCRIPT CASES.json`` (tests/hostile_traces.py,
tests/hostile_models.py: many cases in one process, one JSON report on
stdout) under an address-space limit of 1 GiB and a CPU-time limit, and,
where strace is installed, with every open(2) traced: it returns the
report and the paths under ``watched`` (the directory that holds what no
case may read) that the process tried to open. A FIFO there blocks an
open forever, so a case that opens one fails by the timeout.
"""

from __future__ import annotations

import json
import re
import resource
import shutil
import subprocess
from pathlib import Path

from conftest import PYTHON

ADDRESS_SPACE = 1 << 30          # RLIMIT_AS: 1 GiB for the whole process (a small case maps about 0.5 GiB)
STRACE = shutil.which("strace")
OPENED = re.compile(r'open(?:at2?)?\((?:AT_FDCWD|\d+), "((?:[^"\\]|\\.)*)"')


def limits(cpu_seconds: int):
    def apply():
        resource.setrlimit(resource.RLIMIT_AS, (ADDRESS_SPACE, ADDRESS_SPACE))
        resource.setrlimit(resource.RLIMIT_CPU, (cpu_seconds, cpu_seconds))
    return apply


def run_watched(script: Path, argvs: list, cwd: Path, env: dict, watched: Path, cpu_seconds: int = 300,
                timeout: int = 400) -> tuple:
    """(report, [opened paths under ``watched``], strace used?)."""
    spec = Path(cwd) / "watched-cases.json"
    spec.write_text(json.dumps([[str(a) for a in argv] for argv in argvs]))
    log = Path(cwd) / "watched-open.log"
    command = [PYTHON, str(script), str(spec)]
    if STRACE:
        command = [STRACE, "-f", "-qq", "--seccomp-bpf", "-e", "trace=open,openat,openat2", "-o", str(log)] + command
    proc = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout,
                          preexec_fn=limits(cpu_seconds))
    spec.unlink()
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    opened = []
    if STRACE:
        root = str(Path(watched).resolve())
        for line in log.read_text().splitlines():
            m = OPENED.search(line)
            if m and (Path(cwd) / m.group(1)).resolve().as_posix().startswith(root):
                opened.append(m.group(1))
        log.unlink()
    return report, opened, bool(STRACE)
