"""The catalogue of planted bugs (issue 35 item 7), in mpicube's own code
path: each real class of parallel-training bug, planted from outside the
package by tests/planted_bug.py, is named by `compare` against the serial
trace at the first tensor it makes wrong - also where the loss still
agrees, and with the ranks whose replicas part where the bug leaves
replicated copies different, or with the axis of a pending sum
consumed as replicated (issue 47: the placements of a sharded trace).
Issue 45's FP8 bugs (an amax per shard, the scale inverted, gradients
in e4m3 where the recipe says e5m2) are traced with --fp8 tensorwise, a
block straddling a shard with --fp8 mxfp8 (the layout's refusal bypassed
by the plant), and named at the scale or the FP8 bytes they spoil (trace --fp8 orders a
linear's operands before what its GEMM makes). Issue 47's state bugs (moments dropped, the loss scale reset, a replica
skipping its update, gradients never applied, mixed precision off) are
traced with --state over two steps and named at the state tensor or the
step they spoil. Issue 43's DeepSeek-V3 bugs (k_pe's gradient not summed
over tp, expert gradients doubled under --ep, the router bias updated
from one rank's loads or with the wrong sign) are named at kv_down's
gradient (its rotary key's columns), the last expert's and the bias
update of the step.

All the bugs' traces come from one 2-rank launch (tests/planted_check.py
plants each bug, traces one or two steps of a tiny model, and takes it out
again); the references are serial traces (REFERENCES). The same bugs planted in a PyTorch DTensor model are in
tests/test_check_dtensor.py.
"""

import json

import h5py
import numpy as np
import pytest
from conftest import MpiCube

from test_trace import REPO

from mpicube.check.compare import compare_traces
from mpicube.check.names import computation_order, config_of
from mpicube.files import data

MODEL = ["--n-layer", "2", "--n-head", "4", "--n-embd", "16", "--seq-len", "8", "--batch-size", "8",
         "--dtype", "float64", "--dropout", "0.1", "--seed", "5", "--warmup", "2", "--steps", "1"]

STATE = ["--steps", "2", "--state"]                     # two steps, with the training state
F16 = ["--dtype", "float16", "--loss-scale", "1024", "--loss-scale-growth-interval", "1"]   # the scale grows each step
# issue 43's DeepSeek-V3: MLA with a q rank, the first block dense, then 8 routed experts in 4 groups (top 2 in 2),
# a shared expert and the aux-loss-free bias update; no dropout
DS = ["--arch", "deepseek_v3", "--dropout", "0", "--n-routed-experts", "8", "--top-k", "2", "--n-groups", "4",
      "--topk-groups", "2", "--moe-ffn-hidden", "8", "--n-shared-experts", "1", "--first-k-dense", "1",
      "--bias-update-rate", "0.01", "--kv-lora-rank", "8", "--q-lora-rank", "8", "--qk-rope-head-dim", "4",
      "--qk-nope-head-dim", "4", "--v-head-dim", "4"]
REFERENCES = {"ref.h5": [], "ref257.h5": ["--vocab-size", "257"], "state.h5": STATE, "state16.h5": STATE + F16,
              "bf16.h5": ["--dtype", "bfloat16"], "fp8.h5": ["--fp8", "tensorwise"], "ds.h5": DS,
              "mtp.h5": ["--arch", "deepseek_v3", "--mtp-depth", "1"]}
FP8 = ["--fp8", "tensorwise"]
MX = ["--fp8", "mxfp8", "--fp8-block", "16", "--seq-len", "16"]      # (the reference: in this process, mx_reference)

