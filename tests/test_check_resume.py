"""``mpicube check-resume`` (issue 47): a checkpoint written by the 3-D
layout on 8 ranks, resumed by 1-D on 2 ranks, continues the uninterrupted
serial run tensor by tensor - losses, activations, gradients, parameters,
AdamW moments, RNG offsets, expert loads - for GPT-2, Llama and Mixtral.

Cost: each family is one ``python -m mpicube check-resume`` process (not
under mpiexec: it launches its own two runs, 8 ranks and 2, and runs the
serial reference itself), so three processes and six mpiexec launches in
all, 2 + 2 steps of a one-block model each. Everything that fails closed
is checked on copies of GPT-2's traces with ``--compare-only``, in this
process, with no launch: a dropped moment, a missing step, state traced
by neither side, parameters read back wrongly; and the refusals of bad
input, each one line and nothing left behind.
"""

import json
import os
import shutil
import subprocess
import sys

import h5py
import pytest
from conftest import MpiCube, last_json

import mpicube.cli.main  # noqa: F401 - the commands register on the group as they are imported
from mpicube.cli.common import cli
from mpicube.core.errors import UserError

MODEL = ["--n-layer", "1", "--n-head", "4", "--n-embd", "16", "--seq-len", "8", "--batch-size", "4"]
FAMILIES = {
    "gpt2": ["--dropout", "0.1"],
    "llama": ["--arch", "llama", "--n-kv-head", "2", "--ffn-hidden", "24"],
    "mixtral": ["--arch", "mixtral", "--n-kv-head", "2", "--ffn-hidden", "24", "--n-experts", "4", "--top-k", "2"],
}
SIDES = ["--from-layout", "3d", "--from-ranks", "8", "--to-layout", "1d", "--to-ranks", "2", "--steps", "2",
         "--then", "2"]
RUN_TIMEOUT = 600


def check_resume(runner: MpiCube, family: str, *extra):
    """``python -m mpicube check-resume`` as a user runs it: one process."""
    env = {**runner.env, "MPIEXEC_TIMEOUT": "300"}          # each of its launches
    cmd = [sys.executable, "-m", "mpicube", "check-resume", *SIDES, *MODEL, *FAMILIES[family], *extra]
    return subprocess.run(cmd, cwd=runner.cwd, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT)


@pytest.fixture(scope="module")
def runner(tmp_path_factory, corpus_cache):
    return MpiCube(tmp_path_factory.mktemp("resume"), corpus_cache)


@pytest.fixture(scope="module")
def gpt2_dir(runner):
    """GPT-2's check, run once; its folder is the other tests' material."""
    r = check_resume(runner, "gpt2", "--out", "gpt2", "--json")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return runner.cwd / "gpt2", r


def _verdict(stdout: str) -> str:
    lines = [line for line in stdout.splitlines() if line.startswith("check-resume: ")]
    assert len(lines) == 1, stdout[-2000:]
    return lines[0]


def _expect_ok(r, tensors_at_least: int) -> dict:
    line = _verdict(r.stdout)
    assert line.startswith("check-resume: OK: 3d on 8 ranks for steps 1-2, saved, resumed as 1d on 2 ranks for "
                           "steps 3-4: equal to the uninterrupted serial run"), line
    summary = last_json(r.stdout)
    assert summary["ok"] and summary["first_divergence"] is None and summary["problems"] == []
    assert summary["tensors"] >= tensors_at_least and summary["max_rel"] <= 1e-10, summary
    counts = summary["compared"]
    assert counts["losses"] == 4 and counts["moments"] == 2 * counts["parameters"] > 0, counts
    return summary


