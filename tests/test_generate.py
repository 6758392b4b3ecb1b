"""Generation (issue 11): the key/value cache against the training
forward pass, sampling, tokenizers, and the same tokens for a seed on
several layouts."""

import numpy as np
import pytest
from conftest import TINY, last_json
from gpt2_files import random_gpt2, reference_greedy, write_llmc

from mpicube.model import kvcache
from mpicube import ops
from mpicube.core.config import ModelConfig
from mpicube.cli.generate import Sampler

pytestmark = pytest.mark.timeout(300)


def test_cached_attention_equals_training_attention():
    """Prefill of 5 positions, then 3 one at a time: the same outputs as
    causal attention over all 8 at once (float64)."""
    rng = np.random.default_rng(0)
    B, T, nh, hd = 2, 8, 3, 4
    qkv = rng.standard_normal((B, T, 3 * nh * hd))                     # (B, T, 3 C)
    want, _ = ops.attention_forward(qkv, nh)                            # (B, T, C)
    cache = kvcache.KVCache(np, B, nh, 16, hd, np.float64)
    got = [kvcache.cached_attention(qkv[:, :5], nh, cache, 0)]
    got += [kvcache.cached_attention(qkv[:, t:t + 1], nh, cache, t) for t in range(5, T)]
    assert np.allclose(np.concatenate(got, axis=1), want, rtol=1e-12, atol=1e-12)


