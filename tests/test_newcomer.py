"""What a newcomer trips over first (issue 42), each once a silent surprise
or a dead end, now one line that says what happened and what to do:

* ``--layout 3d`` on one rank trains the serial model; it says so and
  names the mpiexec it probably wanted;
* ``--resume`` with another ``--arch`` refuses, as another --n-embd does;
* ``--init-from`` a model directory takes the family from the directory,
  so a Mixtral's training knobs need no ``--arch mixtral`` repeated;
* every file mpicube writes honours the umask (shards, exports, profiles,
  timelines, the corpus cache), as checkpoints do;
* help and messages name every family mpicube reads;
* ``--data`` at a text file suggests ``mpicube prepare``.

(Ctrl-C checkpointing and exiting 75: tests/test_train.py.) The one-rank
cases run in one process (tests/cli_cases.py), the umask case in one
shell (tests/shell_session.py).
"""

import json
import re
import stat

import numpy as np
import pytest
from conftest import TINY, sample_text_files
from shell_session import run_session
from test_formats import run_cases

SIZES = ["--seq-len", "8", "--batch-size", "2"]


@pytest.fixture(scope="module")
def mixtral_dir(tmp_path_factory):
    """A random 4-expert Hugging Face Mixtral directory (hf_mixtral.write)."""
    from mpicube.core.config import ModelConfig
    from mpicube.files.formats import hf_mixtral
    from mpicube.model.gpt import gpt_params

    cfg = ModelConfig(vocab_size=256, n_ctx=8, n_layer=1, n_head=4, n_embd=16, arch="llama", n_kv_head=2,
                      ffn_hidden=24, n_experts=4, top_k=2)
    r = np.random.default_rng(5)
    out = tmp_path_factory.mktemp("mixtral") / "hf"
    hf_mixtral.write(out, {d.name: 0.2 * r.standard_normal(d.shape) for d in gpt_params(cfg)}, cfg)
    return out


def test_one_rank_trips(tmp_path, mixtral_dir, corpus_cache):
    cases = {
        "3d-on-one-rank": ["train", *TINY[2:], "--layout", "3d", "--steps", "1", "--out", "one"],
        "gpt2-run": ["train", *TINY, "--steps", "1", "--out", "g"],
        "resume-other-arch": ["train", *TINY, "--steps", "2", "--out", "g", "--resume", "--arch", "llama"],
        "mixtral-knobs": ["train", "--init-from", mixtral_dir, *SIZES, "--steps", "1", "--out", "mx",
                          "--router-aux-loss-coef", "0.1", "--capacity-factor", "1.25"],
        "mixtral-as-llama": ["train", "--init-from", mixtral_dir, *SIZES, "--steps", "1", "--out", "bad1",
                             "--arch", "llama"],
        "mixtral-other-top-k": ["train", "--init-from", mixtral_dir, *SIZES, "--steps", "1", "--out", "bad2",
                                "--top-k", "1"],
        "text-as-data": ["train", *TINY, "--data", sample_text_files()[0], "--steps", "1", "--out", "bad3"],
    }
    res = dict(zip(cases, run_cases(tmp_path, list(cases.values()), cache=corpus_cache), strict=True))

    def error(name):
        r = res[name]
        errors = [line for line in r["out"] + r["err"] if line.startswith("error:")]
        assert r["status"] == 2 and len(errors) == 1, (name, r)
        return errors[0]

    r = res["3d-on-one-rank"]
    assert r["status"] == 0, r
    assert ("layout 3d on 1 rank(s) has 1 tensor-parallel rank: it runs as the serial model; its smallest split "
            "takes 8 tensor-parallel ranks: mpiexec -n 8") in r["out"], r
    assert res["gpt2-run"]["status"] == 0, res["gpt2-run"]
    assert "holds a gpt2 model, this run asks for --arch llama (leave out --arch" in error("resume-other-arch")

    r = res["mixtral-knobs"]
    assert r["status"] == 0, r
    model = json.loads((tmp_path / "mx" / "config.json").read_text())["model"]
    assert (model["n_experts"], model["capacity_factor"], model["router_aux_loss_coef"]) == (4, 1.25, 0.1), model
    assert "holds a mixtral model, this run asks for --arch llama" in error("mixtral-as-llama")
    assert "holds a model with top_k 2, this run asks for 1 (leave out --top-k" in error("mixtral-other-top-k")
    assert re.search(r"not an llm.c token shard; to train on a text file, tokenize it first: mpicube prepare \S+ "
                     r"--out \S+\.bin", error("text-as-data"))
    for refused in ("bad1", "bad2", "bad3"):
        assert not (tmp_path / refused).exists(), refused              # nothing left behind


def test_every_file_written_honours_the_umask(tmp_path):
    """Under umask 027 every file is rw-r----- and every directory
    rwxr-x---: a colleague in the group reads shards, checkpoints, Hugging
    Face and llm.c exports, profiles, timelines and the corpus cache
    (mkstemp's 0600 and mkdtemp's 0700 once kept them out)."""
    tiny = " ".join(TINY)
    text = sample_text_files()[0]
    commands = ["umask 027",
                f"mpicube prepare {text} --out data/t.bin --val-fraction 0.1",
                f"mpicube train {tiny} --data data/t.bin --steps 2 --profile 1:2 --out run",
                "mpicube timeline run",
                "mpicube convert run hf --to hf",
                "mpicube convert run m.bin --to llmc",
                f"MPICUBE_CACHE=cache mpicube train {tiny} --steps 1 --out corpus-run"]
    for command, (status, output) in zip(commands, run_session(commands, tmp_path), strict=True):
        assert status == 0, (command, output[-20:])
    wrong, seen = [], set()
    for path in tmp_path.rglob("*"):
        if ".session-bin" in path.parts:
            continue
        mode = stat.S_IMODE(path.stat().st_mode)
        want = 0o750 if path.is_dir() else 0o640
        seen.add(path.relative_to(tmp_path).parts[0])
        if mode != want:
            wrong.append(f"{path.relative_to(tmp_path)}: {mode:o}")
    assert {"data", "run", "hf", "m.bin", "cache", "corpus-run"} <= seen, seen
    assert (tmp_path / "run" / "timeline.png").exists() and (tmp_path / "run" / "profile.json").exists()
    assert not wrong, wrong


def test_help_and_messages_name_every_family():
    """No help text or message says "GPT-2 or Llama" (or "llama only")
    where Mixtral is read too: the commands' help, as printed."""
    from click.testing import CliRunner

    from mpicube.cli.common import cli
    from mpicube.cli import main  # noqa: F401 (registers the commands)

    runner = CliRunner()
    texts = {"mpicube": runner.invoke(cli, ["--help"], terminal_width=200).output}
    for name in cli.commands:
        texts[name] = runner.invoke(cli, [name, "--help"], terminal_width=200).output
    stale = re.compile(r"GPT-2 or Llama|GPT-2 training|--arch llama only|\(or, with --arch llama", re.IGNORECASE)
    assert not [n for n, t in texts.items() if stale.search(" ".join(t.split()))], \
        {n: stale.findall(" ".join(t.split())) for n, t in texts.items()}
    for name in ("train", "eval", "convert", "generate", "inspect"):
        assert "Mixtral" in texts[name], (name, texts[name][:500])
        assert "DeepseekV3" in texts[name] or "DeepSeek-V3" in texts[name], (name, texts[name][:500])
    assert "so far" not in texts["train"], texts["train"]          # no stale "not yet" in a family's line
