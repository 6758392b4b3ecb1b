"""Run many ``mpicube`` commands in one process (one rank) and report, for
each, its exit status and its stdout/stderr lines as JSON: refusals are
many one-second cases, and starting Python and MPI for each would cost
more than the commands. It calls the real entry point (``cli.main``),
errors and exit statuses included.

    python tests/cli_cases.py CASES.json   # [[arg, ...], ...] -> [{status, out, err}, ...] on stdout
"""

import contextlib
import io
import json
import sys


def run(argv):
    from mpicube.cli import main as cli

    out, err = io.StringIO(), io.StringIO()
    status = 0
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            cli.main(argv)
        except SystemExit as e:
            status = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    return {"status": status, "out": out.getvalue().splitlines(), "err": err.getvalue().splitlines()}


if __name__ == "__main__":
    cases = json.loads(open(sys.argv[1]).read())
    print(json.dumps([run([str(a) for a in case]) for case in cases]))
