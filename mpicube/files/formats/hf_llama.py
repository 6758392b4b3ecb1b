"""Hugging Face Llama directories (``LlamaForCausalLM``): ``config.json``
and safetensors files, read through the ``safetensors`` package's NumPy
API (no torch) on any layout, each rank reading only its blocks, and
written (``write``, for ``convert --to hf``) by the same table run
backwards.

How transformers' tensors map to mpicube's (``llama.llama_params``):

* ``nn.Linear`` stores (out, in); mpicube's linears are x @ W, (in, out),
  so every projection is read transposed;
* ``h.{i}.attn.c_attn.weight`` (h, (n_head + 2 n_kv) hd) is the columns
  [q_proj^T | k_proj^T | v_proj^T]; ``h.{i}.mlp.c_fc.weight`` (h, 2 F) is
  [gate_proj^T | up_proj^T]; o_proj and down_proj are c_proj;
* the norms (input_layernorm, post_attention_layernorm, model.norm) are
  ln_1, ln_2 and ln_f; embed_tokens is wte; ``lm_head.weight`` is
  ``lm_head`` (absent when tied).

No permutation of q or k: transformers' Llama rotates with ``rotate_half``
over the two halves of each head (its conversion script permuted Meta's
interleaved weights into that order once), and mpicube rotates the same
way (``ops.llama``), so head columns are taken as stored.

A configuration mpicube does not compute is refused by the field's name.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ...core.config import MAX_DIM, ModelConfig, RopeScaling, float_problem
from .base import FormatError, ModelFile, check_shapes, first_missing, gpt2_shapes
from .hf import CONFIG, READABLE, HFModel, _shown, read_json, write_files

MODEL = "model."
ROPE_TYPES = ("default", "llama3")


def is_llama_dir(path: Path) -> bool:
    """Whether the Hugging Face directory's config.json names a Llama model."""
    try:
        doc = read_json(path / CONFIG, "a model configuration")
    except FormatError:
        return False                  # the GPT-2 reader says what is wrong with it
    return isinstance(doc, dict) and doc.get("model_type") == "llama"


