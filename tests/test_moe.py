"""The mixture of experts (model/moe.py, ops/moe.py, docs/moe.md): the
router's tie-break, weights and drop rule, the whole model's gradient with
each router loss and dispatch mode against finite differences, data
parallelism against serial, metrics, and the one-line refusals."""

import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest

from mpicube.core.config import ModelConfig
from mpicube.ops import moe as router_ops

rng = np.random.default_rng(34)
ENV = dict(os.environ, PYTHONPATH=os.getcwd())


def small_moe(**kw) -> ModelConfig:
    base = dict(vocab_size=11, n_ctx=5, n_layer=2, n_head=2, n_embd=8, arch="llama", n_kv_head=1, ffn_hidden=6,
                n_experts=4, top_k=2)
    return ModelConfig(**{**base, **kw})


def test_top_k_ties_go_to_the_lower_expert():
    logits = np.array([[1.0, 3.0, 3.0, 3.0], [0.0, 0.0, 0.0, 0.0]])
    probs, chosen, weights, lse, _ = router_ops.route(logits, 2, True)
    assert chosen.tolist() == [[1, 2], [0, 1]]
    assert np.allclose(weights, 0.5)                        # renormalised over the two chosen
    _, _, raw, _, _ = router_ops.route(logits, 2, False)
    assert np.allclose(raw, probs[np.arange(2)[:, None], chosen])
    assert np.allclose(lse, np.log(np.exp(logits).sum(1)))


