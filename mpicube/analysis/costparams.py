"""What one rank holds of the model, as the cost model counts it: each
block's linears (``block_linears``: GPT-2's, or Llama's GQA, SwiGLU and
replicated kv heads), the layout's head split, every parameter's local
elements and the replica group its gradient is summed over
(``local_param_sizes``, from each layout's sharding rules in closed form,
not the layout code), the shared kv columns (``kv_param_sizes``), a
mixture's experts among them (``expert_elems``) and, under --zero 2/3,
the segments the store is cut into (``segments_of``). ``costmodel``
re-exports them."""

from __future__ import annotations

from functools import lru_cache

from ..core.config import ModelConfig
from ..model.gpt import gpt_params
from ..parallel import zero
from ..parallel.experts import expert_of
from ..parallel.split import shared_width, split_decl
from .costbase import Problem


def block_linears(cfg: ModelConfig, split: int = 1):
    """(h_in, h_out, position) of every linear of one block, h_out as the
    head split of ``split`` ways holds it in all (``split`` times one
    block's columns): Llama's c_attn [q | k | v] has n_kv kv heads, or one
    copy per block of them when the split exceeds them (kv replication,
    ``params.SharedColumns``); its c_fc is SwiGLU's [gate | up] (2 F) and
    its mlp.c_proj F x h."""
    h = cfg.n_embd
    if cfg.mla:                      # q_up (q_proj), kv_up, c_proj (costmla); then Llama's SwiGLU
        from .costmla import attention_linears

        return attention_linears(cfg) + [(h, 2 * cfg.ffn, "column"), (cfg.ffn, h, "row")]
    if cfg.llama:
        qkv = cfg.n_head * cfg.head_dim + 2 * cfg.head_dim * max(cfg.kv_heads, split)
        return [(h, qkv, "column"), (h, h, "row"), (h, 2 * cfg.ffn, "column"), (cfg.ffn, h, "row")]
    return [(h, 3 * h, "column"), (h, h, "row"), (h, 4 * h, "column"), (4 * h, h, "row")]


def dense_linears(cfg: ModelConfig, split: int = 1, layer: int = None):
    """The sharded linears every token of a block goes through: all of them,
    or in a mixture's block (``layer`` a MoE layer, or any layer of a
    mixture when ``layer`` is None) the attention's only (the experts' are
    priced by the rows they receive, ``costexperts``)."""
    linears = block_linears(cfg, split)
    mixture = cfg.is_moe(layer) if layer is not None else cfg.moe
    if not mixture:
        return linears
    return linears[:-2] + shared_linears(cfg)


def shared_linears(cfg: ModelConfig) -> list:
    """A DeepSeekMoE block's shared experts: one dense SwiGLU of width
    S = n_shared x moe_ffn on the layout's COLUMN and ROW linears
    (``moe.shared``), every token through it."""
    if not cfg.n_shared_experts:
        return []
    S = cfg.n_shared_experts * cfg.moe_ffn
    return [(cfg.n_embd, 2 * S, "column"), (S, cfg.n_embd, "row")]


def stage_layers(p: Problem) -> list:
    """The global indices of this stage's blocks, in the order it runs them:
    its chunks' layers, then on the stage with the head each MTP depth's
    block (n_layer + k - 1, run after the main loss: model/mtp.py)."""
    split = p.chunk_layers
    return [i for k in p.stage_chunks for i in split[k]] + list(range(p.cfg.n_layer, p.cfg.n_layer + p.mtp))


def stage_linears(p: Problem, split: int = 1) -> list:
    """``dense_linears`` of every block of this stage, in turn: a dense
    block's MLP included, a mixture's left to ``costexperts`` (the first
    ``first_k_dense`` blocks of a DeepSeekMoE model are dense)."""
    return [lin for i in stage_layers(p) for lin in dense_linears(p.cfg, split, i)]


def moe_layers(p: Problem, layers: list = None) -> int:
    """How many of ``layers`` (default: this stage's) have a mixture MLP."""
    return sum(p.cfg.is_moe(i) for i in (stage_layers(p) if layers is None else layers))


@lru_cache(maxsize=8)
def model_decls(cfg: ModelConfig) -> tuple:
    """``gpt_params(cfg)``, built once per configuration: the cost model
    walks them for every plan it prices, and a DeepSeek-V3 of 61 blocks x
    256 experts declares some 30,000 tensors (``info`` prices dozens of
    plans)."""
    return tuple(gpt_params(cfg))


