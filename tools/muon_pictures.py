"""Text pictures for docs/muon.md, drawn from the code: what the five
Newton-Schulz iterations of ``training.muon.newton_schulz`` do to the
singular values of a real update (a Gaussian 16 x 48 matrix, the
PyTorch orientation of a 48 -> 16 weight), iteration by iteration, and
how ``muon.orthogonalised`` cuts c_attn's columns under --muon-qkv split
and joint.

    PYTHONPATH=. python tools/muon_pictures.py
    PYTHONPATH=. python tools/muon_pictures.py --check docs/muon.md

--check exits 1 when the page's pictures differ from what the code draws
now (tests/test_muon.py runs it).
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import doc_pictures  # noqa: E402 (tools/, beside this file)

from mpicube.training import muon  # noqa: E402


def iterations() -> str:
    """Singular values (smallest, median, largest) after k = 0..5 steps."""
    G = np.random.default_rng(0).standard_normal((16, 48))
    G[0] *= 30.0                                                   # one direction dominates, as in a momentum
    lines = ["singular values of X_k (16 x 48 update, one row scaled 30x; X_0 = G / |G|_F):",
             "  k   smallest    median   largest"]
    for k in range(muon.NS_STEPS + 1):
        s = np.linalg.svd(muon.newton_schulz(G, steps=k), compute_uv=False)
        lines.append(f"  {k}   {s.min():8.4f}  {np.median(s):8.4f}  {s.max():8.4f}")
    return "\n".join(lines)


def qkv_split() -> str:
    """The column groups ``muon.column_groups`` orthogonalises apart, for
    GPT-2's c_attn and Llama's c_attn with grouped-query heads and SwiGLU's c_fc."""
    from mpicube.core.config import ModelConfig
    from mpicube.model.gpt import gpt_params

    models = {"gpt2": ModelConfig(vocab_size=61, n_ctx=16, n_layer=1, n_head=4, n_embd=16),
              "llama": ModelConfig(vocab_size=61, n_ctx=16, n_layer=1, n_head=4, n_embd=16, arch="llama",
                                   n_kv_head=2, ffn_hidden=12)}
    lines = ["columns of each first linear, one letter per matrix Newton-Schulz sees:"]
    for arch, cfg in models.items():
        for decl in gpt_params(cfg):
            if decl.role != "w_column" or not decl.name.startswith("h.0."):
                continue
            for mode in muon.QKV_MODES:
                row = "".join("abc"[k] * (hi - lo)
                              for k, (lo, hi) in enumerate(muon.column_groups(decl.shape[1], decl.groups, mode)))
                lines.append(f"  {arch:<6} {decl.name[4:]:<18} {str(decl.shape):<9} {mode:<6} {row}")
    return "\n".join(lines)


def pictures() -> dict:
    return {"iterations": iterations(), "qkv": qkv_split()}


if __name__ == "__main__":
    doc_pictures.main(__doc__, pictures, "tools/muon_pictures.py")
