"""llm.c model files (``gpt2_124M.bin`` as written by llm.c's
``train_gpt2.py`` and read by ``train_gpt2.c``).

A header of 256 int32 — magic 20240326, version (3: float32, 5: bfloat16),
max_seq_len, vocab_size, num_layers, num_heads, channels,
padded_vocab_size — then every parameter, float32 or bfloat16, in this
order, each layer's tensors stacked (L, ...)::

    wte (Vp, C)  wpe (maxT, C)  ln1w ln1b (L, C)  qkvw (L, 3C, C)  qkvb (L, 3C)
    attprojw (L, C, C)  attprojb (L, C)  ln2w ln2b (L, C)  fcw (L, 4C, C)  fcb (L, 4C)
    fcprojw (L, C, 4C)  fcprojb (L, C)  lnfw lnfb (C)

Matrices are PyTorch ``nn.Linear`` weights, (out, in): the transpose of
mpicube's (in, out). The vocabulary is padded to Vp (a multiple of 128 as
llm.c writes it) with zero rows, which mpicube never reads. The file is
memory-mapped, so a rank's block costs only the pages it touches.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ..atomic import atomic_write
from ...core import memory
from ...core.config import ModelConfig
from ...core.errors import ConfigError
from .base import FormatError, ModelFile, check_shapes, gpt2_shapes, model_config

MAGIC = 20240326
HEADER_INTS = 256
HEADER_BYTES = 4 * HEADER_INTS
FLOAT32, BFLOAT16 = 3, 5
VERSIONS = {FLOAT32: "float32", BFLOAT16: "bfloat16"}
VOCAB_MULTIPLE = 128                # llm.c pads the vocabulary to a multiple of this
TOKEN_SHARD_MAGIC = 20240520        # an llm.c data shard, which people pass by mistake
# per layer: (llm.c tensor, mpicube suffix, stored transposed)
LAYER_TENSORS = [
    ("ln1w", "ln_1.weight", False), ("ln1b", "ln_1.bias", False),
    ("qkvw", "attn.c_attn.weight", True), ("qkvb", "attn.c_attn.bias", False),
    ("attprojw", "attn.c_proj.weight", True), ("attprojb", "attn.c_proj.bias", False),
    ("ln2w", "ln_2.weight", False), ("ln2b", "ln_2.bias", False),
    ("fcw", "mlp.c_fc.weight", True), ("fcb", "mlp.c_fc.bias", False),
    ("fcprojw", "mlp.c_proj.weight", True), ("fcprojb", "mlp.c_proj.bias", False),
]


def padded_vocab(vocab_size: int) -> int:
    return -(-vocab_size // VOCAB_MULTIPLE) * VOCAB_MULTIPLE


def file_layout(cfg: ModelConfig, vocab_padded: int) -> list:
    """[(llm.c name, file shape, [(mpicube name, layer or None, transposed)])]
    in file order."""
    L, C = cfg.n_layer, cfg.n_embd
    layout = [("wte", (vocab_padded, C), [("wte", None, False)]),
              ("wpe", (cfg.n_ctx, C), [("wpe", None, False)])]
    shapes = gpt2_shapes(cfg)
    for tensor, suffix, transposed in LAYER_TENSORS:
        one = shapes[f"h.0.{suffix}"]
        file_shape = (L,) + (one[::-1] if transposed else one)
        layout.append((tensor, file_shape, [(f"h.{i}.{suffix}", i, transposed) for i in range(L)]))
    layout += [("lnfw", (C,), [("ln_f.weight", None, False)]), ("lnfb", (C,), [("ln_f.bias", None, False)])]
    return layout


def looks_like_llmc(path: Path) -> bool:
    """A file whose first int32 is llm.c's model magic."""
    try:
        with open(path, "rb") as f:
            head = f.read(4)
    except OSError:
        return False
    return len(head) == 4 and int(np.frombuffer(head, "<i4")[0]) == MAGIC


def read_header(path: Path) -> tuple:
    """(ModelConfig, version, padded vocabulary) from an llm.c model file,
    after checking magic, version and the file's size."""
    try:
        if not path.is_file():               # a FIFO or device would block or never end
            raise FormatError(f"{path}: not a regular file")
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(HEADER_BYTES)
    except OSError as e:
        raise FormatError(f"{path}: cannot read it ({e.strerror})") from None
    return parse_header(path, head, size)


def data_bytes(cfg: ModelConfig, vocab_padded: int, version: int) -> int:
    """Bytes of parameters after the header, by arithmetic on Python ints
    (no list of tensors, no overflow): the padded wte, then every other
    parameter once (``ModelConfig.n_params`` counts the real vocabulary)."""
    itemsize = 4 if version == FLOAT32 else 2
    count = cfg.n_params() + (vocab_padded - cfg.vocab_size) * cfg.n_embd
    return count * itemsize


