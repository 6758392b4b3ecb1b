"""``--optimizer sgd``: plain SGD, the reference mode in which a gradient's
scale shows in the parameters (AdamW divides it out).

One serial float64 trace of two steps, checked against the rule its
``optimizer`` attribute states: every updated parameter is the previous
one minus lr times the clipped gradient, with the clipping factor
recomputed here from the recorded gradient norm.
"""

import json

import h5py
import numpy as np
import pytest
from conftest import MpiCube

MODEL = ["--layout", "serial", "--n-layer", "1", "--n-head", "2", "--n-embd", "8", "--seq-len", "8",
         "--batch-size", "2", "--dtype", "float64", "--warmup", "1", "--lr", "0.5", "--grad-clip", "1.0"]


def test_sgd_trace_updates_by_lr_times_the_clipped_gradient(tmp_path, corpus_cache):
    runner = MpiCube(tmp_path, corpus_cache)
    r = runner.run("trace", *MODEL, "--optimizer", "sgd", "--steps", 2, "--out", "sgd.h5")
    assert r.returncode == 0, r
    with h5py.File(tmp_path / "sgd.h5", "r") as f:
        opt = json.loads(f.attrs["optimizer"])
        assert opt["name"] == "SGD" and opt["weight_decay"] == 0.0 and opt["decay"] == []
        clipped = 0
        for s in (1, 2):
            norm, lr = f[f"step_{s}/grad_norm"][()], f[f"step_{s}/lr"][()]
            scale = min(1.0, opt["grad_clip"]["max_norm"] / (norm + opt["grad_clip"]["eps"]))
            clipped += scale < 1.0
            before = "init" if s == 1 else f"step_{s - 1}/param"
            for name in f["init"]:
                expected = f[f"{before}/{name}"][()] - lr * scale * f[f"step_{s}/grad/{name}"][()]
                np.testing.assert_allclose(f[f"step_{s}/param/{name}"][()], expected, rtol=1e-14, atol=1e-16,
                                           err_msg=f"step {s} {name}")
        assert clipped >= 1                          # the clipping factor was exercised, not just 1


def test_an_unknown_optimizer_is_refused():
    from mpicube.core.errors import ConfigError
    from mpicube.training.options import TrainOptions

    with pytest.raises(ConfigError, match="--optimizer must be adamw, sgd or muon, got 'lamb'"):
        TrainOptions(optimizer="lamb").validate()
