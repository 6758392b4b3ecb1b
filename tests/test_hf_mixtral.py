"""A random ``MixtralForCausalLM`` (4 experts, top 2, grouped-query
attention: 4 heads over 2 kv heads), saved by transformers in the hub's
per-expert form, evaluates to 1e-12 of transformers' own float64 loss on
the serial layout, with --ep 4 over four data-parallel replicas, and on
1-D (tp 2), 2-D and 3-D x dp 2 x --ep 2; its greedy tokens are transformers' (serial and
1-D x dp 2 x --ep 2 with the key/value cache, 2-D x dp 2 x --ep 2 without); its training loss
(cross-entropy plus the load-balancing loss) equals transformers'
``loss`` with ``output_router_logits``; and a mixture this build does not
compute is refused by the field's name.

transformers' float64 Mixtral still runs RMSNorm, the rotary angles and
the router's softmax in float32 (on purpose, for 16-bit training); the
reference replaces those three forwards with float64 arithmetic
(tests/hf_float64.py), so that two float64 computations are compared. Its ``load_balancing_loss_func``
sums in float32 too: the aux loss is compared with it at float32's
precision, and to 1e-12 with the same formula evaluated in float64 here.
Skipped where torch or transformers is not installed.
"""

import json

import numpy as np
import pytest

import hf_float64
from mpirun import ROOT, mpiexec

VOCAB, T, B, BATCHES, E, K = 61, 8, 4, 2, 4, 2


def aux_float64(torch, router_logits):
    """transformers' load-balancing formula over all layers' logits, in float64."""
    logits = torch.cat(router_logits, dim=0)                           # (L N, E)
    probs = torch.softmax(logits, dim=-1)
    chosen = torch.topk(probs, K, dim=-1).indices                      # (L N, K)
    counts = torch.nn.functional.one_hot(chosen, E).double().mean(0)   # (K, E)
    return float(E * (counts * probs.mean(0)).sum())


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory):
    with pytest.MonkeyPatch.context() as monkeypatch:
        yield build_mixtral(tmp_path_factory, monkeypatch)


def build_mixtral(tmp_path_factory, monkeypatch):
    """A random float64 MixtralForCausalLM saved in the hub's form, a token
    shard, and transformers' losses and greedy tokens, its float32
    internals patched to float64 (``hf_float64``)."""
    torch = pytest.importorskip("torch", reason="torch is not installed (optional check)")
    transformers = pytest.importorskip("transformers", reason="transformers is not installed (optional check)")
    from mpicube.files import data

    tmp = tmp_path_factory.mktemp("mixtral")
    config = transformers.MixtralConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, num_local_experts=E,
                                        num_experts_per_tok=K, max_position_embeddings=T, rms_norm_eps=1e-5,
                                        rope_theta=500.0, router_aux_loss_coef=0.02, initializer_range=0.2,
                                        attn_implementation="sdpa", experts_implementation="eager")
    torch.manual_seed(0)
    model = transformers.MixtralForCausalLM(config).double().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
    model.save_pretrained(str(tmp / "mixtral"), safe_serialization=True)
    tokens = np.random.default_rng(1).integers(0, VOCAB, BATCHES * B * T + 1)
    data.write_shard(tmp / "tokens.bin", tokens)
    patched = hf_float64.patch(monkeypatch, torch, transformers.models.mixtral.modeling_mixtral)
    assert "MixtralTopKRouter" in patched, patched
    starts = np.arange(BATCHES * B) * T
    x = torch.tensor(np.stack([tokens[s:s + T] for s in starts]))
    y = torch.tensor(np.stack([tokens[s + 1:s + T + 1] for s in starts]))
    with torch.no_grad():
        out = model(x, output_router_logits=True)
        ce = torch.nn.functional.cross_entropy(out.logits.reshape(-1, VOCAB), y.reshape(-1))
        first = model(x[:B], output_router_logits=True)          # the first batch alone, for the training loss
        ce_first = torch.nn.functional.cross_entropy(first.logits.reshape(-1, VOCAB), y[:B].reshape(-1))
        hf_aux = transformers.models.mixtral.modeling_mixtral.load_balancing_loss_func(first.router_logits, E, K)
        model.generation_config.eos_token_id = None                # no stop token: four greedy tokens
        greedy = model.generate(x[:1, :3], max_new_tokens=4, do_sample=False, pad_token_id=0)[0, 3:]
    return dict(greedy=[int(t) for t in greedy], dir=tmp / "mixtral", tokens=tmp / "tokens.bin", ce=float(ce),
                x=x.numpy(), y=y.numpy(),
                ce_first=float(ce_first), aux_first=aux_float64(torch, first.router_logits), hf_aux=float(hf_aux))


@pytest.mark.parametrize("ranks,layout,dp,ep", [(1, "serial", 1, 1), (4, "serial", 4, 4), (4, "1d", 2, 2),
                                                (8, "2d", 2, 2), (16, "3d", 2, 2)])
