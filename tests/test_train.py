"""The training loop end to end: learning, resuming bit for bit, preemption,
divergence. Every run is a real `mpiexec ... python -m mpicube train`."""

import os
import re
import shutil
import signal
import time

import numpy as np
from mpirun import rank_pid
from conftest import TINY, paired, read_metrics, wait_for_steps

from mpicube.files import checkpoint


def run_ok(mpicube, *args, n=1):
    r = mpicube.run("train", *TINY, *args, n=n)
    assert r.returncode == 0, r
    return r


def losses(run_dir):
    return [(s["step"], s["loss"], s["lr"], s["grad_norm"]) for s in read_metrics(run_dir)[0]]


def latest_step(run_dir):
    path = checkpoint.latest(run_dir)
    return None if path is None else int(path.name.split("_")[1])


def test_loss_decreases_on_builtin_corpus(mpicube, tmp_path):
    run_ok(mpicube, "--steps", "30", "--warmup", "5", "--lr", "1e-2", "--out", "run")
    loss = [s["loss"] for s in read_metrics(tmp_path / "run")[0]]
    assert len(loss) == 30
    assert np.mean(loss[-5:]) < loss[0] - 0.5, loss


def test_stop_after_then_resume_is_bit_identical(mpicube, tmp_path):
    """2 data-parallel ranks, float32, dropout on: 6 steps in one go versus
    --stop-after 3 and --resume; every logged number must be identical."""
    opts = ["--steps", "6", "--warmup", "2", "--dropout", "0.1", "--dp", "2", "--eval-every", "2"]
    run_ok(mpicube, *opts, "--out", "whole", n=2)

    r = run_ok(mpicube, *opts, "--out", "split", "--stop-after", "3", n=2)
    assert "--stop-after" in r.stdout
    assert latest_step(tmp_path / "split") == 3
    assert [s for s, *_ in losses(tmp_path / "split")] == [1, 2, 3]

    r = run_ok(mpicube, *opts, "--out", "split", "--resume", n=2)
    assert "resuming from" in r.stdout
    assert losses(tmp_path / "split") == losses(tmp_path / "whole")
    assert read_metrics(tmp_path / "split")[1] == read_metrics(tmp_path / "whole")[1]   # val_loss at 2, 4, 6
    assert latest_step(tmp_path / "split") == 6

    # parameters and optimizer state end up the same too
    with checkpoint.open_checkpoint(tmp_path / "whole") as a, checkpoint.open_checkpoint(tmp_path / "split") as b:
        assert a.attrs["adam_t"] == b.attrs["adam_t"] == 6
        for name in ("model/wte", "model/h.0.attn.c_attn.weight", "optimizer/v/ln_f.weight"):
            assert np.array_equal(a.read(name), b.read(name)), name

    # resuming a finished run does nothing and succeeds; without --resume it refuses
    r = run_ok(mpicube, *opts, "--out", "split", "--resume", n=2)
    assert "nothing to do" in r.stdout and len(losses(tmp_path / "split")) == 6
    r = mpicube.run("train", *TINY, *opts, "--out", "split", n=2)
    assert r.returncode == 2 and "--resume" in r.error_lines()[0], r


def _wait_for_steps(proc, run_dir, n, timeout=120):
    wait_for_steps(proc, run_dir, n, timeout)


def test_sigterm_on_one_rank_checkpoints_and_resumes(mpicube, tmp_path):
    # A schedule far longer than the test, so the signal always lands mid-run
    # (a short run could finish first on a fast machine); both runs stop at
    # step `compared`, where --stop-after leaves the schedule unchanged.
    steps, compared = 100000, 300
    opts = ["--steps", str(steps), "--dp", "2", "--log-every", "1000"]
    run_ok(mpicube, *opts, "--stop-after", str(compared), "--out", "whole", n=2)

    proc = mpicube.popen("train", *TINY, *opts, "--out", "run", n=2)
    try:
        _wait_for_steps(proc, tmp_path / "run", 2)
        pid = rank_pid(proc.pid, 1)
        assert pid is not None, "rank 1 is not running"
        os.kill(pid, signal.SIGTERM)
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 75, (out, err)
    assert "stopped by a signal" in out
    done = len(losses(tmp_path / "run"))
    assert 2 <= done < steps
    assert latest_step(tmp_path / "run") == done          # checkpoint of the last completed step

    if done < compared:
        run_ok(mpicube, *opts, "--stop-after", str(compared), "--out", "run", "--resume", n=2)
        assert latest_step(tmp_path / "run") == compared
    assert losses(tmp_path / "run")[:compared] == losses(tmp_path / "whole")


