"""``--help`` a person can scan, and options that mean one thing.

train's help was 171 lines of options in one block; it is now in sections
(mpicube/cli/sections.py) with the usual workflow at the end. An option
that two commands share has the same default and the same words in both
(``--seed`` was 1337 in train and 0 in bench), and a command's model
argument has one name (eval said CKPT where generate said MODEL).
"""

import click
from click.testing import CliRunner

from mpicube.cli import main  # noqa: F401 (registers the commands)
from mpicube.cli.common import cli

HEADINGS = ["Model:", "Parallelism:", "Optimisation:", "Data and checkpoints:", "Numerics:", "Diagnostics:"]


def help_text(*argv) -> str:
    r = CliRunner().invoke(cli, [*argv, "--help"], terminal_width=100)
    assert r.exit_code == 0, r.output
    return r.output


def test_train_help_is_in_sections_with_the_usual_workflow():
    text = help_text("train")
    lines = text.splitlines()
    found = [line for line in lines if line in HEADINGS]
    assert found == HEADINGS, found
    assert "Other options:" not in text
    command = cli.commands["train"]
    assert command.unplaced(click.Context(command)) == []
    at = {h: lines.index(h) for h in HEADINGS}
    assert at["Model:"] < next(k for k, line in enumerate(lines) if line.lstrip().startswith("--n-embd")) < \
        at["Parallelism:"]
    assert at["Numerics:"] < next(k for k, line in enumerate(lines) if line.lstrip().startswith("--dtype")) < \
        at["Diagnostics:"]
    assert "The usual workflow:" in text and "mpiexec -n 8 mpicube train --layout 3d" in text
    for option in ("--steps", "--lr", "--out", "--resume", "--layout", "--arch", "--profile"):   # each once
        assert sum(line.lstrip().startswith(option + " ") for line in lines) == 1, option
    trace = help_text("trace")
    assert [line for line in trace.splitlines() if line in HEADINGS] == HEADINGS


def shared_options():
    """{option name: [(command, default, help)]} of every option in two or more commands."""
    seen = {}
    for name, command in cli.commands.items():
        for p in command.params:
            if isinstance(p, click.Option):
                seen.setdefault(p.name, []).append((name, p.default, p.help))
    return {k: v for k, v in seen.items() if len(v) > 1}


# (option, command) where the command does its own thing with a shared name, on purpose
OWN_MEANING = {("seed", "generate"): "draws tokens", ("steps", "trace"): "steps traced",
               ("steps", "bench"): "steps timed", ("dtype", "info"): "the estimate's format",
               ("vocab_size", "info"): "the estimate's vocabulary", ("seq_len", "eval"): "default: the model's",
               ("batch_size", "eval"): "default: the checkpoint's", ("data", "eval"): "the shard evaluated",
               ("grad_accum", "eval"): "the pipeline's micro-batches", ("zero", "info"): "priced",
               ("zero", "bench"): "timed", ("grad_accum", "info"): "priced", ("profile", "bench"): "its steps",
               ("optimizer", "info"): "priced", ("hsdp", "info"): "priced",
               ("layout", "info"): "optional", ("layout", "bench"): "several", ("batch_size", "bench"): "each layout's",
               ("top_k", "generate"): "the sampler's", ("out", "prepare"): "a shard", ("out", "trace"): "a trace",
               ("out", "bench"): "the profile's", ("out", "timeline"): "a picture", ("out", "plot"): "a picture",
               ("width", "plot"): "its own picture", ("steps", "plot"): "", ("as_json", "*"): "each its own",
               ("dtype", "check-resume"): "float64: it checks", ("out", "check-resume"): "a folder of traces",
               ("resume", "trace"): "refused without a checkpoint"}


def test_a_shared_option_means_one_thing():
    """An option in several commands has one default and one help text,
    but where a command does its own thing with the name (OWN_MEANING)."""
    differ = []
    for option, uses in shared_options().items():
        same = [(c, d, h) for c, d, h in uses if (option, c) not in OWN_MEANING and (option, "*") not in OWN_MEANING]
        if len({repr(d) for _, d, _ in same}) > 1 or len({h for _, _, h in same}) > 1:
            differ.append(f"--{option}: {same}")
    assert not differ, "\n".join(differ)
    seeds = {c: d for c, d, _ in shared_options()["seed"]}
    assert set(seeds.values()) == {1337} and {"train", "bench", "trace", "generate"} <= set(seeds), seeds


def test_the_model_argument_has_one_name():
    for name in ("eval", "generate", "inspect"):
        usage = help_text(name).splitlines()[0]
        assert usage.endswith("MODEL"), (name, usage)
