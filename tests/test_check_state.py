"""The training state in a trace (``trace --state``, format version 3):
AdamW's moments, the loss scale, the RNG offset, checked like any tensor
and named in computation order (after the step's gradients, before its
updated parameters); a trace without them is a divergence unless it is of
a version that cannot hold them. And two checks of what values say
beyond a difference: an update that was never applied (a parameter after
step s exactly as before it), and mixed precision that did not take
effect (a 16-bit trace whose activations all lie off the 16-bit grid) or
took effect unasked. numpy and h5py, except the last test, which holds
the torch recorder's moments to mpicube's (skipped without torch).
"""

import os
import subprocess

import ml_dtypes
import numpy as np
import pytest
from conftest import MpiCube
from test_check import good, run, variant, write_good  # noqa: F401 - fixtures
from test_trace import REPO, torch_python

from test_check import CFG, OPTIMIZER, STEPS

from mpicube.check import names
from mpicube.check.writer import TraceWriter
from mpicube.core.errors import UserError

N_PARAMS = len(names.param_shapes(CFG))


@pytest.fixture(scope="module")
def stateful(tmp_path_factory):
    return write_good(tmp_path_factory.mktemp("state") / "state.h5", state=True)


def test_the_state_is_compared_and_a_trace_that_lacks_it_is_named(stateful, good, variant, capsys):
    status, out, _, summary = run(capsys, stateful, stateful)
    assert status == 0 and summary["tensors"] == run(capsys, good, good)[3]["tensors"] + STEPS * (2 * N_PARAMS + 2)
    order = [line.split()[0] for line in out.splitlines() if line.startswith("step_1/")]
    assert order.index("step_1/lr") < order.index("step_1/state/exp_avg/wte") < order.index("step_1/param/wte")
    status, out, _, summary = run(capsys, stateful, good)
    assert status == 1 and summary["first_divergence"] == "step_1/state/exp_avg/wte" and "only in A" in out
    older = variant(lambda f: f.attrs.__setitem__("version", 2))
    status, out, _, summary = run(capsys, stateful, older)
    assert status == 0 and "(a version 2 trace does not hold it)" in out, out


def test_state_that_parts_is_named_at_its_step(stateful, tmp_path, capsys):
    import h5py

    for name, spoil in (("step_2/state/exp_avg/h.1.mlp.c_fc.weight", lambda a: a * 0),      # moments dropped
                        ("step_2/state/loss_scale", lambda a: a / 4),                      # the scale reset
                        ("step_2/state/rng_offset", lambda a: a - 1)):                     # the RNG rewound
        b = tmp_path / "b.h5"
        b.write_bytes(stateful.read_bytes())
        with h5py.File(b, "r+") as f:
            f[name][...] = spoil(f[name][()])
        status, out, _, summary = run(capsys, stateful, b)
        assert status == 1 and summary["first_divergence"] == name, out


def test_state_stored_in_another_dtype_is_named(stateful, tmp_path, capsys):
    """The state's datasets have their format's dtypes (moments as the
    parameters, the loss scale float64, the offset and loads int64): one
    stored otherwise is a divergence naming the dtype, even with equal
    values (a moment in float32 in a float64 trace has lost its digits; a
    count as a float is not one)."""
    import h5py

    for name, dtype, want in (("step_2/state/exp_avg_sq/wte", np.float32, "float64"),
                              ("step_1/state/rng_offset", np.float64, "int64"),
                              ("step_2/state/loss_scale", np.float32, "float64")):
        b = tmp_path / "b.h5"
        b.write_bytes(stateful.read_bytes())
        with h5py.File(b, "r+") as f:
            value = f[name][()]
            del f[name]
            f.create_dataset(name, data=np.asarray(value).astype(dtype))
        status, out, _, summary = run(capsys, stateful, b)
        assert status == 1 and summary["first_divergence"] == name, out
        assert f"dtype: B stores {np.dtype(dtype)}, the format {want}" in out, out


