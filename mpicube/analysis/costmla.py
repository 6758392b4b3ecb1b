"""Multi-head latent attention (DeepSeek-V3, ``model.latent_attention``) in
the cost model: the linears a layout shards, the collectives beyond them,
what one block keeps for backward, the generation cache and the FLOPs.

Why its own module: MLA is not a wider Llama attention. Two of its five
projections are REPLICATED (q_down h -> rq, kv_down h -> rkv + dr: every
tp rank holds them whole; ``layouts.modules.ReplicatedLinear``), so they
move no activations on serial and 1-D and only their partial products
elsewhere; the latents between are normed (RMSNorm, eps 1e-6) on the
hidden split the canonical form has; the rotary key k_pe is one tensor
every head reads (``Layout.shared_key``), whose gradient is summed over
the heads' ranks; and the attention op sees q, k and v padded to one
head width qk = dn + dr (``ops.mla.pack``), so its saved tensors, the cp
ring's K/V and Ulysses' slabs are priced at qk, not n_embd / n_head.

Per block and forward pass, beside the COLUMN (q_up or q_proj, kv_up)
and ROW (c_proj) linears ``attention_linears`` lists for the layouts'
own loops (``costmodel``):

* 2-D, 2.5-D (hidden split over the grid row, q ranks), 3-D (over k):
  each REPLICATED output's partial sum all-reduced over the hidden group
  (n (rq) and n (rkv + dr), at the activations' sum wire), the two latent
  norms' statistics (one all-reduce of n each way, compute format), and
  in backward each latent's gradient block all-gathered whole (n r / q,
  activations' format);
* k_pe (n dr): backward all-reduces its gradient over the head ranks
  (1-D: tp; 2-D, 2.5-D: the row), in the compute format (no wire); under
  1-D --sequence-parallel it is all-gathered along T in forward and its
  gradient reduce-scattered; on 3-D it is all-gathered over j in forward
  (to the heads' rows) and its gradient reduce-scattered over j (q slots)
  then all-reduced over k.

The REPLICATED weights' gradients are summed over the whole tp group
where ranks hold different canonical blocks (2-D, 2.5-D, 3-D, 1-D under
--sequence-parallel): ``costparams`` gives them the gradient axis "tp".
"""

from __future__ import annotations

from fractions import Fraction

from ..core.config import ModelConfig
from .costbase import Problem, Traffic


def qk(cfg: ModelConfig) -> int:
    """One head's query/key width dn + dr: the attention op's head size under MLA."""
    return cfg.qk_nope_head_dim + cfg.qk_rope_head_dim


def op_head_dim(cfg: ModelConfig) -> int:
    """The head width the attention op (and the cp ring, Ulysses) sees."""
    return qk(cfg) if cfg.mla else cfg.head_dim


def attention_linears(cfg: ModelConfig) -> list:
    """(h_in, h_out, position) of MLA's COLUMN and ROW linears in one block:
    q_up (rq -> nh qk) or q_proj (h -> nh qk), kv_up (rkv -> nh (dn + dv)),
    c_proj (nh dv -> h). The REPLICATED q_down and kv_down are priced apart."""
    h, nh = cfg.n_embd, cfg.n_head
    q_in = cfg.q_lora_rank or h
    return [(q_in, nh * qk(cfg), "column"), (cfg.kv_lora_rank, nh * (cfg.qk_nope_head_dim + cfg.v_head_dim), "column"),
            (nh * cfg.v_head_dim, h, "row")]


def latents(cfg: ModelConfig) -> list:
    """The widths of the normed latents: [rq (if a q latent), rkv]."""
    return ([cfg.q_lora_rank] if cfg.q_lora_rank else []) + [cfg.kv_lora_rank]


def replicated_outputs(cfg: ModelConfig) -> list:
    """The output widths of the REPLICATED linears: q_down's rq (if any) and kv_down's rkv + dr."""
    return ([cfg.q_lora_rank] if cfg.q_lora_rank else []) + [cfg.kv_lora_rank + cfg.qk_rope_head_dim]