@pytest.mark.timeout(RUN_TIMEOUT + 60)
def test_gpt2_resumed_on_another_layout_follows_the_serial_run(gpt2_dir):
    out, r = gpt2_dir
    summary = _expect_ok(r, 300)
    assert summary["compared"]["other"] > 0                               # activations, masks, rng offsets
    assert sorted(p.name for p in out.iterdir()) == ["compare.txt", "first.h5", "reference.h5", "resumed.h5", "run",
                                                     "second.h5"]
    with h5py.File(out / "resumed.h5", "r") as f:
        assert f.attrs["steps"] == 4 and f["tokens"].shape == (4, 4, 9)
        assert "first_step" not in f.attrs and [int(k[5:]) for k in f if k.startswith("step_")] == [1, 2, 3, 4]
        assert "step_4/dropout/emb" in f and f["step_3/state/rng_offset"][()] == 3
    with h5py.File(out / "second.h5", "r") as f:                          # the resumed run's own trace
        assert f.attrs["first_step"] == 3


@pytest.mark.timeout(2 * RUN_TIMEOUT + 60)
@pytest.mark.parametrize("family", ["llama", "mixtral"])
def test_llama_and_mixtral_resumed_on_another_layout_follow_the_serial_run(runner, family):
    r = check_resume(runner, family, "--out", family, "--json")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    _expect_ok(r, 200)
    if family == "mixtral":
        with h5py.File(runner.cwd / family / "resumed.h5", "r") as f:
            assert f["step_4/state/expert_load/h.0"][()].sum() == 4 * 8 * 2     # B T K choices


# --------------------------------------------------------------------------- failing closed, no launch


def _in_process(*args):
    """check-resume in this process (``--compare-only`` runs nothing):
    (exit status, stdout) or the UserError it raises."""
    return cli.main(args=["check-resume", *SIDES, *MODEL, *FAMILIES["gpt2"], *map(str, args)],
                    prog_name="mpicube", standalone_mode=False)


def _doctored(src, dst, spoil):
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("run"))
    for name in ("resumed.h5", "compare.txt"):
        (dst / name).unlink()
    spoil(dst)
    return dst


def _edit(path, edit):
    with h5py.File(path, "r+") as f:
        edit(f)


@pytest.mark.timeout(300)
def test_what_check_resume_did_not_check_is_a_failure(gpt2_dir, tmp_path, capsys):
    src = gpt2_dir[0]
    status = _in_process("--out", src, "--compare-only")
    assert status == 0 and "check-resume: OK: " in capsys.readouterr().out

    def moments_dropped(d):                  # the second run's moments zeroed: what a resume that lost them holds
        _edit(d / "second.h5", lambda f: f["step_3/state/exp_avg/wte"].__setitem__(Ellipsis, 0.0))

    def step_lost(d):
        _edit(d / "second.h5", lambda f: f.__delitem__("step_4"))

    def no_state(d):                         # neither side traced the state: nothing to hold a resume to
        for name in ("reference.h5", "first.h5", "second.h5"):
            _edit(d / name, lambda f: [f.__delitem__(f"{s}/state") for s in list(f) if s.startswith("step_")])

    def read_back_wrong(d):
        _edit(d / "second.h5", lambda f: f["init/ln_f.bias"].__setitem__(Ellipsis, f["init/ln_f.bias"][()] + 1e-3))

    cases = [(moments_dropped, "first divergence step_3/state/exp_avg/wte"),
             (step_lost, "the second run's trace holds steps 3, not 3-4"),
             (no_state, "step 1: step_1/state/exp_avg/"),
             (read_back_wrong, "the second run read back other parameters than the first saved after step 2: "
                               "ln_f.bias")]
    for spoil, said in cases:
        d = _doctored(src, tmp_path / spoil.__name__, spoil)
        status = _in_process("--out", d, "--compare-only")
        line = _verdict(capsys.readouterr().out)
        assert status == 1 and line.startswith("check-resume: FAILED: ") and said in line, (spoil.__name__, line)


