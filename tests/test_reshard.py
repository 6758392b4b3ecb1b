"""Resharding end to end: a checkpoint saved by the 3-D layout on 8 ranks is
loaded on serial (1 rank), 1-D (2 ranks), 2-D (4 ranks) and 3-D with q = 3
(27 ranks), and a run continued on another layout carries on with the saved
AdamW state: it follows the uninterrupted 3-D run.

Every command is a real ``mpiexec -n N python -m mpicube ...``. The model is
the smallest one every layout accepts: n_embd 36 (q^2 = 4 and 9 divide it),
n_head 6 (p = 2, q = 2, q = 3 divide it), batch 36 (q^2 = 4 and 9 divide it).
"""

import hashlib
import json
import shutil
from pathlib import Path

import h5py
import numpy as np
import pytest
from conftest import MpiCube, checkpoint_tensors, last_json, paired, read_metrics, relerr

from mpicube.files import checkpoint

pytestmark = pytest.mark.timeout(300)

MODEL = ["--n-layer", "1", "--n-head", "6", "--n-embd", "36", "--seq-len", "8", "--batch-size", "36"]
# The source run goes through all 5 steps, saving after steps 3 and 5; the
# continuations run steps 4 and 5 from its step-3 checkpoint. --eval-every 3
# makes it log the validation loss of exactly the model saved at step 3 (on
# the batches `eval` uses by default), and at step 5.
SCHEDULE = ["--steps", "5", "--warmup", "1", "--lr", "1e-2", "--eval-every", "3"]
SAVED_STEP = 3
EVAL_RTOL = 1e-6        # a forward pass in float32, summed in another order
STEP_RTOL = 1e-5        # one more optimizer step in float32, in another order




class Runs:
    """The module's run directories; ``src`` (3-D, 8 ranks, uninterrupted) is
    made once and is both the checkpoint to reshard and the reference."""

    def __init__(self, cube: MpiCube):
        self.cube = cube
        self.dir = cube.cwd

    def train(self, out, layout, n, *extra):
        r = self.cube.run("train", *MODEL, *SCHEDULE, "--layout", layout, "--out", out, *extra, n=n)
        assert r.returncode == 0, r
        return r

    def resume(self, out, layout, n, source=None):
        """Steps 4 and 5 from the saved step (or another checkpoint), full
        state: the checkpoint is copied into the new run directory and the
        run resumed there (--init-from with --resume starts a new run's own
        optimizer; resuming a run directory's own checkpoint keeps it)."""
        source = Path(source or self.saved)
        shutil.copytree(source, self.dir / out / "ckpt" / f"step_{SAVED_STEP:08d}")
        r = self.train(out, layout, n, "--resume")
        assert "resuming from" in r.stdout, r
        return r

    @property
    def saved(self):
        return self.dir / "src" / "ckpt" / f"step_{SAVED_STEP:08d}"


@pytest.fixture(scope="module")
def runs(tmp_path_factory, corpus_cache) -> Runs:
    runs = Runs(MpiCube(tmp_path_factory.mktemp("reshard"), corpus_cache))
    r = runs.train("src", "3d", 8, "--ckpt-every", str(SAVED_STEP), "--keep", "0")
    assert "layout 3d (tp 8, dp 1, q 2)" in r.stdout, r
    assert runs.saved.is_dir() and checkpoint.latest(runs.dir / "src").name == "step_00000005"
    return runs


@pytest.fixture(scope="module")
def saved_val_loss(runs) -> float:
    """The validation loss the 3-D run logged for the model it then saved."""
    evals = read_metrics(runs.dir / "src")[1]
    assert [e["step"] for e in evals] == [SAVED_STEP, SAVED_STEP + 2]
    return evals[0]["val_loss"]


@pytest.mark.parametrize("layout, n, describe", [
    ("serial", 1, {"layout": "serial", "tp": 1, "dp": 1}),
    ("1d", 2, {"layout": "1d", "tp": 2, "dp": 1, "p": 2}),
    ("2d", 4, {"layout": "2d", "tp": 4, "dp": 1, "q": 2, "depth": 1}),
    ("3d", 27, {"layout": "3d", "tp": 27, "dp": 1, "q": 3}),
], ids=["serial-1", "1d-2", "2d-4", "3d-27"])
def test_eval_on_another_layout(runs, saved_val_loss, layout, n, describe):
    """`eval` of the 8-rank 3-D checkpoint on another layout and world size
    gives the loss the saving run measured, to float32 rounding."""
    r = runs.cube.run("eval", runs.saved, "--layout", layout, n=n)
    assert r.returncode == 0, r
    assert "Traceback" not in r.stdout + r.stderr, r
    out = last_json(r.stdout)
    assert out["layout"] == describe
    assert out["step"] == SAVED_STEP and out["batch_size"] == 36 and out["seq_len"] == 8
    assert out["tokens"] == 8 * 36 * 8
    assert relerr(out["loss"], saved_val_loss) < EVAL_RTOL, (out["loss"], saved_val_loss)


