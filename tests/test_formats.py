"""Model files in and out (issue 11): round trips bit for bit, a GPT-2
vocabulary (50257) on every layout, Hugging Face and llm.c files written
here by hand, and one clear error for every refused or malformed file.

Every file is made by the test (tests/gpt2_files.py); nothing is
downloaded. Commands run under a real ``mpiexec``; the many one-line
refusals run through the real entry point in one process
(tests/cli_cases.py).
"""

import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import PYTHON, TINY, last_json, paired
from gpt2_files import (bf16_round, random_gpt2, reference_greedy, reference_logits, reference_loss, write_hf,
                        write_llmc)
from mpirun import job_env

from mpicube.files import checkpoint, data, formats
from mpicube.core.config import ModelConfig
from mpicube.files.formats.convert import convert

pytestmark = pytest.mark.timeout(600)

HERE = Path(__file__).resolve().parent
# GPT-2's vocabulary on a model small enough for 8 ranks on 2 cores; n_embd 16
# and n_head 4 fit 1-D p = 2, 2-D q = 2 and 3-D q = 2.
GPT2_SHAPED = ModelConfig(vocab_size=50257, n_ctx=32, n_layer=2, n_head=4, n_embd=16)
LAYOUTS = [("serial", 1), ("1d", 2), ("2d", 4), ("3d", 8)]


def model_tensors(path) -> dict:
    with checkpoint.open_checkpoint(path) as ck:
        return {n[len("model/"):]: ck.read(n) for n in ck.names() if n.startswith("model/")}


