"""Model files in and out: mpicube checkpoints, Hugging Face GPT-2
directories and llm.c model files (docs/design.md section 10).

``open_model(path)`` detects the format and returns a ``ModelFile``: the
model's configuration and every parameter under its GPT-2 name, in
mpicube's orientation, readable block by block. ``open_everywhere`` does
that on every rank of a job, with rank 0 checking the file first so a bad
file gives one message. ``load_params`` fills a rank's parameter store
with exactly its blocks; ``convert`` writes any of the three formats.

=========  =====================================  ======================
format     path                                   per-rank reads
=========  =====================================  ======================
mpicube    run dir, step dir or checkpoint.h5     HDF5 hyperslabs
hf         directory: config.json + safetensors   safetensors slices
llmc       file with magic 20240326               memory-mapped pages
=========  =====================================  ======================
"""

from __future__ import annotations

from pathlib import Path

from .base import FormatError, ModelFile

KINDS = ("mpicube", "hf", "llmc")
HDF5_SIGNATURE = b"\x89HDF\r\n\x1a\n"

__all__ = ["KINDS", "FormatError", "ModelFile", "detect", "open_model", "open_everywhere", "load_params"]


def detect(path) -> str:
    """Which of KINDS ``path`` holds, or a FormatError saying what was expected."""
    from ..checkpoint.format import CKPT_DIR, MAIN_FILE
    from . import hf, llmc

    p = Path(path)
    if not p.exists():
        raise FormatError(f"{p}: no such file or directory")
    if not p.is_dir() and not p.is_file():     # a FIFO would block the first read forever
        raise FormatError(f"{p}: not a regular file or directory (a model is a file or a directory)")
    if p.is_dir():
        if hf.is_hf_dir(p):
            return "hf"
        if (p / MAIN_FILE).is_file() or (p / CKPT_DIR).is_dir() or p.name == CKPT_DIR:
            return "mpicube"           # a run directory has a config.json of its own
        if (p / hf.CONFIG).is_file():
            found = sorted(x.name for x in p.iterdir() if x.suffix in (".bin", ".safetensors", ".h5", ".pt"))
            raise FormatError(f"{p}: has {hf.CONFIG} but no {hf.SINGLE} or {hf.INDEX} "
                              f"(mpicube reads safetensors only; found {', '.join(found) or 'no weights'})")
        raise FormatError(f"{p}: not a model directory (expected a mpicube run or checkpoint directory, "
                          f"or a Hugging Face GPT-2, Llama, Mixtral or DeepseekV3 directory with {hf.CONFIG} and {hf.SINGLE})")
    if p.name == hf.CONFIG or p.suffix == ".safetensors" or p.name == hf.INDEX:
        if hf.is_hf_dir(p.parent):
            return "hf"
        raise FormatError(f"{p}: a safetensors model needs {hf.CONFIG} and {hf.SINGLE} (or {hf.INDEX}) "
                          f"in its directory: pass the directory")
    try:
        with open(p, "rb") as f:
            head = f.read(8)
    except OSError as e:
        raise FormatError(f"{p}: cannot read it ({e.strerror})") from None
    if head == HDF5_SIGNATURE:
        return "mpicube"
    return "llmc"        # anything else must be an llm.c model file; its reader says what is wrong


def open_model(path, verify: bool = True) -> ModelFile:
    """Open any model file for reading. ``verify`` runs the checks that
    read data (checkpoint checksums, an HF head tied to wte); one rank
    does them, the others open with ``verify=False``."""
    from .. import checkpoint
    from . import hf, hf_deepseek_model, hf_llama, hf_mixtral, llmc, native

    kind = detect(path)
    if kind == "hf":
        p = Path(path)
        p = p if p.is_dir() else p.parent
        if hf_deepseek_model.is_deepseek_dir(p):   # before Mixtral's, which its shared experts would match
            return hf_deepseek_model.DeepseekHFModel(p, check_head=verify)
        if hf_mixtral.is_mixtral_dir(p):
            return hf_mixtral.MixtralHFModel(p, check_head=verify)
        if hf_llama.is_llama_dir(p):              # config.json's model_type says which reader
            return hf_llama.LlamaHFModel(p, check_head=verify)
        return hf.HFModel(p, check_head=verify)
    if kind == "llmc":
        return llmc.LlmcModel(path)
    return native.NativeModel(checkpoint.open_checkpoint(path, verify=verify))


def open_everywhere(mpi_world, path) -> ModelFile:
    """Every rank opens the same model; rank 0 checks it first (and names
    the file it resolved to), so a bad file is one error on every rank. A
    mpicube checkpoint's shards are hashed by all ranks, each its share
    (``checkpoint.open_checkpoint`` with the communicator), not by rank 0 alone."""
    from .. import checkpoint
    from ...parallel.comm import on_root
    from . import native

    def check():
        if detect(path) == "mpicube":
            with open_model(path, verify=False) as m:
                return "mpicube", str(m.ck.file)
        with open_model(path, verify=True) as m:
            return m.kind, str(m.path)

    kind, resolved = on_root(mpi_world, check)
    if kind == "mpicube":
        return native.NativeModel(checkpoint.open_checkpoint(resolved, verify=True, comm=mpi_world))
    return open_model(resolved, verify=False)


def load_params(model: ModelFile, store, fresh: tuple = (), seed: int = 0) -> None:
    """Read exactly this rank's block of every parameter of ``store`` from
    ``model`` (any format), after checking every shape. Parameters whose
    names start with one of ``fresh`` (MTP depths the file lacks:
    ``train --mtp-depth`` over a model without them) are not read: they
    get the initialisation ``store.initialize(seed)`` gives them, which
    depends on their global indices only, not on the layout."""
    from ...parallel.paramspec import init_block
    from .base import check_shapes

    new = {spec.name for spec in store.specs if spec.name.startswith(tuple(fresh))} if fresh else set()
    check_shapes(model.path, {n: model.shape(n) for n in model.names()},
                 {spec.name: tuple(spec.decl.shape) for spec in store.specs if spec.name not in new},
                 what="parameter")
    backend = store.backend
    with store.writing_master() as flat:        # rounds the 16-bit working copy afresh; --zero 1 keeps a chunk
        master = flat.dtype                     # master weights: float32 under 16-bit storage
        for spec in store.specs:
            lo, hi = store.offsets[spec.name]
            block = init_block(spec, seed) if spec.name in new else model.read(spec.name, index=spec.index,
                                                                               dtype=master)
            flat[lo:hi] = backend.asarray(block.reshape(-1), dtype=master)
    for name, value in store.persistent.items():     # buffers (a router's bias), bit for bit where the file has them
        held = model.buffer(name)
        if held is not None:
            if tuple(held.shape) != tuple(value.shape):
                raise FormatError(f"{model.path}: buffer {name!r} has shape {tuple(held.shape)} but this model "
                                  f"needs {tuple(value.shape)}")
            value[...] = backend.asarray(held, dtype=value.dtype)