def test_cached_attention_keeps_kv_heads_only():
    """Grouped-query attention (6 query heads over 2 kv heads): the cache
    holds 2 heads, and a prefill of 3 then 4 single positions give the
    training attention over the kv heads repeated for their query heads."""
    rng = np.random.default_rng(1)
    B, T, nh, nkv, hd = 2, 7, 6, 2, 4
    q = rng.standard_normal((B, T, nh * hd))                             # (B, T, nh hd)
    k, v = rng.standard_normal((2, B, T, nkv, hd))                       # (B, T, nkv, hd) each
    repeated = [np.repeat(t, nh // nkv, axis=2).reshape(B, T, nh * hd) for t in (k, v)]   # head i reads i // 3
    want, _ = ops.attention_forward(np.concatenate([q] + repeated, axis=-1), nh)        # (B, T, nh hd)
    qkv = np.concatenate([q, k.reshape(B, T, -1), v.reshape(B, T, -1)], axis=-1)        # (B, T, (nh + 2 nkv) hd)
    cache = kvcache.KVCache(np, B, nkv, 8, hd, np.float64)
    assert cache.k.shape == (B, nkv, 8, hd)
    got = [kvcache.cached_attention(qkv[:, :3], nh, cache, 0, nkv)]
    got += [kvcache.cached_attention(qkv[:, t:t + 1], nh, cache, t, nkv) for t in range(3, T)]
    assert np.allclose(np.concatenate(got, axis=1), want, rtol=1e-12, atol=1e-12)
    assert np.array_equal(cache.k[:, :, :T], k.transpose(0, 2, 1, 3))


def test_sampler():
    logits = np.array([0.0, 3.0, 1.0, 2.9, -1.0])
    assert Sampler(0.0, 0, 1)(logits) == 1                               # greedy
    assert {Sampler(1.0, 1, s)(logits) for s in range(20)} == {1}       # top-1 is greedy
    draws = [Sampler(1.0, 2, s)(logits) for s in range(200)]
    assert set(draws) == {1, 3} and 70 < draws.count(1) < 130            # p = 0.52 / 0.48
    a, b = Sampler(0.8, 0, 7), Sampler(0.8, 0, 7)
    assert [a(logits) for _ in range(50)] == [b(logits) for _ in range(50)]   # a seed fixes the draws


@pytest.fixture(scope="module")
def small_model(tmp_path_factory):
    """An llm.c file of a random 300-token model (not byte-level: tokens only)."""
    cfg = ModelConfig(vocab_size=300, n_ctx=48, n_layer=2, n_head=4, n_embd=16)
    tensors = random_gpt2(cfg, seed=11)
    path = write_llmc(tmp_path_factory.mktemp("gen") / "m.bin", tensors, cfg)
    return path, tensors, cfg


def test_cache_equals_recomputing_the_prefix(mpicube, small_model):
    """Greedy decoding with the cache, without it (the training forward over
    the whole prefix each step) and a plain NumPy GPT-2 give the same 12
    tokens; on 8 ranks (3-D) too."""
    path, tensors, cfg = small_model
    prompt = [5, 17, 299, 0]
    want = reference_greedy(tensors, cfg, prompt, 12)
    for extra, n in (([], 1), (["--no-cache"], 1), (["--layout", "3d"], 8), (["--layout", "3d", "--no-cache"], 8)):
        r = mpicube.run("generate", path, "--prompt-tokens", "5,17,299,0", "--max-new-tokens", "12",
                        "--temperature", "0", "--dtype", "float64", "--json", *extra, n=n)
        assert r.returncode == 0, r
        result = last_json(r.stdout)
        assert result["tokens"] == want, (extra, result["tokens"], want)
        assert result["text"] is None and result["prompt_tokens"] == prompt


def test_max_new_tokens_fits_the_context_or_is_clipped_with_a_note(mpicube, small_model):
    """The README's quick start asked a 64-position model for 64 (the old
    default) and 200 new tokens, and both were refused. Now the default
    takes what the context holds (48 - 4 here) and a larger request is
    clipped to it with one line saying so; the tokens are the greedy ones."""
    path, tensors, cfg = small_model
    want = reference_greedy(tensors, cfg, [5, 17, 299, 0], cfg.n_ctx - 4)
    for extra in ([], ["--max-new-tokens", "200"]):
        r = mpicube.run("generate", path, "--prompt-tokens", "5,17,299,0", "--temperature", "0", "--dtype", "float64",
                        "--json", *extra)
        assert r.returncode == 0, r
        assert last_json(r.stdout)["tokens"] == want, (extra, r)
        notes = [line for line in r.stdout.splitlines() if "clipped" in line]
        assert notes == ([] if not extra else [
            "--max-new-tokens 200 clipped to 44, the largest that fits: the prompt (4 tokens) plus the new ones "
            "fill the model's context of 48 positions"]), r


def test_byte_level_text_and_sampling_on_two_layouts(mpicube, tmp_path):
    r = mpicube.run("train", *TINY, "--steps", "3", "--out", "run")
    assert r.returncode == 0, r
    outs = []
    for layout, n in (("serial", 1), ("1d", 2)):
        r = mpicube.run("generate", "run", "--prompt", "def f(x):", "--max-new-tokens", "6", "--seed", "9",
                        "--top-k", "20", "--layout", layout, "--json", n=n)
        assert r.returncode == 0, r
        result = last_json(r.stdout)
        assert len(result["tokens"]) == 6 and result["prompt_tokens"] == list(b"def f(x):")
        assert result["text"] == bytes(result["tokens"]).decode("utf-8", errors="replace")
        assert r.stdout.startswith("def f(x):"), r
        outs.append(result["tokens"])
    assert outs[0] == outs[1]


def test_gpt2_text_without_tiktoken_is_one_clear_error(mpicube, tmp_path):
    try:
        import tiktoken  # noqa: F401
        pytest.skip("tiktoken is installed here")
    except ImportError:
        pass
    cfg = ModelConfig(vocab_size=50257, n_ctx=8, n_layer=1, n_head=2, n_embd=8)
    path = write_llmc(tmp_path / "g.bin", random_gpt2(cfg), cfg)
    r = mpicube.run("generate", path, "--prompt", "Hello")
    assert r.returncode == 2, r
    [line] = r.error_lines()
    assert "needs tiktoken" in line and "--prompt-tokens" in line
    r = mpicube.run("generate", path, "--prompt-tokens", "50256", "--max-new-tokens", "3", "--json")
    assert r.returncode == 0, r
    assert last_json(r.stdout)["text"] is None and len(last_json(r.stdout)["tokens"]) == 3


# --------------------------------------------------------------------------- Llama


LLAMA_PROMPT, LLAMA_NEW = [5, 17, 60, 0], 12
LLAMA_RUNS = {"serial, no cache": (1, ["--no-cache"]), "serial": (1, []), "1d tp 2": (2, ["--layout", "1d"]),
              "1d tp 4": (4, ["--layout", "1d"]), "3d 2x2x2": (8, ["--layout", "3d"])}   # tp 4: a kv head on 2 ranks


@pytest.fixture(scope="module")
def llama_generations(tmp_path_factory):
    """A random Llama (8 heads over 2 kv heads, vocabulary 61, Llama 3 rope
    scaling) as a Hugging Face directory, and its greedy continuation by
    ``mpicube generate`` (float64) in each of LLAMA_RUNS: {run: tokens}."""
    from mpirun import mpiexec

    from mpicube.core.config import RopeScaling
    from mpicube.files.formats import hf_llama
    from mpicube.model.gpt import gpt_params

    cfg = ModelConfig(vocab_size=61, n_ctx=24, n_layer=2, n_head=8, n_embd=32, arch="llama", n_kv_head=2,
                      ffn_hidden=24, rope_theta=500.0, rms_eps=1e-5, rope_scaling=RopeScaling(8.0, 1.0, 4.0, 16))
    rng = np.random.default_rng(4)
    tensors = {d.name: 1.0 + 0.2 * rng.standard_normal(d.shape) if d.role == "norm" else
               0.4 * rng.standard_normal(d.shape) for d in gpt_params(cfg)}
    path = tmp_path_factory.mktemp("llama") / "hf"
    hf_llama.write(path, tensors, cfg)
    tokens = {}
    for name, (n, extra) in LLAMA_RUNS.items():
        proc = mpiexec(n, ["-m", "mpicube", "generate", path, "--prompt-tokens", ",".join(map(str, LLAMA_PROMPT)),
                           "--max-new-tokens", LLAMA_NEW, "--temperature", "0", "--dtype", "float64", "--json",
                           *extra], timeout=180)
        assert proc.returncode == 0, (name, proc.stdout + proc.stderr)
        tokens[name] = last_json(proc.stdout)["tokens"]
    return path, tokens


def test_llama_generates_alike_on_every_layout(llama_generations):
    """Greedy tokens with the KV cache (kv heads only) equal the uncached
    training forward's, on serial, 1-D tp 2, 1-D tp 4 (each kv head
    replicated on the 2 ranks of its query heads) and 3-D on 8 ranks."""
    _, tokens = llama_generations
    want = tokens["serial, no cache"]
    assert len(want) == LLAMA_NEW and len(set(want)) > 3, want      # not one token over and over
    for name, got in tokens.items():
        assert got == want, (name, got, want)


def test_llama_greedy_tokens_are_transformers(llama_generations, monkeypatch):
    """transformers' ``generate(do_sample=False)`` (float64 norms and rotary
    angles, its frequencies computed in float64) continues the prompt with
    mpicube's tokens."""
    torch = pytest.importorskip("torch", reason="torch is not installed (optional check)")
    transformers = pytest.importorskip("transformers", reason="transformers is not installed (optional check)")
    import hf_float64

    path, tokens = llama_generations
    hf_float64.patch(monkeypatch, torch, transformers.models.llama.modeling_llama)
    model = transformers.LlamaForCausalLM.from_pretrained(str(path), dtype=torch.float64,
                                                          attn_implementation="sdpa").eval()
    model.generation_config.eos_token_id = model.generation_config.pad_token_id = None
    prompt = torch.tensor([LLAMA_PROMPT])                                # (1, 4); token 0 is a token, not padding
    with torch.no_grad():
        out = model.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False,
                             max_new_tokens=LLAMA_NEW, pad_token_id=-1)
    assert out[0, len(LLAMA_PROMPT):].tolist() == tokens["serial"]
