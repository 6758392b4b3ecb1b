"""Pipeline stages (--pp) on real ranks. Every schedule with every layout,
dp 2, --zero 1, --recompute gathers|blocks, --grad-accum and 16-bit formats
follows the serial model with traffic and each stage's peak saved
activations equal to the cost model in tests/test_combo_matrix.py (pp 2);
here pp 4 with fewer micro-batches than stages (tests/pipeline_check.py).
Checkpoints move between pp sizes and layouts bitwise; a wrong order
hang-fails under the watchdog; an error on one stage ends the job; the
commands take --pp.

Each launch runs several cases on the same ranks (MPI start-up paid once).
"""

import json
import time

import h5py
import numpy as np
import pytest

from conftest import paired
from mpirun import ROOT, mpiexec

CHECK = ["-m", "mpi4py", "tests/pipeline_check.py"]


def run_cases(ranks, cases, tmp_path=None, timeout=240):
    args = []
    for case in cases:
        args += (["--"] if args else []) + case.split()
    proc = mpiexec(ranks, CHECK + args, timeout=timeout)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert out.count("OK pp ") == len(cases), out
    return proc.stdout


@pytest.mark.timeout(300)
def test_four_stages_with_fewer_micro_batches_follow_serial():
    """4 ranks: pp 4 under 1F1B with 3 micro-batches (fewer than stages);
    ZB-H1 with 4, its raw gradients bitwise 1F1B's; DualPipeV over 8
    chunks (its V turning on stage 3) with 8 micro-batches: equal to
    serial, traffic and each stage's peak of tapes and filed weight phases
    the cost model's."""
    out = run_cases(4, ["serial 1 1 4 1f1b 1 3", "serial 1 1 4 zb-h1 1 4 bitwise=1",
                        "serial 1 1 4 dualpipev 2 8 layers=8"])
    assert "bitwise equal to 1F1B's gradients" in out


@pytest.mark.timeout(200)
def test_stages_compose_with_cp_and_sequence_parallel():
    """4 ranks: pp 2 x cp 2 on the serial layout (each stage's ring over
    its own cp pair; stage boundaries send T/cp of each sequence) and 1-D
    tp 2 x pp 2 under --sequence-parallel (T/tp): equal to serial with
    dropout, traffic and each stage's peak saved activations the cost
    model's. (The two used to be refused by the plan's validation.)"""
    run_cases(4, ["serial 1 1 2 1f1b 1 2 cp=2", "1d 1 1 2 1f1b 1 2 sp=1"])


@pytest.mark.timeout(400)
def test_cube_stages_and_checkpoint_round_trip(tmp_path):
    """16 ranks: 3-D tp 8 x pp 2 under 1F1B, its trained state moved
    through checkpoints pp 2 x 3d -> serial -> pp 4 x 1d -> back, bitwise."""
    out = run_cases(16, [f"3d 1 1 2 1f1b 1 2 steps=2 ckpt={tmp_path}"], timeout=360)
    assert "checkpoint round trip OK: 156 tensors" in out


# --------------------------------------------------------------------------- faults

TINY = ["--n-layer", "2", "--n-embd", "16", "--n-head", "2", "--seq-len", "8", "--grad-accum", "2"]


@pytest.mark.timeout(120)
def test_wrong_order_hang_fails_and_stage_error_ends_the_job(tmp_path):
    """A planted order that cannot complete (tests/pipeline_faults.py swap)
    is stopped by the watchdog, which names the receive it waits in; an
    exception on stage 1 while stage 0 waits in a receive ends the job
    within seconds (mpi4py's abort), not at the launcher's timeout."""
    args = ["tests/pipeline_faults.py", "swap", "train", "--pp", "2", *TINY, "--steps", "3",
            "--out", str(tmp_path / "swap"), "--collective-timeout", "3"]
    proc = mpiexec(2, args, timeout=60)
    assert proc.returncode == 76, proc.stdout + proc.stderr
    assert "in irecv over axis pp" in proc.stderr, proc.stderr
    t0 = time.monotonic()
    args = ["tests/pipeline_faults.py", "raise:1", "train", "--pp", "2", *TINY, "--steps", "3",
            "--out", str(tmp_path / "raise"), "--collective-timeout", "0"]
    proc = mpiexec(2, args, timeout=60)
    assert proc.returncode != 0, proc.stdout + proc.stderr
    assert "planted failure in a pipeline stage's backward" in proc.stderr
    assert time.monotonic() - t0 < 45, "the job outlived the error by far"


# --------------------------------------------------------------------------- the commands

CLI = ["-m", "mpicube"]
FLOAT = [*TINY, "--dtype", "float64", "--dropout", "0.1", "--seed", "5"]


def metrics(run_dir) -> list:
    return [r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if "loss" in r]


