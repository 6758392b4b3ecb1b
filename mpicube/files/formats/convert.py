"""``mpicube convert``: read a model in any format, write it in another.

Tensors are copied as they are (same dtype, same values), so mpicube ->
hf -> mpicube gives back the same bits, and so does mpicube -> llmc ->
mpicube for float32 models; llm.c files hold float32, so a float64 model
is rounded on the way there (and the command says so). A Llama model
writes a mpicube checkpoint or a ``LlamaForCausalLM`` directory
(``hf_llama.write``); llm.c's file has no place for it."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from ... import __version__
from . import FormatError, open_model


def _check_destination(dst: Path, to: str) -> None:
    if dst.exists() and not (dst.is_dir() and not any(dst.iterdir())):
        raise FormatError(f"{dst}: already exists; choose a new path (convert never overwrites)")
    if not dst.parent.is_dir():
        raise FormatError(f"{dst.parent}: no such directory")
    if to == "llmc" and dst.is_dir():
        raise FormatError(f"{dst}: an llm.c model is one file, not a directory")


def convert(src, dst, to: str, max_shard_bytes: int | None = None) -> dict:
    """Convert ``src`` (any format) to ``dst`` in format ``to``; returns a
    summary: source description, what was written, notes."""
    from . import hf, hf_deepseek_model, hf_llama, hf_mixtral, llmc

    dst = Path(dst)
    if to not in ("mpicube", "hf", "llmc"):
        raise FormatError(f"unknown format {to!r}; choose mpicube, hf or llmc")
    _check_destination(dst, to)
    notes = []
    with open_model(src, verify=True) as model:
        cfg = model.config
        if cfg.llama and to == "llmc":           # llm.c's file format holds GPT-2's tensors only
            raise FormatError(f"{src}: a Llama model converts to a mpicube checkpoint or a Hugging Face directory, "
                              "not to llmc (llm.c's GPT-2 file has no place for Llama's tensors)")
        model.require_memory(whole=True)         # every tensor is held at once
        tensors = model.read_all()
        buffers = model.read_buffers()           # a sigmoid router's bias: the file's, else the model's zeros
        source = model.describe()
        kind = model.kind
        step = model.step
    dtypes = sorted({str(t.dtype) for t in tensors.values()})
    if to == "llmc" and any(t.dtype != np.float32 for t in tensors.values()):
        notes.append(f"note: llm.c files hold float32; the {', '.join(dtypes)} tensors were rounded to float32")
    if to == "hf" and cfg.moe and cfg.capacity_factor:
        notes.append(f"note: MixtralForCausalLM computes every routed token: the capacity factor "
                     f"{cfg.capacity_factor:g} is not in config.json")
    if to == "hf":
        if cfg.mla:
            written = hf_deepseek_model.write(dst, tensors, cfg, max_shard_bytes=max_shard_bytes, buffers=buffers)
        else:
            writer = hf_mixtral.write if cfg.moe else hf_llama.write if cfg.llama else hf.write
            written = writer(dst, tensors, cfg, max_shard_bytes=max_shard_bytes)
    elif to == "llmc":
        written = [llmc.write(dst, tensors, cfg)]
    else:
        written = [write_mpicube(dst, tensors, cfg, step, {"format": kind, "path": str(Path(src))}, buffers)]
    return {"source": source, "source_format": kind, "to": to, "destination": str(dst),
            "files": [str(p) for p in written], "config": cfg.to_dict(), "dtypes": dtypes, "notes": notes}


def write_mpicube(run_dir: Path, tensors: dict, cfg, step: int, source: dict, buffers: dict = None) -> Path:
    """A one-process mpicube checkpoint of whole tensors: ``run_dir``
    becomes a run directory whose ``ckpt/latest`` names it, so ``eval``,
    ``generate`` and ``train --init-from`` take ``run_dir`` itself.
    ``buffers`` ({name: whole tensor}, a router's bias) go where training
    writes them (``buffers/``)."""
    from .. import checkpoint

    blocks = [checkpoint.Block(name=f"{prefix}/{name}", local=np.asarray(t), shape=t.shape,
                               index=tuple(np.arange(n) for n in t.shape))
              for prefix, held in (("model", tensors), ("buffers", buffers or {})) for name, t in held.items()]
    attrs = {"config": json.dumps(cfg.to_dict()), "layout": json.dumps({"layout": "converted"}),
             "converted_from": json.dumps(source), "mpicube_version": __version__}
    return checkpoint.save(run_dir, step, blocks, attrs)


def parse_size(text: str) -> int:
    """"2GB", "500MB", "64KiB" or a number of bytes -> bytes."""
    units = {"": 1, "B": 1, "KB": 10 ** 3, "MB": 10 ** 6, "GB": 10 ** 9, "KIB": 2 ** 10, "MIB": 2 ** 20,
             "GIB": 2 ** 30}
    s = text.strip().upper()
    digits = s.rstrip("KMGIB")
    try:
        value = float(digits) * units[s[len(digits):]]
    except (ValueError, KeyError):
        raise FormatError(f"--max-shard-size {text!r}: expected a size such as 2GB, 500MB or 1048576") from None
    if value < 1:
        raise FormatError(f"--max-shard-size {text!r} must be at least one byte")
    return int(value)