@lru_cache(maxsize=8)
def headed_decls(cfg: ModelConfig) -> tuple:
    """The declarations with heads (Llama's c_attn): the only ones whose kv columns a split may share."""
    return tuple(d for d in model_decls(cfg) if d.heads)


def head_split(p: Problem) -> int:
    """The ways the layout splits the heads (each layout's ``head_coords``)."""
    if p.layout == "1d":
        return p.tp
    if p.layout in ("2d", "2.5d"):
        return round((p.tp // p.depth) ** 0.5)
    return round(p.tp ** (1 / 3)) if p.layout == "3d" else 1


def local_param_sizes(p: Problem) -> dict:
    """{name: (local elements, gradient axis or None)} for one rank, from the
    sharding rules of each layout (closed forms, not the layout code);
    under a pipeline only the tensors of this stage (``on_stage``); under
    --ep a mixture's experts of one ep rank (E/ep of them, every rank
    holding as many: ``experts.model_specs``), after the dense tensors,
    as ``ParamStore`` lays them out."""
    cfg, out, experts, seen = p.cfg, {}, {}, {}
    mine = {i for k in p.stage_chunks for i in p.chunk_layers[k]} if p.pp > 1 else None
    for decl in model_decls(cfg):
        e = expert_of(decl.name)
        if e is not None and e >= cfg.n_experts // p.ep:
            continue
        if on_stage(p, decl.name, mine):
            # every block's tensor of a name is sharded alike: size it once (a mixture has E of them a block)
            key = (decl.name.split(".", 2)[-1] if decl.name.startswith("h.") else decl.name, decl.role, decl.shape)
            if key not in seen:
                seen[key] = _local_size(p, decl)
            (out if e is None else experts)[decl.name] = seen[key]
    out.update(experts)
    return out


def on_stage(p: Problem, name: str, layers: set = None) -> bool:
    """Whether parameter ``name`` lives on this stage: a block's on the stage
    of its chunk (``layers``: this stage's, computed once by the caller),
    wpe on the first, ln_f (and an untied lm_head) on the last, and wte on
    the first, and on the last too where the LM head is tied to the lookup or
    MTP depths look tokens up there (each end holds a copy;
    ``pipeline.stage_names``); an MTP depth's block and tensors with the head."""
    if p.pp == 1:
        return True
    if name.startswith("h."):
        i = int(name.split(".")[1])
        if i >= p.cfg.n_layer:               # an MTP depth's block: with the head
            return p.has_head
        if layers is None:
            layers = {i for k in p.stage_chunks for i in p.chunk_layers[k]}
        return i in layers
    if name == "wte":                        # the head's (tied) or the MTP depths' lookup on the last stage
        return p.has_embed or (p.has_head and (p.cfg.tied or p.cfg.mtp_depth > 0))
    return p.has_embed if name == "wpe" else p.has_head


def kv_param_sizes(p: Problem) -> dict:
    """{name: (elements, share)} of the shared kv columns this rank holds
    (``params.SharedColumns``: c_attn's k and v columns when the head split
    exceeds the kv heads), summed over the ``share`` ranks of axis "kv"."""
    split, out = head_split(p), {}
    mine = {i for k in p.stage_chunks for i in p.chunk_layers[k]} if p.pp > 1 else None
    for decl in headed_decls(p.cfg):
        width, share = shared_width(decl, split)
        if width and on_stage(p, decl.name, mine):
            n, _ = _local_size(p, decl)
            out[decl.name] = (n // len(split_decl(decl, split, 0)) * width, share)
    return out


def _local_size(p: Problem, decl):
    role, shape, cfg = decl.role, decl.shape, p.cfg
    numel = 1
    for n in shape:
        numel *= n
    if p.layout == "serial":
        return numel, None
    if role == "w_replicated":               # MLA's latent projections: whole on every rank, summed over tp
        shared = p.layout != "1d" or p.sequence_parallel   # where the ranks hold other canonical blocks
        return numel, ("tp" if shared and p.tp > 1 else None)
    if role in ("w_column", "b_column"):     # the head split's share of the columns (whole kv heads, or a copy)
        cols = len(split_decl(decl, head_split(p), 0))
        numel = numel // shape[-1] * cols * head_split(p)
    if p.layout == "1d":
        g = p.tp
        if role == "wte":
            return -(-cfg.vocab_size // g) * cfg.n_embd, None
        if role in ("w_column", "b_column", "w_row"):
            return numel // g, None
        if p.sequence_parallel and role in ("wpe", "norm"):
            return numel, "tp"                 # partial sums from this rank's T/tp positions
        return numel, None
    if p.layout in ("2d", "2.5d"):
        d = p.depth
        q = round((p.tp // d) ** 0.5)
        on_depth = "depth" if d > 1 else None
        if role == "wte":
            return -(-cfg.vocab_size // q) * cfg.n_embd // q, on_depth
        if role in ("w_column", "w_row"):
            return numel // (q * q), on_depth
        return numel // q, "col_depth"     # wpe, norm, biases: hidden block c
    q = round(p.tp ** (1 / 3))
    if role == "wte":
        return -(-cfg.vocab_size // q) * cfg.n_embd // (q * q), None
    if role in ("w_column", "w_row"):
        return numel // (q ** 3), None
    if role == "b_column":
        return numel // q, "ik"
    return numel // q, "ij"                # wpe, norm, b_row


def _group_size(p: Problem, axis: str) -> int:
    if axis == "tp":
        return p.tp
    if axis == "depth":
        return p.depth
    if axis == "col_depth":
        return p.tp // round((p.tp // p.depth) ** 0.5)
    q = round(p.tp ** (1 / 3))
    return q * q                               # ij, ik planes of the cube


def expert_elems(p: Problem, sizes: dict) -> int:
    """Elements of a mixture's experts on this rank when --ep > 1 puts
    them in an expert-data group of their own (``gradients.GradientSync``),
    else 0 (summed with the dense parameters). Their all-to-all and the
    gradient norm's sum over ep: ``costexpertcomm.moe_traffic``."""
    if not p.cfg.moe or p.ep == 1:
        return 0
    return sum(n for name, (n, _) in sizes.items() if expert_of(name) is not None)


def site_of(segment: str) -> str:
    """The block (or end) a segment belongs to: "h.{i}" for "h.{i}.experts"."""
    return segment.removesuffix(zero.EXPERTS)


def segment_name(p: Problem, name: str) -> str:
    """The segment of parameter ``name`` under --zero 2/3: its layer's, or
    with --ep > 1 its block's experts' (``fsdp.SegmentedStore``)."""
    seg = zero.segment_of(name, p.pp > 1)
    return seg + zero.EXPERTS if p.cfg.moe and p.ep > 1 and expert_of(name) is not None else seg


def segments_of(p: Problem, sizes: dict) -> list:
    """[(segment, S, C_s, parts, expert)] of this rank's (stage's) store
    under --zero 2/3 in buffer order: each layer's (``zero.segment_sizes``;
    with stages the tied wte a segment of its own) cut over dp, and under
    --ep each block's experts after it, cut over the expert-data group."""
    totals = {}
    for name, (n, _) in sizes.items():
        seg = segment_name(p, name)
        totals[seg] = totals.get(seg, 0) + n
    out = []
    for seg in sorted(totals, key=lambda s: (zero.segment_key(site_of(s)), s != site_of(s))):
        x = seg != site_of(seg)
        parts = p.edp if x else p.shard_dp
        out.append((seg, totals[seg], -(-totals[seg] // parts), parts, x))
    return out


def grad_runs(p: Problem, sizes: dict) -> list:
    """[(axis, elements)] of the replica groups' gradient sums: one
    all-reduce per run of adjacent tensors summed over one axis
    (``ParamStore.grad_groups``). The store orders its tensors by (expert,
    axis), so each axis is one run of the dense tensors and one of a
    mixture's experts (kept last), the two merged where they meet (and no
    --zero 1 padding parts them, ``zero.ExpertPartition``)."""
    ordered = sorted(((expert_of(name) is not None, axis or ""), n) for name, (n, axis) in sizes.items())
    dense = sum(n for (x, _), n in ordered if not x)
    gap = p.sharded and p.cfg.moe and p.ep > 1 and zero.Partition(dense, p.dp).padded > dense
    runs, last = [], None
    for (x, axis), n in ordered:
        key = (x if gap else False, axis)
        if axis and key == last:
            runs[-1] = (axis, runs[-1][1] + n)
        elif axis:
            runs.append((axis, n))
        last = key
    return runs