def final_params(run_dir):
    ckpts = sorted((run_dir / "ckpt").glob("step_*"))
    with h5py.File(ckpts[-1] / "checkpoint.h5", "r") as f:
        return {g + "/" + n: f[g][n][...] for g in ("model", "optimizer/m", "optimizer/v") for n in f[g]}


@pytest.mark.timeout(300)
def test_commands_take_pp(tmp_path):
    """train --pp 2 stopped and resumed is bitwise the uninterrupted run,
    and on the GPU path (tests/fake_gpu) follows it to 1e-10;
    its checkpoint evaluates and generates the same on serial and on pp 2;
    a trace under pp 2 compares equal with a serial trace; bench --pp."""
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    base = ["train", "--pp", "2", *FLOAT, "--steps", "4", "--log-every", "1"]
    assert mpiexec(2, CLI + base + ["--out", str(whole)]).returncode == 0
    proc = mpiexec(2, CLI + base + ["--out", str(parts), "--stop-after", "2"])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    proc = mpiexec(2, CLI + base + ["--out", str(parts), "--resume"])
    assert proc.returncode == 0 and "resuming from" in proc.stdout, proc.stdout + proc.stderr
    a, b = final_params(whole), final_params(parts)
    assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)
    # the GPU path (CI's stand-in for CuPy: staged point-to-point buffers) follows the CPU run
    fake_gpu = {"PYTHONPATH": f"{ROOT / 'tests' / 'fake_gpu'}:{ROOT}"}
    proc = mpiexec(2, CLI + base + ["--out", str(tmp_path / "gpu"), "--device", "gpu"], env=fake_gpu)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for want, got in paired(metrics(whole), metrics(tmp_path / "gpu")):
        for key in ("loss", "grad_norm"):
            assert abs(got[key] - want[key]) <= 1e-10 * abs(want[key]), (key, got, want)
    config = json.loads((whole / "config.json").read_text())
    assert config["train"]["pp"] == 2 and config["train"]["pp_schedule"] == "1f1b"

    ckpt = str(sorted((whole / "ckpt").glob("step_*"))[-1])
    ev = [json.loads(mpiexec(n, CLI + ["eval", ckpt, "--batches", "2", "--dtype", "float64", *pp]).stdout
                     .strip().splitlines()[-1])["loss"] for n, pp in ((1, []), (2, ["--pp", "2"]))]
    assert abs(ev[0] - ev[1]) <= 1e-12 * abs(ev[0])
    gen = ["generate", ckpt, "--max-new-tokens", "5", "--json", "--dtype", "float64"]
    tokens = [json.loads(mpiexec(n, CLI + gen + pp).stdout.strip().splitlines()[-1])["tokens"]
              for n, pp in ((1, []), (2, ["--pp", "2"]))]
    assert tokens[0] == tokens[1]

    trace = ["trace", *FLOAT, "--steps", "2"]
    assert mpiexec(1, CLI + trace + ["--out", str(tmp_path / "t0.h5")]).returncode == 0
    proc = mpiexec(4, CLI + trace + ["--out", str(tmp_path / "t1.h5"), "--pp", "2", "--layout", "1d"])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    proc = mpiexec(1, CLI + ["compare", str(tmp_path / "t0.h5"), str(tmp_path / "t1.h5")])
    assert proc.returncode == 0 and "all tensors agree" in proc.stdout, proc.stdout + proc.stderr

    proc = mpiexec(2, CLI + ["bench", "--pp", "2", *TINY, "--steps", "1", "--warmup-steps", "1", "--json"])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])["results"][0]
    assert result["pp"] == 2 and result["comm"]["exact"], result


@pytest.mark.timeout(120)
def test_bad_pipeline_input_is_one_line(tmp_path):
    """--pp that does not divide the world or exceeds n_layer, virtual
    stages without interleaved, interleaved with N not a multiple of pp,
    DualPipeV with fewer than 2 pp micro-batches (the other zero-bubble
    refusals: tests/test_schedules.py): one line from rank 0 naming the
    nearest valid values, exit 2."""
    cases = [(["--pp", "3"], "--pp 3 must divide the world size 2"),
             (["--pp", "2", "--n-layer", "1"], "--pp 2 exceeds n_layer 1"),
             (["--pp", "2", "--virtual-stages", "2"], "applies to --pp-schedule interleaved only"),
             (["--pp", "2", "--pp-schedule", "interleaved", "--grad-accum", "3"], "multiple of 2"),
             (["--pp", "2", "--pp-schedule", "dualpipev", "--virtual-stages", "2", "--grad-accum", "3"],
              "--pp-schedule dualpipev needs at least 2 x --pp 2 micro-batches: --grad-accum 3: use --grad-accum 4")]
    for extra, words in cases:
        proc = mpiexec(2, CLI + ["train", "--steps", "1", "--out", str(tmp_path / "bad"), *extra])
        lines = [line for line in proc.stderr.splitlines() if line.strip()]
        assert proc.returncode == 2, proc.stdout + proc.stderr
        assert len(lines) == 1 and words in lines[0], proc.stderr