# bug, reference, layout options, the first divergence, rows that must still agree, a note its row must hold
CATALOGUE = [
    ("sp-grad", "ref.h5", ["--layout", "1d", "--sequence-parallel"], "step_1/grad/ln_f.weight",
     ["step_1/loss", "step_1/logits"], "replicas part: ranks 0 and 1"),
    ("scale=dp", "ref.h5", ["--layout", "1d", "--dp", "2"], "step_1/grad/ln_f.weight", ["step_1/loss"], ""),
    ("scale=cp", "ref.h5", ["--layout", "1d", "--cp", "2"], "step_1/grad/ln_f.weight", ["step_1/loss"], ""),
    ("norm-replicas", "ref.h5", ["--layout", "1d"], "step_1/grad_norm",
     ["step_1/loss", "step_1/grad/wte", "step_1/grad/h.0.ln_1.weight"], ""),
    ("tied-order", "ref.h5", ["--layout", "1d", "--pp", "2"], "step_1/grad/wte",
     ["step_1/loss", "step_1/grad/wpe"], "replicas part: ranks 0 and 1"),
    ("qkv-split", "ref.h5", ["--layout", "1d"], "step_1/act/h.0.attn",
     ["init/h.0.attn.c_attn.weight", "step_1/act/h.0.ln_1"], ""),
    ("dropout-rank", "ref.h5", ["--layout", "1d", "--dp", "2"], "step_1/dropout/emb", ["tokens"], ""),
    ("dp-partial=h.1.mlp.c_fc.weight", "ref.h5", ["--layout", "1d", "--dp", "2"], "step_1/grad/h.1.mlp.c_fc.weight",
     ["step_1/loss", "step_1/grad/h.1.mlp.c_proj.weight"],
     "a pending sum over dp consumed as replicated: ranks 0, 1 hold parts whose sum over dp"),
    ("moments-dropped=2", "state.h5", ["--layout", "1d", *STATE], "step_2/state/exp_avg/wte",
     ["step_1/state/exp_avg/wte", "step_2/loss", "step_2/grad/wte"], ""),
    ("loss-scale-reset=2", "state16.h5", ["--layout", "1d", *STATE, *F16], "step_2/state/loss_scale",
     ["step_1/state/loss_scale", "step_2/loss"], ""),
    ("replica-skip=2", "state.h5", ["--layout", "1d", "--dp", "2", *STATE], "step_2/state/exp_avg/wte",
     ["step_1/param/wte", "step_2/loss"], "replicas part: ranks 0 and 1"),
    ("grads-unapplied", "ref.h5", ["--layout", "1d"], "step_1/param/wte", ["step_1/loss", "step_1/grad/wte"],
     "B: wte is exactly what it was before step 1: its update was not applied"),
    ("precision-off", "bf16.h5", ["--layout", "1d", "--dtype", "bfloat16"], "step_1/act/emb", ["tokens", "init/wte"],
     "B: a bfloat16 trace whose activations and logits of this step all lie off the bfloat16 grid"),
    ("vocab-pad", "ref257.h5", ["--layout", "1d", "--vocab-size", "257"], "step_1/loss", ["step_1/logits"], ""),
    # issue 43: named where each starts, the loss of the step agreeing
    ("kpe-grad-tp", "ds.h5", [*DS, "--layout", "1d"], "step_1/grad/h.1.attn.kv_down.weight",
     ["step_1/loss", "step_1/grad/h.1.attn.kv_up.weight", "step_1/grad/h.1.attn.q_down.weight",
      "step_1/moe/h.1.bias_update"],
     "only the rotary key's columns differ ([8:], k_pe"),
    ("ep-grad-doubled", "ds.h5", [*DS, "--layout", "1d", "--dp", "2", "--ep", "2"],
     "step_1/grad/h.1.moe.experts.7.c_proj.weight",
     ["step_1/loss", "step_1/moe/h.1.experts", "step_1/grad/h.1.moe.shared.c_proj.weight",
      "step_1/moe/h.1.bias_update"], ""),
    ("bias-local-loads", "ds.h5", [*DS, "--layout", "1d", "--dp", "2", "--grad-accum", "2"],
     "step_1/moe/h.1.bias_update", ["step_1/loss", "step_1/moe/h.1.bias", "step_1/param/h.1.moe.router.weight"],
     "replicas part: ranks 0 and 1"),
    ("bias-sign", "ds.h5", [*DS, "--layout", "1d"], "step_1/moe/h.1.bias_update",
     ["step_1/loss", "step_1/moe/h.1.scores", "step_1/grad/h.1.moe.router.weight"], "B is A negated"),
    # issue 45's FP8 bugs, named at step 1 at the scale or FP8 bytes they spoil, before any activation moves
    ("fp8-amax-shard", "fp8.h5", ["--layout", "1d", *FP8], "step_1/fp8/h.0.attn.c_attn/w.forward/scale",
     ["step_1/act/h.0.ln_1", "step_1/fp8/h.0.attn.c_attn/x.forward/scale"], "replicas part: ranks 0 and 1"),
    ("fp8-scale-inverted", "fp8.h5", ["--layout", "1d", *FP8], "step_1/fp8/h.0.attn.c_attn/x.forward/bytes",
     ["step_1/fp8/h.0.attn.c_attn/x.forward/scale", "step_1/fp8/h.0.attn.c_attn/w.forward/scale"],
     "first differs at"),
    ("fp8-grad-e4m3", "fp8.h5", ["--layout", "1d", *FP8], "step_1/fp8/h.1.mlp.c_proj/dy.dgrad/scale",
     ["step_1/loss", "step_1/grad/ln_f.weight", "step_1/fp8/h.1.mlp.c_proj/w.forward/bytes"], ""),
    # a 16-wide MX block cut by 1-D's row split of the attention's output projection (8 columns a rank): the
    # scale of its input x, each rank's from its own half (its W^T's blocks straddle too, after it); the
    # linear before it agrees
    ("fp8-block-straddle", "fp8mx.h5", ["--layout", "1d", *MX], "step_1/fp8/h.0.attn.c_proj/x.forward/scale",
     ["step_1/fp8/h.0.attn.c_attn/x.forward/bytes", "step_1/fp8/h.0.attn.c_attn/w.forward/bytes"],
     "replicas part: ranks 0 and 1"),
    # issue 43: DeepSeek-V3's MTP depth normalised by this rank's tokens (Megatron #2417): named at the depth's
    # loss, its block's activations (h.2) and the main loss still agreeing
    ("mtp-local", "mtp.h5", ["--arch", "deepseek_v3", "--mtp-depth", "1", "--layout", "1d", "--dp", "2"],
     "step_1/mtp/loss_1", ["step_1/act/h.2", "step_1/logits", "step_1/mtp/main_loss"], ""),
]


