"""Hostile Hugging Face directories and llm.c model files (issue 24):
headers and configurations that lie about sizes, values of the wrong type,
JSON that no parser should swallow whole, paths that are not files. Each
is made here from a tiny real model (tests/gpt2_files.py), and each names
the one-line error every command that reads a model must give for it.

``make_cases(root)`` writes them all and returns ``Case``s;
``ENTRY_POINTS`` are the commands each goes through. Run as a script,
``python tests/hostile_models.py CASES.json`` runs commands in one process
through the real entry point, like tests/cli_cases.py, and adds each one's
seconds and the process's peak address space, so a test can run the lot
under an address-space limit.
"""

from __future__ import annotations

import json
import os
import struct
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from gpt2_files import hf_config, random_gpt2, write_hf, write_llmc

from mpicube.core.config import ModelConfig

TINY = ModelConfig(vocab_size=256, n_ctx=16, n_layer=1, n_head=2, n_embd=16)
LLAMA_TINY = ModelConfig(vocab_size=256, n_ctx=16, n_layer=1, n_head=2, n_embd=16, arch="llama", n_kv_head=1,
                         ffn_hidden=24)
I32_MAX = 2 ** 31 - 1
MAGIC, FLOAT32 = 20240326, 3


@dataclass
class Case:
    name: str
    path: Path
    expect: str            # a regex the one error line must match


def llmc_header(path: Path, max_t=16, vocab=256, layers=1, heads=2, channels=16, padded=256, version=FLOAT32,
                body: int = 0, apparent: int = None) -> Path:
    """An llm.c header with these fields, then ``body`` zero bytes; with
    ``apparent``, the file is made that long by a hole (no disk used)."""
    header = np.zeros(256, "<i4")
    header[:8] = (MAGIC, version, max_t, vocab, layers, heads, channels, padded)
    with open(path, "wb") as f:
        f.write(header.tobytes() + b"\0" * body)
        if apparent is not None:
            f.truncate(apparent)
    return path


def llmc_bytes(cfg: ModelConfig, padded: int) -> int:
    """What an honest float32 llm.c file of ``cfg`` weighs, header included."""
    return 1024 + 4 * (cfg.n_params() + (padded - cfg.vocab_size) * cfg.n_embd)


def hf_with(root: Path, name: str, tensors: dict, text: str = None, **config) -> Path:
    """The tiny model as a Hugging Face directory whose config.json has
    ``config`` merged in, or is ``text`` itself."""
    path = write_hf(root / name, tensors, TINY, **config)
    if text is not None:
        (path / "config.json").write_text(text)
    return path


def safetensors_file(path: Path, header: dict, data: bytes = b"", length: int = None) -> None:
    """A safetensors file written by hand: 8-byte header length, JSON header, data."""
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw) if length is None else length) + raw + data)


