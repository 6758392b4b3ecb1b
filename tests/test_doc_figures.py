"""The cost-model figures quoted in README.md and docs/*.md are what the
commands print today.

A figure copied into a page by hand goes stale the day the model changes
(blockwise attention once moved the paper-scale memory per rank from 105
to 80.5 GB while the README kept 105). So a page quotes a cheap command's
output verbatim, marked to be rerun here:

    <!-- figure: rerun by tests/test_doc_figures.py -->
    ```text
    $ mpicube info --n-layer 24 ... \\
          --layout 3d -n 64
    communication per rank per step (float32: elements, bytes, messages):
    ...
      total           41.3G      165GB     2964
    ```

The marker line is followed at once by a fenced block. The block opens
with the command, ``$ mpicube ...`` (continued by lines ending in a
backslash); every following line must be a line of that command's output,
in order and consecutive, except ``...``, which stands for any number of
output lines (so a page may quote an excerpt). Trailing spaces are ignored.
A hand edit, or a model change that moves a quoted figure, fails here;
regenerate the block by running its command.

Only commands that compute figures without training (``info``) are
allowed in such a block, so most of the check stays a few seconds: all of
them run in one process through the real entry point (tests/cli_cases.py).

A second kind of block, a *session*, quotes a few shell commands in a row
with their outputs, as the README's trace and compare do (file size,
tensor count, largest difference): every ``$ `` line is a command
(``NAME="..."``, ``mpicube trace|compare|info ...`` or ``mpiexec -n N
mpicube ...``), the lines after it are an excerpt of its output, by the
same rules. The commands run in one shell in a fresh directory
(tests/shell_session.py); each must exit 0. Keep them small (a trace of
a tiny model for a few steps): the whole file stays under half a minute.
A marker that says ``rounding`` lets a number in e-notation (a float64
rounding difference such as 5.41e-13, which depends on the BLAS kernels
and the reduction order) match any printed within a factor of 10; every
other character must match.
"""

import json
import re
import shlex
import subprocess
from pathlib import Path

from conftest import PYTHON, paired
from mpirun import job_env
from shell_session import run_session

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
MARKER = re.compile(r"^<!-- figure\b.*-->\s*$")
ELISION = "..."
CHEAP = {"info"}            # commands a figure may rerun: no training, a second or less each
SESSION = {"info", "trace", "compare"}  # commands a session may run (tiny models, a few steps)
ASSIGNMENT = re.compile(r"^[A-Z_][A-Z0-9_]*=")
MPIEXEC_PREFIX = re.compile(r"^mpiexec -n [1-8] ")
E_NUMBER = re.compile(r"[0-9]+(?:\.[0-9]+)?e[-+][0-9]+")


def figures(page: Path) -> list:
    """[(where, argv, quoted lines)] of every marked block on ``page``."""
    lines = page.read_text().splitlines()
    found = []
    for n, line in enumerate(lines):
        if not MARKER.match(line):
            continue
        where = f"{page.relative_to(ROOT)}:{n + 1}"
        assert n + 1 < len(lines) and lines[n + 1].startswith("```"), f"{where}: the marker needs a fenced block next"
        end = next((k for k in range(n + 2, len(lines)) if lines[k].startswith("```")), None)
        assert end is not None, f"{where}: the fenced block is not closed"
        body = lines[n + 2:end]
        assert body and body[0].startswith("$ "), f"{where}: the block must open with `$ mpicube ...`"
        if not body[0].startswith("$ mpicube ") or sum(b.startswith("$ ") for b in body) > 1:
            continue                    # a session: sessions() reads it
        command, k = body[0][2:], 0
        while command.endswith("\\"):
            k += 1
            command = command[:-1] + " " + body[k].strip()
        argv = shlex.split(command)[1:]
        assert argv[0] in CHEAP, f"{where}: `mpicube {argv[0]}` is not a cheap command ({', '.join(sorted(CHEAP))})"
        quoted = [q.rstrip() for q in body[k + 1:]]
        assert any(q.strip() != ELISION for q in quoted), f"{where}: the block quotes no output"
        found.append((where, argv, quoted))
    return found


