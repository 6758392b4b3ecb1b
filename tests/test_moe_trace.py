"""Traces of a mixture of experts (issue 34 item 6) and `compare` on them.

A Mixtral trace holds, per MoE layer, the router's logits, the chosen
experts (int32) and their weights, every expert's gradients, and per step
the load-balancing and z-losses (docs/trace-format.md). Expert parallelism
(1-D tp 2 x dp 2 x ep 2, capacity dispatch, written --sharded) and 2-D x
ep 2 and pp 2 x dp 2 x ep 2 (the last stage's head an untied lm_head), and
1-D x cp 2 x ep 2 under --sequence-parallel and --recompute gathers (the
router's decisions on the gathered rows), and dp 4 x ep 2 under --zero 0
(each expert's gradient summed by the plain all-reduce over an
expert-data group of 2: the one --zero 0 case with ep < dp, where a sum
taken as a mean halves the experts' gradients and nothing else), trace the serial steps to
float64 rounding; a detached load-balancing
loss (planted from outside by tests/planted_bug.py) is named at the
router's gradient while the loss and every activation still agree; a
routing that parts is named at its first token.

Three launches (tests/planted_check.py runs several traces in one): the
two serial references, one 4-rank launch (the capacity trace, the
planted bug, the pipeline, sequence parallelism and dp 4 x ep 2), one 8-rank 2-D launch.
"""

import json
import shutil

import h5py
import numpy as np
import pytest
from conftest import MpiCube

from test_trace import REPO

from mpicube.check.compare import compare_traces
from mpicube.check.names import computation_order, config_of

MODEL = ["--arch", "mixtral", "--n-experts", "4", "--top-k", "2", "--n-layer", "2", "--n-head", "4",
         "--n-kv-head", "2", "--n-embd", "16", "--ffn-hidden", "24", "--seq-len", "8", "--batch-size", "4",
         "--dtype", "float64", "--dropout", "0.1", "--seed", "5", "--warmup", "2", "--steps", "2",
         "--router-z-loss-coef", "0.01"]
CAP = ["--capacity-factor", "1.0"]
EP = ["--layout", "1d", "--dp", "2", "--ep", "2"]


@pytest.fixture(scope="module")
def traces(tmp_path_factory, corpus_cache):
    runner = MpiCube(tmp_path_factory.mktemp("moetrace"), corpus_cache)
    runner.env["MPIEXEC_TIMEOUT"] = "240"

    def launch(n, cases):
        cmd = runner.command("trace", n=n)
        at = cmd.index("-m")
        cmd[at:] = [str(REPO / "tests" / "planted_check.py"), str(runner.cwd), json.dumps(cases)]
        r = runner.run(cmd=cmd, timeout=280)
        assert r.returncode == 0, r

    serial = ["--layout", "serial", *MODEL]
    launch(1, [["none", serial, "serial.h5"], ["none", serial + CAP, "serial-cap.h5"]])
    launch(4, [["none", EP + MODEL + CAP + ["--sharded"], "ep2-cap.h5"],
               ["router-aux-grad", EP + MODEL, "router-aux-grad.h5"],
               ["none", ["--layout", "serial", "--pp", "2", "--dp", "2", "--ep", "2", *MODEL], "pp2-ep2.h5"],
               ["none", ["--layout", "1d", "--cp", "2", "--ep", "2", "--sequence-parallel", "--recompute", "gathers",
                         *MODEL, *CAP], "sp-cp2-ep2-cap.h5"],
               ["none", ["--layout", "serial", "--dp", "4", "--ep", "2", *MODEL], "dp4-ep2.h5"]])
    launch(8, [["none", ["--layout", "2d", "--dp", "2", "--ep", "2", *MODEL], "2d-ep2.h5"]])
    return runner.cwd


def _softmax(x):
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