def make_cases(root: Path) -> list:
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    t = random_gpt2(TINY, seed=3)
    good = write_llmc(root / "good.bin", t, TINY)
    honest = good.stat().st_size
    cases = []

    def llmc(name, expect, **fields):
        cases.append(Case(name, llmc_header(root / f"{name}.bin", **fields), expect))

    # llm.c headers that lie about the file behind them (all over the tiny model's real size)
    body = honest - 1024
    truncated = r"truncated: the header describes .* but the file has"
    llmc("llmc-layers-2^31", truncated, layers=I32_MAX, body=body)
    llmc("llmc-width-2^31", truncated, heads=1, channels=I32_MAX, body=body)
    llmc("llmc-vocab-2^31", truncated, vocab=I32_MAX, padded=I32_MAX, body=body)
    llmc("llmc-context-2^31", truncated, max_t=I32_MAX, body=body)
    llmc("llmc-longer", r"longer than its header says", body=body + 4096)
    llmc("llmc-negative-layers", r"n_layer must be a positive integer, got -1", layers=-1, body=body)
    llmc("llmc-zero-heads", r"n_head must be a positive integer, got 0", heads=0, body=body)
    llmc("llmc-padded-below-vocab", r"padded_vocab_size 128 is smaller than vocab_size 256", padded=128, body=body)
    (root / "empty.bin").write_bytes(b"")
    cases.append(Case("llmc-empty", root / "empty.bin", r"too short for an llm.c model header"))
    # Honest headers over sparse files: sizes agree, but the model cannot be held.
    many = ModelConfig(vocab_size=1, n_ctx=1, n_layer=2 ** 24, n_head=1, n_embd=1)
    llmc("llmc-sparse-16M-layers", r"n_layer 16,777,216: 201,326,596 parameter tensors.* needs at least",
         max_t=1, vocab=1, layers=many.n_layer, heads=1, channels=1, padded=1, apparent=llmc_bytes(many, 1))
    wide = ModelConfig(vocab_size=2 ** 26, n_ctx=16, n_layer=1, n_head=2, n_embd=16)
    llmc("llmc-sparse-4GiB", r"needs at least .* of (address space|memory)", vocab=wide.vocab_size,
         padded=wide.vocab_size, apparent=llmc_bytes(wide, wide.vocab_size))
    os.mkfifo(root / "fifo.bin")
    cases.append(Case("llmc-fifo", root / "fifo.bin", r"fifo.bin: not a regular file or directory"))

    # Hugging Face configs that lie about the safetensors beside them, or are not what they say
    def hf(name, expect, text=None, **config):
        cases.append(Case(name, hf_with(root, name, t, text, **config), expect))

    hf("hf-layers-2^31", r"missing tensor 'transformer.h.1.ln_1.weight'.*describes n_layer 2,147,483,647",
       n_layer=I32_MAX)
    hf("hf-layers-4000-digits", r"missing tensor 'transformer.h.1.ln_1.weight'.*describes n_layer about 2\^",
       text=json.dumps(hf_config(TINY))[:-1] + ', "n_layer": ' + "9" * 4000 + "}")
    hf("hf-width-2^40", r"has shape \(256, 16\) but its configuration needs \(256, 1099511627776\)",
       n_embd=2 ** 40, n_head=1)
    hf("hf-vocab-2^62", r"has shape \(256, 16\) but its configuration needs \(4611686018427387904, 16\)",
       vocab_size=2 ** 62)
    hf("hf-n_embd-null", r"n_embd must be a positive integer, got None", n_embd=None)
    hf("hf-n_embd-object", r"n_embd must be a positive integer, got \{\}", n_embd={})
    hf("hf-n_layer-string", r"n_layer must be a positive integer, got '1'", n_layer="1")
    hf("hf-n_layer-float", r"n_layer must be a positive integer, got 1.0", n_layer=1.0)
    hf("hf-n_positions-true", r"n_ctx must be a positive integer, got True", n_positions=True)
    hf("hf-eps-1e400", r"layer_norm_epsilon Infinity is not a finite number",
       text=json.dumps(hf_config(TINY)).replace('"layer_norm_epsilon": 1e-05', '"layer_norm_epsilon": 1e400'))
    hf("hf-not-an-object", r"config.json: not a JSON object", text="[1, 2, 3]")
    hf("hf-nested-100k", r"config.json: cannot read it as JSON", text="[" * 100_000 + "]" * 100_000)
    big = hf_with(root, "hf-config-100MiB", t)
    with open(big / "config.json", "r+b") as f:
        f.truncate(100 << 20)                              # a hole: no disk used
    cases.append(Case("hf-config-100MiB", big, r"config.json: 104,857,600 bytes is too large"))
    lying = hf_with(root, "hf-safetensors-past-end", t)
    safetensors_file(lying / "model.safetensors", {"transformer.wte.weight": {
        "dtype": "F32", "shape": [I32_MAX, 16], "data_offsets": [0, I32_MAX * 64]}}, b"\0" * 64)
    cases.append(Case("hf-safetensors-past-end", lying, r"not a readable safetensors file"))
    huge = hf_with(root, "hf-safetensors-header-2^60", t)
    safetensors_file(huge / "model.safetensors", {}, length=2 ** 60)
    cases.append(Case("hf-safetensors-header-2^60", huge, r"not a readable safetensors file"))
    index = hf_with(root, "hf-index-list", t)
    (index / "model.safetensors").unlink()
    (index / "model.safetensors.index.json").write_text('{"weight_map": [1, 2]}')
    cases.append(Case("hf-index-list", index, r"not a safetensors index"))
    fifo = hf_with(root, "hf-fifo-config", t)
    (fifo / "config.json").unlink()
    os.mkfifo(fifo / "config.json")
    cases.append(Case("hf-fifo-config", fifo, r"not a model directory"))
    return cases + llama_cases(root)