# issue 47's envelope demonstration (docs/trace-format.md, "Measured tolerances"): bfloat16 candidates on 2 ranks
BF16_CANDIDATES = [("none", "bf16-good.h5"), ("grad-error=h.1.mlp.c_fc.weight", "bf16-grad.h5")]
# and under FP8 (float32 master weights, tensorwise scales), two steps so that step 2's weight codes come from
# rounded updates; the envelope of the serial reference is measured in this process (no launch of its own)
FP8 = ["--dtype", "float32", "--fp8", "tensorwise", "--steps", "2", "--dropout", "0"]
FP8_CANDIDATES = [("none", "fp8-good.h5"), ("grad-error=h.1.mlp.c_fc.weight", "fp8-grad.h5")]


def fp8_envelope(out, corpus) -> None:
    """``mpicube trace --layout serial MODEL FP8 --envelope 2 --out OUT``
    run in this process on one rank (MPI.COMM_SELF)."""
    from mpi4py import MPI

    from mpicube.analysis.envelope import run_envelope
    from mpicube.cli.common import env_settings
    from mpicube.cli.train import trace_command

    argv = ["--layout", "serial", *MODEL, *FP8, "--data", str(corpus), "--envelope", "2", "--out", str(out)]
    options = trace_command.make_context("trace", argv).params
    run_envelope({**options, **env_settings()}, MPI.COMM_SELF, say=lambda *a, **k: None)


def mx_reference(out, corpus) -> None:
    """``mpicube trace --layout serial MODEL MX --out OUT`` run in this
    process on one rank (MPI.COMM_SELF): the block-straddle plant's
    serial reference, without a launch of its own."""
    from mpi4py import MPI

    from mpicube.analysis.trace import run_trace
    from mpicube.cli.common import env_settings
    from mpicube.cli.train import trace_command

    argv = ["--layout", "serial", *MODEL, *MX, "--data", str(corpus), "--out", str(out)]
    options = trace_command.make_context("trace", argv).params
    run_trace({**options, **env_settings()}, MPI.COMM_SELF, say=lambda *a, **k: None)


@pytest.fixture(scope="module")
def runner(tmp_path_factory, corpus_cache) -> MpiCube:
    """The serial references, then every bug's trace from one 2-rank
    launch (tests/planted_check.py)."""
    runner = MpiCube(tmp_path_factory.mktemp("planted"), corpus_cache)
    runner.env["MPIEXEC_TIMEOUT"] = "240"
    for out, extra in REFERENCES.items():
        r = runner.run("trace", "--layout", "serial", *MODEL, *extra, "--out", out)
        assert r.returncode == 0, r
    r = runner.run("trace", "--layout", "serial", *MODEL, "--dtype", "bfloat16", "--envelope", "4", "--out",
                   "envelope.h5")
    assert r.returncode == 0 and "envelope of 4 bfloat16 reruns" in r.stdout, r
    corpus = data.builtin_corpus(corpus_cache)[0]
    fp8_envelope(runner.cwd / "fp8-envelope.h5", corpus)
    mx_reference(runner.cwd / "fp8mx.h5", corpus)
    cases = json.dumps([[bug, [*MODEL, *options, "--sharded"]] for bug, _, options, *_ in CATALOGUE]
                       + [[bug, [*MODEL, "--layout", "1d", "--dtype", "bfloat16"], out]
                          for bug, out in BF16_CANDIDATES]
                       + [[bug, [*MODEL, "--layout", "1d", *FP8, "--data", str(corpus)], out]
                          for bug, out in FP8_CANDIDATES])
    cmd = runner.command("trace", n=2)
    at = cmd.index("-m")
    cmd[at:] = [str(REPO / "tests" / "planted_check.py"), str(runner.cwd), cases]
    r = runner.run(cmd=cmd, timeout=280)
    assert r.returncode == 0, r
    return runner