def test_capacity_keeps_each_experts_first_choosers_in_token_order():
    chosen = np.array([[0, 1], [0, 2], [1, 0], [0, 3]])     # expert 0 chosen by tokens 0, 1, 2, 3
    assert router_ops.capacity(0.5, 2, 4, 4) == 1          # ceil(0.5 * 2 * 4 / 4)
    order, expert, counts = router_ops.dispatch(chosen, 4, cap=2)
    assert counts.tolist() == [4, 2, 1, 1]
    kept = sorted((int(e), int(i) // 2) for e, i in zip(expert, order))
    assert kept == [(0, 0), (0, 1), (1, 0), (1, 2), (2, 1), (3, 3)]   # expert 0 drops tokens 2 and 3
    # two ranks before this one already sent expert 0 one chooser: it keeps one more here
    order, expert, _ = router_ops.dispatch(chosen, 4, cap=2, offset=np.array([1, 0, 0, 0]))
    assert sorted(int(i) // 2 for e, i in zip(expert, order) if e == 0) == [0]


def test_route_backward_matches_finite_differences():
    logits = rng.normal(size=(5, 4))
    dw, dall, dlse = rng.normal(size=(5, 2)), rng.normal(size=4), rng.normal(size=5)
    for norm in (True, False):
        def f(z):
            probs, chosen, w, lse, _ = router_ops.route(z, 2, norm)
            return (w * dw).sum() + (probs * dall).sum() + (lse * dlse).sum()
        got = router_ops.route_backward(dw, router_ops.route(logits, 2, norm)[4], dall, dlse)
        want = np.zeros_like(logits)
        for idx in np.ndindex(*logits.shape):
            e = np.zeros_like(logits)
            e[idx] = 1e-6
            want[idx] = (f(logits + e) - f(logits - e)) / 2e-6
        assert np.abs(got - want).max() < 1e-8


@pytest.mark.parametrize("kw", [dict(router_z_loss_coef=0.05),
                                dict(norm_topk=False, capacity_factor=0.7, router_aux_loss_coef=0.3),
                                dict(top_k=1, n_layer=1)],
                         ids=["mixtral-z", "no-norm-capacity", "top1"])
def test_whole_moe_gradient(kw):
    """Every parameter's gradient (router, experts, attention below them),
    dropout and the router losses on, against central differences."""
    sys.path.insert(0, os.path.dirname(__file__))
    from test_ops import check_whole_model_gradient

    cfg = small_moe(**kw)
    assert check_whole_model_gradient(cfg) == cfg.n_params()


def test_moe_config_stores_and_counts():
    cfg = small_moe(capacity_factor=1.5)
    d = cfg.to_dict()
    assert d["n_experts"] == 4 and d["capacity_factor"] == 1.5
    assert ModelConfig.from_dict(d).to_dict() == d
    assert "n_experts" not in small_moe(n_experts=0).to_dict()        # a dense Llama stores as before
    from mpicube.model.gpt import gpt_params, param_names
    decls = gpt_params(cfg)
    assert [d.name for d in decls] == list(param_names(cfg))
    assert sum(int(np.prod(d.shape)) for d in decls) == cfg.n_params()
    assert "h.1.moe.experts.3.c_proj.weight" in [d.name for d in decls]


# One launch each. dp 2: dropless with --ep 2 and --zero 2 on CI's stand-in GPU (tests/fake_gpu) against
# the CPU's serial model; capacity with --zero 1 and --recompute blocks.
# dp 4: --ep 4 (capacity, recompute); --ep 2 (two experts per rank, each held by two replicas)
# with --grad-accum 2 and --zero 1 (dense state over the 4 replicas, each expert's over its 2), and
# dropless with --zero 3 (each block's dense segment gathered and reduce-scattered over the 4, its
# experts' segment over the 2), both checked without dropout against the serial model accumulating
# the same micro-batch groups.
# 1-D tp 2 x dp 2 with --ep 2 (capacity, --recompute gathers: each expert's rows padded to a multiple of
# tp for its row shards, padded > 0; --zero 1). --cp 2 (ep folded into dp x cp: each cp
# rank routes its positions, the ledger sums over the ring too, the drop order interleaves the ring's
# positions, experts' gradients skip the ring's sum): cp 2 x ep 2 alone (capacity), and 1-D x dp 2 x
# cp 2 x ep 4 (one expert a rank, its replicas' gradients summed over nobody) under --sequence-parallel
# (the mixture routes the gathered sequences and reduce-scatters its output) with a capacity, --zero 1
# and --recompute blocks. Passing all of them,
# gradients are equal whatever the ep size. dp 4 x ep 4 and 1-D x dp 2 x ep 2 also generate
# (MPICUBE_CHECK_GENERATE: greedy, with and without the key/value cache, the serial model's tokens), as
# does the 3-D x dp 2 x ep 2 case below.
# MPICUBE_CHECK_DEEPSEEK (DS): the same launch then checks the mixture with DeepSeekMoE's options
# (parallel_check.DEEPSEEK: sigmoid router with a bias, groups, scaling, a shared expert, the
# sequence-wise auxiliary loss) for 5 steps, the bias updated from the global loads after each and
# equal to serial's bit for bit, so the same for ep 1, 2 and 4.
GPU = {"PYTHONPATH": f"{os.getcwd()}/tests/fake_gpu:{os.getcwd()}", "MPICUBE_CHECK_DEVICE": "gpu"}
DS = {"MPICUBE_CHECK_DEEPSEEK": "1"}
DP_CASES = [(2, "serial", 2, "0", "2", {**GPU, "MPICUBE_CHECK_ZERO": "2", **DS}),
            (2, "serial", 2, "0.8", "1", {"MPICUBE_CHECK_ZERO": "1", "MPICUBE_CHECK_RECOMPUTE": "blocks"}),
            (4, "serial", 4, "0", "2", {"MPICUBE_CHECK_ZERO": "3", "MPICUBE_CHECK_ACCUM": "2", **DS}),
            (4, "serial", 4, "0.8", "4", {"MPICUBE_CHECK_RECOMPUTE": "blocks", "MPICUBE_CHECK_GENERATE": "1", **DS}),
            (4, "serial", 4, "0.8", "2", {"MPICUBE_CHECK_ACCUM": "2", "MPICUBE_CHECK_ZERO": "1"}),
            (4, "1d", 2, "0.8", "2", {"MPICUBE_CHECK_RECOMPUTE": "gathers", "MPICUBE_CHECK_ZERO": "1",
                                      "MPICUBE_CHECK_GENERATE": "1", **DS}),
            (2, "serial", 1, "0.8", "2", {"MPICUBE_CHECK_CP": "2"}),
            (8, "1d", 2, "0.5", "4", {"MPICUBE_CHECK_CP": "2", "MPICUBE_CHECK_ZERO": "1",
                                      "MPICUBE_CHECK_RECOMPUTE": "blocks", "MPICUBE_CHECK_SEQPAR": "1", **DS})]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("ranks,layout,dp,capacity,ep,extra", DP_CASES,
                         ids=["dp2-ep2-dropless-zero2-gpu", "dp2-capacity-zero1-recompute", "dp4-ep2-zero3-accum2",
                              "dp4-ep4-capacity-recompute",
                              "dp4-ep2-accum2-capacity-zero1", "1d-dp2-ep2-capacity-gathers-zero1",
                              "cp2-ep2-capacity", "1d-dp2-cp2-sp-ep4-capacity-zero1-recompute"])
def test_moe_data_and_expert_parallel_match_serial(ranks, layout, dp, capacity, ep, extra):
    """Replicas (dropout on) follow serial to 1e-10 in float64: loss with
    the router losses, logits, every gradient (each rank's experts), the
    gradient norm, parameters after 3 steps."""
    from mpirun import mpiexec

    dropout = 0.0 if "MPICUBE_CHECK_ACCUM" in extra else 0.1
    proc = mpiexec(ranks, ["-m", "mpi4py", "tests/parallel_check.py", layout, dp, 1, dropout, 8], timeout=200,
                   env={"MPICUBE_CHECK_ARCH": "mixtral", "MPICUBE_CHECK_CAPACITY": capacity, "MPICUBE_CHECK_EP": ep,
                        **extra})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"OK {layout} world={ranks} dp={dp}" in proc.stdout
    assert f"device={extra.get('MPICUBE_CHECK_DEVICE', 'cpu')}" in proc.stdout
    assert f"arch=mixtral capacity={float(capacity)} ep={ep}" in proc.stdout
    assert f"zero={extra.get('MPICUBE_CHECK_ZERO', '0')}" in proc.stdout
    assert f"recompute={extra.get('MPICUBE_CHECK_RECOMPUTE', 'none')} " in proc.stdout
    assert ("sequence-parallel" in proc.stdout) == ("MPICUBE_CHECK_SEQPAR" in extra), proc.stdout
    padded = int(proc.stdout.split("padded=")[1].split()[0])
    assert (padded > 0) == (layout == "1d" and extra.get("MPICUBE_CHECK_RECOMPUTE") == "gathers"), proc.stdout
    assert ("generated=" in proc.stdout) == ("MPICUBE_CHECK_GENERATE" in extra)
    assert (f"OK deepseek-moe {layout} world={ranks} dp={dp} " in proc.stdout) == ("MPICUBE_CHECK_DEEPSEEK" in extra)


# the tensor-parallel layouts with --ep 2, one launch each (16 ranks): 2-D (2x2 grid) x dp 2 x --cp 2
# dropless under --zero 2 (the expert-data group spans the ring: each block's experts reduce-scattered
# over its 2 ranks, the ring summing the dense chunks only; its capacity case runs under pp below); the
# 2x2x2 cube x --cp 2 (ep folded into the ring, dp 1) dropless, and x dp 2 under a capacity with
# --recompute gathers (its linears gather the padded rows again in backward) and --zero 3 (each block's
# dense segment over dp 2, its experts' over an expert-data group of 1), on CI's stand-in GPU, which
# also generates (a decoding step leaves experts without rows: the cube pads them, every rank runs every
# expert); 2.5-D (depth 2) x --cp 2 under a capacity (the drop order over the token group and the
# ring; an expert with no rows on a grid row still runs). The cube pads each expert's rows to the most
# of its j line (padded > 0); SUMMA needs no padding.
TP_CASES = [(16, "2d", 2, 1, "0", {"MPICUBE_CHECK_CP": "2", "MPICUBE_CHECK_ZERO": "2", **DS}),
            (16, "3d", 1, 1, "0", {"MPICUBE_CHECK_CP": "2"}),
            (16, "3d", 2, 1, "0.8", {"MPICUBE_CHECK_RECOMPUTE": "gathers", "MPICUBE_CHECK_ZERO": "3",
                                        "MPICUBE_CHECK_GENERATE": "1", **GPU, **DS}),
            (16, "2.5d", 1, 2, "0.8", {"MPICUBE_CHECK_CP": "2"})]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("ranks,layout,dp,depth,capacity,extra", TP_CASES,
                         ids=["2d-cp2-dropless-zero2", "3d-cp2-dropless", "3d-capacity-recompute-gathers-zero3-gpu",
                              "2.5d-cp2-capacity"])
def test_moe_on_2d_25d_3d_with_expert_parallelism_matches_serial(ranks, layout, dp, depth, capacity, extra):
    """Each expert's linears split like any MLP's on 2-D, 2.5-D and 3-D,
    the router's rows over the hidden columns, with --ep 2 over dp x cp
    (dropout on): loss, logits, every gradient, the norm and parameters
    after 3 steps equal serial's to 1e-10 in float64."""
    from mpirun import mpiexec

    proc = mpiexec(ranks, ["-m", "mpi4py", "tests/parallel_check.py", layout, dp, depth, 0.1, 8], timeout=200,
                   env={"MPICUBE_CHECK_ARCH": "mixtral", "MPICUBE_CHECK_CAPACITY": capacity, "MPICUBE_CHECK_EP": "2",
                        **extra})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"OK {layout} world={ranks} dp={dp} depth={depth}" in proc.stdout
    padded = int(proc.stdout.split("padded=")[1].split()[0])
    assert f"arch=mixtral capacity={float(capacity)} ep=2 padded={padded}" in proc.stdout
    assert (padded > 0) == (layout == "3d"), proc.stdout
    assert f"device={extra.get('MPICUBE_CHECK_DEVICE', 'cpu')}" in proc.stdout
    assert f"cp={extra.get('MPICUBE_CHECK_CP', '1')}" in proc.stdout
    assert f"zero={extra.get('MPICUBE_CHECK_ZERO', '0')}" in proc.stdout
    assert ("generated=" in proc.stdout) == ("MPICUBE_CHECK_GENERATE" in extra)
    assert (f"OK deepseek-moe {layout} world={ranks} dp={dp} " in proc.stdout) == ("MPICUBE_CHECK_DEEPSEEK" in extra)


@pytest.mark.timeout(240)
def test_moe_pipeline_on_2d_matches_serial():
    """pp 2 x 2-D (2x2 grid) x cp 2 x ep 2 (folded into the ring) under
    1F1B, 2 micro-batches, capacity 0.8 (16 ranks): the stages' router
    ledgers, summed over the world, count each token once (its grid row's
    q ranks hold it; the ring's ranks hold other positions, and the router
    losses are added at cp rank 0 only), to 1e-10 of the serial model
    accumulating the same groups."""
    from mpirun import mpiexec

    proc = mpiexec(16, ["-m", "mpi4py", "tests/pipeline_check.py", "2d", 1, 1, 2, "1f1b", 1, 2, "dropout=0.0",
                        "moe=0.8", "ep=2", "cp=2"], timeout=200)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "OK pp 2d world=16 dp=1 depth=1 pp=2 schedule=1f1b" in proc.stdout
    assert "cp=2 sp=0 moe=0.8 ep=2" in proc.stdout


@pytest.mark.timeout(240)
def test_moe_pipelines_match_serial():
    """One launch, six cases: pp 2 x dp 2 x ep 2 under the interleaved
    schedule (2 chunks per stage), 2 micro-batches, capacity 0.8,
    --recompute blocks, --zero 2 (each stage's blocks' expert segments
    over the expert-data group); pp 2 x dp 2 under 1F1B with --zero 3,
    dropless; pp 2 x cp 2 x ep 2 (capacity: the ring's drop order under
    stages); pp 2 x 1-D (tp 2) under --sequence-parallel and --recompute
    gathers (capacity); and two with DeepSeekMoE's options; ZBV over pp 2 x
    dp 2 x ep 2 (the experts' deferred weight phases priced, costwgrad). Each stage's chunks share a micro-batch's router
    ledger, summed over the world between its last forward and first
    backward; against the serial model accumulating the same micro-batch
    groups, to 1e-10."""
    from mpirun import mpiexec

    proc = mpiexec(4, ["-m", "mpi4py", "tests/pipeline_check.py",
                       "serial", 2, 1, 2, "interleaved", 2, 2, "dropout=0.0", "moe=0.8", "ep=2", "recompute=blocks",
                       "zero=2", "--", "serial", 2, 1, 2, "1f1b", 1, 2, "dropout=0.0", "moe=0", "zero=3",
                       "--", "serial", 1, 1, 2, "1f1b", 1, 2, "dropout=0.0", "moe=0.8", "ep=2", "cp=2",
                       "--", "1d", 1, 1, 2, "1f1b", 1, 2, "dropout=0.0", "moe=0.8", "sp=1", "recompute=gathers",
                       "--", "serial", 2, 1, 2, "interleaved", 2, 2, "dropout=0.0", "moe=0.8", "ep=2",
                       "recompute=blocks", "zero=2", "deepseek=1",
                       "--", "serial", 1, 1, 2, "1f1b", 1, 2, "dropout=0.0", "moe=0.8", "ep=2", "cp=2", "deepseek=1",
                       "--", "serial", 2, 1, 2, "zbv", 2, 2, "dropout=0.0", "moe=0", "ep=2"],
                   timeout=200)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "schedule=interleaved V=2 accum=2" in proc.stdout and "recompute=blocks zero=2 cp=1 sp=0 moe=0.8 ep=2" \
        in proc.stdout
    assert "schedule=1f1b V=1 accum=2" in proc.stdout and "zero=3 cp=1 sp=0 moe=0 ep=1" in proc.stdout
    assert "schedule=zbv V=2 accum=2" in proc.stdout
    # DeepSeekMoE's options (parallel_check.DEEPSEEK) on pp 2 x dp 2 x ep 2 and pp 2 x cp 2 x ep 2: the
    # stages' biases updated from the world's loads, equal to serial's bit for bit after every step, and
    # each stage's traffic and memory equal to the cost model for its recorded routing
    assert "zero=2 cp=1 sp=0 moe=0.8 ep=2 deepseek" in proc.stdout and "cp=2 sp=0 moe=0.8 ep=2 deepseek" in proc.stdout
    assert "OK pp serial world=4 dp=1" in proc.stdout and "zero=0 cp=2 sp=0 moe=0.8 ep=2" in proc.stdout
    assert "OK pp 1d world=4 dp=1" in proc.stdout and "recompute=gathers zero=0 cp=1 sp=1 moe=0.8 ep=1" in proc.stdout


@pytest.mark.timeout(240)
def test_expert_parallel_checkpoint_holds_every_expert(tmp_path):
    """train --dp 2 --cp 2 --ep 2 --zero 3 writes each expert once (the
    ranks of the expert-data group's rank 0 at cp rank 0, the sharded
    state gathered: each block's dense chunks over dp, its experts' over
    the expert-data group); the checkpoint evaluates, serially and on
    --ep 2, to the serial run's checkpoint's loss, and generate --pp 2
    --dp 2 --ep 2 gives its serial greedy tokens."""
    from mpirun import mpiexec

    args = ["-m", "mpicube", "train", "--arch", "mixtral", "--n-experts", "4", "--n-layer", "2", "--n-head", "4",
            "--n-kv-head", "2", "--n-embd", "16", "--ffn-hidden", "24", "--seq-len", "8", "--batch-size", "4",
            "--steps", "2", "--dtype", "float64", "--capacity-factor", "1.0"]
    for ranks, extra in ((1, []), (4, ["--dp", "2", "--cp", "2", "--ep", "2", "--zero", "3"])):
        proc = mpiexec(ranks, args + ["--out", tmp_path / f"r{ranks}"] + extra, timeout=200)
        assert proc.returncode == 0, proc.stdout + proc.stderr
    rec = json.loads((tmp_path / "r4" / "metrics.jsonl").read_text().splitlines()[-1])
    assert rec["ep_bytes"] > 0 and "ep_bytes" not in json.loads((tmp_path / "r1" / "metrics.jsonl").read_text()
                                                                 .splitlines()[-1])
    losses = []
    evals = ((1, "r1", []), (1, "r4", []), (2, "r4", ["--dp", "2", "--ep", "2", "--layout", "serial"]))
    for ranks, run, extra in evals:
        proc = mpiexec(ranks, ["-m", "mpicube", "eval", tmp_path / run / "ckpt" / "step_00000002", "--batches", "2",
                               "--batch-size", "4", "--dtype", "float64"] + extra, timeout=200)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        losses.append(json.loads(proc.stdout.strip().splitlines()[-1])["loss"])
    assert abs(losses[1] - losses[0]) <= 1e-10 * losses[0] and abs(losses[2] - losses[0]) <= 1e-10 * losses[0]

    # generate --pp 2 --dp 2 --ep 2 (experts over two ranks at each stage, the all-to-all at every decoding
    # step, key/value cache; the last stage's head is the untied lm_head): the serial model's greedy tokens
    # (computed here, in this process), routed dropless (the capacity noted)
    from mpi4py import MPI

    from mpicube.cli.generate import GenerateOptions, generate

    ckpt = tmp_path / "r4" / "ckpt" / "step_00000002"
    want = generate(GenerateOptions(str(ckpt), prompt_tokens="3,1,4", max_new_tokens=5, temperature=0.0,
                                    dtype="float64"), MPI.COMM_SELF)
    assert want["note"] and len(want["tokens"]) == 5
    proc = mpiexec(4, ["-m", "mpicube", "generate", ckpt, "--prompt-tokens", "3,1,4", "--max-new-tokens", 5,
                       "--temperature", 0, "--dtype", "float64", "--pp", 2, "--dp", 2, "--ep", 2, "--json"],
                   timeout=200)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert json.loads(proc.stdout.strip().splitlines()[-1])["tokens"] == want["tokens"]
    assert "capacity factor 1 not applied: generation routes every token to its top 2 experts" in proc.stdout

    # convert --to hf writes a MixtralForCausalLM directory holding the same tensors (capacity noted)
    proc = cli("convert", str(tmp_path / "r4" / "ckpt" / "step_00000002"), str(tmp_path / "hf"), "--to", "hf")
    assert proc.returncode == 0, proc.stderr
    assert "capacity factor 1 is not in config.json" in proc.stdout
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["architectures"] == ["MixtralForCausalLM"]
    from mpicube.files.formats import open_model

    with open_model(tmp_path / "r4" / "ckpt" / "step_00000002") as a, open_model(tmp_path / "hf") as b:
        want, got = a.read_all(), b.read_all()
        assert b.config.n_experts == 4 and b.config.top_k == 2
    assert sorted(want) == sorted(got) and all(np.array_equal(want[n], got[n]) for n in want)


def cli(*args):
    return subprocess.run([sys.executable, "-m", "mpicube", *args], capture_output=True, text=True, env=ENV,
                          timeout=120)


def test_train_logs_router_losses_and_expert_tokens(tmp_path):
    out = tmp_path / "run"
    proc = cli("train", "--arch", "mixtral", "--n-experts", "4", "--n-layer", "2", "--n-head", "4", "--n-kv-head", "2",
               "--n-embd", "16", "--ffn-hidden", "24", "--seq-len", "8", "--batch-size", "2", "--steps", "2",
               "--capacity-factor", "1.0", "--router-z-loss-coef", "0.001", "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    rec = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])
    tokens = np.array(rec["expert_tokens"])                           # (layers, experts)
    assert tokens.shape == (2, 4) and (tokens.sum(1) == 2 * 8 * 2).all()   # N K choices per layer
    assert rec["router_aux_loss"] > 0 and rec["router_z_loss"] > 0 and len(rec["expert_dropped"]) == 2
    model = json.loads((out / "config.json").read_text())["model"]
    assert (model["n_experts"], model["top_k"], model["capacity_factor"]) == (4, 2, 1.0)


@pytest.mark.parametrize("args,message", [
    (["--arch", "llama", "--n-experts", "4", "--top-k", "5"], "--top-k 5 must be from 1 to --n-experts 4"),
    (["--arch", "mixtral", "--capacity-factor", "0"], "--capacity-factor must be positive"),
    (["--arch", "llama", "--top-k", "2"], "--top-k needs --n-experts"),
    (["--n-experts", "4"], "--n-experts applies to --arch llama or mixtral only, not gpt2"),
    (["--arch", "llama", "--ep", "2"], "--ep 2 needs a mixture of experts"),
])
def test_bad_moe_options_are_one_line(args, message, tmp_path):
    proc = cli("train", "--steps", "1", "--out", str(tmp_path / "r"), *args)
    assert proc.returncode == 2, proc.stderr
    assert message in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert not (tmp_path / "r").exists()


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    """A random 4-expert Mixtral directory and a dense Llama one (hf_mixtral.write, hf_llama.write)."""
    from mpicube.files.formats import hf_llama, hf_mixtral
    from mpicube.model.gpt import gpt_params

    out, r = {}, np.random.default_rng(5)
    for name, experts, writer in (("mixtral", 4, hf_mixtral.write), ("llama", 0, hf_llama.write)):
        cfg = small_moe(n_head=4, n_embd=16, n_kv_head=2, n_ctx=8, n_experts=experts, top_k=2 if experts else 0)
        out[name] = tmp_path_factory.mktemp(name) / "hf"
        writer(out[name], {d.name: 0.2 * r.standard_normal(d.shape) for d in gpt_params(cfg)}, cfg)
    return out


@pytest.mark.parametrize("model,extra,message", [
    ("mixtral", ["--ep", "3"], "--ep 3 must divide --n-experts 4: use --ep 1"),
    ("llama", ["--ep", "2"], "--ep 2 needs a mixture of experts"),
])
def test_bad_generate_ep_is_one_line(hf_dirs, model, extra, message):
    proc = cli("generate", str(hf_dirs[model]), "--prompt-tokens", "1,2", "--max-new-tokens", "2", *extra)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert message in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert proc.stdout == ""


@pytest.mark.parametrize("extra,grid", [
    (["-n", "16", "--dp", "2", "--layout", "3d"], "i,j,k"),
    (["-n", "16", "--dp", "2", "--cp", "2", "--layout", "2d"], "l,r,c"),
    (["-n", "16", "--dp", "2", "--depth", "2", "--layout", "2.5d", "--capacity-factor", "1.0"], "l,r,c"),
    (["-n", "8", "--dp", "2", "--pp", "2", "--layout", "1d", "--capacity-factor", "1.0"], "(t)"),
])
def test_info_experts_draws_every_layout(extra, grid):
    """info --experts draws each rank's experts and their shards on 2-D,
    2.5-D, 3-D, with --cp and --pp (each row equals the rank's store in the
    parallel_check launches), and one dispatch step: the rows each ep rank
    sends to each add up to what each receives and to every expert's rows."""
    proc = cli("info", "--arch", "mixtral", "--n-experts", "4", "--n-layer", "2", "--n-head", "4", "--n-kv-head", "2",
               "--n-embd", "16", "--ffn-hidden", "24", "--seq-len", "8", "--ep", "2", "--experts", *extra)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    world = int(extra[1])
    table = out.split("experts on ")[1].split("\n\n")[0].splitlines()[3:]
    assert grid in out and [int(r.split()[0]) for r in table] == list(range(world)), out
    assert all(r.split()[8] in ("0..1", "2..3") for r in table), table        # E/ep experts a rank
    pic = out.split("one dispatch step")[1].split("\n\n")[0].splitlines()
    sent = [[int(v) for v in r.split(")")[1].split()[:2]] for r in pic if r.strip().startswith("ep ")]
    received = [int(v) for v in next(r for r in pic if r.strip().startswith("received")).split()[1:]]
    per_expert = [int(v.split()[1]) for v in pic[-1].split(":")[1].split(";")[0].split(",")]
    assert received == [sum(col) for col in zip(*sent)] and sum(received) == sum(per_expert) > 0, pic
    if "--capacity-factor" in extra and "1d" in extra:    # the capacity applied exactly: 32 = ceil(1 x 2 x 64 / 4)
        assert "capacity 32 per expert" in out and max(per_expert) <= 32, pic


def test_info_counts_the_ep_ranks_of_dp_x_cp():
    """Under --cp the ep ranks come from dp x cp: --dp 2 --cp 2 --ep 4 holds each expert on one rank, and a
    rank routes its T/cp positions (32 = 8 sequences x 4 positions x top 2 / ep 2 rows to each ep rank)."""
    base = ["info", "--arch", "mixtral", "--n-experts", "4", "--n-layer", "2", "--n-head", "4", "--n-kv-head", "2",
            "--n-embd", "16", "--ffn-hidden", "24", "--seq-len", "8", "--layout", "serial", "--batch-size", "8"]
    proc = cli(*base, "-n", "4", "--dp", "2", "--cp", "2", "--ep", "4")
    assert proc.returncode == 0, proc.stderr
    assert "each expert held by 1 rank of dp x cp (dp cp/ep)" in proc.stdout, proc.stdout
    proc = cli(*base, "-n", "2", "--cp", "2", "--ep", "2")
    assert proc.returncode == 0, proc.stderr
    assert "uniform routing: 32 rows to each ep rank per layer and micro-batch" in proc.stdout, proc.stdout
    # the 2x2x2 cube splits those rows again over q^2 = 4 (costexperts.grid): 8 x 4 / 4 x 2 / 2
    cube = [a if a != "serial" else "3d" for a in base]
    proc = cli(*cube, "-n", "16", "--cp", "2", "--ep", "2")
    assert proc.returncode == 0, proc.stderr
    assert "uniform routing: 8 rows to each ep rank per layer and micro-batch" in proc.stdout, proc.stdout
    assert "balanced routing: 16 rows sent" in proc.stdout, proc.stdout


@pytest.mark.parametrize("plan,message", [
    (dict(dp=4, ep=3), "--ep 3 must divide --n-experts 4: use --ep 1 or 2 or 4"),
    (dict(dp=6, ep=4), "--ep 4 must divide --dp 6"),
    (dict(dp=1, cp=2, ep=4), "--ep 4 must divide --dp 1 x --cp 2 (the expert-parallel ranks are data-parallel "
                             "replicas and context-parallel ranks): use --ep 1 or 2"),
    (dict(dp=2, ep=4, zero=3), "--ep 4 must divide --dp 2"),
    (dict(layout="2d", dp=1, sequence_parallel=True), "--sequence-parallel applies to the 1d layout only"),
])
def test_bad_expert_parallel_plans_are_refused(plan, message):
    from mpicube.core.errors import ConfigError
    from mpicube.parallel.gridspec import Plan
    from mpicube.parallel.planning import resolve

    plan = dict(plan)
    cfg = small_moe(n_head=4, n_embd=16, n_kv_head=4, n_ctx=8, capacity_factor=plan.pop("capacity", None))
    tp = {"1d": 2, "2d": 4, "3d": 8}.get(plan.get("layout"), 1)
    with pytest.raises(ConfigError, match=re.escape(message)):
        resolve(Plan(**{"layout": "serial", **plan}), cfg, 12, plan["dp"] * plan.get("cp", 1) * tp)


@pytest.mark.parametrize("plan", [dict(layout="1d", recompute="gathers"), dict(layout="1d", sequence_parallel=True),
                                  dict(layout="1d", sequence_parallel=True, cp=2, recompute="gathers"),
                                  dict(layout="3d", cp=2, ep=2), dict(layout="2.5d", depth=2, cp=2, ep=2),
                                  dict(layout="2d", cp=2, pp=2, ep=2), dict(layout="serial", cp=2, pp=2, ep=2)],
                         ids=["1d-gathers", "1d-sp", "1d-sp-cp-gathers", "3d-cp", "2.5d-cp", "2d-cp-pp", "cp-pp"])
def test_expert_plans_on_every_axis_resolve(plan):
    """The pairings once refused (--cp on 2.5-D and 3-D, --cp with --pp,
    --sequence-parallel, 1-D's --recompute gathers) are plans like any."""
    from mpicube.parallel.gridspec import Plan
    from mpicube.parallel.planning import resolve

    cfg = small_moe(n_head=4, n_embd=16, n_kv_head=4, n_ctx=8, n_layer=2)
    tp = {"1d": 2, "2d": 4, "2.5d": 8, "3d": 8}.get(plan["layout"], 1)
    run = resolve(Plan(**plan), cfg, 8, plan.get("cp", 1) * plan.get("pp", 1) * tp)
    assert (run.layout, run.tp) == (plan["layout"], tp)


def test_info_json_prices_a_mixtures_memory_per_ep_rank():
    """info --json for a mixture: a rank holds E/ep experts (--ep 2 halves
    the experts' parameters, gradients and moments), and --zero 1 cuts the
    dense state over dp and the experts' over the expert-data group
    (dp/ep = 1 rank here: each keeps all of its experts' moments), in
    a (C,) buffer of their own."""
    cfg = small_moe(n_head=4, n_embd=16, n_kv_head=2, n_ctx=8, ffn_hidden=24, vocab_size=256)
    experts = cfg.n_layer * cfg.n_experts * 3 * cfg.n_embd * cfg.ffn       # every expert of every layer
    dense = cfg.n_params() - experts
    base = ["info", "--arch", "mixtral", "--n-experts", "4", "--n-layer", "2", "--n-head", "4", "--n-kv-head", "2",
            "--n-embd", "16", "--ffn-hidden", "24", "--seq-len", "8", "--layout", "serial", "-n", "2", "--dp", "2",
            "--batch-size", "8", "--json"]
    got = {}
    for ep, zero in ((1, 0), (2, 0), (2, 1)):
        proc = cli(*base, "--ep", str(ep), "--zero", str(zero))
        assert proc.returncode == 0, proc.stderr
        got[ep, zero] = json.loads(proc.stdout.splitlines()[-1])["memory_bytes_by_kind"]
    assert got[1, 0]["params"] == 4 * (dense + experts)                   # float32, every expert
    assert got[2, 0]["params"] == got[2, 0]["grads"] == 4 * (dense + experts // 2)
    assert got[2, 1]["optimizer"] == 4 * 2 * (-(-dense // 2) + experts // 2)
    # balanced routing: a rank's experts run on its n K rows whatever ep (the all-to-all moves them)
    assert got[2, 1]["activations"] == got[2, 0]["activations"] == got[1, 0]["activations"] > 0


def accumulating(cfg, accum: int, batch: int):
    """The serial model of ``cfg`` on ``batch`` sequences a step run as
    ``accum`` micro-batches (the trainer's own builder), float64, no dropout."""
    from mpi4py import MPI

    from mpicube.parallel.gridspec import GridSpec
    from mpicube.parallel.planning import resolve
    from mpicube.training.parts import Numerics, build_parts

    run = resolve(GridSpec("serial", grad_accum=accum), cfg, batch, 1)
    return build_parts(run, MPI.COMM_SELF, Numerics("float64"), seed=9, dropout=0.0)


def accumulated_step(parts, x, y):
    """(loss, {name: gradient}) of one step through training.accum."""
    from mpicube.training.accum import forward_backward

    parts.store.zero_grad()
    loss = forward_backward(parts, x, y, step=1)
    return loss, {n: g.copy() for n, g in parts.store.grad.items()}


@pytest.mark.parametrize("coefs", [dict(router_aux_loss_coef=0.3, router_z_loss_coef=0.0),
                                   dict(router_aux_loss_coef=0.0, router_z_loss_coef=0.05),
                                   dict(router_aux_loss_coef=0.3, router_z_loss_coef=0.05)],
                         ids=["aux", "z", "aux-z"])
def test_an_accumulated_mixture_step_is_the_unaccumulated_step_of_the_same_batch(coefs):
    """--grad-accum divides every router term by the micro-batch count, in
    the loss and in its gradient (RouterLedger.aux_term, z_term, dprobs,
    dlse). Checked where the two must agree exactly: a global batch made of
    the same 2 sequences twice, run as 2 micro-batches (each the 2
    sequences) and as 1 of 4. The aux loss is nonlinear in the batch, but
    each micro-batch's counts and probability sums are half the whole
    batch's, so aux (and z, a mean) are the same number either way; the
    loss and every gradient then agree to 1e-12. Dropless (a capacity
    counts its tokens per micro-batch). The serial references of
    test_moe_data_and_expert_parallel_match_serial accumulate through the
    same ledger, so a missing 1/A there passes them."""
    cfg = small_moe(**coefs)
    half_x = rng.integers(0, cfg.vocab_size, (2, cfg.n_ctx))                 # (2, T)
    half_y = rng.integers(0, cfg.vocab_size, (2, cfg.n_ctx))
    x, y = np.concatenate([half_x, half_x]), np.concatenate([half_y, half_y])   # (4, T): micro-batches equal
    loss_1, grads_1 = accumulated_step(accumulating(cfg, 1, 4), x, y)
    parts = accumulating(cfg, 2, 4)
    assert parts.grad_accum == 2 and parts.micro_rows(1) == slice(2, 4)
    loss_2, grads_2 = accumulated_step(parts, x, y)
    assert abs(loss_2 - loss_1) <= 1e-12 * abs(loss_1)
    router = [n for n in grads_1 if n.endswith("moe.router.weight")]
    assert len(router) == cfg.n_layer and all(np.abs(grads_1[n]).max() > 0 for n in router)
    for name, want in grads_1.items():
        err = np.abs(grads_2[name] - want).max() / np.abs(want).max()
        assert err < 1e-12, f"{name}: relative error {err:.2e} with --grad-accum 2"


def test_an_accumulated_mixture_gradient_matches_finite_differences():
    """Two different micro-batches (the aux loss of each its own, the
    step's their mean): the accumulated gradient of the routers and the
    norms below them against central differences of the step's loss
    (training.accum.forward_loss, the same micro-batches forward only)."""
    sys.path.insert(0, os.path.dirname(__file__))
    from test_ops import RTOL, numeric_grad

    from mpicube.training.accum import forward_loss

    cfg = small_moe(router_aux_loss_coef=0.3, router_z_loss_coef=0.05)
    parts = accumulating(cfg, 2, 4)
    store = parts.store
    store.flat[:] += np.random.default_rng(48).normal(0, 0.1, store.flat.shape)    # generic norm weights
    x, y = rng.integers(0, cfg.vocab_size, (4, cfg.n_ctx)), rng.integers(0, cfg.vocab_size, (4, cfg.n_ctx))
    _, grads = accumulated_step(parts, x, y)
    checked = [n for n in store.data if n.endswith(("moe.router.weight", "ln_2.weight"))]
    assert len(checked) == 2 * cfg.n_layer
    for name in checked:
        numeric = numeric_grad(lambda: forward_loss(parts, parts.model, x, y, step=1), store.data[name])
        err = np.abs(grads[name] - numeric).max() / np.abs(numeric).max()
        assert err < RTOL, f"{name}: relative error {err:.2e} against central differences"