@pytest.mark.timeout(300)
def test_mixtral_trace_holds_the_router_and_its_losses_as_documented(traces):
    """Every name of the format in computation order; the chosen experts
    and weights are the top-2 of the recorded logits (ties to the lower
    index) renormalised; aux and z recomputed from the logits equal the
    recorded ones, and the step's loss is the logits' cross-entropy plus
    0.02 aux + 0.01 z."""
    with h5py.File(traces / "serial.h5", "r") as f:
        cfg = config_of(json.loads(f.attrs["config"]))
        assert cfg["n_experts"] == 4 and cfg["top_k"] == 2
        names = []
        f.visititems(lambda n, o: names.append(n) if isinstance(o, h5py.Dataset) else None)
        assert sorted(names) == sorted(computation_order(cfg, 2))
        assert f["init/h.1.moe.experts.3.c_fc.weight"].shape == (16, 48)
        assert f["step_1/grad/h.0.moe.router.weight"].shape == (16, 4)
        tokens = f["tokens"][()]                                               # (N, B, T+1)
        for s in (1, 2):
            g = f[f"step_{s}"]
            counts, sums, z, L, N = np.zeros(4), np.zeros(4), 0.0, 2, 4 * 8
            for i in range(2):
                logits = g[f"moe/h.{i}.logits"][()]                             # (B, T, E)
                chosen, weights = g[f"moe/h.{i}.experts"][()], g[f"moe/h.{i}.weights"][()]   # (B, T, K)
                assert chosen.dtype == np.int32 and chosen.shape == (4, 8, 2)
                p = _softmax(logits)
                assert np.array_equal(chosen, np.argsort(-p, axis=-1, kind="stable")[..., :2])
                top = np.take_along_axis(p, chosen.astype(np.int64), axis=-1)
                assert np.abs(weights - top / top.sum(axis=-1, keepdims=True)).max() <= 1e-15
                counts += np.bincount(chosen.reshape(-1), minlength=4)
                sums += p.reshape(-1, 4).sum(axis=0)
                m = logits.max(axis=-1)
                z += ((m + np.log(np.exp(logits - m[..., None]).sum(axis=-1))) ** 2).sum()
            aux = 4 * (counts * sums).sum() / (L * N) ** 2
            assert abs(g["moe/aux_loss"][()] - aux) <= 1e-14 and abs(g["moe/z_loss"][()] - z / (L * N)) <= 1e-14
            y = tokens[s - 1, :, 1:]                                             # (B, T)
            lp = np.log(_softmax(g["logits"][()]))                               # (B, T, V)
            ce = -np.take_along_axis(lp, y[..., None].astype(np.int64), axis=-1).mean()
            assert abs(g["loss"][()] - (ce + 0.02 * aux + 0.01 * z / (L * N))) <= 1e-12


@pytest.mark.timeout(300)
@pytest.mark.parametrize("ref,other", [("serial-cap.h5", "ep2-cap.h5"), ("serial.h5", "2d-ep2.h5"),
                                       ("serial.h5", "pp2-ep2.h5"), ("serial-cap.h5", "sp-cp2-ep2-cap.h5"),
                                       ("serial.h5", "dp4-ep2.h5")],
                         ids=["1d-dp2-ep2-capacity-sharded", "2d-dp2-ep2", "pp2-dp2-ep2",
                              "1d-sp-cp2-ep2-gathers-capacity", "dp4-ep2-zero0"])
def test_expert_parallel_traces_equal_serial(traces, ref, other):
    result = compare_traces(traces / ref, traces / other)
    assert result.first_divergence is None, [(r.name, r.note) for r in result.rows if not r.ok][:3]
    with h5py.File(traces / ref, "r") as f:
        cfg = config_of(json.loads(f.attrs["config"]))
    assert sum(r.compared for r in result.rows) == len(computation_order(cfg, 2))
    assert result.max_rel <= 1e-10