def test_ctrl_c_checkpoints_and_exits_75_as_sigterm_does(mpicube, tmp_path):
    """Ctrl-C (SIGINT on the rank, as a terminal sends it) once interrupted
    with status 130 and lost every step since the last checkpoint; now the
    first one checkpoints the last completed step and exits 75."""
    proc = mpicube.popen("train", *TINY, "--steps", "100000", "--log-every", "1000", "--out", "run")
    try:
        _wait_for_steps(proc, tmp_path / "run", 2)
        pid = rank_pid(proc.pid, 0)
        assert pid is not None, "rank 0 is not running"
        os.kill(pid, signal.SIGINT)
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 75, (out, err)
    done = len(losses(tmp_path / "run"))
    assert 2 <= done < 100000 and latest_step(tmp_path / "run") == done, (out, err)


def test_time_limit_stops_with_status_75(mpicube, tmp_path):
    r = mpicube.run("train", *TINY, "--steps", "100000", "--time-limit", "0:0.5", "--out", "run")
    assert r.returncode == 75, r
    assert "--time-limit" in r.stdout
    done = len(losses(tmp_path / "run"))
    assert 1 <= done < 100000 and latest_step(tmp_path / "run") == done


def test_divergence_stops_without_saving_bad_state(mpicube, tmp_path):
    # an absurd learning rate overflows float32 within a couple of steps
    r = mpicube.run("train", *TINY, "--steps", "10", "--lr", "1e30", "--warmup", "0", "--ckpt-every", "1",
                    "--out", "run")
    assert r.returncode == 3, r
    assert "Traceback" not in r.stdout + r.stderr
    good = len(losses(tmp_path / "run"))                  # steps logged before the bad one
    assert 1 <= good < 10
    [line] = r.error_lines()
    assert f"diverged at step {good + 1}" in line and "without saving" in line, line
    assert latest_step(tmp_path / "run") == good
    assert not (tmp_path / "run" / "ckpt" / f"step_{good + 1:08d}").exists()
    ok, report = checkpoint.inspect(tmp_path / "run")
    assert ok, report
    with checkpoint.open_checkpoint(tmp_path / "run") as ck:
        assert all(np.isfinite(ck.read(name)).all() for name in ck.names() if name.startswith("model/"))


