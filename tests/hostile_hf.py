"""Hostile Hugging Face Llama and Mixtral directories, command-line floats,
contexts and token shards (issue 44, classes 5 to 9), each made from a tiny
real model, and each naming what every command that reads it must do.

``make_cases(root, out)`` writes them under ``root`` (targets no case may
open under ``root/outside``) and returns ``Case``s whose ``argv`` are
``mpicube`` commands writing under ``out``: a refusal must be one
``error:`` line, exit 2, leaving no run directory or conversion behind;
the valid-but-odd cases (a Hugging Face cache's snapshot linked into its
blobs, a link inside the directory, a context of 2**26 positions
generating two tokens) must work. tests/hostile_models.py runs the argvs
in one process.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from hostile_models import LLAMA_TINY

from mpicube.core.config import ModelConfig
from mpicube.files.shards import write_shard

MIXTRAL_TINY = ModelConfig(vocab_size=256, n_ctx=16, n_layer=1, n_head=2, n_embd=16, arch="llama", n_kv_head=1,
                           ffn_hidden=24, n_experts=2, top_k=1)
INF = "1e400"               # what json reads as inf


@dataclass
class Case:
    name: str
    argv: list
    expect: str = ""                               # regex of the one error line; "" for a command that works
    leaves: list = field(default_factory=list)     # paths that must not exist afterwards


def tensors(cfg: ModelConfig, seed: int = 5) -> dict:
    from mpicube.model.gpt import gpt_params

    rng = np.random.default_rng(seed)
    return {d.name: (1.0 + 0.1 * rng.standard_normal(d.shape) if d.role == "norm" else
                     0.1 * rng.standard_normal(d.shape)).astype(np.float32) for d in gpt_params(cfg)}


def model_dir(path: Path, cfg: ModelConfig, edit=None, text=None) -> Path:
    """The tiny Llama or Mixtral as a Hugging Face directory (mpicube's own
    writer), its config.json changed by ``edit(doc)`` or by replacing
    ``text`` = (old, new) in its JSON text."""
    from mpicube.files.formats import hf_llama, hf_mixtral

    (hf_mixtral if cfg.moe else hf_llama).write(path, tensors(cfg), cfg)
    doc = json.loads((path / "config.json").read_text())
    if edit is not None:
        edit(doc)
    raw = json.dumps(doc)
    if text is not None:
        assert text[0] in raw, (text, raw)
        raw = raw.replace(text[0], text[1])
    (path / "config.json").write_text(raw)
    return path


def readers(name: str, path: Path, out: Path, expect: str) -> list:
    """Every command that reads a model directory, as a Case each."""
    run, converted = out / f"{name}-run", out / f"{name}-converted"
    return [
        Case(f"{name} via eval", ["eval", path, "--batches", "1", "--batch-size", "4", "--seq-len", "16"], expect),
        Case(f"{name} via convert", ["convert", path, converted, "--to", "mpicube"], expect, [converted]),
        Case(f"{name} via train --init-from", ["train", "--init-from", path, "--out", run, "--steps", "1",
                                                "--batch-size", "4", "--seq-len", "16"], expect, [run]),
        Case(f"{name} via generate", ["generate", path, "--prompt-tokens", "1,2", "--max-new-tokens", "2"], expect),
    ]


def make_cases(root: Path, out: Path) -> list:
    root, out = Path(root), Path(out)
    outside = root / "outside"
    outside.mkdir(parents=True, exist_ok=True)
    cases = []
    llama = model_dir(root / "llama", LLAMA_TINY)
    cases += readers("llama-good", llama, out, "")

    # 5. every float of a config, one rule on both paths
    eps = '"rms_norm_eps": 1e-06'
    cases += readers("llama-eps-1e400", model_dir(root / "eps-inf", LLAMA_TINY, text=(eps, f'"rms_norm_eps": {INF}')),
                     out, r"rms_norm_eps = Infinity is not supported: it must be a finite number in \(0, 1\), got inf")
    cases += readers("llama-eps-2", model_dir(root / "eps-2", LLAMA_TINY, text=(eps, '"rms_norm_eps": 2.0')), out,
                     r"rms_norm_eps = 2.0 is not supported: it must be a finite number in \(0, 1\), got 2.0")
    cases += readers("llama-theta-1e400", model_dir(root / "theta-inf", LLAMA_TINY, text=(
        '"rope_theta": 10000.0', f'"rope_theta": {INF}')), out, r"rope_theta = Infinity is not supported: it must be "
                     r"a finite number in \(1, inf\), got inf")
    cases += readers("mixtral-aux-1e400", model_dir(root / "aux-inf", MIXTRAL_TINY, text=(
        '"router_aux_loss_coef": 0.02', f'"router_aux_loss_coef": {INF}')), out,
        r"router_aux_loss_coef = Infinity is not supported: it must be a finite number in \[0, 1000\], got inf")
    train = ["train", "--arch", "llama", "--layout", "serial", "--n-layer", "1", "--n-head", "2", "--n-embd", "16",
             "--seq-len", "16", "--batch-size", "4", "--steps", "1"]
    for option, value, expect in [("--rms-eps", "inf", r"--rms-eps must be a finite number in \(0, 1\), got inf"),
                                  ("--rms-eps", "nan", r"--rms-eps must be a finite number in \(0, 1\), got nan"),
                                  ("--rope-theta", "inf", r"--rope-theta must be a finite number in \(1, inf\), got inf"),
                                  ("--router-aux-loss-coef", "inf",
                                   r"--router-aux-loss-coef must be a finite number in \[0, 1000\], got inf")]:
        run = out / f"cli{option}-{value}"
        arch = ["--arch", "mixtral"] if "router" in option else []
        cases.append(Case(f"train {option} {value}", train + arch + [option, value, "--out", run], expect, [run]))

    # 6. a context that decides the memory
    cases += readers("llama-context-2^40", model_dir(root / "ctx-2^40", LLAMA_TINY, edit=lambda d: d.update(
        max_position_embeddings=2 ** 40)), out, r"max_position_embeddings = 1099511627776 is more than mpicube holds")
    wide = model_dir(root / "ctx-2^26", LLAMA_TINY, edit=lambda d: d.update(max_position_embeddings=2 ** 26))
    cases.append(Case("llama-context-2^26 generates 2 tokens", ["generate", wide, "--prompt-tokens", "1,2,3",
                                                                 "--max-new-tokens", "2", "--json"]))

    # 7. symbolic links out of a model directory
    def linked(name, rel, target_dir=outside):
        path = model_dir(root / name, LLAMA_TINY)
        target = (target_dir / f"{name}-{rel.replace('/', '-')}").resolve()
        shutil.move(path / rel, target)
        os.symlink(target, path / rel)
        return path
    outside_link = r"a symbolic link to .*outside.*, outside the model directory"
    cases += readers("link-weights-out", linked("link-weights", "model.safetensors"), out, outside_link)
    cases += readers("link-config-out", linked("link-config", "config.json"), out, outside_link)
    sharded = root / "link-shard"
    from mpicube.files.formats import hf_llama
    hf_llama.write(sharded, tensors(LLAMA_TINY), LLAMA_TINY, max_shard_bytes=20_000)
    shard = sorted(sharded.glob("model-*.safetensors"))[-1]
    shutil.move(shard, outside / shard.name)
    os.symlink((outside / shard.name).resolve(), shard)
    cases += readers("link-index-shard-out", sharded, out, outside_link)
    inner = model_dir(root / "link-inside", LLAMA_TINY)              # a link inside the directory: read
    (inner / "weights").mkdir()
    shutil.move(inner / "model.safetensors", inner / "weights" / "real.safetensors")
    os.symlink("weights/real.safetensors", inner / "model.safetensors")
    cases += readers("link-inside", inner, out, "")
    cases += readers("hf-cache", hf_cache(root / "hub" / "models--tiny--llama", "blobs"), out, "")
    cases += readers("hf-cache-link-past-blobs", hf_cache(root / "hub" / "models--tiny--evil", "../../outside"), out,
                     outside_link)

    # 9. a token past the vocabulary leaves no run directory behind
    good_tokens = np.arange(4096) % 256
    write_shard(root / "good.bin", good_tokens)
    for width, bad in (("uint16", 300), ("uint32", 70_000)):
        tokens = good_tokens.copy()
        tokens[1000] = bad
        write_shard(root / f"bad-{width}.bin", tokens)
        for which in ("train", "val"):
            data = [root / f"bad-{width}.bin", root / "good.bin"][:: 1 if which == "train" else -1]
            run = out / f"vocab-{which}-{width}"
            cases.append(Case(f"token {bad} in the {which} shard ({width})",
                              ["train", "--layout", "serial", "--n-layer", "1", "--n-head", "2", "--n-embd", "16",
                               "--seq-len", "16", "--batch-size", "4", "--steps", "1", "--data", data[0],
                               "--val-data", data[1], "--eval-every", "1", "--eval-batches", "1", "--out", run],
                              rf"bad-{width}.bin: token {bad} at position 1,000 is outside the model's vocabulary",
                              [run]))
    run = out / "vocab-init-from"                   # the vocabulary from a model file: refused before --out too
    cases.append(Case("token 300 in the train shard (uint16), --init-from", [
        "train", "--init-from", llama, "--seq-len", "16", "--batch-size", "4", "--steps", "1",
        "--data", root / "bad-uint16.bin", "--out", run],
        r"bad-uint16.bin: token 300 at position 1,000 is outside the model's vocabulary", [run]))
    run = out / "vocab-init-from-default-batch"     # the batch from the file's model: planned before --out
    cases.append(Case("token 300 in the train shard (uint16), --init-from, default batch", [
        "train", "--init-from", llama, "--seq-len", "16", "--steps", "1",
        "--data", root / "bad-uint16.bin", "--out", run],
        r"bad-uint16.bin: token 300 at position 1,000 is outside the model's vocabulary", [run]))
    return cases


def hf_cache(repo: Path, blobs: str) -> Path:
    """Hugging Face's cache layout: ``repo/snapshots/REV/*`` symbolic links
    to ``repo/blobs/NAME`` (``blobs``: the blobs folder, relative to repo,
    where the files really are); returns the snapshot directory."""
    repo.mkdir(parents=True)
    built = model_dir(repo / "built", LLAMA_TINY)
    store = (repo / blobs).resolve()
    store.mkdir(parents=True, exist_ok=True)
    snapshot = repo / "snapshots" / "0123abcd"
    snapshot.mkdir(parents=True)
    for f in sorted(built.iterdir()):
        blob = store / f"{repo.name}-{f.name}.blob"
        shutil.move(f, blob)
        os.symlink(os.path.relpath(blob, snapshot), snapshot / f.name)
    built.rmdir()
    return snapshot
