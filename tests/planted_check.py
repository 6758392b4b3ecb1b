"""The catalogue of tests/planted_bug.py in one launch (tests/test_planted_bugs.py):

    mpiexec -n 2 python tests/planted_check.py OUTDIR '[["sp-grad", ["--layout", "1d", ...]], ...]'

For each (bug, trace options[, file name]): plant the bug (``none``:
nothing), run ``mpicube trace ... --out OUTDIR/BUG.h5`` (or the name
given) in this process (every rank), take the bug out again. A bug changes the process only while its trace runs, so one
launch serves them all; any failure ends the launch with a traceback.
"""

import json
import sys
from pathlib import Path

from planted_bug import plant

import mpicube.analysis.trace  # noqa: F401 - every module loaded before a plant, so it and its undo reach all
from mpicube.cli.common import cli
from mpicube.cli.main import _init_mpi


def main(outdir: str, cases: str) -> None:
    _init_mpi()
    for case in json.loads(cases):
        bug, options = case[:2]          # a third item names the trace file (default: the bug's name)
        undo = plant(bug)
        try:
            out = Path(outdir) / (case[2] if len(case) > 2 else bug.replace("=", "-") + ".h5")
            status = cli.main(args=["trace", *options, "--out", str(out)], prog_name="mpicube",
                              standalone_mode=False)
            assert status in (None, 0), (bug, status)
        finally:
            undo()


if __name__ == "__main__":
    main(*sys.argv[1:])