def sessions(page: Path) -> list:
    """[(where, rounding, [(command, quoted lines)])] of every marked block
    on ``page`` that quotes several commands, or one that is not
    ``mpicube ...`` alone."""
    lines = page.read_text().splitlines()
    found = []
    for n, line in enumerate(lines):
        if not MARKER.match(line) or not lines[n + 1].startswith("```"):
            continue                    # figures() names a malformed block
        end = next(k for k in range(n + 2, len(lines)) if lines[k].startswith("```"))
        body = lines[n + 2:end]
        if not body or (body[0].startswith("$ mpicube ") and sum(b.startswith("$ ") for b in body) == 1):
            continue
        where = f"{page.relative_to(ROOT)}:{n + 1}"
        steps = []
        for b in body:
            if b.startswith("$ "):
                command = b[2:]
                run = MPIEXEC_PREFIX.sub("", command)
                words = shlex.split(run)
                assert ASSIGNMENT.match(command) or (words[0] == "mpicube" and words[1] in SESSION), \
                    f"{where}: `{command}` is not NAME=... or (mpiexec -n N) mpicube {'|'.join(sorted(SESSION))}"
                steps.append((command, []))
            else:
                assert steps, f"{where}: the block must open with a `$ ` command"
                steps[-1][1].append(b.rstrip())
        found.append((where, "rounding" in line, steps))
    return found


def same_line(quoted: str, printed: str, rounding: bool) -> bool:
    """``quoted`` is ``printed``; under ``rounding`` its e-notation numbers
    may be anything within 10x of the printed ones."""
    if not rounding or quoted == printed:
        return quoted == printed
    if E_NUMBER.sub("#", quoted) != E_NUMBER.sub("#", printed):
        return False
    pairs = list(zip(E_NUMBER.findall(quoted), E_NUMBER.findall(printed)))
    return all((float(a) == float(b) == 0) or (float(a) > 0 and float(b) > 0 and 0.1 <= float(a) / float(b) <= 10)
               for a, b in pairs)


def mismatch(quoted: list, output: list, rounding: bool = False):
    """None if ``quoted`` is an excerpt of ``output`` (runs of consecutive
    lines, in order, separated by ``...``), else the first quoted line
    that is not where it should be."""
    pos, free = 0, True              # free: the next quoted line may skip output lines (start, or after ...)
    for q in quoted:
        if q.strip() == ELISION:
            free = True
            continue
        if free:
            while pos < len(output) and not same_line(q, output[pos], rounding):
                pos += 1
        if pos >= len(output) or not same_line(q, output[pos], rounding):
            return q
        pos, free = pos + 1, False
    return None


def test_quoted_figures_are_what_the_commands_print(tmp_path):
    blocks = [b for page in PAGES for b in figures(page)]
    assert blocks, "no page quotes a figure: the marker convention has been lost"
    spec = tmp_path / "cases.json"
    spec.write_text(json.dumps([argv for _, argv, _ in blocks]))
    proc = subprocess.run([PYTHON, str(ROOT / "tests" / "cli_cases.py"), str(spec)], cwd=tmp_path,
                          env=job_env({}), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    stale = []
    for (where, argv, quoted), res in paired(blocks, json.loads(proc.stdout.strip().splitlines()[-1])):
        assert res["status"] == 0, (where, res)
        wrong = mismatch(quoted, [line.rstrip() for line in res["out"]])
        if wrong is not None:
            stale.append(f"{where}: `mpicube {shlex.join(argv)}` no longer prints {wrong!r}")
    assert not stale, "stale figures (rerun the command and paste its output):\n" + "\n".join(stale)


def test_quoted_sessions_are_what_the_commands_print(tmp_path):
    """The README's trace and compare (file size, tensor count, largest
    difference), rerun as written."""
    blocks = [b for page in PAGES for b in sessions(page)]
    assert blocks, "no page quotes a session: the README's trace and compare lost their marker"
    stale = []
    for k, (where, rounding, steps) in enumerate(blocks):
        cwd = tmp_path / f"session{k}"
        cwd.mkdir()
        results = run_session([command for command, _ in steps], cwd)
        for (command, quoted), (status, output) in paired(steps, results):
            assert status == 0, (where, command, output[-20:])
            wrong = mismatch(quoted, [line.rstrip() for line in output], rounding)
            if wrong is not None:
                stale.append(f"{where}: `{command}` no longer prints {wrong!r}")
    assert not stale, "stale figures (rerun the commands and paste their output):\n" + "\n".join(stale)


def test_rounding_matches_within_ten_times_and_nothing_else():
    """The rule a ``rounding`` marker relaxes, and only that one."""
    line = "245 tensors compared; largest relative difference 5.41e-13"
    assert same_line(line, line.replace("5.41e-13", "1.2e-12"), True)
    assert not same_line(line, line.replace("5.41e-13", "6.0e-12"), True)
    assert not same_line(line, line.replace("245", "221"), True)
    assert not same_line(line, line.replace("5.41e-13", "1.2e-12"), False)