def llama_dir(root: Path, name: str, tensors: dict, edit=None) -> Path:
    """The tiny Llama as a Hugging Face directory (mpicube's own writer),
    its config.json then changed by ``edit(doc)``."""
    from mpicube.files.formats import hf_llama

    path = root / name
    hf_llama.write(path, tensors, LLAMA_TINY)
    if edit is not None:
        doc = json.loads((path / "config.json").read_text())
        edit(doc)
        (path / "config.json").write_text(json.dumps(doc))
    return path


def llama_cases(root: Path) -> list:
    """Llama configurations mpicube does not compute (issue 33), each
    refused naming the field: a sliding window, biases, a rope type other
    than default and llama3 (either generation's field), a llama3 scaling
    without its factor, tied embeddings beside a stored lm_head, a head
    size other than hidden/heads, kv heads not dividing the heads. The
    first case, "llama-good", is the unchanged model."""
    from mpicube.model.gpt import gpt_params

    rng = np.random.default_rng(5)
    t = {d.name: (1.0 + 0.1 * rng.standard_normal(d.shape) if d.role == "norm" else
                  0.1 * rng.standard_normal(d.shape)).astype(np.float32) for d in gpt_params(LLAMA_TINY)}

    def old_rope(doc):
        del doc["rope_parameters"]
        doc["rope_scaling"] = {"type": "dynamic", "factor": 2.0}

    edits = [
        ("llama-good", None, ""),
        ("llama-sliding-window", lambda d: d.update(sliding_window=8), r"sliding_window = 8 is not supported"),
        ("llama-attention-bias", lambda d: d.update(attention_bias=True), r"attention_bias = true is not supported"),
        ("llama-mlp-bias", lambda d: d.update(mlp_bias=True), r"mlp_bias = true is not supported"),
        ("llama-rope-yarn", lambda d: d.update(rope_parameters={"rope_type": "yarn", "factor": 4.0}),
         r'rope_parameters.rope_type = "yarn" is not supported'),
        ("llama-rope-scaling-dynamic", old_rope, r'rope_scaling.rope_type = "dynamic" is not supported'),
        ("llama-llama3-no-factor", lambda d: d.update(rope_parameters={
            "rope_type": "llama3", "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16}), r"rope_parameters.factor must be a positive number"),
        ("llama-tied-with-lm-head", lambda d: d.update(tie_word_embeddings=True),
         r"unexpected tensor 'lm_head.weight'.*tie_word_embeddings"),
        ("llama-head-dim", lambda d: d.update(head_dim=4), r"head_dim = 4 is not supported"),
        ("llama-kv-heads", lambda d: d.update(num_key_value_heads=3),
         r"num_key_value_heads = 3 must divide num_attention_heads 2"),
    ]
    return [Case(name, llama_dir(root, name, t, edit), expect) for name, edit, expect in edits]


def entry_points(case: Case, out: Path) -> dict:
    """{command name: argv} that read ``case``'s model: every command that
    takes a model file given on the command line, one of each kind."""
    out = Path(out) / case.name
    return {
        "eval": ["eval", case.path, "--batches", "1", "--batch-size", "4"],
        "inspect": ["inspect", case.path],
        "convert": ["convert", case.path, out.with_name(case.name + "-converted"), "--to", "hf"],
        "train --init-from": ["train", "--init-from", case.path, "--out", out.with_name(case.name + "-run"),
                              "--steps", "1", "--batch-size", "4", "--seq-len", "16"],
    }


def vm_peak() -> int:
    """This process's peak address space in bytes (Linux; 0 elsewhere)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmPeak:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from cli_cases import run

    import resource

    def cpu():
        use = resource.getrusage(resource.RUSAGE_SELF)
        return use.ru_utime + use.ru_stime

    results = []
    for argv in json.loads(Path(sys.argv[1]).read_text()):
        t0, c0 = time.monotonic(), cpu()
        result = run([str(a) for a in argv])
        result["seconds"], result["cpu"] = time.monotonic() - t0, cpu() - c0
        results.append(result)
    print(json.dumps({"results": results, "vm_peak": vm_peak()}))