def test_the_writer_refuses_state_it_does_not_know(tmp_path):
    with pytest.raises(UserError, match="state 'momentum' is not one of exp_avg, exp_avg_sq, loss_scale"):
        with TraceWriter(tmp_path / "x.h5", CFG, OPTIMIZER, "float64", {}) as w:
            w.step(1, loss=1.0, lr=0.1, grad_norm=1.0, grads={}, params={}, state={"momentum": 1.0})
    assert not list(tmp_path.iterdir())


def test_an_update_never_applied_is_named_at_the_parameter(good, variant, capsys):
    def unapplied(f):
        for name in names.param_shapes(CFG):
            f[f"step_1/param/{name}"][...] = f[f"init/{name}"][()]
    status, out, _, summary = run(capsys, good, variant(unapplied))
    assert status == 1 and summary["first_divergence"] == "step_1/param/wte"
    assert "B: wte is exactly what it was before step 1: its update was not applied" in out


def on_grid(f, names_, dtype=ml_dtypes.bfloat16):
    for n in names_:
        f[n][...] = f[n][()].astype(dtype).astype(np.float64)


def computed(step):
    return [f"step_{step}/act/{a}" for a in names.act_names(CFG)] + [f"step_{step}/logits"]


def test_16_bit_values_in_a_float64_trace_are_named(good, variant, capsys):
    status, out, _, summary = run(capsys, good, variant(lambda f: on_grid(f, computed(2))))
    assert status == 1 and summary["first_divergence"] == "step_2/act/emb"
    assert "B: a float64 trace whose activations and logits of this step all lie on the bfloat16 grid" in out
    status, _, _, _ = run(capsys, good, variant(lambda f: on_grid(f, computed(2)[1:])))   # act/emb off the grid
    assert status == 1                                                                     # ... still 1: the values


def test_a_16_bit_trace_computed_in_float32_is_named(tmp_path, capsys):
    off = write_good(tmp_path / "off.h5", dtype="bfloat16")              # random float32 values: off the grid
    on = write_good(tmp_path / "on.h5", dtype="bfloat16")
    import h5py
    with h5py.File(on, "r+") as f:
        for s in range(1, STEPS + 1):
            on_grid(f, computed(s)[2:3])                   # one activation a step on the grid: a 16-bit linear's
    status, out, _, summary = run(capsys, on, off)
    assert status == 1 and summary["first_divergence"] == "step_1/act/emb"
    assert ("B: a bfloat16 trace whose activations and logits of this step all lie off the bfloat16 grid: "
            "computed in float32, mixed precision not in effect") in out
    assert "A: a bfloat16" not in out


@pytest.mark.timeout(300)
def test_torch_adamw_moments_follow_mpicube(tmp_path, corpus_cache):
    """tools/torch_trace.py on a reference traced with --state records
    torch.optim.AdamW's exp_avg and exp_avg_sq through the recorder; they
    follow mpicube's moments to float64 rounding."""
    python = torch_python()
    if python is None:
        pytest.skip("torch is not installed (optional: pip install torch)")
    runner = MpiCube(tmp_path, corpus_cache)
    r = runner.run("trace", "--layout", "serial", "--n-layer", "2", "--n-head", "4", "--n-embd", "16", "--seq-len",
                   "8", "--batch-size", "8", "--dtype", "float64", "--dropout", "0.1", "--seed", "5", "--warmup", "2",
                   "--steps", "2", "--state", "--out", "ref.h5")
    assert r.returncode == 0, r
    proc = subprocess.run([python, str(REPO / "tools" / "torch_trace.py"), str(tmp_path / "ref.h5"), "--out",
                           str(tmp_path / "torch.h5")], capture_output=True, text=True, timeout=240,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    from mpicube.check.compare import compare_traces
    result = compare_traces(tmp_path / "ref.h5", tmp_path / "torch.h5")
    moments = [r for r in result.rows if "/state/exp_avg" in r.name]
    assert result.first_divergence is None
    assert len(moments) == 2 * 28 * 2, len(moments)                  # 2 moments, 28 parameters, 2 steps
    assert max(r.max_rel for r in moments) <= 1e-10
