"""Every command of the README's quick start runs as written.

The quick start is what a newcomer types first, and both of its
``generate`` commands once exited 2 on the model ``make train`` had just
built (64 new tokens plus the prompt did not fit its 64 positions). So,
as tests/test_hints.py runs every printed hint, this runs every command
the quick start shows, in order, in one shell in a fresh directory
(tests/shell_session.py): the lines of its ``sh`` blocks, and the ``$``
lines of its ``text`` blocks. Blocks under a figure marker are rerun, and
their output checked, by tests/test_doc_figures.py, so they are counted
here, not run twice.

Two changes keep it cheap, and only these: ``make train`` (which would
install a venv) becomes the ``mpicube train`` it runs with the Makefile's
own TRAIN_DEFAULTS, and every ``train`` trains a few steps
(``--steps``, ``--eval-every`` appended: the last value of an option wins).
"""

import re
import shlex

from conftest import REPO
from shell_session import run_session

MARKER = re.compile(r"^<!-- figure\b.*-->\s*$")
CHEAP_TRAIN = "--steps 4 --eval-every 2"


def section(text: str, title: str) -> list:
    """The lines of the ``## title`` section of a Markdown page."""
    lines = text.splitlines()
    start = lines.index(f"## {title}")
    end = next((k for k in range(start + 1, len(lines)) if lines[k].startswith("## ")), len(lines))
    return lines[start + 1:end]


def quick_start_commands() -> list:
    """[(command, under a figure marker)] in the order the quick start shows them."""
    lines = section((REPO / "README.md").read_text(), "Quick start")
    found, k = [], 0
    while k < len(lines):
        if not lines[k].startswith("```"):
            k += 1
            continue
        kind, marked = lines[k][3:].strip(), k > 0 and bool(MARKER.match(lines[k - 1]))
        end = next(j for j in range(k + 1, len(lines)) if lines[j].startswith("```"))
        for line in lines[k + 1:end]:
            if kind == "sh" and line.strip():
                found.append((shlex.join(shlex.split(line, comments=True)), marked))
            elif kind == "text" and line.startswith("$ "):
                found.append((line[2:], marked))
        k = end + 1
    return found


def make_train_defaults() -> str:
    """The Makefile's TRAIN_DEFAULTS, continuation lines joined."""
    text = (REPO / "Makefile").read_text().replace("\\\n", " ")
    return re.search(r"^TRAIN_DEFAULTS = (.*)$", text, re.MULTILINE).group(1).split("#")[0].strip()


def cheap(command: str) -> str:
    """The command as run here: ``make train`` as the Makefile runs it, and
    every train a few steps."""
    if command == "make train":
        command = f"mpicube train {make_train_defaults()}"
    if re.search(r"\bmpicube train\b", command):
        command += " " + CHEAP_TRAIN
    return command


def test_the_quick_start_finds_its_commands():
    """The parse itself: the commands a reader sees, figures marked."""
    commands = quick_start_commands()
    assert [c for c, _ in commands][:4] == ["make train", "mpicube plot runs/default --out loss.png",
                                           "mpicube eval runs/default",
                                           "mpicube generate runs/default --prompt 'def main(' --max-new-tokens 200 "
                                           "--temperature 0.8 --top-k 40"], commands
    assert any(marked and c.startswith("mpicube trace") for c, marked in commands), commands
    assert cheap("make train").startswith("mpicube train --n-layer 4 ") and cheap("make train").endswith(CHEAP_TRAIN)


def test_every_quick_start_command_runs_as_written(tmp_path, corpus_cache):
    """Each command exits 0; the generate asking a 64-position model for 200
    new tokens says it clipped them."""
    commands = [cheap(c) for c, marked in quick_start_commands() if not marked]
    assert len(commands) >= 5, commands
    results = run_session(commands, tmp_path, env={"MPICUBE_CACHE": str(corpus_cache)}, timeout=400)
    for command, (status, output) in zip(commands, results, strict=True):
        assert status == 0, (command, output[-30:])
    said = {c: out for c, (_, out) in zip(commands, results, strict=True)}
    clipped = [line for c, out in said.items() if "--max-new-tokens 200" in c for line in out if "clipped" in line]
    assert clipped == ["--max-new-tokens 200 clipped to 55, the largest that fits: the prompt (9 tokens) plus the "
                       "new ones fill the model's context of 64 positions"], said