def test_bad_input_is_one_line_and_leaves_nothing(gpt2_dir, tmp_path, capsys):
    cases = [
        (["--out", tmp_path / "new", "--compare-only"], "lacks reference.h5, first.h5, second.h5"),
        (["--out", gpt2_dir[0]], "exists and is not an empty directory"),
        (["--out", tmp_path / "x", "--from-args", "--n-layer 2"], "--from-args '--n-layer 2': No such option"),
        (["--out", tmp_path / "x", "--to-args", "--dp 3"], "the second run (1d on 2 ranks)"),
    ]
    for args, said in cases:
        with pytest.raises(UserError, match=said.replace("(", r"\(").replace(")", r"\)")):
            _in_process(*args)
    argv = ["check-resume", *SIDES, "--n-layer", "1", "--out", tmp_path / "y"]
    with pytest.raises(UserError, match="check-resume needs --batch-size"):
        cli.main(args=list(map(str, argv)), prog_name="mpicube", standalone_mode=False)
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists() and not (tmp_path / "new").exists()
    status = _in_process("--out", tmp_path / "p", "--print-commands")
    out = capsys.readouterr().out.splitlines()
    assert status == 0 and not (tmp_path / "p").exists()
    assert out[0].startswith("mpicube trace --layout serial ") and " --state --steps 4 " in out[0]
    assert " -n 8 " in out[1] and "--layout 3d" in out[1] and "--stop-after 2 --run-dir" in out[1]
    assert " -n 2 " in out[2] and "--layout 1d" in out[2] and "--resume --run-dir" in out[2]
    assert os.path.basename(out[1].split()[0]) == "mpiexec"


def _rewritten(src, dst):
    """``src`` (a resumed run's trace) written again through TraceWriter
    from ``first_step``: what a framework's recorder writes for the run it
    resumed from its own checkpoint."""
    from mpicube.check.writer import TraceWriter

    with h5py.File(src, "r") as f:
        def group(path):
            return {k: f[path][k][()] for k in f[path]} if path in f else {}
        attrs = {k: f.attrs[k] for k in ("config", "optimizer", "dtype", "dropout", "seed")}
        steps = sorted(int(k[5:]) for k in f if k.startswith("step_"))
        with TraceWriter(dst, json.loads(attrs["config"]), json.loads(attrs["optimizer"]), str(attrs["dtype"]),
                         {"framework": "test"}, float(attrs["dropout"]), int(attrs["seed"]),
                         first_step=steps[0]) as w:
            w.init(group("init"))
            for i, s in enumerate(steps):
                g = f"step_{s}/"
                state = {m: group(g + "state/" + m) for m in ("exp_avg", "exp_avg_sq")}
                state["rng_offset"] = f[g + "state/rng_offset"][()]
                w.step(s, loss=f[g + "loss"][()], lr=f[g + "lr"][()], grad_norm=f[g + "grad_norm"][()],
                       grads=group(g + "grad"), params=group(g + "param"), acts=group(g + "act"),
                       logits=f[g + "logits"][()], masks=group(g + "dropout"), tokens=f["tokens"][i], state=state)


def test_a_frameworks_resumed_trace_stands_in_for_the_second_run(gpt2_dir, tmp_path, capsys):
    """TraceWriter (and so the torch recorder) writes a resumed run's trace
    from ``first_step``; check-resume --compare-only takes it for the
    second run, and a writer that starts at step 1 is refused."""
    from mpicube.check.writer import TraceWriter

    d = _doctored(gpt2_dir[0], tmp_path / "framework", lambda d: None)
    _rewritten(gpt2_dir[0] / "second.h5", d / "second.h5")
    with h5py.File(d / "second.h5", "r") as f:
        assert f.attrs["first_step"] == 3 and f.attrs["steps"] == 4
    status = _in_process("--out", d, "--compare-only")
    assert status == 0 and "check-resume: OK: " in capsys.readouterr().out
    with h5py.File(d / "first.h5", "r") as f:
        cfg, opt = json.loads(f.attrs["config"]), json.loads(f.attrs["optimizer"])
    with pytest.raises(UserError, match="step 3 written after step 0"):
        with TraceWriter(tmp_path / "x.h5", cfg, opt, "float64", {}) as w:
            w.step(3, loss=1.0, lr=0.1, grad_norm=1.0, grads={}, params={})