def parse_header(path: Path, head: bytes, size: int) -> tuple:
    """``read_header`` on the first bytes of a file (up to HEADER_BYTES) and
    its size: any bytes give a result or a FormatError. The size the
    header describes is compared with the file's before anything is built."""
    header = np.frombuffer(head[:len(head) // 4 * 4], dtype="<i4")
    if header.size < 8:
        raise FormatError(f"{path}: too short for an llm.c model header ({size} bytes)")
    magic, version = int(header[0]), int(header[1])
    if magic == TOKEN_SHARD_MAGIC:
        raise FormatError(f"{path}: is an llm.c token shard (magic {magic}), not a model file")
    if magic != MAGIC:
        raise FormatError(f"{path}: wrong magic number {magic} (expected {MAGIC} for an llm.c model file)")
    if version not in VERSIONS:
        raise FormatError(f"{path}: llm.c model version {version} is not read (mpicube reads 3, float32, "
                          f"and 5, bfloat16, both with a padded vocabulary)")
    if size < HEADER_BYTES:
        raise FormatError(f"{path}: truncated: {size} bytes, shorter than the {HEADER_BYTES}-byte header")
    max_t, vocab, layers, heads, channels, vocab_padded = (int(v) for v in header[2:8])
    cfg = model_config(path, layers, heads, channels, max_t, vocab)
    if vocab_padded < vocab:
        raise FormatError(f"{path}: padded_vocab_size {vocab_padded} is smaller than vocab_size {vocab}")
    expected = HEADER_BYTES + data_bytes(cfg, vocab_padded, version)
    if size != expected:
        what = "truncated" if size < expected else "longer than its header says"
        count = (expected - HEADER_BYTES) // (4 if version == FLOAT32 else 2)
        raise FormatError(f"{path}: {what}: the header describes {count:,} {VERSIONS[version]} parameters "
                          f"({expected:,} bytes with the header; n_layer {layers:,}, n_embd {channels:,}, "
                          f"padded vocabulary {vocab_padded:,}) but the file has {size:,} bytes")
    return cfg, version, vocab_padded


class LlmcModel(ModelFile):
    kind = "llmc"

    def __init__(self, path):
        path = Path(path)
        cfg, self.version, self.vocab_padded = read_header(path)
        super().__init__(path, cfg)          # refuses a tensor list that cannot fit, before building it
        try:
            memory.require_address(path.stat().st_size, f"mapping {path}")
        except ConfigError as e:
            raise FormatError(str(e)) from None
        raw = np.memmap(path, dtype="<f4" if self.version == FLOAT32 else "<u2", mode="r", offset=HEADER_BYTES)
        self._views = {}                     # mpicube name -> (view in file order, transposed)
        offset = 0
        for _, shape, members in file_layout(cfg, self.vocab_padded):
            n = int(np.prod(shape))
            block = raw[offset:offset + n].reshape(shape)
            offset += n
            for name, layer, transposed in members:
                view = block if layer is None else block[layer]
                if name == "wte":
                    view = view[:cfg.vocab_size]            # the real vocabulary only
                self._views[name] = view.T if transposed else view
        check_shapes(path, {n: v.shape for n, v in self._views.items()}, self.shapes)

    def dtype(self, name: str) -> np.dtype:
        return np.dtype(np.float32)

    def read_box(self, name: str, box: tuple) -> np.ndarray:
        block = np.asarray(self._views[name][box])
        if self.version == BFLOAT16:          # bfloat16 is the top half of a float32
            block = (block.astype(np.uint32) << 16).view(np.float32)
        return block

    def describe(self) -> str:
        return (f"llm.c model file {self.path} (version {self.version}, {VERSIONS[self.version]}, "
                f"vocabulary {self.config.vocab_size} padded to {self.vocab_padded})")

    def close(self) -> None:
        self._views = {}


def write(dst, tensors: dict, cfg: ModelConfig) -> Path:
    """Write an llm.c model file (version 3, float32) from {mpicube name:
    whole tensor}; the vocabulary is padded with zero rows to a multiple of
    128 as llm.c expects. Written to a temporary file and renamed."""
    dst = Path(dst)
    check_shapes(dst, {n: t.shape for n, t in tensors.items()}, gpt2_shapes(cfg))
    vocab_padded = padded_vocab(cfg.vocab_size)
    header = np.zeros(HEADER_INTS, dtype="<i4")
    header[:8] = (MAGIC, FLOAT32, cfg.n_ctx, cfg.vocab_size, cfg.n_layer, cfg.n_head, cfg.n_embd, vocab_padded)

    def chunks():
        yield header.tobytes()
        for _, _, members in file_layout(cfg, vocab_padded):
            for name, _, transposed in members:
                t = np.asarray(tensors[name], dtype="<f4")
                yield np.ascontiguousarray(t.T if transposed else t).tobytes()
            if members[0][0] == "wte":
                yield np.zeros((vocab_padded - cfg.vocab_size, cfg.n_embd), dtype="<f4").tobytes()

    atomic_write(dst, chunks())
    return dst