def test_init_from_on_another_world_size(mpicube, tmp_path):
    opts = ["--steps", "6", "--warmup", "2", "--lr", "1e-2", "--dtype", "float64"]
    run_ok(mpicube, *opts, "--out", "whole")
    run_ok(mpicube, *opts, "--out", "first", "--stop-after", "4")

    # the full state on 2 ranks: --resume of a copy of the run directory
    shutil.copytree(tmp_path / "first", tmp_path / "second")
    r = run_ok(mpicube, *opts, "--out", "second", "--resume", "--dp", "2", n=2)
    assert "resuming from" in r.stdout
    resumed, whole = losses(tmp_path / "second"), losses(tmp_path / "whole")
    assert [s for s, *_ in resumed] == [1, 2, 3, 4, 5, 6]
    for got, want in paired(resumed, whole):
        assert got[0] == want[0] and got[2] == want[2]
        assert np.allclose(got[1:], want[1:], rtol=1e-10, atol=0)   # up to data-parallel rounding

    # --init-from with --resume (as the job scripts pass it) into an empty run
    # directory: the parameters of `first`, but this run's own schedule and
    # optimizer from step 1, not first's step 5
    r = run_ok(mpicube, *opts, "--out", "tuned", "--init-from", "first", "--resume", "--dp", "2", n=2)
    assert "initialized parameters from" in r.stdout and "resuming" not in r.stdout
    tuned = losses(tmp_path / "tuned")
    assert [s for s, *_ in tuned] == [1, 2, 3, 4, 5, 6]
    assert [lr for _, _, lr, _ in tuned] == [lr for _, _, lr, _ in whole]
    assert tuned[0][1] < whole[0][1] - 0.2                        # trained parameters, fresh schedule
    with checkpoint.open_checkpoint(tmp_path / "tuned") as ck:
        assert ck.step == 6 and ck.attrs["adam_t"] == 6
    # resumed later, the run continues its own checkpoint, not `first`
    r = run_ok(mpicube, *opts, "--steps", "7", "--out", "tuned", "--init-from", "first", "--resume", "--dp", "2",
               n=2)
    assert f"resuming from {tmp_path / 'tuned' / 'ckpt' / 'step_00000006'}" in r.stdout or \
        "resuming from tuned/ckpt/step_00000006" in r.stdout, r.stdout

    # parameters only: a fresh optimizer, step 1, and a better start than random
    run_ok(mpicube, "--steps", "1", "--lr", "0", "--dtype", "float64", "--out", "params", "--init-from", "whole",
           "--dp", "2", n=2)
    with checkpoint.open_checkpoint(tmp_path / "params") as ck:
        assert ck.step == 1 and ck.attrs["adam_t"] == 1
    assert losses(tmp_path / "params")[0][1] < losses(tmp_path / "whole")[0][1] - 0.2

    # a model of another shape: one error naming the tensor
    r = mpicube.run("train", *TINY, "--n-embd", "32", "--out", "wide", "--init-from", "whole")
    assert r.returncode == 2, r
    [line] = r.error_lines()
    assert re.search(r"tensor 'model/[^']+' has shape \(.*16.*\) but this model needs \(.*32.*\)", line), line
    assert "Traceback" not in r.stdout + r.stderr

    # --resume on a run directory without a checkpoint starts afresh and says so
    r = run_ok(mpicube, "--steps", "1", "--out", "empty", "--resume")
    assert "starting a fresh run" in r.stdout and len(losses(tmp_path / "empty")) == 1


def test_signals_after_a_signal_stop_are_ignored_not_fatal():
    """A scheduler may repeat its warning while a stopped job finalises;
    after a signal-driven stop SIGUSR1/SIGTERM must not fall back to their
    default action (killing the rank), while a run that was not stopped by
    a signal hands the previous handlers back, except that a default
    SIGUSR1 (which would kill a finished rank on a late scheduler warning)
    becomes ignored."""
    from mpicube.training.stopping import SIGNAL, EarlyStop

    before, before_term = signal.getsignal(signal.SIGUSR1), signal.getsignal(signal.SIGTERM)
    mine = []
    try:
        signal.signal(signal.SIGUSR1, lambda *_: mine.append(1))
        own = signal.getsignal(signal.SIGUSR1)
        quiet = EarlyStop(world=None)
        with quiet.signal_handlers():
            assert signal.getsignal(signal.SIGUSR1) == quiet.on_signal
        assert signal.getsignal(signal.SIGUSR1) == own
        assert signal.getsignal(signal.SIGTERM) == before_term

        signal.signal(signal.SIGUSR1, signal.SIG_DFL)
        with EarlyStop(world=None).signal_handlers():
            pass
        assert signal.getsignal(signal.SIGUSR1) == signal.SIG_IGN
        signal.raise_signal(signal.SIGUSR1)                  # a late warning: would end this process if default
    finally:
        signal.signal(signal.SIGUSR1, before)

    stopped = EarlyStop(world=None)
    try:
        with stopped.signal_handlers():
            signal.raise_signal(signal.SIGUSR1)
            assert stopped.signalled == SIGNAL
        assert signal.getsignal(signal.SIGUSR1) == signal.SIG_IGN
        assert signal.getsignal(signal.SIGTERM) == signal.SIG_IGN
        signal.raise_signal(signal.SIGUSR1)                  # would end this test process if not ignored
    finally:
        signal.signal(signal.SIGUSR1, before)
        signal.signal(signal.SIGTERM, before_term)

