"""Hugging Face GPT-2 directories: ``config.json`` and safetensors files
with ``transformers``' GPT2LMHeadModel names, read and written through the
``safetensors`` package's NumPy API (no torch).

GPT-2's linears are ``Conv1D`` modules whose weights are stored (in, out),
the orientation mpicube uses, so tensors map one to one:
``transformer.h.{i}.attn.c_attn.weight`` is mpicube's
``h.{i}.attn.c_attn.weight`` and so on; ``transformer.wte.weight`` is
``wte``. The LM head is tied: ``lm_head.weight`` is absent or equal to the
token embedding. OpenAI's original release stores the same names without
the ``transformer.`` prefix and keeps the attention mask buffers
(``h.{i}.attn.bias``, ``h.{i}.attn.masked_bias``), which are ignored.
A configuration mpicube's model cannot compute is refused by name.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np

from ..atomic import honour_umask

from ...core import memory
from ...core.config import ModelConfig
from .base import FormatError, ModelFile, check_shapes, first_missing, gpt2_shapes, model_config

CONFIG = "config.json"
SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
PREFIX = "transformer."
HEAD = "lm_head.weight"
BUFFERS = (".attn.bias", ".attn.masked_bias")      # causal-mask buffers of older transformers
# activation_function values that are GPT-2's tanh-approximated GELU
TANH_GELU = ("gelu_new", "gelu_pytorch_tanh")
READABLE = {"F64": np.float64, "F32": np.float32, "F16": np.float16}
MAX_JSON_BYTES = 64 << 20     # config.json is about a kilobyte, an index of 10,000 tensors about a megabyte


def is_hf_dir(path: Path) -> bool:
    return path.is_dir() and (path / CONFIG).is_file() and ((path / SINGLE).is_file() or (path / INDEX).is_file())


def inside(where: Path) -> Path:
    """``where`` (a file of a model directory) if it may be read, else a
    FormatError: the file, followed through any symbolic links, must lie
    inside the model directory, or - Hugging Face's cache, where
    ``MODEL/snapshots/REV/config.json`` links to ``../../blobs/SHA`` - inside
    the ``blobs`` directory of the repository that holds the snapshot. A
    link anywhere else is refused before the file is opened
    (docs/formats.md, "Symbolic links")."""
    where = Path(where)
    folder = os.path.realpath(where.parent)
    target = os.path.realpath(where)
    if _within(target, folder):
        return where
    snapshots = os.path.dirname(folder)
    if os.path.basename(snapshots) == "snapshots" and _within(target, os.path.join(os.path.dirname(snapshots),
                                                                                     "blobs")):
        return where
    raise FormatError(f"{where}: a symbolic link to {target}, outside the model directory (mpicube follows links "
                      f"inside it, and a Hugging Face cache snapshot's links into its ../../blobs only)")


def _within(path: str, folder: str) -> bool:
    return os.path.commonpath([path, folder]) == folder


def _safe_open(path: Path):
    from safetensors import safe_open

    inside(path)
    try:
        return safe_open(str(path), framework="numpy")
    except Exception as e:  # noqa: BLE001 - SafetensorError, OSError
        raise FormatError(f"{path}: not a readable safetensors file (truncated or corrupt?): {e}") from None


def read_json(where: Path, what: str):
    """The JSON document of a small file (config.json, the safetensors
    index), or a FormatError: a file larger than MAX_JSON_BYTES, unreadable,
    not JSON, or nested too deeply for the parser."""
    inside(where)
    try:
        size = where.stat().st_size
        if size <= MAX_JSON_BYTES:
            return json.loads(where.read_bytes())
    except (OSError, ValueError, RecursionError) as e:
        raise FormatError(f"{where}: cannot read it as JSON: {e}") from None
    raise FormatError(f"{where}: {size:,} bytes is too large for {what} (at most {MAX_JSON_BYTES:,})")


def parse_config(path: Path, doc) -> ModelConfig:
    """The ModelConfig of a GPT-2 ``config.json``, or a FormatError naming
    the setting that mpicube's GPT-2 does not compute. Any JSON document
    gives one or the other (the sizes are checked before they are used)."""
    where = path / CONFIG
    if not isinstance(doc, dict):
        raise FormatError(f"{where}: not a JSON object")
    model_type = doc.get("model_type")
    if model_type != "gpt2":
        raise FormatError(f"{where}: model_type {_shown(model_type, repr)} is not 'gpt2'; mpicube reads GPT-2 "
                          "models only")
    missing = [k for k in ("n_layer", "n_head", "n_embd", "vocab_size") if k not in doc]
    if "n_positions" not in doc and "n_ctx" not in doc:
        missing.append("n_positions")
    if missing:
        raise FormatError(f"{where}: missing {', '.join(missing)}")
    cfg = model_config(where, doc["n_layer"], doc["n_head"], doc["n_embd"],
                       doc["n_positions"] if "n_positions" in doc else doc["n_ctx"], doc["vocab_size"])
    eps = doc.get("layer_norm_epsilon", 1e-5)
    # json reads 1e400 as inf: a number, but not one to compare or print as JSON
    finite = isinstance(eps, int) or (isinstance(eps, float) and math.isfinite(eps))
    if isinstance(eps, bool) or not finite:
        raise FormatError(f"{where}: layer_norm_epsilon {_shown(eps)} is not a finite number")
    refusals = [
        ("activation_function", doc.get("activation_function", "gelu_new") not in TANH_GELU,
         "mpicube's MLP uses the tanh-approximated GELU ('gelu_new')"),
        ("n_inner", doc.get("n_inner") not in (None, 4 * cfg.n_embd),
         "mpicube's MLP is 4 * n_embd wide"),
        ("layer_norm_epsilon", eps != 1e-5,
         "mpicube's LayerNorm uses eps 1e-5"),
        ("scale_attn_weights", doc.get("scale_attn_weights", True) is not True,
         "mpicube scales attention scores by 1/sqrt(head_dim)"),
        ("scale_attn_by_inverse_layer_idx", bool(doc.get("scale_attn_by_inverse_layer_idx", False)),
         "mpicube does not scale attention by the layer index"),
        ("add_cross_attention", bool(doc.get("add_cross_attention", False)),
         "mpicube's GPT-2 has no cross-attention"),
        ("tie_word_embeddings", doc.get("tie_word_embeddings", True) is not True,
         "mpicube's LM head is tied to the token embedding (wte)"),
        ("is_encoder_decoder", bool(doc.get("is_encoder_decoder", False)),
         "mpicube's GPT-2 is a decoder only"),
    ]
    for key, refused, why in refusals:
        if refused:
            raise FormatError(f"{where}: {key} = {_shown(doc.get(key))} is not supported: {why}")
    return cfg


def _shown(value, show=json.dumps) -> str:
    """A JSON value for a message, cut short (a refused value may be a
    megabyte of nested lists)."""
    try:
        text = show(value)
    except (ValueError, RecursionError):
        text = type(value).__name__
    return text if len(text) <= 80 else text[:77] + "..."


class HFModel(ModelFile):
    kind = "hf"

    def __init__(self, path, check_head: bool = True):
        path = Path(path)
        cfg = parse_config(path, read_json(path / CONFIG, "a model configuration"))
        self.path = path                    # the files are opened (and counted) before the model is built
        self._files = {}                    # file name -> open safetensors handle
        try:
            self._map = self._weight_map()  # tensor name in the file -> file name
            self._check_described(cfg)
            super().__init__(path, cfg)
            self._locate()
            if check_head:
                self._check_head()
        except BaseException:
            self.close()
            raise

    def _weight_map(self) -> dict:
        if (self.path / INDEX).is_file():
            where = self.path / INDEX
            doc = read_json(where, "a safetensors index")
            weight_map = doc.get("weight_map") if isinstance(doc, dict) else None
            if not (isinstance(weight_map, dict) and all(isinstance(v, str) for v in weight_map.values())):
                raise FormatError(f"{where}: not a safetensors index (a JSON object with a 'weight_map')")
            for name in sorted(set(weight_map.values())):
                if "/" in name or name.startswith(".") or not (self.path / name).is_file():
                    raise FormatError(f"{where}: shard {name!r} is missing")
            held = {file: set(self._open(file).keys()) for file in set(weight_map.values())}   # each shard's names, once
            for name, file in weight_map.items():
                if name not in held[file]:
                    raise FormatError(f"{self.path / file}: has no tensor {name!r}, which {INDEX} places there")
            return dict(weight_map)
        return dict.fromkeys(self._open(SINGLE).keys(), SINGLE)

    def _check_described(self, cfg: ModelConfig) -> None:
        """Before the model's tensor list is built: every tensor that
        config.json implies is in the files, found by walking the names one
        at a time (a config claiming 2**31 layers stops at the first layer
        the files lack), and said with what each side holds."""
        prefix = PREFIX if PREFIX + "wte.weight" in self._map else ""
        missing = first_missing(cfg, lambda name: prefix + file_name(name) in self._map)
        if missing is None:
            return
        fname = prefix + file_name(missing)
        claim = ""
        if memory.tensor_count(cfg.n_layer) > len(self._map):
            held = sum(math.prod(self._open(f).get_slice(n).get_shape()) for n, f in self._map.items())
            claim = (f"; {CONFIG} describes n_layer {memory.format_count(cfg.n_layer)}: "
                     f"{memory.format_count(memory.tensor_count(cfg.n_layer))} tensors of "
                     f"{memory.format_count(cfg.n_params())} parameters, the files hold {len(self._map):,} "
                     f"tensors of {held:,}")
        raise FormatError(f"{self.path}: missing tensor {fname!r} (mpicube's {missing}; the model needs every "
                          f"GPT-2 parameter){claim}")

    def _open(self, file: str):
        if file not in self._files:
            self._files[file] = _safe_open(self.path / file)
        return self._files[file]

    def _locate(self) -> None:
        """Map mpicube names to file names; check dtypes, shapes and strays."""
        prefix = PREFIX if PREFIX + "wte.weight" in self._map else ""
        self.file_names = {name: prefix + file_name(name) for name in self.shapes}
        found, self._dtypes = {}, {}
        for name, fname in self.file_names.items():
            if fname not in self._map:
                continue
            sl = self._open(self._map[fname]).get_slice(fname)
            found[name] = tuple(sl.get_shape())
            code = sl.get_dtype()
            if code not in READABLE:
                hint = " (safetensors' NumPy API has no bfloat16: save the model in float32)" if code == "BF16" else ""
                raise FormatError(f"{self._where(fname)}: tensor {fname!r} has dtype {code}; "
                                  f"mpicube reads {', '.join(READABLE)}{hint}")
            self._dtypes[name] = np.dtype(READABLE[code])
        missing = [n for n in self.shapes if n not in found]
        if missing:
            raise FormatError(f"{self.path}: missing tensor {self.file_names[missing[0]]!r} (mpicube's "
                              f"{missing[0]}; the model needs every GPT-2 parameter)")
        check_shapes(self.path, found, self.shapes)
        known = set(self.file_names.values()) | {HEAD}
        for fname in self._map:
            if fname not in known and not fname.endswith(BUFFERS):
                raise FormatError(f"{self._where(fname)}: unexpected tensor {fname!r}: mpicube's GPT-2 has no such "
                                  "parameter")

    def _check_head(self) -> None:
        """An LM head that is stored must be the token embedding itself."""
        if HEAD not in self._map:
            return
        sl = self._open(self._map[HEAD]).get_slice(HEAD)
        wte_name = self.file_names["wte"]
        if tuple(sl.get_shape()) != self.shapes["wte"]:
            raise FormatError(f"{self._where(HEAD)}: {HEAD} has shape {tuple(sl.get_shape())}, unlike wte "
                              f"{self.shapes['wte']}: an untied LM head is not supported")
        rows = self.shapes["wte"][0]
        wte = self._open(self._map[wte_name]).get_slice(wte_name)
        step = max(1, (1 << 22) // max(1, self.shapes["wte"][1]))
        for lo in range(0, rows, step):
            hi = min(rows, lo + step)                    # safetensors slices do not clip
            if not np.array_equal(sl[lo:hi], wte[lo:hi]):
                raise FormatError(f"{self._where(HEAD)}: {HEAD} differs from {wte_name}: an untied LM head is not "
                                  "supported (mpicube ties it to the token embedding)")

    def _where(self, fname: str) -> Path:
        return self.path / self._map.get(fname, SINGLE)

    def dtype(self, name: str) -> np.dtype:
        return self._dtypes[name]

    def read_box(self, name: str, box: tuple) -> np.ndarray:
        fname = self.file_names[name]
        try:
            return self._open(self._map[fname]).get_slice(fname)[box]
        except FormatError:
            raise
        except Exception as e:  # noqa: BLE001
            raise FormatError(f"{self._where(fname)}: cannot read tensor {fname!r}: {e}") from None

    def describe(self) -> str:
        n = len(set(self._map.values()))
        files = f"{n} safetensors shards" if n > 1 else SINGLE
        return f"Hugging Face GPT-2 directory {self.path} ({files})"

    def close(self) -> None:
        self._files = {}


def file_name(name: str) -> str:
    """mpicube's parameter name -> GPT2LMHeadModel's, without the prefix."""
    return {"wte": "wte.weight", "wpe": "wpe.weight"}.get(name, name)


def config_json(cfg: ModelConfig) -> dict:
    """A config.json that ``transformers`` loads as GPT2LMHeadModel."""
    doc = {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "activation_function": "gelu_new",
        "n_layer": cfg.n_layer,
        "n_head": cfg.n_head,
        "n_embd": cfg.n_embd,
        "n_positions": cfg.n_ctx,
        "n_ctx": cfg.n_ctx,
        "n_inner": None,
        "vocab_size": cfg.vocab_size,
        "layer_norm_epsilon": 1e-5,
        "initializer_range": 0.02,
        "attn_pdrop": 0.0,
        "embd_pdrop": 0.0,
        "resid_pdrop": 0.0,
        "scale_attn_weights": True,
        "scale_attn_by_inverse_layer_idx": False,
        "reorder_and_upcast_attn": False,
        "tie_word_embeddings": True,
        "torch_dtype": "float32",
    }
    if cfg.vocab_size == 50257:          # GPT-2's BPE: <|endoftext|> begins and ends texts
        doc["bos_token_id"] = doc["eos_token_id"] = 50256
    return doc


def write(dst, tensors: dict, cfg: ModelConfig, max_shard_bytes: int | None = None) -> list:
    """Write a Hugging Face GPT-2 directory ``dst`` from {mpicube name:
    whole tensor} (``write_files``). Returns the files written."""
    dst = Path(dst)
    check_shapes(dst, {n: t.shape for n, t in tensors.items()}, gpt2_shapes(cfg))
    named = [(PREFIX + file_name(n), tensors[n]) for n in gpt2_shapes(cfg)]
    return write_files(dst, named, config_json(cfg), max_shard_bytes)


def write_files(dst: Path, named: list, config: dict, max_shard_bytes: int | None = None) -> list:
    """Write the tensors ``named`` [(file name, array)] and ``config`` as
    config.json into a new directory ``dst``: one ``model.safetensors``, or
    shards of at most ``max_shard_bytes`` with ``model.safetensors.index.json``.
    The directory appears complete or not at all. Returns the files written."""
    from safetensors.numpy import save_file

    named = [(fname, np.ascontiguousarray(array)) for fname, array in named]
    groups = [[]]
    size = 0
    for fname, array in named:
        if max_shard_bytes and groups[-1] and size + array.nbytes > max_shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append((fname, array))
        size += array.nbytes
    tmp = Path(tempfile.mkdtemp(prefix=f".{dst.name}.", dir=dst.parent))
    try:
        honour_umask(tmp, directory=True)      # mkdtemp's 0700 would keep the export from colleagues
        files = []
        if len(groups) == 1:
            save_file(dict(groups[0]), str(tmp / SINGLE), metadata={"format": "pt"})
            files.append(SINGLE)
        else:
            weight_map = {}
            for k, group in enumerate(groups, 1):
                shard = f"model-{k:05d}-of-{len(groups):05d}.safetensors"
                save_file(dict(group), str(tmp / shard), metadata={"format": "pt"})
                weight_map.update({fname: shard for fname, _ in group})
                files.append(shard)
            index = {"metadata": {"total_size": sum(a.nbytes for _, a in named)}, "weight_map": weight_map}
            (tmp / INDEX).write_text(json.dumps(index, indent=2) + "\n")
            files.append(INDEX)
        (tmp / CONFIG).write_text(json.dumps(config, indent=2) + "\n")
        files.append(CONFIG)
        for name in files:                     # safetensors writes its files 0600
            honour_umask(tmp / name)
        os.replace(tmp, dst)                 # dst does not exist or is an empty directory
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return [dst / f for f in files]
