"""`mpicube trace` and `mpicube compare` end to end, on real traces.

Every layout's trace equals the serial one in float64 (through `compare`,
so `compare` itself is tested on real traces); one altered element is
named as the first divergence; a deliberately wrong 3-D linear
(planted from outside by tests/planted_bug.py) is caught at the first
activation it touches;
the torch version of the same steps agrees when torch is available.
"""

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest
from conftest import MpiCube, last_json

from mpicube.files import data
from mpicube.check.names import computation_order
from mpicube.check.tolerance import DEFAULT_TOLERANCES

REPO = Path(__file__).resolve().parents[1]
STEPS = 3
CFG = {"vocab_size": 256, "n_ctx": 8, "n_layer": 2, "n_head": 4, "n_embd": 16}
MODEL = ["--n-layer", "2", "--n-head", "4", "--n-embd", "16", "--seq-len", "8", "--batch-size", "8",
         "--dtype", "float64", "--dropout", "0.1", "--seed", "5", "--warmup", "2"]
N_TENSORS = len(computation_order(CFG, STEPS))      # every name a full trace holds
CFG_ACTS = [n for n in computation_order(CFG, 1) if n.startswith("step_1/act/")]
GRADS = [n for n in computation_order(CFG, 1) if n.startswith("step_1/grad/")]


@pytest.fixture(scope="module")
def runner(tmp_path_factory, corpus_cache) -> MpiCube:
    runner = MpiCube(tmp_path_factory.mktemp("trace"), corpus_cache)
    runner.env["MPIEXEC_TIMEOUT"] = "240"      # 8 ranks on 2 cores start slowly
    return runner


@pytest.fixture(scope="module")
def serial_trace(runner) -> Path:
    r = runner.run("trace", "--layout", "serial", *MODEL, "--steps", STEPS, "--out", "serial.h5")
    assert r.returncode == 0, r
    assert f"wrote serial.h5: {STEPS} steps of serial" in r.stdout
    return runner.cwd / "serial.h5"


def compare(runner, a, b, *extra):
    r = runner.run("compare", a, b, "--json", *extra)
    return r, (last_json(r.stdout) if r.returncode in (0, 1) else None)


def test_serial_trace_holds_the_steps_it_ran(serial_trace, corpus_cache):
    """The file is what docs/trace-format.md says, and its tensors are the
    serial model's: the loader's batches, the initial parameters, and step
    1's loss, logits and gradients recomputed here in-process."""
    from mpi4py import MPI

    from mpicube.core.config import ModelConfig
    from mpicube.parallel.planning import resolve
    from mpicube.training.parts import Numerics
    from mpicube.training.train import build_parts

    with h5py.File(serial_trace, "r") as f:
        assert f.attrs["format"] == "mpicube-trace" and f.attrs["version"] == 4 and f.attrs["steps"] == STEPS
        assert json.loads(f.attrs["config"]) == CFG and f.attrs["dtype"] == "float64"
        assert json.loads(f.attrs["layout"])["layout"] == "serial"
        opt = json.loads(f.attrs["optimizer"])
        assert opt["betas"] == [0.9, 0.95] and opt["grad_clip"]["max_norm"] == 1.0
        assert "h.0.attn.c_attn.weight" in opt["decay"] and "wte" not in opt["decay"]
        assert opt["lr"]["values"] == [f[f"step_{s}/lr"][()] for s in range(1, STEPS + 1)]
        names = []
        f.visititems(lambda n, o: names.append(n) if isinstance(o, h5py.Dataset) else None)
        assert sorted(names) == sorted(computation_order(CFG, STEPS))

        tokens = f["tokens"][()]                                        # (N, B, T+1)
        assert tokens.shape == (STEPS, 8, 9) and tokens.dtype == np.int32
        loader = data.TrainLoader(data.read_shard(data.builtin_corpus(corpus_cache)[0]), 8, 8, 5)
        for s in range(STEPS):
            x, y = loader.batch(s)
            assert np.array_equal(tokens[s, :, :-1], x) and np.array_equal(tokens[s, :, 1:], y)

        masks = f["step_1/dropout/h.1.attn"][()]                         # (B, nh, T, T)
        assert masks.shape == (8, 4, 8, 8) and set(np.unique(masks)) == {0, 1}
        assert 0.85 < masks.mean() < 0.95                                # keep probability 0.9

        cfg = ModelConfig(**CFG)
        parts = build_parts(resolve("serial", cfg, 8, 1), MPI.COMM_SELF, Numerics("float64"), seed=5, dropout=0.1)
        for name, block in parts.store.data.items():
            assert np.array_equal(f[f"init/{name}"][()], block), name
        parts.store.zero_grad()
        x, y = tokens[0, :, :-1], tokens[0, :, 1:]
        loss = parts.model.forward(x, y, step=1)
        assert loss == f["step_1/loss"][()]
        assert np.array_equal(parts.model.logits, f["step_1/logits"][()])
        parts.model.backward()
        for name, grad in parts.store.grad.items():
            assert np.array_equal(f[f"step_1/grad/{name}"][()], grad), name