@pytest.mark.timeout(300)
@pytest.mark.parametrize("bug,ref,options,first,agree,note", CATALOGUE, ids=[c[0] for c in CATALOGUE])
def test_a_planted_bug_is_named_at_the_first_tensor_it_spoils(runner, bug, ref, options, first, agree, note):
    result = compare_traces(runner.cwd / ref, runner.cwd / (bug.replace("=", "-") + ".h5"))
    assert result.first_divergence == first, [(r.name, r.note) for r in result.rows if not r.ok][:3]
    rows = {r.name: r for r in result.rows}
    assert all(rows[name].ok for name in agree), [(n, rows[n].max_rel) for n in agree]
    assert note in rows[first].note, rows[first].note


@pytest.mark.timeout(300)
def test_the_envelope_passes_a_bf16_candidate_and_fails_a_1_percent_gradient_error(runner):
    """The serial float64 reference with the envelope of 4 bfloat16 reruns:
    a correct 2-rank bfloat16 candidate passes it; the same with
    h.1.mlp.c_fc's gradient 1% too large fails it there, and passes the
    depth bound."""
    ref = runner.cwd / "envelope.h5"
    good = compare_traces(ref, runner.cwd / "bf16-good.h5", verdict="envelope")
    assert good.first_divergence is None, [(r.name, r.note) for r in good.rows if not r.ok][:3]
    bad = compare_traces(ref, runner.cwd / "bf16-grad.h5", verdict="envelope")
    assert bad.first_divergence == "step_1/grad/h.1.mlp.c_fc.weight", [(r.name, r.note) for r in bad.rows if not r.ok]
    row = next(r for r in bad.rows if r.name == bad.first_divergence)
    assert "a systematic error along the tensor" in row.note, row.note
    assert compare_traces(ref, runner.cwd / "bf16-grad.h5", verdict="depth").first_divergence is None


def test_a_deepseek_trace_holds_the_sigmoid_router_as_documented(runner):
    """The serial DeepSeek-V3 reference (docs/trace-format.md, "DeepSeek-V3"):
    every name of the format in computation order (block 0 dense, block 1
    a mixture with a shared expert); per token the scores are the
    sigmoid of the logits, the experts the top 2 of score + bias among the
    2 of 4 groups with the best two-expert sums, their weights the scores
    renormalised (--routed-scaling-factor 1); the bias update is 0.01 sign(mean load - load)
    over the step's tokens."""
    with h5py.File(runner.cwd / "ds.h5", "r") as f:
        cfg = config_of(json.loads(f.attrs["config"]))
        names = []
        f.visititems(lambda n, o: names.append(n) if isinstance(o, h5py.Dataset) else None)
        assert sorted(names) == sorted(n for n in computation_order(cfg, 1) if "/dropout/" not in n)   # none
        assert "init/h.0.mlp.c_fc.weight" in names and f["init/h.1.moe.shared.c_fc.weight"].shape == (16, 16)
        g = f["step_1/moe"]
        logits, scores, bias = g["h.1.logits"][()], g["h.1.scores"][()], g["h.1.bias"][()]   # (B, T, E), (E,)
        chosen, weights = g["h.1.experts"][()].astype(np.int64), g["h.1.weights"][()]        # (B, T, K)
        update = g["h.1.bias_update"][()]                                                     # (E,)
    assert np.abs(scores - 1 / (1 + np.exp(-logits))).max() <= 1e-15 and not bias.any()      # step 1: no update yet
    biased = (scores + bias).reshape(-1, 4, 2)                                               # (n, groups, 2)
    best = np.argsort(-biased.sum(axis=-1), axis=-1, kind="stable")[:, :2]                  # (n, 2) kept groups
    kept = np.full(biased.shape, -np.inf)
    np.put_along_axis(kept, best[..., None], np.take_along_axis(biased, best[..., None], axis=1), axis=1)
    want = np.argsort(-kept.reshape(-1, 8), axis=-1, kind="stable")[:, :2]                  # (n, 2)
    assert np.array_equal(chosen.reshape(-1, 2), want)
    top = np.take_along_axis(scores, chosen, axis=-1)
    assert cfg["routed_scaling_factor"] == 1.0
    assert np.abs(weights - top / top.sum(axis=-1, keepdims=True)).max() <= 1e-14
    load = np.bincount(chosen.ravel(), minlength=8)
    assert np.array_equal(update, 0.01 * np.sign(load.mean() - load)) and update.any()


