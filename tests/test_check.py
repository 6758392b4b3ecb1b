"""mpicube.check: a checker that fails closed, the trace format read and
written without MPI, and bad input named in one line.

In-process on small synthetic traces written by ``TraceWriter`` (the
values are random: what is tested here is what compare does with two
files, not the model's numerics, which tests/test_trace.py checks on real
traces). Each variant of a good trace - NaN, inf, missing, misnamed, wrong
dtype, untransposed, a missing step or attribute - must exit 1 and name
its tensor; each broken file must exit 2 with one line naming the file and
the item.
"""

import json
import subprocess
import sys

import h5py
import numpy as np
import pytest

from mpicube.check import names
from mpicube.check.compare import compare_traces
from mpicube.check.reference import Reference, lr_at
from mpicube.check.report import main
from mpicube.check.writer import TraceWriter
from mpicube.core.errors import UserError

CFG = {"vocab_size": 16, "n_ctx": 4, "n_layer": 2, "n_head": 2, "n_embd": 8}
B, T, STEPS, P = 2, 4, 2, 0.1
OPTIMIZER = {"name": "AdamW", "lr": {"peak": 1e-3, "warmup": 1, "steps": STEPS, "min_lr": 1e-4,
                                     "values": [1e-3, 1e-4]}, "betas": [0.9, 0.95], "eps": 1e-8,
             "weight_decay": 0.1, "decay": ["h.0.attn.c_attn.weight"], "grad_clip": {"max_norm": 1.0}}


def tensors(rng):
    return {n: rng.standard_normal(shape) for n, shape in names.param_shapes(CFG).items()}


def write_good(path, dtype="float64", seed=0, state=False):
    """A complete trace of STEPS steps with dropout masks, random values;
    with ``state`` the training state too (trace --state), drawn from a
    generator of its own, so that the rest is the same either way."""
    rng = np.random.default_rng(seed)
    state_rng = np.random.default_rng(seed + 1000)
    h, nh, L = CFG["n_embd"], CFG["n_head"], CFG["n_layer"]
    with TraceWriter(path, CFG, OPTIMIZER, dtype, {"framework": "test"}, dropout=P, seed=1) as w:
        w.init(tensors(rng))
        for s in range(1, STEPS + 1):
            masks = {"emb": rng.random((B, T, h)) > P}
            for i in range(L):
                masks.update({f"h.{i}.attn": rng.random((B, nh, T, T)) > P,
                              f"h.{i}.resid_attn": rng.random((B, T, h)) > P,
                              f"h.{i}.resid_mlp": rng.random((B, T, h)) > P})
            acts = {k: rng.standard_normal((B, T, h)) for k in names.act_names(CFG)}
            w.step(s, loss=2.5 + s, lr=OPTIMIZER["lr"]["values"][s - 1], grad_norm=1.5, grads=tensors(rng),
                   params=tensors(rng), acts=acts, logits=rng.standard_normal((B, T, CFG["vocab_size"])),
                   masks=masks, tokens=rng.integers(0, CFG["vocab_size"], (B, T + 1)),
                   state={"exp_avg": tensors(state_rng), "exp_avg_sq": {n: v ** 2 for n, v in tensors(state_rng).items()},
                          "loss_scale": 1024.0 * 2 ** s, "rng_offset": s} if state else None)
    return path


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    return write_good(tmp_path_factory.mktemp("check") / "good.h5")


@pytest.fixture
def variant(good, tmp_path):
    """A copy of the good trace to spoil, through ``edit(f)``."""
    def make(edit):
        path = tmp_path / "variant.h5"
        path.write_bytes(good.read_bytes())
        with h5py.File(path, "r+") as f:
            edit(f)
        return path
    return make


def run(capsys, *args):
    status = main([str(a) for a in args] + ["--json"])
    out, err = capsys.readouterr()
    summary = json.loads(out.strip().splitlines()[-1]) if status in (0, 1) else None
    return status, out, err, summary


