"""Analytic memory per rank per training step: parameters, gradients,
optimizer state and the activations kept for backward.

The companion of ``costmodel`` (communication and FLOPs), over the same
``Problem``; the conventions for ``--recompute`` and ``--zero 1`` are in
its docstring. The activation terms mirror what ``GPT.saved_elements``,
``GPT.saved_bytes`` and ``GPT.recompute_peak_*`` measure, and the tests
hold the two equal.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ..parallel import zero
from ..parallel.fsdp_stream import slot_key
from ..parallel.schedules import model_chunk
from .costexperts import chunk_moe_terms
from .costfp8 import keeps_local_input, quantized_copy_kept
from .costmla import attention_terms, cache_elems
from .costmtp import depth_terms
from .costmuon import muon_workspace
from .costcp import attention_split
from .costmodel import Problem, local_param_sizes
from .costparams import block_linears, moe_layers, segments_of, shared_linears, site_of, stage_layers
from .costpipe import peak_over_schedule
from .costwgrad import weight_phase_terms


@dataclass
class Memory:
    """Elements held per rank, by category (``step_memory``), or their
    bytes (``step_memory_bytes``)."""

    params: int
    grads: int
    optimizer: int
    activations: int

    def total(self) -> int:
        return self.params + self.grads + self.optimizer + self.activations


def activation_elems(p: Problem, dropout: bool = False) -> int:
    """Elements kept for backward after one forward pass (what
    ``GPT.saved_elements`` measures)."""
    return sum(activation_terms(p, dropout).values())


def activation_bytes(p: Problem, dropout: bool = False) -> int:
    """Bytes of ``activation_elems`` (what ``GPT.saved_bytes`` measures):
    activations in the storage format, LayerNorm's per-row statistics in the
    compute format, the gradient panels of the tied embedding in the master
    format."""
    w = p.widths
    width = {"act": w.act, "stat": w.stat, "grad": w.grad}
    return sum(n * width[kind] for kind, n in activation_terms(p, dropout).items())


def activation_terms(p: Problem, dropout: bool = False) -> dict:
    """{"act", "stat", "grad": elements} kept for backward: LayerNorm
    outputs and statistics, linear inputs (gathered in 3-D), q/k/v,
    attention output and log-sum-exp, GELU input and tanh, logits and softmax,
    gathered embedding panels and their gradients, masks. Under
    --recompute blocks: the block inputs, what lies outside the blocks, and
    one rerun block's working set on top (``kept_and_rerun_terms``)."""
    kept, rerun = kept_and_rerun_terms(p, dropout)
    return {kind: kept[kind] + rerun[kind] for kind in kept}


def kept_and_rerun_terms(p: Problem, dropout: bool = False) -> tuple:
    """({kind: elements} kept right after forward (``GPT.saved_elements``),
    {kind: elements} of one block's caches after its rerun under
    --recompute blocks (``GPT.recompute_peak_elements``), zero otherwise),
    for this stage's layers, lookup and head (the whole model without a
    pipeline)."""
    micro, step, rerun = chunk_terms(p, p.layers, p.has_embed, p.has_head, dropout)
    return {kind: micro[kind] + step[kind] for kind in micro}, rerun