def test_a_deepseek_mtp_trace_orders_the_depths_as_documented(runner):
    """The serial --mtp-depth 1 reference (docs/trace-format.md,
    "DeepSeek-V3"): every name it holds is one of the format's, in the
    format's shapes; the depth's block h.2 and mtp.0.* follow the head
    among the parameters, its block's records follow the main logits,
    and its gradients come first in backward (the head with it, the
    main model's ln_f after), which is the order compare reads in."""
    from mpicube.check.names import ordered, param_shapes

    with h5py.File(runner.cwd / "mtp.h5", "r") as f:
        cfg = config_of(json.loads(f.attrs["config"]))
        held = []
        f.visititems(lambda n, o: held.append(n) if isinstance(o, h5py.Dataset) else None)
        shapes = {n: f[n].shape for n in held}
    assert cfg["mtp_depth"] == 1 and cfg["n_layer"] == 2
    order = computation_order(cfg, 1)
    assert ordered(held, cfg) == [n for n in order if n in set(held)] and set(held) <= set(order)
    params = list(param_shapes(cfg))
    assert sorted(n[5:] for n in held if n.startswith("init/")) == sorted(params)
    assert params[params.index("lm_head") + 1:params.index("lm_head") + 2] == ["h.2.ln_1.weight"]
    assert params[-4:] == ["mtp.0.enorm.weight", "mtp.0.hnorm.weight", "mtp.0.proj.weight", "mtp.0.ln_f.weight"]
    assert all(shapes[f"init/{n}"] == s and shapes[f"step_1/grad/{n}"] == s for n, s in param_shapes(cfg).items())
    step = [n[7:] for n in ordered(held, cfg) if n.startswith("step_1/")]
    assert step.index("logits") < step.index("act/h.2.ln_1") < step.index("act/h.2") < step.index("mtp/loss_1")
    grads = [n[5:] for n in step if n.startswith("grad/")]
    assert grads[:3] == ["lm_head", "mtp.0.ln_f.weight", "h.2.mlp.c_proj.weight"]
    assert grads[grads.index("h.2.ln_1.weight") + 1:grads.index("ln_f.weight") + 1] == \
        ["mtp.0.proj.weight", "mtp.0.enorm.weight", "mtp.0.hnorm.weight", "ln_f.weight"]


@pytest.mark.timeout(300)
def test_the_envelope_of_an_fp8_reference_passes_an_fp8_candidate_and_fails_a_1_percent_gradient_error(runner):
    """--fp8 tensorwise, float32 master weights: the envelope varies the
    attention's order only (its scales follow the micro-batch) and floors
    each bound at u depth; a correct 2-rank candidate passes it over
    two steps, its FP8 weight codes included, and the 1% gradient error
    fails it at the gradient (at float32 by its size alone: the floor,
    u depth, is about 1e-6)."""
    import h5py

    ref = runner.cwd / "fp8-envelope.h5"
    with h5py.File(ref, "r") as f:
        env = json.loads(f.attrs["envelope"])
        assert env["fp8"] == "tensorwise" and env["runs"] == 2 and env["dtype"] == "float32"
        assert [o["grad_accum"] for o in env["orders"]] == [1, 1]
        assert any("/fp8/" in name for name in env["tensors"])            # the scales are measured too
    good = compare_traces(ref, runner.cwd / "fp8-good.h5", verdict="envelope")
    assert good.first_divergence is None, [(r.name, r.note) for r in good.rows if not r.ok][:3]
    assert sum(r.compared and r.name.endswith("/bytes") for r in good.rows) > 0
    bad = compare_traces(ref, runner.cwd / "fp8-grad.h5", verdict="envelope")
    assert bad.first_divergence == "step_1/grad/h.1.mlp.c_fc.weight", [(r.name, r.note) for r in bad.rows if not r.ok]
    row = next(r for r in bad.rows if r.name == bad.first_divergence)
    assert "> 4 x envelope" in row.note and row.rel_fro > 1000 * row.bound, row.note   # float32: its size alone