def test_a_trace_agrees_with_itself_and_the_file_is_the_format(good, capsys):
    status, out, _, summary = run(capsys, good, good)
    assert status == 0 and "all tensors agree" in out
    assert summary["tensors"] == len(names.computation_order(CFG, STEPS))
    with h5py.File(good, "r") as f:
        assert f.attrs["format"] == names.FORMAT and f.attrs["steps"] == STEPS
        assert f["tokens"].shape == (STEPS, B, T + 1) and f["tokens"].dtype == np.int32
        assert f["step_1/dropout/h.0.attn"].dtype == np.uint8 and f["step_1/loss"].shape == ()


def set_to(name, index, value):
    def edit(f):
        data = np.array(f[name][()])
        data[index] = value
        f[name][...] = data
    return edit


@pytest.mark.parametrize("name, index, value, said", [
    ("step_1/loss", (), np.nan, "nan in B"),
    ("step_2/grad/h.1.mlp.c_fc.weight", (3, 5), np.inf, "inf in B at (3, 5)"),
    ("step_1/act/h.0", (1, 2, 3), -np.inf, "-inf in B at (1, 2, 3)"),
])
def test_nan_or_inf_on_one_side_is_a_divergence(variant, good, capsys, name, index, value, said):
    status, out, _, summary = run(capsys, good, variant(set_to(name, index, value)))
    assert status == 1 and summary["first_divergence"] == name
    assert f"first divergence: {name} (non-finite:" in out and said in out


def test_the_same_nan_at_the_same_place_agrees_and_is_said(variant, capsys):
    a = variant(set_to("step_1/logits", (0, 1, 2), np.nan))
    b = a.with_name("b.h5")
    b.write_bytes(a.read_bytes())
    status, out, _, _ = run(capsys, a, b)
    assert status == 0 and "both hold nan at 1 place(s), first (0, 1, 2)" in out
    with h5py.File(b, "r+") as f:                      # NaN against inf at that place: not the same value
        set_to("step_1/logits", (0, 1, 2), np.inf)(f)
    status, out, _, summary = run(capsys, a, b)
    assert status == 1 and summary["first_divergence"] == "step_1/logits" and "nan in A vs inf in B" in out


def test_a_missing_tensor_fails_unless_allowed(variant, good, capsys):
    b = variant(lambda f: f.__delitem__("step_2/act/h.1"))
    status, out, _, summary = run(capsys, good, b)
    assert status == 1 and summary["first_divergence"] == "step_2/act/h.1" and "only in A" in out
    status, out, _, _ = run(capsys, good, b, "--allow-missing", "step_*/act/h.*")
    assert status == 0 and "1 missing but allowed" in out
    status, _, _, _ = run(capsys, b, good, "--allow-missing", "step_*/act/emb")    # another pattern: still fails
    assert status == 1


def test_the_activations_inside_a_block_are_named_and_a_version_1_trace_lacks_them(variant, good, capsys):
    """Version 2 added each block's norm outputs and branch outputs, in
    computation order between the block's masks (a wrong head split is
    named at the attention, not at the block). A version 2 trace without
    them fails; a version 1 trace, which cannot hold them, is compared on
    everything else, the rows saying why they are allowed."""
    with h5py.File(good, "r") as f:
        kept = [n for n in names.computation_order(CFG, STEPS) if n.startswith("step_1/")][:12]
        assert kept[2:11] == ["step_1/act/h.0.ln_1", "step_1/dropout/h.0.attn", "step_1/dropout/h.0.resid_attn",
                              "step_1/act/h.0.attn", "step_1/act/h.0.ln_2", "step_1/dropout/h.0.resid_mlp",
                              "step_1/act/h.0.mlp", "step_1/act/h.0", "step_1/act/h.1.ln_1"]
        assert all(n in f for n in kept)

    def drop_inside(version):
        def edit(f):
            f.attrs["version"] = version
            for s in range(1, STEPS + 1):
                for n in names.act_names(CFG):
                    if n.count(".") == 2:
                        del f[f"step_{s}/act/{n}"]
        return edit
    status, out, _, summary = run(capsys, good, variant(drop_inside(2)))
    assert status == 1 and summary["first_divergence"] == "step_1/act/h.0.ln_1" and "only in A" in out
    status, out, _, summary = run(capsys, good, variant(drop_inside(1)))
    assert status == 0 and summary["first_divergence"] is None, out
    assert "16 missing but allowed" in out and "(a version 1 trace does not hold it)" in out
    spoiled = variant(lambda f: (drop_inside(1)(f), f["step_1/act/h.1"].__setitem__((0, 0, 0), 7.0)))
    status, _, _, summary = run(capsys, good, spoiled)
    assert status == 1 and summary["first_divergence"] == "step_1/act/h.1"     # the rest is still compared