@pytest.mark.timeout(300)
def test_a_detached_load_balancing_loss_is_named_at_the_router_gradient(traces):
    """The planted bug keeps the aux loss in the loss but drops its
    gradient: everything forward agrees (the loss included), the experts'
    gradients of the last layer agree, and the first divergence is that
    layer's router gradient."""
    result = compare_traces(traces / "serial.h5", traces / "router-aux-grad.h5")
    assert result.first_divergence == "step_1/grad/h.1.moe.router.weight", \
        [(r.name, r.note) for r in result.rows if not r.ok][:3]
    rows = {r.name: r for r in result.rows}
    agree = ["step_1/loss", "step_1/logits", "step_1/moe/aux_loss", "step_1/moe/h.1.experts",
             "step_1/moe/h.1.logits", "step_1/act/h.1.mlp"] + \
        [f"step_1/grad/h.1.moe.experts.{e}.{w}.weight" for e in range(4) for w in ("c_fc", "c_proj")]
    assert all(rows[n].ok and rows[n].compared for n in agree), [(n, rows[n].max_rel) for n in agree]


def test_a_routing_that_parts_is_named_at_its_first_token(traces, tmp_path):
    """Chosen experts are integers, compared exactly: one changed choice
    is the first divergence, with the token where it happened."""
    bad = tmp_path / "bad.h5"
    shutil.copy(traces / "serial.h5", bad)
    with h5py.File(bad, "r+") as f:
        chosen = f["step_1/moe/h.1.experts"]
        was = chosen[2, 5].tolist()
        chosen[2, 5, 1] = (was[1] + 1) % 4 if (was[1] + 1) % 4 != was[0] else (was[1] + 2) % 4
    result = compare_traces(traces / "serial.h5", bad)
    assert result.first_divergence == "step_1/moe/h.1.experts"
    note = {r.name: r.note for r in result.rows}["step_1/moe/h.1.experts"]
    assert note.startswith(f"first differs at token (sequence 2, position 5): experts {was} in A"), note


def test_trace_writer_writes_a_mixture_that_compares_equal(traces, tmp_path):
    """mpicube.check's TraceWriter (what a framework's recorder hands its
    arrays to) takes the mixture's parameters and moe/ tensors under the
    format's names: the serial trace rewritten through it compares equal,
    and a moe name outside the format is refused naming it."""
    from mpicube.check.reference import Reference
    from mpicube.check.writer import TraceWriter
    from mpicube.core.errors import UserError

    out = tmp_path / "rewritten.h5"
    with Reference(traces / "serial.h5") as ref, h5py.File(traces / "serial.h5", "r") as f:
        with TraceWriter(out, ref.config, ref.optimizer, ref.dtype, {"framework": "numpy"}, ref.dropout) as w:
            w.init(ref.init())
            for s in ref.step_numbers():
                g = f[f"step_{s}"]
                group = lambda kind: {k: v[()] for k, v in g[kind].items()}    # noqa: E731
                w.step(s, loss=g["loss"][()], lr=g["lr"][()], grad_norm=g["grad_norm"][()], grads=group("grad"),
                       params=group("param"), acts=group("act"), logits=g["logits"][()], masks=group("dropout"),
                       tokens=ref.tokens[s - 1], moe=group("moe"))
            with pytest.raises(UserError, match="moe tensor 'h.0.router'"):
                w.step(3, loss=0, lr=0, grad_norm=0, grads={}, params={}, moe={"h.0.router": np.zeros(1)})
    result = compare_traces(traces / "serial.h5", out)
    assert result.first_divergence is None and result.max_rel == 0, \
        [(r.name, r.note) for r in result.rows if not r.ok][:3]


def test_a_mixture_against_a_dense_llama_is_bad_input_naming_the_keys(traces, tmp_path):
    """Traces of different models are bad input: a mixture's config keys
    present in one trace only are named (not a KeyError)."""
    from mpicube.core.errors import UserError

    dense = tmp_path / "dense.h5"
    shutil.copy(traces / "serial.h5", dense)
    with h5py.File(dense, "r+") as f:
        cfg = json.loads(f.attrs["config"])
        f.attrs["config"] = json.dumps({k: v for k, v in cfg.items() if k not in (
            "n_experts", "top_k", "norm_topk", "capacity_factor", "router_aux_loss_coef", "router_z_loss_coef")})
    with pytest.raises(UserError, match="different models: n_experts 4 vs absent, top_k 2 vs absent"):
        compare_traces(traces / "serial.h5", dense)