def test_mixtral_directory_evaluates_like_transformers(mixtral, ranks, layout, dp, ep):
    # the cube takes q^2 = 4 sequences per replica: the same B x BATCHES sequences as one batch
    batch, batches = (B * BATCHES, 1) if layout == "3d" else (B, BATCHES)
    proc = mpiexec(ranks, ["-m", "mpicube", "eval", mixtral["dir"], "--data", mixtral["tokens"], "--batch-size", batch,
                           "--seq-len", T, "--batches", batches, "--dtype", "float64", "--layout", layout,
                           "--dp", dp, "--ep", ep], timeout=180, env={"PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    got = json.loads(proc.stdout.strip().splitlines()[-1])["loss"]
    assert abs(got - mixtral["ce"]) <= 1e-12 * abs(mixtral["ce"]), f"{got!r} vs transformers {mixtral['ce']!r}"


@pytest.mark.parametrize("ranks,extra", [(1, []), (4, ["--layout", "1d", "--dp", "2", "--ep", "2"]),
                                         (8, ["--layout", "2d", "--dp", "2", "--ep", "2", "--no-cache"])])
def test_mixtral_greedy_tokens_equal_transformers(mixtral, ranks, extra):
    """Serial, 1-D x dp 2 x ep 2 with the key/value cache, 2-D x dp 2 x ep 2
    recomputing the prefix: every decoding step's rows reach the experts'
    ranks by the all-to-all, and the tokens are transformers'."""
    prompt = ",".join(str(int(t)) for t in mixtral["x"][0, :3])
    proc = mpiexec(ranks, ["-m", "mpicube", "generate", mixtral["dir"], "--prompt-tokens", prompt, "--max-new-tokens",
                           4, "--temperature", 0, "--dtype", "float64", "--json"] + extra, timeout=180,
                   env={"PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    tokens = json.loads(proc.stdout.strip().splitlines()[-1])["tokens"]
    assert tokens[-4:] == mixtral["greedy"], (tokens, mixtral["greedy"])


def test_mixtral_training_loss_includes_transformers_aux_loss(mixtral):
    """One forward of mpicube's serial model read from the directory:
    cross-entropy + 0.02 aux, the aux equal to transformers' formula."""
    from mpi4py import MPI

    from mpicube.device.backend import make_backend
    from mpicube.files.formats import open_model
    from mpicube.model.gpt import gpt_params
    from mpicube.parallel.grid import build_layout
    from mpicube.parallel.params import ParamStore
    from mpicube.parallel.planning import resolve
    from mpicube.training.driver import make_runner

    mf = open_model(mixtral["dir"])
    cfg = mf.config
    assert (cfg.n_experts, cfg.top_k, cfg.router_aux_loss_coef, cfg.kv_heads) == (E, K, 0.02, 2)
    layout = build_layout(resolve("serial", cfg, B, 1, seq_len=T), make_backend("cpu", "float64"), MPI.COMM_SELF)
    store = ParamStore([layout.shard(d) for d in gpt_params(cfg)], layout.backend, seed=0)
    for spec in store.specs:
        lo, hi = store.offsets[spec.name]
        store.flat[lo:hi] = mf.read_box(spec.name, tuple(slice(0, n) for n in spec.decl.shape)).reshape(-1)
    mf.close()
    runner = make_runner(cfg, layout, store)
    loss = runner.forward(mixtral["x"][:B], mixtral["y"][:B])
    aux = runner.router_log.take()["router_aux_loss"]
    assert abs(aux - mixtral["aux_first"]) <= 1e-12 * aux
    assert abs(aux - mixtral["hf_aux"]) <= 1e-6 * aux                  # transformers' own, summed in float32
    want = mixtral["ce_first"] + 0.02 * mixtral["aux_first"]
    assert abs(loss - want) <= 1e-12 * want, f"{loss!r} vs {want!r}"


def test_mixtral_round_trip_loads_in_transformers(mixtral, tmp_path):
    """HF -> mpicube checkpoint -> HF: transformers loads the export with
    every tensor equal to the original's."""
    import subprocess
    import sys

    import torch
    import transformers

    for src, dst, to in ((mixtral["dir"], tmp_path / "run", "mpicube"), (tmp_path / "run", tmp_path / "hf", "hf")):
        proc = subprocess.run([sys.executable, "-m", "mpicube", "convert", str(src), str(dst), "--to", to],
                              capture_output=True, text=True, env={"PYTHONPATH": str(ROOT), "PATH": ""}, timeout=120)
        assert proc.returncode == 0, proc.stderr
    a = transformers.MixtralForCausalLM.from_pretrained(str(mixtral["dir"]), dtype=torch.float64).state_dict()
    b = transformers.MixtralForCausalLM.from_pretrained(str(tmp_path / "hf"), dtype=torch.float64).state_dict()
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("field,value", [("shared_expert_intermediate_size", 64), ("scoring_func", "sigmoid"),
                                         ("router_jitter_noise", 0.1), ("num_experts_per_tok", 5),
                                         ("model_type", "qwen2_moe")])
def test_unsupported_mixture_is_refused_by_name(tmp_path, field, value):
    from mpicube.files.formats import hf_mixtral
    from mpicube.files.formats.base import FormatError

    doc = {"model_type": "mixtral", "vocab_size": VOCAB, "hidden_size": 16, "intermediate_size": 24,
           "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "num_local_experts": E,
           "num_experts_per_tok": K, "max_position_embeddings": T, field: value}
    assert hf_mixtral.is_mixtral_dir(tmp_path) is False                # no config.json yet
    (tmp_path / "config.json").write_text(json.dumps(doc))
    assert hf_mixtral.is_mixtral_dir(tmp_path)
    with pytest.raises(FormatError, match=field):
        hf_mixtral.parse_config(tmp_path, doc)