def test_a_misnamed_tensor_is_named_where_the_real_one_is_missing(variant, good, capsys):
    def rename(f):
        f.move("step_1/grad/h.0.mlp.c_fc.weight", "step_1/grad/h.0.mlp.fc.weight")
    status, out, _, summary = run(capsys, good, variant(rename))
    assert status == 1 and summary["first_divergence"] == "step_1/grad/h.0.mlp.c_fc.weight"
    assert "step_1/grad/h.0.mlp.fc.weight" in out and "only in B" in out


def test_a_wrong_dtype_is_named(variant, good, capsys):
    def to_float32(f):
        data = f["step_1/grad/wpe"][()]
        del f["step_1/grad/wpe"]
        f["step_1/grad/wpe"] = data.astype(np.float32)
    status, out, _, summary = run(capsys, good, variant(to_float32))
    assert status == 1 and summary["first_divergence"] == "step_1/grad/wpe"
    assert "B stores float32, the format float64" in out


def test_untransposed_weights_are_named(variant, good, capsys):
    def transpose(name):
        def edit(f):
            data = f[name][()]
            del f[name]
            f[name] = data.T
        return edit
    status, out, _, summary = run(capsys, good, variant(transpose("step_1/grad/h.1.attn.c_proj.weight")))
    assert status == 1 and summary["first_divergence"] == "step_1/grad/h.1.attn.c_proj.weight"     # square
    status, out, _, summary = run(capsys, good, variant(transpose("init/h.0.mlp.c_fc.weight")))
    assert status == 1 and summary["first_divergence"] == "init/h.0.mlp.c_fc.weight"
    assert "shapes (8, 32) vs (32, 8)" in out


def test_a_missing_step_is_named_and_can_be_allowed(variant, good, capsys):
    def drop_step(f):
        tokens = f["tokens"][:1]
        del f["step_2"], f["tokens"]
        f["tokens"] = tokens
        f.attrs["steps"] = 1
    b = variant(drop_step)
    status, out, _, summary = run(capsys, good, b)
    assert status == 1 and summary["first_divergence"] == "step_2" and "step 2 only in A (missing in B)" in out
    status, out, _, _ = run(capsys, good, b, "--allow-missing", "step_2/*")
    assert status == 0 and "first 1 steps" in out                    # tokens compared over the common step


def test_a_missing_attribute_fails_and_the_dtype_comes_from_the_data(variant, good, capsys):
    def drop_dtype_and_nudge(f):
        del f.attrs["dtype"]
        f["step_1/grad/wte"][0, 0] += 1e-5 * np.abs(f["step_1/grad/wte"][()]).max()
    b = variant(drop_dtype_and_nudge)
    status, out, _, summary = run(capsys, good, b)
    assert status == 1 and summary["first_divergence"] == "@dtype" and "attribute dtype missing in B" in out
    # allowed: float64 read from the data, so a 1e-5 relative error still fails (float32's budget would pass it)
    status, out, _, summary = run(capsys, good, b, "--allow-missing", "@dtype")
    assert status == 1 and summary["first_divergence"] == "step_1/grad/wte"
    assert "no dtype attribute: float64 from the data" in out


def test_depth_bound_is_printed_and_can_decide(variant, good, capsys):
    def nudge(f):
        f["step_2/act/h.0"][0, 0, 0] *= 1 + 1e-12
    b = variant(nudge)
    status, out, _, _ = run(capsys, good, b)                        # inside float64's budget (rtol 1e-10)
    row = next(line for line in out.splitlines() if line.startswith("step_2/act/h.0 "))
    assert status == 0 and row.split()[-1] == "yes" and float(row.split()[-2].rstrip("x")) < 1
    status, out, _, summary = run(capsys, good, b, "--tolerance", "depth")   # past what rounding explains
    assert status == 1 and summary["first_divergence"] == "step_2/act/h.0"
    ds = [names.depth(n, CFG) for n in names.computation_order(CFG, STEPS) if "dropout" not in n and "/lr" not in n]
    assert ds == sorted(ds) and names.depth("init/wte", CFG) == 0