def _continued(run_dir):
    """Records of steps 4 and 5, and the validation loss after step 5."""
    steps, evals = read_metrics(run_dir)
    steps = [s for s in steps if s["step"] > SAVED_STEP]
    evals = [e for e in evals if e["step"] > SAVED_STEP]
    assert [s["step"] for s in steps] == [SAVED_STEP + 1, SAVED_STEP + 2]
    assert [e["step"] for e in evals] == [SAVED_STEP + 2]
    return steps, evals[0]["val_loss"]


@pytest.mark.parametrize("layout, n", [("serial", 1), ("2d", 4)])
def test_resume_on_another_layout_carries_optimizer_state(runs, layout, n):
    """Steps 4 and 5 continued from the 3-D checkpoint on another layout
    follow the uninterrupted 3-D run on 8 ranks. Step 4's loss only needs
    the parameters; step 5's loss, and the parameters and moments saved
    after it, depend on the AdamW moments and step count carried over."""
    out = f"cont_{layout}"
    runs.resume(out, layout, n)
    got, got_val = _continued(runs.dir / out)
    want, want_val = _continued(runs.dir / "src")
    for g, w in paired(got, want):
        assert g["lr"] == w["lr"]
    assert relerr(got[0]["loss"], want[0]["loss"]) < EVAL_RTOL, (got[0], want[0])
    assert relerr(got[1]["loss"], want[1]["loss"]) < STEP_RTOL, (got[1], want[1])
    assert relerr(got[1]["grad_norm"], want[1]["grad_norm"]) < STEP_RTOL, (got[1], want[1])
    assert relerr(got_val, want_val) < STEP_RTOL, (got_val, want_val)

    a, b = checkpoint_tensors(runs.dir / out), checkpoint_tensors(runs.dir / "src")
    assert sorted(a) == sorted(b)
    assert any(name.startswith("optimizer/m/") for name in a) and any(name.startswith("optimizer/v/") for name in a)
    for name in a:
        assert a[name].shape == b[name].shape, name
        scale = float(np.abs(b[name]).max())
        assert np.abs(a[name] - b[name]).max() <= STEP_RTOL * 10 * scale, name
    with checkpoint.open_checkpoint(runs.dir / out) as ck:
        assert ck.step == SAVED_STEP + 2 and ck.attrs["adam_t"] == SAVED_STEP + 2


def _zero_moments(src, dst):
    """A copy of checkpoint ``src`` whose AdamW moments are all zero, still
    self-consistent (its shard digests updated): what a resume that dropped
    the optimizer state would continue from."""
    shutil.copytree(src, dst)
    for shard in sorted((dst / "shards").iterdir()):
        with h5py.File(shard, "r+") as f:
            names = []
            f.visititems(lambda name, obj: names.append(name) if isinstance(obj, h5py.Dataset) else None)
            for name in names:
                if name.startswith("optimizer/"):
                    f[name][...] = 0
    with h5py.File(dst / "checkpoint.h5", "r+") as f:
        hashed = json.loads(f.attrs["shard_sha256"])                # every file the digests cover
        assert any(name.startswith("shards/") for name in hashed)
        f.attrs["shard_sha256"] = json.dumps({name: hashlib.sha256((dst / name).read_bytes()).hexdigest()
                                              for name in hashed})


def test_comparison_detects_lost_optimizer_state(runs):
    """The control for the test above: the same continuation from the same
    parameters but zero moments gives the same step-4 loss and a step-5
    loss and moments far outside the tolerances used there."""
    zeroed = runs.dir / "zeroed_step"
    _zero_moments(runs.saved, zeroed)
    with checkpoint.open_checkpoint(zeroed) as ck:        # verifies the rewritten digests
        assert not ck.read("optimizer/m/wte").any() and ck.read("model/wte").any()
    runs.resume("cont_zeroed", "serial", 1, source=zeroed)
    got, _ = _continued(runs.dir / "cont_zeroed")
    want, _ = _continued(runs.dir / "src")
    assert relerr(got[0]["loss"], want[0]["loss"]) < EVAL_RTOL
    assert relerr(got[1]["loss"], want[1]["loss"]) > 100 * STEP_RTOL, (got[1], want[1])
    a, b = checkpoint_tensors(runs.dir / "cont_zeroed"), checkpoint_tensors(runs.dir / "src")
    m = "optimizer/m/h.0.attn.c_attn.weight"
    assert np.abs(a[m] - b[m]).max() > 100 * STEP_RTOL * np.abs(b[m]).max()