def _geometry(p: Problem) -> tuple:
    """(n token rows per rank, hidden split q (1: none), hidden axis)."""
    if p.layout in ("serial", "1d"):
        return p.local_batch * p.local_seq, 1, None
    if p.layout in ("2d", "2.5d"):
        q = round((p.tp // p.depth) ** 0.5)
        return p.local_batch // (p.depth * q) * p.local_seq, q, "row"
    q = round(p.tp ** (1 / 3))
    return p.local_batch // (q * q) * p.local_seq, q, "k"


def latent_traffic(p: Problem) -> Traffic:
    """One micro-batch's MLA collectives beyond its COLUMN and ROW linears
    on this stage's layers (module docstring), at this rank's positions."""
    t, cfg, w = Traffic(), p.cfg, p.widths
    if not cfg.mla or p.layout == "serial":
        return t
    n, q, hidden = _geometry(p)
    L, dr = p.blocks, cfg.qk_rope_head_dim
    forwards = 2 if p.recompute == "blocks" else 1
    if hidden:
        for r in replicated_outputs(cfg):
            t.sum(hidden, q, n * r, times=forwards * L, width=w.red)          # partial products
        for r in latents(cfg):
            t.allreduce(hidden, q, n, times=(forwards + 1) * L, width=w.stat)  # RMSNorm: forward, backward
            t.allgather(hidden, q, n * r // q, times=L, width=w.act)          # the latent's gradient whole
    if p.layout == "1d" and p.sequence_parallel:
        t.allgather("tp", p.tp, n // p.tp * dr, times=forwards * L, width=w.act)   # k_pe along T
        t.reduce_scatter("tp", p.tp, n * dr, times=L, width=w.stat)               # its gradient
    elif p.layout == "1d":
        t.allreduce("tp", p.tp, n * dr, times=L, width=w.stat)
    elif p.layout in ("2d", "2.5d"):
        t.allreduce("row", q, n * dr, times=L, width=w.stat)
    else:
        t.allgather("j", q, n * dr, times=forwards * L, width=w.act)
        t.reduce_scatter("j", q, q * n * dr, times=L, width=w.stat)
        t.allreduce("k", q, n * dr, times=L, width=w.stat)
    return t


def oned_linear_sums(p: Problem, layers: list) -> Traffic:
    """1-D's sums of MLA blocks' COLUMN and ROW linears (without
    --sequence-parallel): each ROW output all-reduced in forward (again
    under --recompute blocks), each COLUMN input gradient in backward;
    under --recompute gathers each COLUMN input (a replicated activation)
    gathered again from its row shard."""
    t, w, g = Traffic(), p.widths, p.tp
    n = p.local_batch * p.local_seq
    forwards = 2 if p.recompute == "blocks" else 1
    for h_in, h_out, position in layers:
        if position == "row":
            t.sum("tp", g, n * h_out, times=forwards, width=w.red)
        else:
            t.sum("tp", g, n * h_in, width=w.red)
            if p.recompute == "gathers":
                t.allgather("tp", g, n * h_in // g, width=w.act)
    return t


def oned_sequence_sums(p: Problem, layers: list) -> Traffic:
    """1-D under --sequence-parallel, the same linears: a COLUMN gathers its
    input along T (again in backward under --recompute gathers, again in
    the rerun under blocks) and reduce-scatters its input gradient; a ROW
    reduce-scatters its output (again under blocks) and gathers dY."""
    t, w, g = Traffic(), p.widths, p.tp
    n = p.local_batch * p.local_seq
    again = p.recompute in ("gathers", "blocks")
    for h_in, h_out, position in layers:
        if position == "row":
            t.reduce_scatter("tp", g, n * h_out, times=1 + (p.recompute == "blocks"), width=w.red)
            t.allgather("tp", g, n // g * h_out, width=w.act)
        else:
            t.allgather("tp", g, n // g * h_in, times=1 + again, width=w.act)
            t.reduce_scatter("tp", g, n * h_in, width=w.red)
    return t


def attention_terms(p: Problem, n: int, nc: int, split_cols: int, heads: int, q: int, shard: int) -> tuple:
    """(act, stat) elements one MLA branch keeps for backward on one rank:
    n intermediate rows (nc canonical ones), the canonical width split
    ``split_cols`` ways, ``heads`` head ranks, ``q`` the cube's side (1
    elsewhere), ``shard`` 1-D's row shard of a replicated activation.

    The block input h (after ln_1) is kept once by the REPLICATED linears
    (and q_proj, reading the same array) - on 3-D beside a COLUMN's
    gathered copy, on 1-D under --recompute gathers beside q_proj's row
    shard; each latent its norm's normalised rows and 1/rms and its
    up-projection's input (a row shard of it, a gathered copy on 3-D);
    the attention op its packed [q | k | v] and scaled q (4 n nh_l qk),
    its output (n nh_l qk) and log-sum-exp; c_proj its input, each head's
    first dv columns of that output (``ops.mla.unpack``: a view of it for
    one head or dv = qk, else a copy; 3-D: its gathered input, q n nh dv
    / q; under Ulysses the view is of the output brought back to this
    rank's positions, which the op did not keep), and on 3-D the gathered
    W panels of the three sharded linears."""
    cfg, regather = p.cfg, p.recompute == "gathers"
    h = cfg.n_embd
    cc = h // split_cols
    nh_l, width = cfg.n_head // heads, qk(cfg)
    act = nc * cc                                                  # h, kept by q_down / kv_down
    stat = 0
    cube = p.layout == "3d"
    gathered = q > 1
    for r in latents(cfg):
        rc = r // split_cols
        act += nc * rc                                             # the norm's normalised rows
        stat += nc                                                 # and 1/rms
        if cube:
            act += n * r // q if regather else q * n * r // q      # the up-projection's X (local or gathered)
        elif p.sequence_parallel:
            act += nc * rc if regather else n * rc                 # its T/p shard, or the gathered rows
        else:
            act += n * rc // shard if regather else n * rc
    if not cfg.q_lora_rank:                                        # q_proj reads h itself
        if cube and not regather:
            act += q * n * h // q
        elif p.layout == "1d" and regather:
            act += nc * cc // shard if not p.sequence_parallel else 0
        elif p.sequence_parallel:
            act += n * cc
    act += 5 * n * nh_l * width                                   # [q | k | v], scaled q, the op's output
    if cube and not regather:
        act += q * n * (cfg.n_head * cfg.v_head_dim) // q          # c_proj's gathered input
    elif nh_l > 1 and cfg.v_head_dim != width:                     # c_proj's input: the op's output's first dv
        act += n * nh_l * cfg.v_head_dim                           # columns of each head, a copy (one head: a view)
    elif p.ulysses > 1:                # a view of the output brought back to this rank's positions: the op kept
        act += n * nh_l * width        # its own at its heads and the group's positions
    if cube and not regather and gathered:
        act += sum((h_in // q) * (h_out // q) for h_in, h_out, _ in attention_linears(cfg))
    return act, stat


def cache_elems(p: Problem, seqs: int) -> int:
    """MLA's generation cache on one rank (``LatentAttention.new_cache``):
    per block of the stage and token, the normed kv latent (this rank's
    block of its columns) and the rotated k_pe, for ``seqs`` sequences."""
    cfg = p.cfg
    _, q, hidden = _geometry(p)
    return p.layers * seqs * cfg.n_ctx * (cfg.kv_lora_rank // q + cfg.qk_rope_head_dim)


def linear_flops(cfg: ModelConfig, N: int) -> int:
    """Forward FLOPs of one MLA branch's five projections for N tokens."""
    flops = sum(2 * N * h_in * h_out for h_in, h_out, _ in attention_linears(cfg))
    return flops + sum(2 * N * cfg.n_embd * r for r in replicated_outputs(cfg))


def replicated_flops_share(p: Problem) -> Fraction:
    """The fraction of the REPLICATED projections' work one rank does: the
    same rows on every 1-D rank (1), else a 1/tp share like the rest."""
    return Fraction(1) if p.layout == "1d" and not p.sequence_parallel else Fraction(1, p.tp)