def test_compare_traces_of_different_dtypes_follows_the_coarser(tmp_path, good):
    f32 = write_good(tmp_path / "f32.h5", dtype="float32")
    result = compare_traces(good, f32)
    assert (result.rtol, result.atol) == (1e-3, 1e-6) and result.dtypes == ("float64", "float32")
    assert result.first_divergence is None                     # the same values, rounded to float32
    assert compare_traces(good, f32, rtol=1e-10, atol=0).first_divergence == "init/wte"


# --------------------------------------------------------------------------- bad input: exit 2, one line


def one_line_error(capsys, *args):
    status, _, err, _ = run(capsys, *args)
    lines = [line for line in err.splitlines() if line.strip()]
    assert status == 2 and len(lines) == 1, err
    return lines[0]


def test_bad_files_are_named_in_one_line(tmp_path, good, variant, capsys):
    text = tmp_path / "text.h5"
    text.write_text("not hdf5\n")
    assert "text.h5: not an HDF5 file" in one_line_error(capsys, good, text)
    other = tmp_path / "other.h5"
    with h5py.File(other, "w") as f:
        f.attrs["format"] = "mpicube-checkpoint"
    assert "other.h5: not a trace (format 'mpicube-checkpoint'" in one_line_error(capsys, other, good)
    v5 = variant(lambda f: f.attrs.__setitem__("version", 5))
    assert "variant.h5: trace version 5, this mpicube reads versions 1, 2, 3, 4 (writes 4)" in \
        one_line_error(capsys, good, v5)
    cut = tmp_path / "cut.h5"
    cut.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    assert "cut.h5: truncated or damaged HDF5 file" in one_line_error(capsys, good, cut)


def test_a_dataset_that_cannot_be_read_is_named(tmp_path, good, capsys):
    broken = tmp_path / "broken.h5"
    broken.write_bytes(good.read_bytes())
    with h5py.File(broken, "r+") as f:                          # a compressed tensor whose bytes are then spoiled
        data = f["step_1/logits"][()]
        del f["step_1/logits"]
        f.create_dataset("step_1/logits", data=data, chunks=data.shape, compression="gzip")
        info = f["step_1/logits"].id.get_chunk_info(0)
    raw = bytearray(broken.read_bytes())
    raw[info.byte_offset: info.byte_offset + info.size] = b"\xff" * info.size
    broken.write_bytes(bytes(raw))
    line = one_line_error(capsys, good, broken)
    assert "broken.h5: dataset step_1/logits cannot be read" in line


def test_a_name_map_missing_a_parameter_is_bad_input(tmp_path):
    params = tensors(np.random.default_rng(0))
    del params["h.1.ln_2.bias"]
    writer = TraceWriter(tmp_path / "t.h5", CFG, OPTIMIZER, "float64", {})
    with pytest.raises(UserError, match=r"t.h5: init: no 'h.1.ln_2.bias' \(a name map"):
        writer.init(params)
    params = tensors(np.random.default_rng(0))
    params["wte"] = params["wte"].T
    with pytest.raises(UserError, match=r"init/wte has shape \(8, 16\), the format \(16, 8\)"):
        writer.init(params)
    writer.discard()
    assert not list(tmp_path.iterdir())                         # nothing left behind


# --------------------------------------------------------------------------- the reference, without MPI


def test_reference_reads_what_the_writer_wrote(good):
    with Reference(good) as ref, h5py.File(good, "r") as f:
        assert ref.config == CFG and ref.steps == STEPS and ref.dropout == P and ref.decay == set(OPTIMIZER["decay"])
        init = ref.init()
        assert list(init) == names.forward_param_order(CFG)
        assert all(np.array_equal(init[n], f[f"init/{n}"][()]) for n in init)
        x, y = ref.batch(2)
        assert x.shape == y.shape == (B, T) and np.array_equal(y[:, :-1], x[:, 1:])
        assert set(ref.masks(1)) == {"emb", "h.0.attn", "h.0.resid_attn", "h.0.resid_mlp", "h.1.attn",
                                     "h.1.resid_attn", "h.1.resid_mlp"}
        assert ref.lr(2) == 1e-4 and lr_at(OPTIMIZER["lr"], 3) == pytest.approx(1e-4)


