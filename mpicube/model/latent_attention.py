"""DeepSeek-V3's attention branch: multi-head latent attention (MLA) built
from the layout's linears and ``ops.mla``'s local math, with the four
calls of an attention branch (``forward(h, ctx)``, ``backward``,
``decode``, ``n_local_kv``; ``attention.SelfAttention`` is GPT-2's and
Llama's).

    h (B_c, T, C_c) --q_down (REPLICATED)--> cq (B_c, T, rq) --q_norm--> --q_up (COLUMN)--> q (B_m, T, nh qk)
                    (rq = 0: --q_proj (COLUMN)--> q)
    h --kv_down (REPLICATED)--> [c_kv | k_pe] (B_c, T, rkv + dr); c_kv --kv_norm--> --kv_up (COLUMN)--> kv
    (q, kv, k_pe) --ops.mla.pack--> the project's attention op (T x T, blockwise, the cp ring)
                  --ops.mla.unpack--> (B_m, T, nh dv) --c_proj (ROW)--> (B_c, T, C_c)

The latents come out of the REPLICATED down-projections whole on every
rank holding those rows. Where the canonical form splits the hidden size
over ``layout.hidden_comm`` (2-D, 2.5-D), a latent is held like a
canonical activation: this rank's block of its columns
(``layout.canonical_block``), normed with its statistics all-summed over
the hidden split, fed to the column-parallel up-projection (SUMMA), and
its gradient blocks all-gathered back into the whole latent gradient the
REPLICATED backward needs; on serial and 1-D the block is the whole
latent and nothing moves. The rotary key
part k_pe is shared by every head: the layout moves it to the rows the
heads attend over (``Layout.shared_key``: as it is; gathered along the
sequence under 1-D's --sequence-parallel; other rows on 3-D), and a rank
splitting the heads computes its gradient summed over its own heads
only, so ``Layout.shared_key_backward`` sums it over the other heads'
ranks (an all-reduce over ``head_comm``, a reduce-scatter along the
sequence, 3-D's reduce-scatter and all-reduce) before kv_down's
backward; the up-projections' input gradients are
already complete (a column-parallel linear sums dX over the same ranks).
The bug this guards against was found in torchtitan after ~1,000 steps
(PR #1373's review).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from .. import ops
from ..core.config import ModelConfig
from ..core.errors import ConfigError
from ..device.arrays import array_module
from ..ops import mla
from ..parallel.layouts.base import COLUMN, REPLICATED, ROW, Layout
from ..parallel.layouts.modules import RMSNorm
from ..parallel.params import ParamStore
from .dropout import Dropout, positions
from .tape import Micro, Saved


def mla_dims(cfg: ModelConfig) -> mla.MlaDims:
    """``ops.mla``'s sizes of ``cfg`` (YaRN's softmax factor where its rope scaling sets one)."""
    factor = getattr(cfg.rope_scaling, "softmax_factor", 1.0) if cfg.rope_scaling is not None else 1.0
    return mla.MlaDims(nope=cfg.qk_nope_head_dim, rope=cfg.qk_rope_head_dim, v=cfg.v_head_dim,
                       kv_rank=cfg.kv_lora_rank, q_rank=cfg.q_lora_rank, interleaved=cfg.rope_interleave,
                       softmax_factor=factor)


@dataclass
class LatentTape(Saved):
    """What ``LatentAttention`` keeps for backward."""

    q_down: object          # q_down's saved input (B_c, T, C_c), or None without a q latent
    q_norm: object          # the q latent norm's (normalised rows, 1/rms), or None
    q_up: object            # q_up's (or q_proj's) saved input
    kv_down: object         # kv_down's saved input (B_c, T, C_c)
    kv_norm: object         # the kv latent norm's
    kv_up: object           # kv_up's saved input (B_c, T, rkv) normed latent
    core: object            # the attention op's own saved activations
    positions: object       # (T,) the global positions q and k_pe were rotated at
    c_proj: object          # c_proj's saved input (B_m, T, nh dv)


class LatentAttention:
    """MLA of block ``prefix`` on this rank's heads ``layout.head_ids``
    around the op pair ``attention`` (``ops``, ``ops.attention_blocks``
    or the context-parallel ring)."""

    def __init__(self, layout: Layout, store: ParamStore, prefix: str, attention, dropout: Dropout, site: str):
        cfg = layout.cfg
        self.dims = mla_dims(cfg)
        if self.dims.v > self.dims.qk:
            raise ConfigError(f"--v-head-dim {self.dims.v} must be at most --qk-nope-head-dim + --qk-rope-head-dim "
                              f"{self.dims.qk} (the attention ops pad v to the query/key width)")
        hidden = layout.hidden_comm if layout.hidden_comm is not None and layout.hidden_comm.size > 1 else None
        self.hidden = hidden                           # the canonical hidden split the latents follow, or None
        self.kv_block = self._block(layout, cfg.kv_lora_rank, "--kv-lora-rank")   # (rkv_c,) this rank's columns
        self.q_down = self.q_norm = self.q_block = None
        if cfg.q_lora_rank:
            self.q_block = self._block(layout, cfg.q_lora_rank, "--q-lora-rank")
            self.q_down = layout.linear(store, prefix + ".q_down", REPLICATED, bias=False)
            self.q_norm = RMSNorm(store, prefix + ".q_norm", cfg.q_lora_rank, hidden, mla.LATENT_EPS)
            self.q_up = layout.linear(store, prefix + ".q_up", COLUMN, bias=False)
        else:
            self.q_up = layout.linear(store, prefix + ".q_proj", COLUMN, bias=False)
        self.kv_down = layout.linear(store, prefix + ".kv_down", REPLICATED, bias=False)
        self.kv_norm = RMSNorm(store, prefix + ".kv_norm", cfg.kv_lora_rank, hidden, mla.LATENT_EPS)
        self.kv_up = layout.linear(store, prefix + ".kv_up", COLUMN, bias=False)
        self.c_proj = layout.linear(store, prefix + ".c_proj", ROW, bias=False)
        self.layout = layout                           # places k_pe, which every head reads (shared_key)
        self.attention, self.dropout, self.site = attention, dropout, site
        self.n_local_heads = self.n_local_kv = len(layout.head_ids)
        self.n_seqs = len(layout.canonical_seqs)       # the latent cache's rows: the canonical ones (= mid here)
        self.full_masks = attention is ops
        self.theta, self.scaling = cfg.rope_theta, cfg.rope_scaling
        self._tables = {}

    def _block(self, layout, n: int, option: str):
        """This rank's columns of an n-wide latent: a slice, equal blocks over the hidden split."""
        cols = layout.canonical_block(n)
        if self.hidden is not None and len(cols) * self.hidden.size != n:
            raise ConfigError(f"{option} {n} must be divisible by the {self.hidden.size} ranks splitting the hidden "
                              f"size (a latent is split as the hidden size is)")
        return slice(int(cols[0]), int(cols[-1]) + 1)

    def _gather(self, dx):
        """dx (B_c, T, r_c), this rank's block of a latent's gradient -> (B_c, T, r), the whole."""
        return dx if self.hidden is None else self.hidden.allgather(array_module(dx).ascontiguousarray(dx), axis=-1)

    def tables(self, pos, like):
        """(cos, sin) (T, dr) at global positions ``pos`` (T,) in like's format and array module."""
        key = (tuple(np.asarray(pos).tolist()), like.dtype)
        if key not in self._tables:
            xp = array_module(like)
            self._tables[key] = tuple(xp.asarray(t, dtype=like.dtype)
                                      for t in ops.rope_tables(pos, self.dims.rope, self.theta, self.scaling))
        return self._tables[key]

    def _project(self, h, expand: bool = True):
        """h (B_c, T, C_c) -> (q (B_m, T, nh qk), kv (B_m, T, nh (dn + dv)), k_pe (B_c, T, dr), saved parts)."""
        s_qd = s_qn = None
        if self.q_down is not None:
            cq, s_qd = self.q_down.forward(h)                                  # (B_c, T, rq)
            cq, s_qn = self.q_norm.forward(cq[..., self.q_block])              # (B_c, T, rq_c)
            q, s_qu = self.q_up.forward(cq)                                    # (B_m, T, nh qk)
        else:
            q, s_qu = self.q_up.forward(h)                                     # (B_m, T, nh qk)
        ckv, s_kvd = self.kv_down.forward(h)                                   # (B_c, T, rkv + dr)
        c_kv, k_pe = mla.split_latent(ckv, self.dims.kv_rank)                  # (B_c, T, rkv), (B_c, T, dr)
        c_kv, s_kvn = self.kv_norm.forward(c_kv[..., self.kv_block])           # (B_c, T, rkv_c)
        kv, s_kvu = self.kv_up.forward(c_kv) if expand else (None, None)      # (B_m, T, nh (dn + dv))
        return q, kv, k_pe, c_kv, (s_qd, s_qn, s_qu, s_kvd, s_kvn, s_kvu)

    def forward(self, h, ctx: Micro):
        """h (B_c, T, C_c) -> (y (B_c, T, C_c), LatentTape)."""
        q, kv, k_pe, _, saved = self._project(h)
        k_pe = self.layout.shared_key(k_pe)                                    # (B_m, T, dr) the heads' rows
        T = q.shape[1]
        pos = positions(ctx, T)
        cos, sin = self.tables(pos, q)                                         # (T, dr)
        drop = self.dropout
        masks = drop.attention if self.full_masks else drop.attention_blocks
        qkv = mla.pack(q, kv, k_pe, self.n_local_heads, self.dims, cos, sin)   # (B_m, T, 3 nh qk)
        a, s_core = self.attention.attention_forward(qkv, self.n_local_heads, masks(ctx, self.site + ".attn", T),
                                                     drop.keep)                # (B_m, T, nh qk)
        y, s_proj = self.c_proj.forward(mla.unpack(a, self.n_local_heads, self.dims))   # (B_c, T, C_c)
        return y, LatentTape(*saved, s_core, pos, s_proj)

    def backward(self, dy, saved: LatentTape):
        """dy (B_c, T, C_c) -> dh (B_c, T, C_c)."""
        da = mla.unpack_backward(self.c_proj.backward(dy, saved.c_proj), self.dims)   # (B_m, T, nh qk)
        dqkv = self.attention.attention_backward(da, saved.core)                      # (B_m, T, 3 nh qk)
        cos, sin = self.tables(saved.positions, dqkv)
        dq, dkv, dk_pe = mla.pack_backward(dqkv, self.n_local_heads, self.dims, cos, sin)
        dk_pe = self.layout.shared_key_backward(dk_pe)  # k_pe is every head's: summed over all -> (B_c, T_c, dr)
        dc_kv = self._gather(self.kv_norm.backward(self.kv_up.backward(dkv, saved.kv_up), saved.kv_norm))   # (B_c, T, rkv)
        dh = self.kv_down.backward(mla.join_latent_grads(dc_kv, dk_pe), saved.kv_down)         # (B_c, T, C_c)
        dcq = self.q_up.backward(dq, saved.q_up)
        if self.q_down is None:
            return dh + dcq
        return dh + self.q_down.backward(self._gather(self.q_norm.backward(dcq, saved.q_norm)), saved.q_down)

    def new_cache(self, xp, positions: int, dtype):
        """MLA's compressed cache (``ops.mla.LatentCache``) of this rank's
        sequences over ``positions`` positions: per token the normed kv
        latent (this rank's block of its columns) and the rotated k_pe."""
        dims = dataclasses.replace(self.dims, kv_rank=self.kv_block.stop - self.kv_block.start)
        return mla.LatentCache(xp, self.n_seqs, positions, dims, dtype)

    def decode(self, h, cache, pos: int):
        """Inference on positions pos .. pos+t-1 through the latent cache, no
        dropout: h (B_c, t, C_c) -> (B_c, t, C_c). The new positions' latent
        and rotated key join the cache; kv_up expands every cached position
        for this rank's heads, and the queries attend to them."""
        q, _, k_pe, c_kv, _ = self._project(h, expand=False)                  # (B_m, t, nh qk), ..
        t = q.shape[1]
        cos, sin = self.tables(np.arange(pos, pos + t), q)                    # (t, dr)
        cache.append(c_kv, mla.rotate_k_pe(k_pe, cos, sin, self.dims.interleaved))
        latent, k_rot = cache.view()                                          # (B_c, S, rkv_c), (B_c, S, dr)
        kv = self.kv_up.forward(latent)[0]                                    # (B_m, S, nh (dn + dv))
        k_rot = self.layout.shared_key(k_rot)                                 # (B_m, S, dr)
        y = mla.decode_forward(q, kv, k_rot, self.n_local_heads, self.dims, cos, sin, pos)   # (B_m, t, nh dv)
        return self.c_proj.forward(y)[0]