CASES = [
    # (ranks, layout, dp, depth)
    (4, "1d", 2, 1),
    (4, "2d", 1, 1),
    (8, "2.5d", 1, 2),
    (8, "3d", 1, 1),
]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("ranks,layout,dp,depth", CASES, ids=[f"{c[1]}-n{c[0]}-dp{c[2]}" for c in CASES])
def test_every_layout_traces_the_serial_steps(runner, serial_trace, ranks, layout, dp, depth):
    out = f"{layout}-{ranks}.h5"
    r = runner.run("trace", "--layout", layout, "--dp", dp, "--depth", depth, *MODEL, "--steps", STEPS,
                   "--out", out, n=ranks, timeout=240)
    assert r.returncode == 0, r
    r, summary = compare(runner, serial_trace, out)
    assert r.returncode == 0, r
    assert summary["first_divergence"] is None and summary["tensors"] == N_TENSORS
    assert summary["max_rel"] <= 1e-10
    assert "all tensors agree" in r.stdout


def test_an_honest_float32_trace_keeps_the_documented_depth_margin(runner, serial_trace):
    """The depth-aware bound (mpicube/check/tolerance.py) on a pair that
    differs by rounding only: the same serial steps in float32 and float64.
    Every activation, logit, loss, gradient and gradient norm of every step
    stays inside the bound with the margin the module states (at least
    DOCUMENTED_MARGIN; measured 10 at step 1's first MLP branch, up to
    thousands), so --tolerance depth passes everything up to the optimizer's
    update. The updated parameters are the documented exception (AdamW on
    gradients that are pure rounding noise), named here as the first
    divergence. A bound that shrank with depth (or grew too slowly) fails."""
    from mpicube.check.compare import compare_traces
    from mpicube.check.names import depth
    from mpicube.check.tolerance import DOCUMENTED_MARGIN

    args = [a if a != "float64" else "float32" for a in MODEL]
    r = runner.run("trace", "--layout", "serial", *args, "--steps", STEPS, "--out", "f32.h5")
    assert r.returncode == 0, r
    result = compare_traces(serial_trace, runner.cwd / "f32.h5", verdict="depth")
    sharp = [row for row in result.rows if row.compared and row.name.startswith("step_")
             and row.name.split("/")[1] in ("act", "grad", "logits", "loss", "grad_norm")]
    assert len(sharp) == STEPS * (len(CFG_ACTS) + len(GRADS) + 3), len(sharp)
    low = min(sharp, key=lambda row: row.margin)
    assert low.margin >= DOCUMENTED_MARGIN, (low.name, low.margin, low.rel_fro, low.bound)
    assert max(depth(row.name, CFG) for row in sharp) >= 30            # the bound grows over three steps
    assert result.first_divergence.split("/")[1] == "param", result.first_divergence