def test_check_imports_without_mpi_cupy_or_torch():
    code = ("import sys, mpicube.check.compare, mpicube.check.report, mpicube.check.reference, "
            "mpicube.check.writer, mpicube.check.namemaps, mpicube.check.torch; "
            "bad = [m for m in sys.modules if m.split('.')[0] in ('mpi4py', 'cupy', 'torch', 'numba') "
            "or m.startswith(('mpicube.parallel', 'mpicube.device', 'mpicube.model', 'mpicube.training'))]; "
            "print(bad)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stdout + out.stderr


def test_a_step_the_steps_attribute_declares_but_no_file_holds_is_missing(variant, capsys):
    a = variant(lambda f: f.attrs.__setitem__("steps", 3))
    status, out, _, summary = run(capsys, a, a)
    assert status == 1 and summary["first_divergence"] == "step_3"
    assert "step 3 declared by A's steps attribute, in neither file" in out
    assert run(capsys, a, a, "--allow-missing", "step_3/*")[0] == 0


LLAMA = {**CFG, "arch": "llama", "n_kv_head": 1, "ffn_hidden": 12, "rope_theta": 10000.0, "rms_eps": 1e-6,
         "tie_embeddings": False}


def test_a_llama_trace_is_written_read_and_compared_under_llama_names(tmp_path, capsys):
    """A Llama config carries its six settings; the writer wants Llama's
    parameters (no biases, no wpe, lm_head last), the reader gives them in
    declaration order, a Llama config without one of its settings is bad
    input naming it, and two Llama traces that part are named at a Llama
    gradient in backward order (lm_head first)."""
    shapes = names.param_shapes(LLAMA)
    assert list(shapes)[:3] == ["wte", "h.0.ln_1.weight", "h.0.attn.c_attn.weight"]
    assert shapes["h.0.attn.c_attn.weight"] == (8, 16) and shapes["h.0.mlp.c_fc.weight"] == (8, 24)
    assert list(shapes)[-2:] == ["ln_f.weight", "lm_head"] and "wpe" not in shapes
    assert names.backward_param_order(LLAMA)[:3] == ["lm_head", "ln_f.weight", "h.1.mlp.c_proj.weight"]
    rng = np.random.default_rng(0)
    params = lambda: {n: rng.standard_normal(s) for n, s in shapes.items()}     # noqa: E731

    def write(path, bump=0.0):
        with TraceWriter(path, LLAMA, OPTIMIZER, "float64", {"framework": "test"}) as w:
            w.init(params())
            grads = params()
            grads["lm_head"][0, 0] += bump
            w.step(1, loss=2.5, lr=1e-3, grad_norm=1.5, grads=grads, params=params(),
                   acts={k: np.zeros((B, T, CFG["n_embd"])) for k in names.act_names(LLAMA)},
                   tokens=np.zeros((B, T + 1)))
        return path
    a = write(tmp_path / "a.h5")
    rng = np.random.default_rng(0)
    b = write(tmp_path / "b.h5", bump=1.0)
    with Reference(a) as ref:
        assert ref.config == LLAMA and list(ref.init()) == names.forward_param_order(LLAMA)
    status, _, _, summary = run(capsys, a, b)
    assert status == 1 and summary["first_divergence"] == "step_1/grad/lm_head"
    with pytest.raises(UserError, match="unknown parameter 'wpe'"):          # GPT-2's names refused
        with TraceWriter(tmp_path / "c.h5", LLAMA, OPTIMIZER, "float64", {}) as w:
            w.init(tensors(rng))
    assert not (tmp_path / "c.h5").exists() and not list(tmp_path.glob(".c.h5*"))      # nothing left behind
    with h5py.File(b, "r+") as f:
        f.attrs["config"] = json.dumps({k: v for k, v in LLAMA.items() if k != "n_kv_head"})
    assert "the 'config' attribute lacks n_kv_head" in one_line_error(capsys, a, b)