def _rope(where: Path, doc: dict) -> tuple:
    """(theta, RopeScaling or None) from
    ``rope_parameters`` (transformers 5: rope_type, rope_theta and the
    scaling's keys in one object) or ``rope_theta`` and ``rope_scaling``
    (earlier versions; rope_type once spelled ``type``). Rope types other
    than "default" and "llama3" are refused naming the field."""
    field = "rope_parameters" if doc.get("rope_parameters") is not None else "rope_scaling"
    params = doc.get(field) or {}
    if not isinstance(params, dict):
        raise FormatError(f"{where}: {field} = {_shown(params)} is not a JSON object")
    theta = params.get("rope_theta", doc.get("rope_theta", 10000.0))
    if why := float_problem("rope_theta", theta):
        name = f"{field}.rope_theta" if "rope_theta" in params else "rope_theta"
        raise FormatError(f"{where}: {name} = {_shown(theta)} is not supported: it {why}")
    kind = params.get("rope_type", params.get("type", "default"))
    if kind not in ROPE_TYPES:
        raise FormatError(f"{where}: {field}.rope_type = {_shown(kind)} is not supported: mpicube implements the "
                          f"rope types {' and '.join(ROPE_TYPES)}")
    partial = params.get("partial_rotary_factor", doc.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        raise FormatError(f"{where}: partial_rotary_factor = {_shown(partial)} is not supported: mpicube rotates "
                          "every column of a head")
    scaling = None
    if kind == "llama3":
        try:
            scaling = RopeScaling.from_dict(params, field)
        except ValueError as e:
            raise FormatError(f"{where}: {e}") from None
    return theta, scaling


def parse_config(path: Path, doc) -> ModelConfig:
    """The ModelConfig of a Llama ``config.json``, or a FormatError naming
    the field mpicube's Llama does not compute."""
    where = path / CONFIG
    if not isinstance(doc, dict):
        raise FormatError(f"{where}: not a JSON object")
    sizes = {"vocab_size": "vocab_size", "n_layer": "num_hidden_layers", "n_head": "num_attention_heads",
             "n_embd": "hidden_size", "ffn_hidden": "intermediate_size", "n_ctx": "max_position_embeddings"}
    values = {}
    for ours, theirs in sizes.items():
        value = doc.get(theirs)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise FormatError(f"{where}: {theirs} = {_shown(value)} is not a positive integer")
        if value > MAX_DIM:                    # a context of 2**40 would convert into a checkpoint nothing reads
            raise FormatError(f"{where}: {theirs} = {_shown(value)} is more than mpicube holds (at most "
                              f"{MAX_DIM:,}: shapes are int32-sized)")
        values[ours] = value
    kv = doc.get("num_key_value_heads", values["n_head"])
    if isinstance(kv, bool) or not isinstance(kv, int) or kv < 1 or values["n_head"] % kv:
        raise FormatError(f"{where}: num_key_value_heads = {_shown(kv)} must divide num_attention_heads "
                          f"{values['n_head']}")
    if values["n_embd"] % values["n_head"]:
        raise FormatError(f"{where}: hidden_size {values['n_embd']} is not divisible by num_attention_heads "
                          f"{values['n_head']}")
    theta, scaling = _rope(where, doc)
    eps = doc.get("rms_norm_eps", 1e-6)
    refusals = [
        ("head_dim", doc.get("head_dim") not in (None, values["n_embd"] // values["n_head"]),
         "mpicube's head size is hidden_size / num_attention_heads"),
        ("attention_bias", bool(doc.get("attention_bias", False)), "mpicube's Llama attention has no biases"),
        ("mlp_bias", bool(doc.get("mlp_bias", False)), "mpicube's Llama MLP has no biases"),
        ("hidden_act", doc.get("hidden_act", "silu") != "silu", "mpicube's SwiGLU gates with SiLU"),
        ("rms_norm_eps", float_problem("rms_eps", eps) is not None, f"it {float_problem('rms_eps', eps)}"),
        ("sliding_window", doc.get("sliding_window") is not None, "mpicube's attention is full causal"),
        ("tie_word_embeddings", not isinstance(doc.get("tie_word_embeddings", False), bool),
         "it must be true or false"),
    ]
    for key, refused, why in refusals:
        if refused:
            raise FormatError(f"{where}: {key} = {_shown(doc.get(key))} is not supported: {why}")
    return ModelConfig(arch="llama", n_kv_head=kv, rope_theta=float(theta), rms_eps=float(eps),
                       tie_embeddings=doc.get("tie_word_embeddings", False), rope_scaling=scaling, **values)


def sources(cfg: ModelConfig, name: str) -> tuple:
    """(parts, transposed) for mpicube's ``name``: the HF tensors whose
    columns (in mpicube's orientation) are concatenated into it, each as
    (HF name, width), and whether they are stored (out, in)."""
    if name == "wte":
        return [(MODEL + "embed_tokens.weight", cfg.n_embd)], False
    if name == "lm_head":
        return [("lm_head.weight", cfg.n_embd)], False
    if name == "ln_f.weight":
        return [(MODEL + "norm.weight", None)], False
    layer, suffix = name[2:].split(".", 1)                    # "h.{i}.<suffix>"
    p = f"{MODEL}layers.{layer}."
    q, kv = cfg.n_head * cfg.head_dim, cfg.kv_heads * cfg.head_dim
    table = {
        "ln_1.weight": ([(p + "input_layernorm.weight", None)], False),
        "ln_2.weight": ([(p + "post_attention_layernorm.weight", None)], False),
        "attn.c_attn.weight": ([(p + "self_attn.q_proj.weight", q), (p + "self_attn.k_proj.weight", kv),
                                (p + "self_attn.v_proj.weight", kv)], True),
        "attn.c_proj.weight": ([(p + "self_attn.o_proj.weight", cfg.n_embd)], True),
        "mlp.c_fc.weight": ([(p + "mlp.gate_proj.weight", cfg.ffn), (p + "mlp.up_proj.weight", cfg.ffn)], True),
        "mlp.c_proj.weight": ([(p + "mlp.down_proj.weight", cfg.n_embd)], True),
    }
    return table[suffix]


class LlamaHFModel(HFModel):
    """A ``LlamaForCausalLM`` directory as a ModelFile: blocks of mpicube's
    tensors assembled from slices of transformers' (the file handling is
    the GPT-2 reader's). A family built on Llama's (``hf_mixtral``) gives
    its own ``parse`` and ``table``."""

    parse = staticmethod(parse_config)          # config.json -> ModelConfig
    table = staticmethod(sources)               # mpicube's name -> transformers' tensors

    def __init__(self, path, check_head: bool = True):
        path = Path(path)
        cfg = self.parse(path, read_json(path / CONFIG, "a model configuration"))
        self.path, self._files = path, {}
        try:
            self._map = self._weight_map()
            cfg = self.stored_config(cfg)
            missing = first_missing(cfg, lambda n: all(f in self._map for f, _ in self.table(cfg, n)[0]))
            if missing is not None:
                absent = next(f for f, _ in self.table(cfg, missing)[0] if f not in self._map)
                raise FormatError(f"{self.path}: missing tensor {absent!r} (mpicube's {missing})")
            ModelFile.__init__(self, path, cfg)
            self._locate_llama()
        except BaseException:
            self.close()
            raise

    def _locate_llama(self) -> None:
        """Check every tensor's dtype and shape, and refuse strays (a stored
        lm_head in a tied model among them)."""
        cfg, found, self._dtypes = self.config, {}, {}
        for name, shape in self.shapes.items():
            parts, transposed = self.table(cfg, name)
            for fname, width in parts:
                sl = self._open(self._map[fname]).get_slice(fname)
                code = sl.get_dtype()
                if code not in READABLE:
                    raise FormatError(f"{self._where(fname)}: tensor {fname!r} has dtype {code}; mpicube reads "
                                      f"{', '.join(READABLE)} (save the model in float32)")
                self._dtypes[name] = np.dtype(READABLE[code])
                want = (shape[0],) if width is None else (width, shape[0]) if transposed else (shape[0], width)
                found[fname] = tuple(sl.get_shape())
                check_shapes(self.path, {fname: found[fname]}, {fname: want})
        for name, (fname, shape) in self.buffer_sources().items():
            if fname not in self._map:
                raise FormatError(f"{self.path}: missing tensor {fname!r} (mpicube's buffer {name})")
            sl = self._open(self._map[fname]).get_slice(fname)
            if sl.get_dtype() not in READABLE:
                raise FormatError(f"{self._where(fname)}: tensor {fname!r} has dtype {sl.get_dtype()}; mpicube "
                                  f"reads {', '.join(READABLE)} (save the model in float32)")
            found[fname] = tuple(sl.get_shape())
            check_shapes(self.path, {fname: found[fname]}, {fname: shape})
        for fname, shape in self.copies(cfg).items():          # stored copies of tensors read elsewhere
            if fname in self._map:
                found[fname] = tuple(self._open(self._map[fname]).get_slice(fname).get_shape())
                check_shapes(self.path, {fname: found[fname]}, {fname: shape})
        for fname in self._map:
            if fname not in found:
                why = "the model ties lm_head to embed_tokens (tie_word_embeddings)" if fname == "lm_head.weight" \
                    else "mpicube's Llama has no such parameter"
                raise FormatError(f"{self._where(fname)}: unexpected tensor {fname!r}: {why}")

    def read_box(self, name: str, box: tuple) -> np.ndarray:
        """Block ``box`` (slices, mpicube's orientation) of ``name``, from the
        column ranges of the HF tensors it is made of."""
        parts, transposed = self.table(self.config, name)
        if len(box) == 1:                                        # a norm weight
            return self._slice(parts[0][0], box)
        rows, cols = box
        pieces, start = [], 0
        for fname, width in parts:
            lo, hi = max(cols.start, start), min(cols.stop, start + width)
            if lo < hi:
                local = slice(lo - start, hi - start)
                pieces.append(self._slice(fname, (local, rows)).T if transposed else self._slice(fname, (rows, local)))
            start += width
        return np.concatenate(pieces, axis=1)

    def stored_config(self, cfg: ModelConfig) -> ModelConfig:
        """The configuration as the file's tensors hold it (``self._map``
        known): a family whose config.json counts modules a save may leave
        out (DeepSeek's MTP) gives its own; a Llama's is its config's."""
        return cfg

    def copies(self, cfg: ModelConfig) -> dict:
        """{HF tensor name: shape} of tensors a file may store as copies of
        others mpicube reads (DeepSeek's MTP embedding and head): accepted,
        not read. A Llama has none."""
        return {}

    def buffer_sources(self) -> dict:
        """{mpicube buffer name: (HF tensor name, shape)} of the persistent
        tensors that are not parameters (a family with a router bias gives
        its own; a Llama has none)."""
        return {}

    def buffer(self, name: str):
        table = self.buffer_sources()
        return self._slice(table[name][0], (slice(None),)) if name in table else None

    def _slice(self, fname: str, box: tuple) -> np.ndarray:
        try:
            return self._open(self._map[fname]).get_slice(fname)[box]
        except Exception as e:  # noqa: BLE001 - a damaged shard
            raise FormatError(f"{self._where(fname)}: cannot read tensor {fname!r}: {e}") from None

    def describe(self) -> str:
        n = len(set(self._map.values()))
        files = f"{n} safetensors shards" if n > 1 else "model.safetensors"
        return f"Hugging Face Llama directory {self.path} ({files})"


def config_json(cfg: ModelConfig, dtype: str = "float32") -> dict:
    """A config.json that transformers loads as ``LlamaForCausalLM`` and
    ``parse_config`` reads back as ``cfg``. The rotary settings are
    written both ways: ``rope_parameters`` (transformers 5) and
    ``rope_theta`` with ``rope_scaling`` (earlier versions). mpicube knows
    no tokenizer's special tokens, so bos/eos are left unset."""
    rope = {"rope_type": "default"} if cfg.rope_scaling is None else cfg.rope_scaling.to_dict()
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.n_embd,
        "intermediate_size": cfg.ffn,
        "num_hidden_layers": cfg.n_layer,
        "num_attention_heads": cfg.n_head,
        "num_key_value_heads": cfg.kv_heads,
        "head_dim": cfg.head_dim,
        "max_position_embeddings": cfg.n_ctx,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.rms_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": None if cfg.rope_scaling is None else cfg.rope_scaling.to_dict(),
        "rope_parameters": {**rope, "rope_theta": cfg.rope_theta},
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "tie_word_embeddings": cfg.tied,
        "initializer_range": 0.02,
        "bos_token_id": None,
        "eos_token_id": None,
        "dtype": dtype,
    }


def hf_tensors(cfg: ModelConfig, tensors: dict, table=sources, names=None) -> list:
    """[(HF name, array)] of mpicube's whole ``tensors``, by the table the
    reader uses (``sources``) run backwards: each HF tensor is its column
    range of the mpicube tensor, transposed back to (out, in) where
    transformers' ``nn.Linear`` stores it so. No other permutation.
    ``table``: a family built on Llama's gives its own (``hf_mixtral``,
    ``hf_deepseek``), and ``names`` the tensors it writes (default: the
    model's ``gpt2_shapes``)."""
    named = []
    for name in (gpt2_shapes(cfg) if names is None else names):
        parts, transposed = table(cfg, name)
        start = 0
        for fname, width in parts:
            t = tensors[name]
            if width is not None:                                 # (in, out) columns [start, start + width)
                t = t[:, start:start + width]
                t = t.T if transposed else t
                start += width
            named.append((fname, t))
    return named


def write(dst, tensors: dict, cfg: ModelConfig, max_shard_bytes: int | None = None) -> list:
    """Write a Hugging Face ``LlamaForCausalLM`` directory ``dst`` from
    {mpicube name: whole tensor} (one file or shards, ``hf.write_files``).
    Returns the files written."""
    dst = Path(dst)
    check_shapes(dst, {n: t.shape for n, t in tensors.items()}, gpt2_shapes(cfg))
    dtypes = sorted({str(t.dtype) for t in tensors.values()})
    return write_files(dst, hf_tensors(cfg, tensors), config_json(cfg, dtypes[-1]), max_shard_bytes)