def test_the_activations_inside_a_block_are_recomputed_from_the_format(serial_trace):
    """Block 1 of step 1, recomputed here with NumPy from the trace's own
    inputs (its parameters at init, act/h.0 and the dropout masks) as
    docs/trace-format.md defines each tensor, independently of mpicube's
    trace collector: ln_1 (LayerNorm), attn (causal attention, the masks on
    the probabilities and on c_proj's output), ln_2 on the stream after the
    attention, mlp (tanh GELU). A collector that named one for another
    (ln_1 <-> ln_2) passes every serial-vs-layout comparison; not this."""
    p, eps = 0.1, 1e-5
    with h5py.File(serial_trace, "r") as f:
        w = {k: f[f"init/h.1.{k}"][()] for k in ("ln_1.weight", "ln_1.bias", "attn.c_attn.weight",
                                                   "attn.c_attn.bias", "attn.c_proj.weight", "attn.c_proj.bias",
                                                   "ln_2.weight", "ln_2.bias", "mlp.c_fc.weight", "mlp.c_fc.bias",
                                                   "mlp.c_proj.weight", "mlp.c_proj.bias")}
        s = f["step_1"]
        x = s["act/h.0"][()]                                                 # (B, T, h)
        keep_p, keep_a, keep_m = (s[f"dropout/h.1.{k}"][()].astype(np.float64)
                                  for k in ("attn", "resid_attn", "resid_mlp"))
        got = {k: s[f"act/h.1.{k}"][()] for k in ("ln_1", "attn", "ln_2", "mlp")}
        after = s["act/h.1"][()]                                             # (B, T, h)

    def layer_norm(v, g, b):                                                 # (B, T, h)
        mu, var = v.mean(-1, keepdims=True), v.var(-1, keepdims=True)
        return (v - mu) / np.sqrt(var + eps) * g + b

    B, T, h = x.shape
    nh = CFG["n_head"]
    want = {"ln_1": layer_norm(x, w["ln_1.weight"], w["ln_1.bias"])}
    qkv = want["ln_1"] @ w["attn.c_attn.weight"] + w["attn.c_attn.bias"]     # (B, T, 3h)
    q, k, v = (qkv[..., i * h:(i + 1) * h].reshape(B, T, nh, h // nh).transpose(0, 2, 1, 3) for i in range(3))
    scores = q @ k.transpose(0, 1, 3, 2) / np.sqrt(h // nh)                  # (B, nh, T, T)
    scores = np.where(np.tril(np.ones((T, T), dtype=bool)), scores, -np.inf)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs = probs / probs.sum(-1, keepdims=True) * keep_p / (1 - p)
    heads = (probs @ v).transpose(0, 2, 1, 3).reshape(B, T, h)              # (B, T, h)
    want["attn"] = (heads @ w["attn.c_proj.weight"] + w["attn.c_proj.bias"]) * keep_a / (1 - p)
    want["ln_2"] = layer_norm(x + want["attn"], w["ln_2.weight"], w["ln_2.bias"])
    u = want["ln_2"] @ w["mlp.c_fc.weight"] + w["mlp.c_fc.bias"]             # (B, T, 4h)
    gelu = 0.5 * u * (1 + np.tanh(np.sqrt(2 / np.pi) * (u + 0.044715 * u ** 3)))
    want["mlp"] = (gelu @ w["mlp.c_proj.weight"] + w["mlp.c_proj.bias"]) * keep_m / (1 - p)
    for name in ("ln_1", "attn", "ln_2", "mlp"):
        err = np.abs(got[name] - want[name]).max() / np.abs(want[name]).max()
        assert err < 1e-12, f"act/h.1.{name}: relative error {err:.2e}"
    assert np.abs(after - (x + want["attn"] + want["mlp"])).max() < 1e-12 * np.abs(after).max()


@pytest.mark.timeout(300)
def test_the_trainers_options_trace_the_serial_steps(runner, serial_trace):
    """The trace observes the trainer's own step, so what the trainer can
    do traces: 1-D 2 x dp 2 with --zero 3, two micro-batches and block
    recomputation follows the serial trace to 1e-10 (the micro-batches'
    activations land in their rows of the step's tensors)."""
    r = runner.run("trace", "--layout", "1d", "--dp", 2, "--zero", 3, "--grad-accum", 2, "--recompute", "blocks",
                   *MODEL, "--steps", STEPS, "--out", "options.h5", n=4, timeout=240)
    assert r.returncode == 0, r
    r, summary = compare(runner, serial_trace, "options.h5")
    assert r.returncode == 0, r
    assert summary["first_divergence"] is None and summary["tensors"] == N_TENSORS
    assert summary["max_rel"] <= 1e-10


def test_an_altered_element_is_the_first_divergence(runner, serial_trace):
    altered = runner.cwd / "altered.h5"
    shutil.copy(serial_trace, altered)
    with h5py.File(altered, "r+") as f:
        f["step_2/act/h.1"][3, 4, 5] += 1e-7
    r, summary = compare(runner, serial_trace, altered)
    assert r.returncode == 1, r
    assert summary["first_divergence"] == "step_2/act/h.1" and summary["tensors"] == N_TENSORS
    assert "1 outside tolerance" in r.stdout and "first divergence: step_2/act/h.1" in r.stdout
    r, summary = compare(runner, serial_trace, altered, "--atol", "1e-6")       # a looser tolerance
    assert r.returncode == 0 and summary["first_divergence"] is None, r


@pytest.mark.timeout(300)
def test_a_wrong_cube_axis_is_caught_at_the_first_activation_it_touches(runner, serial_trace):
    """tests/planted_bug.py makes block 1's c_fc reduce-scatter its output
    over j instead of k: same shapes, wrong sums. Everything before block 1's
    MLP agrees, its norm included; the MLP branch's output is the first
    divergence (inside the block, not just the block's output)."""
    cmd = runner.command("trace", "--layout", "3d", *MODEL, "--steps", 1, "--out", "wrong.h5", n=8)
    at = cmd.index("-m")
    cmd[at:at + 2] = [str(REPO / "tests" / "planted_bug.py"), "cube-axis=h.1.mlp.c_fc"]
    r = runner.run(cmd=cmd, timeout=240)
    assert r.returncode == 0, r
    r, summary = compare(runner, serial_trace, "wrong.h5")
    assert r.returncode == 1, r
    assert summary["first_divergence"] == "step_1/act/h.1.mlp"
    rows = {line.split()[0]: line for line in r.stdout.splitlines() if line.startswith("step_1/")}
    assert rows["step_1/act/h.1.ln_2"].endswith("yes") and rows["step_1/act/h.1.mlp"].endswith("NO")
    assert rows["step_1/act/h.1.attn"].endswith("yes") and rows["step_1/act/h.1"].endswith("NO")
    assert "only in A" in r.stdout                                      # steps 2 and 3


def test_compare_fails_on_tensors_present_in_one_trace_only_unless_allowed(runner, serial_trace):
    """Through the command line: a missing step and missing masks are a
    divergence (exit 1) naming the first, and --allow-missing patterns let
    a deliberate subset through."""
    partial = runner.cwd / "partial.h5"
    shutil.copy(serial_trace, partial)
    with h5py.File(partial, "r+") as f:
        del f["step_3"]
        del f["step_1/dropout"]
    r, summary = compare(runner, serial_trace, partial)
    assert r.returncode == 1, r
    assert summary["first_divergence"] == "step_1/dropout/emb"
    assert "step_3  " in r.stdout and "step 3 only in A (missing in B)" in r.stdout
    r, summary = compare(runner, serial_trace, partial, "--allow-missing", "step_1/dropout/*",
                         "--allow-missing", "step_3/*")
    assert r.returncode == 0, r
    n_dropout = 1 + 3 * CFG["n_layer"]
    n_step = len(computation_order(CFG, 1)) - len(computation_order(CFG, 0))
    assert summary["tensors"] == N_TENSORS - n_step - n_dropout
    assert f"{n_dropout + 1} missing but allowed" in r.stdout                # the masks and the step


def test_compare_refuses_what_is_not_a_comparable_trace(runner, serial_trace):
    (runner.cwd / "text.h5").write_text("not hdf5\n")
    with h5py.File(runner.cwd / "other.h5", "w") as f:
        f.attrs["format"] = "mpicube-checkpoint"
    small = ["--n-layer", "1", "--n-head", "2", "--n-embd", "8", "--seq-len", "8", "--batch-size", "2"]
    r = runner.run("trace", "--layout", "serial", *small, "--steps", 1, "--out", "small.h5")
    assert r.returncode == 0, r
    for other, message in [("missing.h5", "missing.h5: no such file"),
                           ("text.h5", "text.h5: not an HDF5 file"),
                           ("other.h5", "other.h5: not a trace (format 'mpicube-checkpoint'"),
                           ("small.h5", "different models: n_layer 2 vs 1, n_head 4 vs 2, n_embd 16 vs 8")]:
        r = runner.run("compare", serial_trace, other)
        assert r.returncode == 2, r
        assert len(r.error_lines()) == 1 and message in r.error_lines()[0], r
        assert "Traceback" not in r.stderr


def test_trace_refuses_a_trace_over_max_bytes_or_nowhere_to_write(runner):
    r = runner.run("trace", "--layout", "serial", *MODEL, "--out", "big.h5", "--max-bytes", "100K")
    assert r.returncode == 2 and len(r.error_lines()) == 1, r
    assert "more than --max-bytes" in r.stderr and not (runner.cwd / "big.h5").exists()
    r = runner.run("trace", "--layout", "serial", *MODEL, "--out", "no/such/dir/t.h5")
    assert r.returncode == 2 and r.error_lines() == ["error: --out no/such/dir/t.h5: directory no/such/dir "
                                                     "does not exist"], r
    r = runner.run("trace", "--layout", "serial", *MODEL, "--out", "x.h5", "--max-bytes", "lots")
    assert r.returncode == 2 and "is not a size" in r.stderr, r


def test_compare_help_states_the_default_tolerances(runner):
    r = runner.run("compare", "--help")
    assert r.returncode == 0, r
    text = " ".join(r.stdout.split())
    for dtype, tolerances in DEFAULT_TOLERANCES.items():
        for value in tolerances:                                        # 1e-10, 1e-3, ... as the help writes them
            said = f"{value:.0e}".replace("e-0", "e-")
            assert f"{said} {dtype}" in text or f"{said} float16/{dtype}" in text, (dtype, said, text)


# --------------------------------------------------------------------------- torch


def torch_python():
    """A Python that has torch and h5py: this one, or MPICUBE_TORCH_PYTHON."""
    if importlib.util.find_spec("torch") is not None:
        return sys.executable
    return os.environ.get("MPICUBE_TORCH_PYTHON")


@pytest.mark.timeout(300)
def test_torch_trace_agrees_with_mpicube(runner, serial_trace):
    """tools/torch_trace.py (modules, autograd, torch.optim.AdamW, clipping,
    the trace's dropout masks, recorded by mpicube.check.torch through the
    nanoGPT name map) follows mpicube's serial trace to float64 rounding,
    and every gradient is within the depth-aware bound."""
    python = torch_python()
    if python is None:
        pytest.skip("torch is not installed (optional, for tools/torch_trace.py only: pip install torch, "
                    "or set MPICUBE_TORCH_PYTHON to a Python that has torch and h5py)")
    out = runner.cwd / "torch.h5"
    env = {**os.environ, "PYTHONPATH": str(REPO)}                    # mpicube.check, from this checkout
    proc = subprocess.run([python, str(REPO / "tools" / "torch_trace.py"), str(serial_trace), "--out", str(out)],
                          capture_output=True, text=True, timeout=240, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    r, summary = compare(runner, serial_trace, out)
    assert r.returncode == 0, r
    assert summary["first_divergence"] is None and summary["tensors"] == N_TENSORS
    assert summary["max_rel"] <= 1e-10
    r = runner.run("compare", serial_trace, out, "--tolerance", "depth")
    beyond = [line.split()[0] for line in r.stdout.splitlines() if line.endswith(" NO")]
    assert all("/param/" in name for name in beyond), r.stdout      # AdamW's rounding-noise caveat only


LLAMA = ["--arch", "llama", "--n-layer", "2", "--n-head", "4", "--n-kv-head", "2", "--n-embd", "16",
         "--ffn-hidden", "24", "--seq-len", "8", "--batch-size", "4", "--dtype", "float64", "--dropout", "0.1",
         "--seed", "5", "--warmup", "2", "--steps", "2"]
LLAMA_CFG = {"vocab_size": 256, "n_ctx": 8, "n_layer": 2, "n_head": 4, "n_embd": 16, "arch": "llama",
             "n_kv_head": 2, "ffn_hidden": 24, "rope_theta": 10000.0, "rms_eps": 1e-6, "tie_embeddings": False}


@pytest.mark.timeout(300)
def test_llama_traces_under_llama_names_and_torch_agrees(runner):
    """A Llama trace (grouped-query attention 4 heads on 2 kv heads, an
    untied lm_head, no biases, dropout) holds every Llama tensor in
    computation order, 1-D tp 2 with sequence parallelism traces the same
    steps, and tools/torch_trace.py's plain-torch Llama (rotate_half,
    repeated kv heads, SwiGLU, RMSNorm) recorded through the hf_llama map
    agrees with it to float64 rounding (skipped without torch)."""
    r = runner.run("trace", "--layout", "serial", *LLAMA, "--out", "llama.h5")
    assert r.returncode == 0, r
    with h5py.File(runner.cwd / "llama.h5", "r") as f:
        assert json.loads(f.attrs["config"]) == LLAMA_CFG
        names = []
        f.visititems(lambda n, o: names.append(n) if isinstance(o, h5py.Dataset) else None)
        assert sorted(names) == sorted(computation_order(LLAMA_CFG, 2))
        assert f["init/h.0.attn.c_attn.weight"].shape == (16, 32) and f["init/lm_head"].shape == (256, 16)
        assert "init/wpe" not in f and "init/h.0.ln_1.bias" not in f
    r = runner.run("trace", "--layout", "1d", "--sequence-parallel", *LLAMA, "--out", "llama-tp.h5", n=2)
    assert r.returncode == 0, r
    r, summary = compare(runner, "llama.h5", "llama-tp.h5")
    assert r.returncode == 0 and summary["tensors"] == len(computation_order(LLAMA_CFG, 2)), r
    python = torch_python()
    if python is None:
        pytest.skip("torch is not installed (optional: pip install torch, or set MPICUBE_TORCH_PYTHON)")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run([python, str(REPO / "tools" / "torch_trace.py"), "llama.h5", "--out", "torch-llama.h5"],
                          capture_output=True, text=True, timeout=240, env=env, cwd=runner.cwd)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    r, summary = compare(runner, "llama.h5", "torch-llama.h5")
    assert r.returncode == 0, r
    assert summary["tensors"] == len(computation_order(LLAMA_CFG, 2)) and summary["max_rel"] <= 1e-12


@pytest.mark.timeout(600)
@pytest.mark.skipif(os.environ.get("MPICUBE_TEST_27") != "1",
                    reason="27 ranks take minutes on 2 cores: set MPICUBE_TEST_27=1 to run")
def test_27_rank_cube_traces_the_serial_steps(runner, serial_trace):
    model = [a for a in MODEL]
    model[model.index("--batch-size") + 1] = "9"
    model[model.index("--n-embd") + 1] = "18"
    model[model.index("--n-head") + 1] = "3"
    r = runner.run("trace", "--layout", "serial", *model, "--steps", STEPS, "--out", "s9.h5")
    assert r.returncode == 0, r
    r = runner.run("trace", "--layout", "3d", *model, "--steps", STEPS, "--out", "c27.h5", n=27, timeout=500)
    assert r.returncode == 0, r
    r, summary = compare(runner, "s9.h5", "c27.h5")
    assert r.returncode == 0 and summary["max_rel"] <= 1e-10, r


def test_teaching_doc_quotes_lines_the_layouts_still_have():
    """docs/tensor-parallelism.md ties each step to `file` · `function` ·
    `a line of it`; a refactor that moves the line must update the page."""
    import re

    text = (REPO / "docs" / "tensor-parallelism.md").read_text()
    quotes = re.findall(r"`(\w+\.py)` · `([\w.]+)` · `([^`]+)`", text)
    assert len(quotes) >= 20
    for filename, function, line in quotes:
        path = REPO / "mpicube" / "parallel" / ("layouts" if filename != "gradients.py" else "") / filename
        source = path.read_text()
        assert f"def {function.split('.')[-1]}(" in source, (filename, function)
        assert line in source, (filename, function, line)
    for picture in re.findall(r"\]\((tp/[\w.]+\.png)\)", text):
        assert (REPO / "docs" / picture).is_file(), picture


def test_trace_starts_from_a_checkpoint(runner):
    """--init-from: the trace's init/ are exactly the checkpoint's parameters."""
    small = ["--n-layer", "1", "--n-head", "2", "--n-embd", "8", "--seq-len", "8", "--batch-size", "2",
             "--dtype", "float64"]
    r = runner.run("train", "--layout", "serial", *small, "--steps", "2", "--out", "run")
    assert r.returncode == 0, r
    r = runner.run("trace", "--layout", "serial", *small, "--steps", 1, "--init-from", "run", "--out", "from.h5")
    assert r.returncode == 0, r
    from mpicube.files import checkpoint

    with checkpoint.open_checkpoint(runner.cwd / "run") as ck, h5py.File(runner.cwd / "from.h5", "r") as f:
        names = [n[len("model/"):] for n in ck.names() if n.startswith("model/")]
        assert sorted(names) == sorted(f["init"])
        for name in names:
            assert np.array_equal(ck.read(f"model/{name}"), f[f"init/{name}"][()]), name
