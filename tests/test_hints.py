"""Every hint a command prints is a command that works.

A hint that fails is worse than none: the user did what the tool said and
got an error (``train --profile`` once ended with "draw it with
`mpicube timeline runs/prof`", which needed ``--out``). This runs cheap
commands that print hints (tiny models), collects every hint from their
output and runs each one, expecting exit status 0. Two kinds of hint:

* a command in backticks, `mpicube ...`: run as it stands;
* "continue with ... --resume ..." or "pass --resume": the command that
  printed it again, changed as the hint says (plus --resume, less
  --stop-after when the hint says so).

A new kind of hint in a command's output that this file cannot turn into a
command fails the test (``UNRECOGNISED``), so hints cannot be added without
being run here.
"""

import re
import shlex

from conftest import TINY

BACKTICKED = re.compile(r"`(mpicube [^`]*)`")
RESUME = re.compile(r"(continue with [^;()\n]*--resume[^\n]*|pass --resume)")
# Phrases that look like advice but that this file does not know how to run.
UNRECOGNISED = re.compile(r"`[^`]*`|\b(continue with|pass --|try )", re.IGNORECASE)


def without_option(argv: list, name: str) -> list:
    """``argv`` less ``name`` and its value."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == name:
            skip = True
        else:
            out.append(a)
    return out


def hints(argv: list, output: str) -> list:
    """(hint text, the command it asks for) for every hint in ``output``,
    which ``argv`` printed."""
    found = []
    for line in output.splitlines():
        rest = line
        for m in BACKTICKED.finditer(line):
            found.append((m.group(0), shlex.split(m.group(1))[1:]))
            rest = rest.replace(m.group(0), "")
        m = RESUME.search(rest)
        if m:
            again = without_option(argv, "--stop-after") if "less --stop-after" in m.group(0) else list(argv)
            found.append((m.group(0), again + ["--resume"]))
            rest = rest.replace(m.group(0), "")
        assert not UNRECOGNISED.search(rest), f"a hint this test cannot run: {line!r}"
    return found


def test_every_hint_printed_runs(mpicube, tiny_shard):
    """train --profile --stop-after (a timeline hint and a continue hint),
    the same train again without --resume (refused with a hint), and bench
    --profile into its default run directory (a timeline hint): each hint
    run exits 0, and what it promises is there."""
    train = ["train", *TINY, "--data", tiny_shard, "--steps", "4", "--profile", "1:2", "--stop-after", "2",
             "--out", "run"]
    bench = ["bench", *TINY, "--steps", "2", "--warmup-steps", "1", "--profile", "2:2"]
    printed = []
    for argv in (train, train, bench):
        r = mpicube.run(*argv)
        printed += hints(list(map(str, argv)), r.stdout + r.stderr)
    kinds = sorted({text.split()[0] for text, _ in printed})
    assert kinds == ["`mpicube", "continue", "pass"], printed      # all three kinds were printed

    for text, argv in printed:
        r = mpicube.run(*argv)
        assert r.returncode == 0, (text, argv, r)
        if argv[0] == "timeline":
            assert (mpicube.cwd / argv[1] / "timeline.png").stat().st_size > 0, (text, r)
        if text.startswith("continue"):           # it continued: past the profiled steps, to the end
            assert "resuming from run/ckpt/step_00000002" in r.stdout and "done: 4 steps" in r.stdout, r