def run_cases(tmp_path, cases, cache=None) -> list:
    spec = tmp_path / "cases.json"
    spec.write_text(json.dumps([[str(a) for a in case] for case in cases]))
    env = job_env({"MPICUBE_CACHE": str(cache)} if cache else None, timeout=300)
    proc = subprocess.run([PYTHON, str(HERE / "cli_cases.py"), str(spec)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


# --------------------------------------------------------------------------- round trips


def test_round_trips_are_bit_for_bit(mpicube, tmp_path):
    r = mpicube.run("train", *TINY, "--vocab-size", "300", "--steps", "2", "--out", "run")
    assert r.returncode == 0, r
    source = model_tensors(tmp_path / "run")
    converts = [["run", "hf", "--to", "hf"], ["hf", "back_hf", "--to", "mpicube"],
                ["run", "m.bin", "--to", "llmc"], ["m.bin", "back_llmc", "--to", "mpicube"],
                ["run", "hf_sharded", "--to", "hf", "--max-shard-size", "8KB"]]
    evals = [["eval", model, "--dtype", "float64", "--batches", "2", "--batch-size", "4"]
             for model in ("run", "hf", "m.bin", "back_llmc")]
    inspects = [["inspect", "hf"], ["inspect", "m.bin"]]
    cases = [["convert", *c] for c in converts] + evals + inspects
    results = run_cases(tmp_path, cases, mpicube.env["MPICUBE_CACHE"])          # one process
    for res in results:
        assert res["status"] == 0, res
    for back in ("back_hf", "back_llmc"):
        got = model_tensors(tmp_path / back)
        assert got.keys() == source.keys()
        for name in source:
            assert got[name].dtype == source[name].dtype and np.array_equal(got[name], source[name]), (back, name)
    with formats.open_model(tmp_path / "hf_sharded") as m:
        assert "safetensors shards" in m.describe()
        assert all(np.array_equal(m.read(n), source[n]) for n in source)

    # the Hugging Face side, read with safetensors alone: transformers' names and Conv1D (in, out) weights
    from safetensors.numpy import load_file

    hf = load_file(str(tmp_path / "hf" / "model.safetensors"))
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["model_type"] == "gpt2" and config["activation_function"] == "gelu_new"
    assert (config["vocab_size"], config["n_positions"], config["n_embd"]) == (300, 16, 16)
    assert "lm_head.weight" not in hf and len(hf) == len(source)
    assert np.array_equal(hf["transformer.wte.weight"], source["wte"])
    assert hf["transformer.h.0.attn.c_attn.weight"].shape == (16, 48)
    assert np.array_equal(hf["transformer.h.0.mlp.c_proj.weight"], source["h.0.mlp.c_proj.weight"])

    # the llm.c side: header, the padded vocabulary, nn.Linear (out, in) weights in llm.c's order
    raw = (tmp_path / "m.bin").read_bytes()
    header = np.frombuffer(raw[:1024], "<i4")
    assert list(header[:8]) == [20240326, 3, 16, 300, 1, 2, 16, 384]
    body = np.frombuffer(raw[1024:], "<f4")
    wte = body[:384 * 16].reshape(384, 16)
    assert np.array_equal(wte[:300], source["wte"]) and not wte[300:].any()
    off = 384 * 16 + 16 * 16 + 2 * 16                            # wte, wpe, ln1w, ln1b
    qkvw = body[off:off + 48 * 16].reshape(48, 16)
    assert np.array_equal(qkvw, source["h.0.attn.c_attn.weight"].T)

    # converted models evaluate alike (float64 to 1e-9) and inspect reads them
    losses = [json.loads(res["out"][-1])["loss"] for res in results[len(converts):len(converts) + len(evals)]]
    assert max(losses) - min(losses) <= 1e-9 * losses[0], losses
    for res in results[-len(inspects):]:
        assert "result: OK" in res["out"] and any("h.0.attn.c_attn.weight" in line for line in res["out"]), res


# --------------------------------------------------------------------------- GPT-2's vocabulary everywhere


@pytest.fixture(scope="module")
def gpt2_shaped(tmp_path_factory):
    """The same random GPT-2-shaped model as an HF directory, an llm.c file
    and a mpicube run, plus a token shard of GPT-2 ids (some above 50000)."""
    d = tmp_path_factory.mktemp("gpt2")
    tensors = random_gpt2(GPT2_SHAPED, seed=1)
    write_hf(d / "hf", tensors, GPT2_SHAPED)
    write_llmc(d / "gpt2.bin", tensors, GPT2_SHAPED)
    convert(d / "hf", d / "run", "mpicube")
    tokens = np.random.default_rng(2).integers(0, GPT2_SHAPED.vocab_size, 4000)
    tokens[:10] = 50256
    data.write_shard(d / "tokens.bin", tokens)
    return d, tensors


def test_gpt2_vocabulary_converts_evaluates_and_generates_on_every_layout(mpicube, gpt2_shaped):
    d, tensors = gpt2_shaped
    files = [d / "hf", d / "gpt2.bin", d / "run", d / "hf"]            # a different format on each layout
    tokens = data.read_shard(d / "tokens.bin")
    x, y = zip(*[data.eval_batch(tokens, 4, 16, k) for k in range(2)])
    want = np.mean([reference_loss(tensors, GPT2_SHAPED, xb, yb) for xb, yb in zip(x, y)])
    prompt = [50256, 464, 3290]
    greedy = reference_greedy(tensors, GPT2_SHAPED, prompt, 6)
    sampled = []
    for (layout, n), model in zip(LAYOUTS, files):
        r = mpicube.run("eval", model, "--data", d / "tokens.bin", "--batch-size", "4", "--seq-len", "16",
                        "--batches", "2", "--dtype", "float64", "--layout", layout, n=n)
        assert r.returncode == 0, r
        got = last_json(r.stdout)["loss"]
        assert abs(got - want) <= 1e-9 * want, (layout, got, want)
        if layout in ("serial", "3d"):
            r = mpicube.run("generate", model, "--prompt-tokens", ",".join(map(str, prompt)), "--max-new-tokens",
                            "6", "--temperature", "0", "--dtype", "float64", "--layout", layout, "--json", n=n)
            assert r.returncode == 0, r
            assert last_json(r.stdout)["tokens"] == greedy, (layout, r)
        r = mpicube.run("generate", model, "--prompt-tokens", ",".join(map(str, prompt)), "--max-new-tokens", "8",
                        "--top-k", "40", "--seed", "5", "--layout", layout, "--json", n=n)
        assert r.returncode == 0, r
        sampled.append(last_json(r.stdout)["tokens"])
    assert all(s == sampled[0] for s in sampled) and len(set(sampled[0])) > 1, sampled


def test_init_from_each_format_reads_every_block_on_3d(mpicube, gpt2_shaped, tmp_path):
    """train --init-from on a 2x2x2 cube: with lr 0 the saved parameters are
    the file's, bit for bit, so every rank read exactly its block (vocabulary
    padding included: 50257 is odd)."""
    d, tensors = gpt2_shaped
    for name, model in (("from_llmc", d / "gpt2.bin"), ("from_hf", d / "hf")):
        r = mpicube.run("train", "--layout", "3d", "--init-from", model, "--data", d / "tokens.bin", "--seq-len", "8",
                        "--batch-size", "4", "--steps", "1", "--lr", "0", "--out", tmp_path / name, n=8)
        assert r.returncode == 0, r
        assert "vocab 50257" in r.stdout and "initialized parameters from" in r.stdout, r
        got = model_tensors(tmp_path / name)
        for key, want in tensors.items():
            assert np.array_equal(got[key], want), (name, key)


@pytest.mark.skipif(sys.version_info < (3, 9), reason="needs Python 3.9")
def test_logits_match_transformers(tmp_path):
    torch = pytest.importorskip("torch", reason="torch is not installed (optional check)")
    transformers = pytest.importorskip("transformers", reason="transformers is not installed (optional check)")
    cfg = ModelConfig(vocab_size=301, n_ctx=16, n_layer=2, n_head=2, n_embd=16)
    tensors = random_gpt2(cfg, seed=3)
    path = formats.hf.write(tmp_path / "hf", tensors, cfg)[0].parent
    model = transformers.GPT2LMHeadModel.from_pretrained(str(path)).eval()
    tokens = [1, 5, 300, 42, 7, 0, 299]
    with torch.no_grad():
        want = model(torch.tensor([tokens])).logits[0].double().numpy()
    got = reference_logits(formats.open_model(path).read_all(), cfg, tokens)
    assert np.allclose(got, want, rtol=1e-4, atol=1e-4)


# --------------------------------------------------------------------------- files by hand


def test_original_release_names_sharded_files_and_bfloat16(tmp_path):
    cfg = ModelConfig(vocab_size=50, n_ctx=8, n_layer=2, n_head=2, n_embd=8)
    tensors = random_gpt2(cfg, seed=4)
    # OpenAI's release: no "transformer." prefix, attention mask buffers, a head equal to wte
    mask = {f"h.{i}.attn.bias": np.tril(np.ones((1, 1, 8, 8), np.float32)) for i in range(2)}
    mask["lm_head.weight"] = tensors["wte"]
    write_hf(tmp_path / "release", tensors, cfg, prefix="", extra=mask)
    write_hf(tmp_path / "sharded", tensors, cfg, shards=3)
    write_llmc(tmp_path / "bf16.bin", tensors, cfg, version=5)
    for name in ("release", "sharded"):
        with formats.open_model(tmp_path / name) as m:
            assert m.config == cfg
            assert all(np.array_equal(m.read(n), t) for n, t in tensors.items()), name
    with formats.open_model(tmp_path / "bf16.bin") as m:
        assert all(np.array_equal(m.read(n), bf16_round(t)) for n, t in tensors.items())
        # a block with padding rows and a column block in three runs, as layouts ask for
        rows, cols = np.arange(45, 52), np.r_[0:2, 8:10, 16:18]
        block = m.read("wte", index=(rows, np.arange(8)))
        assert np.array_equal(block[:5], bf16_round(tensors["wte"])[45:50]) and not block[5:].any()
        got = m.read("h.1.attn.c_attn.weight", index=(np.arange(8), cols))
        assert np.array_equal(got, bf16_round(tensors["h.1.attn.c_attn.weight"])[:, cols])


def refusal_cases(root: Path):
    """(name, command, expected message) for every refused configuration
    and malformed file, each made here."""
    cfg = ModelConfig(vocab_size=50, n_ctx=8, n_layer=1, n_head=2, n_embd=8)
    t = random_gpt2(cfg, seed=5)
    cases = []

    def hf_case(name, expect, tensors=t, extra=None, **config):
        write_hf(root / name, tensors, cfg, extra=extra, **config)
        cases.append((name, ["eval", root / name], expect))

    hf_case("relu", r"activation_function = \"relu\" is not supported", activation_function="relu")
    hf_case("untied-config", r"tie_word_embeddings = false is not supported", tie_word_embeddings=False)
    hf_case("cross-attention", r"add_cross_attention = true is not supported", add_cross_attention=True)
    hf_case("layer-idx", r"scale_attn_by_inverse_layer_idx = true is not supported",
            scale_attn_by_inverse_layer_idx=True)
    hf_case("n-inner", r"n_inner = 16 is not supported", n_inner=16)
    hf_case("eps", r"layer_norm_epsilon = 1e-06 is not supported", layer_norm_epsilon=1e-6)
    hf_case("neo", r"model_type 'gpt_neo' is not 'gpt2'", model_type="gpt_neo")
    hf_case("untied-head", r"lm_head.weight differs from transformer.wte.weight: an untied LM head",
            extra={"lm_head.weight": t["wte"] + 1})
    hf_case("missing", r"missing tensor 'transformer.h.0.mlp.c_fc.bias'",
            tensors={k: v for k, v in t.items() if k != "h.0.mlp.c_fc.bias"})
    hf_case("shape", r"tensor 'h.0.attn.c_proj.weight' has shape \(8, 7\) but its configuration needs \(8, 8\)",
            tensors={**t, "h.0.attn.c_proj.weight": t["h.0.attn.c_proj.weight"][:, :7]})
    hf_case("stray", r"unexpected tensor 'transformer.h.0.crossattention.c_attn.weight'",
            extra={"transformer.h.0.crossattention.c_attn.weight": t["h.0.attn.c_attn.weight"]})
    write_hf(root / "truncated", t, cfg)
    st = root / "truncated" / "model.safetensors"
    st.write_bytes(st.read_bytes()[:-100])
    cases.append(("truncated-hf", ["inspect", root / "truncated"], r"not a readable safetensors file"))

    write_llmc(root / "good.bin", t, cfg)
    raw = (root / "good.bin").read_bytes()
    (root / "magic.bin").write_bytes(np.int32(20240999).tobytes() + raw[4:])
    (root / "short.bin").write_bytes(raw[:-12])
    (root / "v2.bin").write_bytes(raw[:4] + np.int32(2).tobytes() + raw[8:])
    data.write_shard(root / "shard.bin", np.arange(300))
    cases += [
        ("wrong-magic", ["generate", root / "magic.bin"], r"wrong magic number 20240999 \(expected 20240326"),
        ("truncated-llmc", ["eval", root / "short.bin"], r"truncated: the header describes .* but the file has"),
        ("llmc-v2", ["inspect", root / "v2.bin"], r"llm.c model version 2 is not read"),
        ("token-shard", ["train", "--init-from", root / "shard.bin", "--out", root / "x"],
         r"is an llm.c token shard \(magic 20240520\), not a model file"),
        ("bad-ids", ["eval", root / "good.bin", "--data", root / "shard.bin", "--seq-len", "4", "--batch-size", "1"],
         r"shard.bin: token 50 at position 50 is outside the model's vocabulary of 50"),
        ("too-long", ["generate", root / "good.bin", "--prompt-tokens", "1,2,3,4,5,6,7,8", "--max-new-tokens", "6"],
         r"the prompt \(8 tokens\) leaves no room in the model's context of 8 positions: the largest "
         r"--max-new-tokens that fits is 0"),
        ("no-tokenizer", ["generate", root / "good.bin", "--prompt", "hi"], r"has no known tokenizer"),
        ("not-a-model", ["convert", root, root / "y", "--to", "hf"], r"not a model directory"),
        ("exists", ["convert", root / "good.bin", root / "relu", "--to", "hf"], r"already exists"),
    ]
    return cases


def test_each_refusal_and_malformed_file_is_one_line_and_exit_2(tmp_path):
    cases = refusal_cases(tmp_path)
    results = run_cases(tmp_path, [argv for _, argv, _ in cases])
    for (name, _, expect), res in paired(cases, results):
        lines = res["out"] + res["err"]
        errors = [line for line in lines if line.startswith("error:")]
        assert res["status"] == 2 and len(errors) == 1, (name, res)
        assert re.search(expect, errors[0]), (name, errors[0])
        assert not any("Traceback" in line for line in lines), (name, res)


def test_a_bad_file_on_several_ranks_is_still_one_line(mpicube, tmp_path):
    (tmp_path / "junk.bin").write_bytes(b"\0" * 2048)
    r = mpicube.run("generate", tmp_path / "junk.bin", "--layout", "1d", n=2)
    assert r.returncode == 2, r
    [line] = r.error_lines()
    assert "junk.bin: wrong magic number 0" in line and not line.startswith("error: rank"), r
