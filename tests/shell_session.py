"""Run commands copied from a page, as a reader would type them, in one
shell: ``mpicube ...`` and ``mpiexec -n N mpicube ...`` as written,
variables set by one line (``M="..."``) seen by the next.

``mpicube`` is a two-line script on PATH that runs this tree's
``python -m mpicube`` (the venv's console script would run the tree the
editable install points at), and ``mpiexec`` is the one beside this
Python (tests/mpirun.py). Each command's output (stdout and stderr
together, as a terminal shows them) and exit status come back apart:
the shell prints a sentinel line after each.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from conftest import PYTHON
from mpirun import MPIEXEC, job_env

SENTINEL = "@@shell_session status "


def wrapper_bin(where: Path) -> Path:
    """A folder holding ``mpicube``, this tree's entry point."""
    where.mkdir(parents=True, exist_ok=True)
    script = where / "mpicube"
    script.write_text(f'#!/bin/sh\nexec "{PYTHON}" -m mpicube "$@"\n')
    script.chmod(0o755)
    return where


def run_session(commands: list, cwd: Path, env: dict | None = None, timeout: float = 300) -> list:
    """[(exit status, output lines)] of each command of ``commands``,
    run in turn by one bash in ``cwd``. A command that fails does not stop
    the ones after it (each has its own status)."""
    script = []
    for command in commands:
        script += [command + " 2>&1", f'echo "{SENTINEL}$?"']
    bin_dir = wrapper_bin(Path(cwd) / ".session-bin")
    environ = job_env({"PYTHONUNBUFFERED": "1", **(env or {})}, timeout=int(timeout))
    environ["PATH"] = os.pathsep.join([str(bin_dir), str(MPIEXEC.parent), environ.get("PATH", "")])
    proc = subprocess.run(["bash", "-c", "\n".join(script)], cwd=cwd, env=environ, capture_output=True, text=True,
                          timeout=timeout + 30)
    results, lines = [], []
    for line in proc.stdout.splitlines():
        if line.startswith(SENTINEL):
            results.append((int(line[len(SENTINEL):]), lines))
            lines = []
        else:
            lines.append(line)
    assert len(results) == len(commands), (f"the shell ran {len(results)} of {len(commands)} commands",
                                           proc.stdout[-2000:], proc.stderr[-2000:])
    return results
