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
allowed, so the whole check stays a few seconds: all of them run in one
process through the real entry point (tests/cli_cases.py).
"""

import json
import re
import shlex
import subprocess
from pathlib import Path

from conftest import PYTHON, paired
from mpirun import job_env

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
MARKER = re.compile(r"^<!-- figure\b.*-->\s*$")
ELISION = "..."
CHEAP = {"info"}            # commands a figure may rerun: no training, a second or less each


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
        assert body and body[0].startswith("$ mpicube "), f"{where}: the block must open with `$ mpicube ...`"
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


def mismatch(quoted: list, output: list):
    """None if ``quoted`` is an excerpt of ``output`` (runs of consecutive
    lines, in order, separated by ``...``), else the first quoted line
    that is not where it should be."""
    pos, free = 0, True              # free: the next quoted line may skip output lines (start, or after ...)
    for q in quoted:
        if q.strip() == ELISION:
            free = True
            continue
        if free:
            while pos < len(output) and output[pos] != q:
                pos += 1
        if pos >= len(output) or output[pos] != q:
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