def chunk_terms(p: Problem, L: int, embed: bool, head: bool, dropout: bool = False, micro: int = 0,
                first: int = 0) -> tuple:
    """({kind: elements} one micro-batch keeps for backward on a chunk of
    ``L`` blocks, with the lookup if ``embed`` and ln_f and the LM head if
    ``head`` (and then the MTP depths: their blocks among the chunk's,
    ``costmtp.depth_terms`` each); {kind: elements} the chunk holds once per step however many
    micro-batches are in flight: the gathered wte panel and its gradient,
    from the first use of wte to the end of backward; {kind: elements} of
    one rerun block under --recompute blocks). A stage that only looks up
    keeps the panel it gathered (the head, which would let it go under
    --recompute gathers, never runs there). A mixture's layers are priced
    for micro-batch ``micro``'s rows of the stage's layers from the
    ``first``-th (``costexperts.layer_rows``)."""
    cfg, T, h, mode = p.cfg, p.local_seq, p.cfg.n_embd, p.recompute   # T: this rank's positions
    depths = cfg.mtp_depth if head else 0
    L += depths                        # each MTP depth's block runs on the chunk with the head, after the main ones
    if p.layout in ("serial", "1d"):
        q, split_rows, split_cols, heads = 1, 1, 1, (p.tp if p.layout == "1d" else 1)
        V = -(-cfg.vocab_size // heads) * heads // heads
        mid_cols = h // heads
    elif p.layout in ("2d", "2.5d"):
        q = round((p.tp // p.depth) ** 0.5)
        split_rows, split_cols, heads = p.depth * q, q, q
        V = -(-cfg.vocab_size // q)
        mid_cols = h // q
    else:
        q = round(p.tp ** (1 / 3))
        split_rows, split_cols, heads = q * q, q, q
        V = -(-cfg.vocab_size // q)
        mid_cols = h // q
    seqs = p.local_batch // split_rows
    n = seqs * T                       # token rows per rank, canonical and intermediate alike
    cc = h // split_cols               # canonical width
    nc = n // p.tp if p.sequence_parallel else n   # canonical rows: T/tp of each sequence (layouts/seqpar.py)
    lse = n * (cfg.n_head // heads)    # blockwise attention's per-row log-sum-exp, in the compute format
    # 1-D keeps a replicated activation it can gather again as a row shard of 1/p.
    shard = p.tp if p.layout == "1d" else 1
    # On a grid of one rank (q = 1) a "gathered" weight is the parameter itself, not a copy.
    gathered = q > 1
    regather = mode == "gathers"
    # 3-D under a tile or row recipe: a linear keeps its local X raw, as under --recompute gathers (costfp8)
    local_x = regather or keeps_local_input(p)

    # one block: LN xhat (x2), qkv and the scaled copy of q, GELU input and tanh; blockwise
    # attention keeps no probabilities (ops.attention_blocks), only lse and its output.
    # Llama: RMSNorm's xhat (x2); the rotated and repeated [q | k | v] the attention op sees
    # (n_head heads each, whatever the kv heads) and its scaled q; SwiGLU's [gate | up], sigmoid
    # and silu (4 F_m) and mlp.c_proj's input (F_m) instead of GELU's 4 h_m pair and input.
    # DeepSeek-V3: MLA's branch (``costmla.attention_terms``) instead of the attention's.
    # A mixture's block: the router and experts instead of the MLP (``costexperts.layer_terms``,
    # added per MoE layer below; the first ``first_k_dense`` blocks keep the dense ``mlp``).
    if cfg.llama:
        act_kept, mlp_in = 4 * (cfg.ffn // heads), cfg.ffn // heads
    else:
        act_kept, mlp_in = 2 * 4 * mid_cols, 4 * mid_cols
    linears = block_linears(cfg, q)
    attn_linears, mlp_linears = linears[:-2], linears[-2:]
    latent_stat = 0
    if cfg.mla:
        mla_p = dataclasses.replace(p, recompute="gathers") if local_x and not regather else p
        attn, latent_stat = attention_terms(mla_p, n, nc, split_cols, heads, q, shard)
        block = 2 * nc * cc + attn
    else:
        block = 2 * nc * cc + n * 4 * mid_cols
        if p.layout == "3d" and not local_x and gathered:
            block += n * mid_cols      # the attention output: c_proj keeps its gathered input instead
        else:                          # Ulysses: the op keeps its output at its heads and the group's positions
            # (parallel/ulysses.py), beside c_proj's input at this rank's positions; a tensor-scaled --fp8 on
            # a grid: beside c_proj's quantized copy of it (costfp8)
            block += ((p.ulysses > 1) + quantized_copy_kept(p)) * n * mid_cols
        if p.layout == "3d":
            block += sum(_cube_linear(n, q, h_in, h_out, local_x, gathered) for h_in, h_out, _ in attn_linears)
        else:
            block += (n * cc // shard if regather else n * cc) + n * mid_cols     # c_attn's input, c_proj's
    def swiglu(linears, kept, inputs):  # a dense MLP: its activation's cache, its two linears' inputs (and W)
        if p.layout == "3d":
            return n * kept + sum(_cube_linear(n, q, h_in, h_out, local_x, gathered) for h_in, h_out, _ in linears)
        return n * kept + (n * cc // shard if regather else n * cc) + n * inputs   # c_fc's input, mlp.c_proj's

    mlp = swiglu(mlp_linears, act_kept, mlp_in)
    # a DeepSeekMoE block's shared experts (S per rank): a dense SwiGLU, whose c_fc keeps the very rows the
    # mixture keeps as its input (``costexperts``' "input") wherever the layout's linear keeps its X as given
    S = cfg.n_shared_experts * cfg.moe_ffn // heads
    same_input = (regather if p.layout == "3d" else
                  not (p.layout == "1d" and (regather or p.sequence_parallel)))
    shared = swiglu(shared_linears(cfg), 4 * S, S) - same_input * n * cc if cfg.moe and S else 0
    if dropout:
        block += 2 * nc * cc           # residual masks; attention's are drawn block by block, never kept
    layers = stage_layers(p)[first:first + L]
    n_moe = moe_layers(p, layers)      # blocks with a mixture: the rest keep ``mlp``
    # outside the blocks: ln_f xhat, logits and softmax, head input (head); embedding mask (lookup);
    # the wte panel and its gradient (either)
    outside, panel, grad = 0, 0, 0
    if head:
        outside += nc * cc + 2 * n * V
        if p.layout == "3d":
            outside += n * h // q if regather else q * n * h // q             # head input
        else:
            outside += n * cc // shard if regather else n * cc               # head input
    if p.layout in ("2d", "2.5d", "3d") and (embed or head):
        wte_panel = V * (h // q) if p.layout == "3d" else (V * q) * (h // q)  # 3-D's over i; wte[:, block c]
        if cfg.tied:                   # one panel for the lookup and the head
            panel = 0 if regather and head else gathered * wte_panel
            grad = wte_panel                                                  # its gradient
        else:                          # the lookup's wte panel, the head's lm_head panel (let go under gathers)
            panel = gathered * wte_panel * (int(embed) + (0 if regather else int(head)))
            grad = wte_panel * (int(embed) + int(head))
    if dropout and embed:
        outside += nc * cc
    outside_stat = 0
    if depths:                         # each depth's norms, projection inputs, output norm and loss head
        mtp_act, mtp_stat = depth_terms(p, n, nc, cc, q, V, shard)
        outside, outside_stat = outside + depths * mtp_act, depths * mtp_stat
        if p.layout in ("2d", "2.5d", "3d") and not cfg.tied and not embed:   # the depths' own wte panel
            panel += gathered * wte_panel
            grad += wte_panel
    step = {"act": panel, "stat": 0, "grad": grad}
    none = {"act": 0, "stat": 0, "grad": 0}
    moe_first = moe_layers(p, stage_layers(p)[:first])                  # the stage's MoE layers before the chunk
    moe, moe_most = chunk_moe_terms(p, n_moe, micro, moe_first) if n_moe else (none, none)
    stat = 2 * nc + lse + latent_stat                                    # a block's rstd of norms, lse
    if mode == "blocks":
        kept = {"act": L * n * cc // shard + outside, "stat": nc * head + outside_stat, "grad": 0}
        reruns = ([{"act": block + mlp, "stat": stat}] if n_moe < L else []) + \
                 ([{"act": block + shared + moe_most["act"], "stat": stat + moe_most["stat"]}] if n_moe else [])
        rerun = max(reruns, key=lambda r: r["act"] + r["stat"]) if L else none
        return kept, step, {**rerun, "grad": 0}
    kept = {"act": L * block + (L - n_moe) * mlp + n_moe * shared + outside + moe["act"],
            "stat": L * stat + head * nc + outside_stat + moe["stat"], "grad": 0}
    return kept, step, none


def _cube_linear(n: int, q: int, h_in: int, h_out: int, regather: bool, gathered: bool) -> int:
    """What a 3-D linear keeps: its X, local (--recompute gathers) or
    gathered over q, and its gathered W panel (none on a grid of one rank)."""
    if regather:
        return n * h_in // q
    return q * n * h_in // q + gathered * (h_in // q) * (h_out // q)


def kv_cache_elems(p: Problem) -> int:
    """Elements of the key/value cache generation keeps on one rank
    (``GPT.new_caches``: per block of the stage, keys and values of its
    intermediate sequences, its kv heads and all n_ctx positions): under
    grouped-query attention the rank's n_kv / split kv heads, or one copy
    of the kv head its queries read when the head split exceeds them."""
    seqs, heads = attention_split(p)
    cfg = p.cfg
    if cfg.mla:                        # the kv latent and the rotated k_pe (``costmla.cache_elems``)
        return cache_elems(p, seqs)
    kv = max(1, cfg.kv_heads * heads // cfg.n_head) if cfg.llama else heads
    return p.layers * 2 * seqs * kv * cfg.n_ctx * cfg.head_dim


def step_memory(p: Problem, dropout: bool = False) -> Memory:
    """Elements per rank. Under --zero 1 the buffers are padded to P_pad (a
    multiple of dp) and AdamW keeps 2 C moments (C = P_pad / dp), to which
    Muon adds its step's temporaries (``costmuon``: the gathered update
    and one whole matrix with its Newton-Schulz workspace); --zero 2
    and 3: ``segmented_memory``. Under a pipeline: this stage's parameters,
    and its peak saved activations over the schedule
    (``pipeline_peak_activations``)."""
    if p.segmented:
        return segmented_memory(p, dropout)[0]
    sizes = local_param_sizes(p)
    params = sum(n for n, _ in sizes.values())
    acts = _stage_activations(p, dropout, bytes_=False)
    if _expert_split(p):            # zero.ExpertPartition: (C,) summed gradients of their own too
        padded, chunk = _expert_sizes(p, sizes)
        return Memory(padded, padded + chunk, 2 * chunk, acts)
    if p.sharded:
        padded, chunk = zero.sizes(params, p.dp, p.zero)
        return Memory(padded, padded, 2 * chunk + muon_workspace(p), acts)
    return Memory(params, params, 2 * params + muon_workspace(p), acts)


def _expert_split(p: Problem) -> bool:
    """Whether --zero 1 cuts a mixture's buffer in two (``zero.ExpertPartition``:
    --ep > 1, the experts' state over the expert-data group)."""
    return p.sharded and p.cfg.moe and p.ep > 1


def _expert_sizes(p: Problem, sizes: dict) -> tuple:
    """(P_pad, C) of ``zero.ExpertPartition``: the dense part padded to a
    multiple of dp, the experts' to one of the expert-data group."""
    from ..parallel.experts import expert_of

    experts = sum(n for name, (n, _) in sizes.items() if expert_of(name) is not None)
    dense = zero.Partition(sum(n for n, _ in sizes.values()) - experts, p.dp)
    mine = zero.Partition(experts, p.edp)
    return dense.padded + mine.padded, dense.chunk + mine.chunk


def _stage_activations(p: Problem, dropout: bool, bytes_: bool) -> int:
    if p.pp == 1:
        return activation_bytes(p, dropout) if bytes_ else activation_elems(p, dropout)
    if bytes_:
        return pipeline_peak_activation_bytes(p, p.stage, dropout)
    return sum(pipeline_peak_activations(p, p.stage, dropout).values())


def step_memory_bytes(p: Problem, dropout: bool = False) -> Memory:
    """``step_memory`` in bytes: under mixed precision the parameters are a
    float32 master plus a 16-bit working copy, gradients and Adam moments
    float32, activations mostly 16-bit."""
    if p.segmented:
        return segmented_memory(p, dropout)[1]
    w, elems = p.widths, step_memory(p, dropout)
    acts = _stage_activations(p, dropout, bytes_=True)
    if _expert_split(p):            # the working copy whole, the master only the chunks
        chunk = elems.optimizer // 2
        return Memory(elems.params * w.act + chunk * w.grad, elems.grads * w.grad, elems.optimizer * w.grad, acts)
    if p.sharded:   # the full buffer is the 16-bit working copy, the float32 master only the chunk
        chunk = (elems.optimizer - muon_workspace(p)) // 2
        params = elems.params * w.act + (chunk * w.grad if w.act != w.grad else 0)
        return Memory(params, elems.grads * w.grad, elems.optimizer * w.grad, acts)
    params = elems.params
    working = params * w.act if w.act != w.grad else 0
    return Memory(params * w.grad + working, params * w.grad, elems.optimizer * w.grad, acts)


def segmented_memory(p: Problem, dropout: bool = False) -> tuple:
    """(elements, bytes) per rank under --zero 2 and 3 (mpicube.parallel.fsdp):
    the master chunk, summed gradient chunk and moments (C, C, 2 C); the
    gradient slots (the end segments' and two blocks', one if the store
    has one block; the ends: outside, and under a pipeline the tied wte);
    --zero 2 the whole P_pad working copy, --zero 3 the parameter slots
    (the same widths) and, under mixed precision, the master chunk's 16-bit
    rounding. All are allocated once: this is the peak of weights and
    gradients, the prefetched block included."""
    w = p.widths
    segments = segments_of(p, local_param_sizes(p))
    chunk = sum(c for _, _, c, _, _ in segments)
    padded = {seg: parts * c for seg, _, c, parts, _ in segments}
    sites = {}                                   # a block's slot holds its dense and (--ep) expert segments
    for seg, n in padded.items():
        sites[site_of(seg)] = sites.get(site_of(seg), 0) + n
    blocks = [site for site in sites if not zero.is_end(site)]
    widths = {}                                  # slot -> its width, as parallel/fsdp.py allocates them:
    for site, n in sites.items():                # each end its own, block k slot k mod 2 (its widest block)
        key = slot_key(site, blocks)
        widths[key] = max(widths.get(key, 0), n)
    slots = sum(widths.values())
    mixed = w.act != w.grad
    grads = chunk + slots
    state = 2 * chunk + muon_workspace(p)          # the moments, and Muon's temporaries (costmuon)
    if p.zero == 2:
        whole = sum(padded.values())
        elems = Memory(whole + chunk, grads, state, _stage_activations(p, dropout, bytes_=False))
        size = Memory(whole * w.act + chunk * w.grad, grads * w.grad, state * w.grad,
                      _stage_activations(p, dropout, bytes_=True))
        return elems, size
    rounded = chunk if mixed else 0
    elems = Memory(chunk + rounded + slots, grads, state, _stage_activations(p, dropout, bytes_=False))
    size = Memory(chunk * w.grad + (rounded + slots) * w.act, grads * w.grad, state * w.grad,
                  _stage_activations(p, dropout, bytes_=True))
    return elems, size


def _stage_terms(p: Problem, stage: int, dropout: bool) -> tuple:
    """({(micro-batch, local chunk): its kept terms}, per-step terms,
    {(micro-batch, local chunk): its rerun terms}) of ``stage``. The
    micro-batches differ only under a mixture's measured routing
    (``p.routing``, this stage's layers); otherwise one is priced for all."""
    split, last = p.chunk_layers, p.pp * p.virtual_stages - 1
    if p.routing is not None and stage != p.stage:             # the routing is p.stage's: price another's expected
        p = dataclasses.replace(p, routing=None)
    per_micro, rerun = {}, {}
    measured = p.routing is not None
    for m in range(p.grad_accum if measured else 1):
        first = 0                                              # the chunk's first layer among the stage's
        for v in range(p.virtual_stages):
            k = model_chunk(p.pp_schedule, stage, v, p.pp)
            kept, panel, chunk_rerun = chunk_terms(p, len(split[k]), k == 0, k == last, dropout, m, first)
            first += len(split[k])
            # each micro-batch in flight on the end chunks holds its own wte panel and
            # gradient accumulator (the executor runs one GPT object per micro-batch,
            # which gathers and reduce-scatters wte per micro-batch, as without stages)
            per_micro[m, v] = {kind: kept[kind] + panel[kind] for kind in kept}
            rerun[m, v] = chunk_rerun
    if not measured:
        for m in range(1, p.grad_accum):
            for v in range(p.virtual_stages):
                per_micro[m, v], rerun[m, v] = per_micro[0, v], rerun[0, v]
    return per_micro, {"act": 0, "stat": 0, "grad": 0}, rerun


def pipeline_peak_activations(p: Problem, stage: int = None, dropout: bool = False) -> dict:
    """{"act", "stat", "grad": elements} a rank of ``stage`` (default
    ``p.stage``) holds for backward at its peak over the step: each
    in-flight micro-batch chunk of its schedule holds one micro-batch's
    saved activations of that chunk's layers (and the lookup's on chunk 0,
    ln_f's and the head's on the last), the wte panel and its gradient are
    held once, and one rerun block sits on top during a backward under
    --recompute blocks. Without a pipeline: ``activation_terms``."""
    if p.pp == 1:
        return activation_terms(p, dropout)
    stage = p.stage if stage is None else stage
    return peak_over_schedule(p, stage, *_stage_terms(p, stage, dropout), lambda t: sum(t.values()),
                              _weight_terms(p, stage))[1]


def pipeline_peak_activation_bytes(p: Problem, stage: int = None, dropout: bool = False) -> int:
    """The bytes at the peak (activations in the storage format, statistics
    in the compute format, gradient panels in the master format); the
    peak of bytes, which the peak of elements need not be."""
    if p.pp == 1:
        return activation_bytes(p, dropout)
    stage = p.stage if stage is None else stage
    w = p.widths
    width = {"act": w.act, "stat": w.stat, "grad": w.grad}
    return peak_over_schedule(p, stage, *_stage_terms(p, stage, dropout),
                              lambda t: sum(n * width[k] for k, n in t.items()), _weight_terms(p, stage))[0]


def _weight_terms(p: Problem, stage: int) -> dict:
    """{(micro-batch, local chunk): what its weight phase holds} (``costwgrad``;
    a mixture's at the rows of each micro-batch, as ``_stage_terms``)."""
    split = p.chunk_layers
    if p.routing is not None and stage != p.stage:             # the routing is p.stage's: price another's expected
        p = dataclasses.replace(p, routing=None)
    out = {}
    for m in range(p.grad_accum):
        first = 0
        for v in range(p.virtual_stages):
            layers = len(split[model_chunk(p.pp_schedule, stage, v, p.pp)])
            out[m, v] = weight_phase_terms(p, layers, m, first)
            first += layers
    return out

