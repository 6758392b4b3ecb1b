"""The tensors of a trace: their names, the order the computation makes
them in, and how deep in the computation each one lies.

The order is what makes "the first divergence" mean something: a wrong
activation in block 1 of step 2 spoils every later activation, the loss,
every gradient and every parameter, so only the earliest disagreeing
tensor points at the bug. The depth is what the tolerance grows with: a
tensor produced after k dependent operations carries the rounding of all
k of them (tolerance.py).
"""

from __future__ import annotations

import math
import re

from . import deepseek_names as ds

FORMAT = "mpicube-trace"
VERSION = 4                  # 2: the activations inside each block (BLOCK_ACTS); 3: placements, state (STATE);
#                              4: the sigmoid router's bias, scores and bias update (deepseek_names)
READS = (1, 2, 3, 4)            # versions compare reads; an older trace lacks only what later ones added
CONFIG_KEYS = ("vocab_size", "n_ctx", "n_layer", "n_head", "n_embd")
# a Llama trace's config adds these (mpicube's ModelConfig.to_dict, docs/llama.md); a GPT-2 one has none
LLAMA_KEYS = {"arch": str, "n_kv_head": int, "ffn_hidden": int, "rope_theta": float, "rms_eps": float,
              "tie_embeddings": bool}
# a mixture of experts' (a Llama whose n_experts > 0: docs/moe.md) adds these; all six or none
MOE_KEYS = {"n_experts": int, "top_k": int, "norm_topk": bool, "capacity_factor": float,
            "router_aux_loss_coef": float, "router_z_loss_coef": float}
SCALARS = ("loss", "lr", "grad_norm")                  # float64 (), whatever the trace's dtype
BLOCK_PARAMS = ("ln_1.weight", "ln_1.bias", "attn.c_attn.weight", "attn.c_attn.bias",
                "attn.c_proj.weight", "attn.c_proj.bias", "ln_2.weight", "ln_2.bias",
                "mlp.c_fc.weight", "mlp.c_fc.bias", "mlp.c_proj.weight", "mlp.c_proj.bias")
LLAMA_BLOCK_PARAMS = ("ln_1.weight", "attn.c_attn.weight", "attn.c_proj.weight", "ln_2.weight", "mlp.c_fc.weight",
                      "mlp.c_proj.weight")      # no biases; c_attn [q | k | v] (GQA), c_fc [gate | up]
MASK_SITES = ("attn", "resid_attn", "resid_mlp")
# inside block i, in the order computed: act/h.{i}.ln_1 (ln_1's output), act/h.{i}.attn (the attention
# branch after its residual dropout, before the residual add), act/h.{i}.ln_2, act/h.{i}.mlp (likewise)
BLOCK_ACTS = ("ln_1", "attn", "ln_2", "mlp")
# the training state after step s's update (version 3, written on request: ``trace --state``): AdamW's moments
# per parameter (state/exp_avg/NAME, state/exp_avg_sq/NAME, the parameter's shape), the loss scale the next step
# multiplies by (state/loss_scale, float64 (), float16 runs), the counter the next step's random draws are keyed
# by (state/rng_offset, int64 ()), and a mixture's expert loads (state/expert_load/h.{i}, int64 (E,): the tokens
# routed to each expert in step s, every micro-batch's, each of a token's K choices counted)
MOMENTS = ("exp_avg", "exp_avg_sq")
STATE_SCALARS = ("state/loss_scale", "state/rng_offset")
NEW_IN = {2: tuple(f"step_*/act/h.*.{a}" for a in BLOCK_ACTS),     # patterns of what each version added
          3: ("step_*/state/*",),
          4: ("step_*/moe/h.*.bias", "step_*/moe/h.*.scores", "step_*/moe/h.*.bias_update")}
# a mixture of experts' router, per MoE layer i, in the order computed (between act/h.{i}.ln_2 and
# act/h.{i}.mlp): moe/h.{i}.logits (B, T, E) float, moe/h.{i}.experts (B, T, K) int32 (the chosen, best
# first), moe/h.{i}.weights (B, T, K) float; per step moe/aux_loss and moe/z_loss, float64 () (before their
# coefficients; the step's ``loss`` includes coef x each)
ROUTER = ("logits", "experts", "weights")
ROUTER_PARTS = ds.SIGMOID_ROUTER + (ds.BIAS_UPDATE,)      # any router's moe/h.{i}.* (a sigmoid router's: deepseek_names)
STEP_KINDS = ("act", "grad", "param")                   # of these, every compared step must have something
MOE_SCALARS = ("moe/aux_loss", "moe/z_loss")


def config_of(raw: dict) -> dict:
    """A trace's model config, checked: the five sizes as integers, and for
    a Llama (``arch`` "llama") its six settings (LLAMA_KEYS) typed; a
    ValueError names the first item that is missing or not of its type."""
    if not isinstance(raw, dict) or any(k not in raw for k in CONFIG_KEYS):
        raise ValueError(f"lacks one of {', '.join(CONFIG_KEYS)}")
    cfg = {}
    for k in CONFIG_KEYS:
        if not _typed(raw[k], int):
            raise ValueError(f"holds a size that is not an integer ({k})")
        cfg[k] = int(raw[k])
    arch = raw.get("arch", "gpt2")
    if arch == "gpt2":
        return cfg
    if arch not in ("llama", "deepseek_v3"):
        raise ValueError(f"has arch {arch!r}, not gpt2, llama or deepseek_v3")
    for k, kind in LLAMA_KEYS.items():
        value = raw.get(k)
        if not _typed(value, kind):
            raise ValueError(f"lacks {k} or holds it not as {kind.__name__} (a Llama config)")
        cfg[k] = kind(value)
    cfg["arch"] = arch
    for k, kind in ds.MLA_KEYS.items() if arch == "deepseek_v3" else ():
        if not _typed(raw.get(k), kind):
            raise ValueError(f"lacks {k} or holds it not as {kind.__name__} (a deepseek_v3 config)")
        cfg[k] = kind(raw[k])
    if arch == "deepseek_v3" and raw.get("mtp_depth", 0):     # its MTP depths' losses are traced (step_names);
        depth = raw["mtp_depth"]                             # the depths' own parameters sort after a step's
        if not _typed(depth, int) or depth < 0:
            raise ValueError("holds mtp_depth not as an integer of at least 0 (a deepseek_v3 config)")
        cfg["mtp_depth"] = int(depth)
    if raw.get("n_experts", 0):
        for k, kind in MOE_KEYS.items():
            if not _typed(raw.get(k), kind):
                raise ValueError(f"lacks {k} or holds it not as {kind.__name__} (a mixture of experts' config)")
            cfg[k] = kind(raw[k])
        for k, default in ds.MOE_DEFAULTS.items():          # stored where they differ from the defaults
            kind = type(default)
            if k in raw and not _typed(raw[k], kind):
                raise ValueError(f"holds {k} not as {kind.__name__} (a mixture of experts' config)")
            cfg[k] = kind(raw[k]) if k in raw else default
    return cfg


def _typed(value, kind) -> bool:
    """Whether ``value`` is a JSON value of ``kind`` (an integral float is an
    int; a non-finite number is neither)."""
    if kind in (str, bool):
        return isinstance(value, kind)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    return isinstance(value, int) or (math.isfinite(value) and kind(value) == value)


def moe(cfg: dict) -> bool:
    """Whether each block's MLP is a mixture of experts."""
    return cfg.get("n_experts", 0) > 0


def llama(cfg: dict) -> bool:
    """Llama-like: RMSNorm, rotary, SwiGLU, no biases (llama, and deepseek_v3 with its latent attention)."""
    return cfg.get("arch", "gpt2") in ("llama", "deepseek_v3")


def tied(cfg: dict) -> bool:
    """Whether the LM head is ``wte`` (GPT-2 always; Llama with tie_embeddings)."""
    return cfg.get("tie_embeddings", True) if llama(cfg) else True


def block_params(cfg: dict, i: int = 0) -> tuple:
    """Block i's parameter suffixes in declaration order; a mixture of
    experts' MLP is its router, then per expert ``c_fc`` and ``c_proj``,
    then the shared experts (model/moe.py's ``expert_names``); deepseek_v3's
    attention is MLA's (deepseek_names)."""
    return tuple(block_shapes(cfg, i)) if llama(cfg) else BLOCK_PARAMS


def forward_param_order(cfg: dict) -> list:
    """Parameter names in the model's declaration order (as checkpoints list
    them): GPT-2's, or Llama's (``wte``, the blocks, ``ln_f.weight``, and
    ``lm_head`` when the head is not tied; then DeepSeek-V3's MTP depths,
    deepseek_names.mtp_params)."""
    names = ["wte"] if llama(cfg) else ["wte", "wpe"]
    for i in range(cfg["n_layer"]):
        names += [f"h.{i}.{s}" for s in block_params(cfg, i)]
    if llama(cfg):       # then a deepseek_v3's MTP depths, each its block h.{L+k-1} and mtp.{k-1}.*
        return names + ["ln_f.weight"] + ([] if tied(cfg) else ["lm_head"]) + ds.mtp_params(cfg, block_params)
    return names + ["ln_f.weight", "ln_f.bias"]


def backward_param_order(cfg: dict) -> list:
    """Parameter names in the order backward completes their gradients:
    a DeepSeek-V3's MTP depths from the last (an untied ``lm_head`` just
    before depth 1's), else an untied ``lm_head``; ln_f, the blocks from last to first (each from
    mlp.c_proj back to ln_1, weight before bias), then wpe, and wte last
    (the LM head, when tied, and the lookup both add to it)."""
    if llama(cfg):       # the MTP depths' first (deepseek_names.mtp_backward), an untied head among them
        names = ds.mtp_backward(cfg, _backward_block, [] if tied(cfg) else ["lm_head"]) + ["ln_f.weight"]
        for i in reversed(range(cfg["n_layer"])):
            names += [f"h.{i}.{s}" for s in _backward_block(cfg, i)]
        return names + ["wte"]
    names = ["ln_f.weight", "ln_f.bias"]
    pairs = [BLOCK_PARAMS[k:k + 2] for k in range(0, len(BLOCK_PARAMS), 2)]
    for i in reversed(range(cfg["n_layer"])):
        names += [f"h.{i}.{s}" for pair in reversed(pairs) for s in pair]
    return names + ["wpe", "wte"]


def _backward_block(cfg: dict, i: int = 0) -> list:
    """Block i's parameters (a Llama-like block's) in the order backward
    completes them: the MLP's back to ``ln_2`` (a mixture's:
    deepseek_names.mixture_backward), then the attention's back to
    ``ln_1`` (MLA's: deepseek_names.attention_backward)."""
    mlp = ds.mixture_backward(cfg) if ds.is_moe(cfg, i) else ["mlp.c_proj.weight", "mlp.c_fc.weight"]
    attention = ds.attention_backward(cfg) if ds.mla(cfg) else ["attn.c_proj.weight", "attn.c_attn.weight",
                                                                "ln_1.weight"]
    return mlp + ["ln_2.weight"] + attention


def act_names(cfg: dict) -> list:
    """The ``act/`` names of a step, in computation order: ``emb``, then per
    block i ``h.{i}.ln_1``, ``h.{i}.attn``, ``h.{i}.ln_2``, ``h.{i}.mlp`` and
    ``h.{i}`` (the residual stream after the block), then ``ln_f``."""
    names = ["emb"]
    for i in range(cfg["n_layer"]):
        names += [f"h.{i}.{a}" for a in BLOCK_ACTS] + [f"h.{i}"]
    return names + ["ln_f"]


def step_names(cfg: dict, s: int, state: bool = False) -> list:
    """Every name step ``s`` of a full trace holds, in computation order;
    with ``state`` the training state too (written on request, ``trace
    --state``). A dropout mask comes just before the activation it is
    applied in."""
    g = f"step_{s}/"
    L, mtp = cfg["n_layer"], ds.mtp_depth(cfg)
    order = [g + "dropout/emb", g + "act/emb"]
    for i in range(L):
        order += _block_step_names(cfg, i, g)
    order += [g + "act/ln_f", g + "logits"]
    for i in range(L, L + mtp):                    # the MTP depths' blocks h.{L+k-1}, after the main head's logits
        order += _block_step_names(cfg, i, g)
    order += [g + n for n in MOE_SCALARS] if moe(cfg) else []
    # multi-token prediction: the main loss, then each depth's
    order += ([g + "mtp/main_loss"] + [g + f"mtp/loss_{k}" for k in range(1, mtp + 1)] if mtp else []) + [g + "loss"]
    order += [g + f"grad/{n}" for n in backward_param_order(cfg)]
    order += [g + "grad_norm", g + "lr"] + [g + n for n in ds.bias_update_names(cfg)]
    if state:
        order += [g + f"state/{m}/{n}" for n in forward_param_order(cfg) for m in MOMENTS]
        order += [g + n for n in STATE_SCALARS]
        order += [g + f"state/expert_load/h.{i}" for i in range(ds.n_blocks(cfg)) if ds.is_moe(cfg, i)]
    return order + [g + f"param/{n}" for n in forward_param_order(cfg)]


def _block_step_names(cfg: dict, i: int, g: str) -> list:
    """Block i's names of a step (``g`` its ``step_%d/``), in computation
    order: its norms, dropout masks, branches and router records."""
    b = f"h.{i}"
    order = [g + f"act/{b}.ln_1", g + f"dropout/{b}.attn", g + f"dropout/{b}.resid_attn", g + f"act/{b}.attn",
             g + f"act/{b}.ln_2"]
    order += [g + f"moe/{b}.{r}" for r in ds.router_parts(cfg)] if ds.is_moe(cfg, i) else []
    return order + [g + f"dropout/{b}.resid_mlp", g + f"act/{b}.mlp", g + f"act/{b}"]


def computation_order(cfg: dict, steps: int, state: bool = False) -> list:
    """Every name a trace of ``steps`` steps may hold, in the order the
    computation makes it (with ``state``, the training state too)."""
    order = ["tokens"] + [f"init/{n}" for n in forward_param_order(cfg)]
    for s in range(1, steps + 1):
        order += step_names(cfg, s, state)
    return order


def missing_by_version(version: int) -> tuple:
    """Patterns of the names a trace of ``version`` cannot hold because a
    later version of the format added them (compare allows them missing
    from that trace only)."""
    return tuple(p for v, patterns in NEW_IN.items() if v > version for p in patterns)


def step_of(name: str) -> int:
    """The step of ``step_3/act/h.0`` (3); 0 for what belongs to no step."""
    head = name.split("/", 1)[0]
    return int(head[5:]) if head.startswith("step_") and head[5:].isdigit() else 0


def ordered(names, cfg: dict) -> list:
    """``names`` in computation order; names the format does not define go
    after everything else of their step (or at the end), alphabetically; a
    bare ``step_%d`` (a whole step) goes where its step begins. Costs what
    the names cost, whatever the config or the step numbers declare: one
    step's order is built once, for the blocks and experts the names hold."""
    names = list(names)
    cfg = _trimmed(cfg, names)
    head = {n: i for i, n in enumerate(["tokens"] + [f"init/{n}" for n in forward_param_order(cfg)])}
    within = {n.split("/", 1)[1]: i for i, n in enumerate(step_names(cfg, 1, state=True))}

    weights = {n: i for i, n in enumerate(forward_param_order(cfg))}

    def key(n):
        s = step_of(n)
        if not s:
            return (0, head[n], "") if n in head else (math.inf, 0, n)
        if n == f"step_{s}":                            # a whole step (missing): where the step starts
            return (s, -1, n)
        rest = n.split("/", 1)[1] if "/" in n else None
        anchor = fp8_anchor(rest or "")
        if anchor in within:                            # just before what the quantized GEMM makes
            _, linear, operand, what = (rest.split("/") + [""])[:4]
            role = operand.partition(".")[0]              # x before w before dy, a scale before its bytes
            return (s, within[anchor] - 0.5, f"{weights.get(linear + '.weight', 0):06d} "
                                             f"{'xwd'.find(role[:1])} {what != 'scale':d} {rest}")
        return (s, within[rest], "") if rest in within else (s, len(within), n)
    return sorted(names, key=key)


def fp8_anchor(rest: str):
    """The traced name an FP8 operand (``fp8/<linear>/<role>.<gemm>/...``,
    ``trace --fp8``) is computed just before, or None for any other name:
    a forward GEMM's operands before the block's attention or MLP output
    that the linear makes, dgrad's and wgrad's before the linear weight's
    gradient. So ``compare`` names a wrong scale or quantized byte as the
    first divergence, ahead of the activation it spoils."""
    parts = rest.split("/")
    if len(parts) < 3 or parts[0] != "fp8":
        return None
    linear, gemm = parts[1], parts[2].partition(".")[2]
    if gemm != "forward":
        return f"grad/{linear}.weight"
    part = "attn" if ".attn." in linear else "mlp"
    return f"act/h.{_block(linear)}.{part}"


def _trimmed(cfg: dict, names: list) -> dict:
    """``cfg`` with no more layers and experts than ``names`` mention: the
    order of the names present is the same, and a config declaring 2**40
    layers costs nothing."""
    cfg = dict(cfg)
    if cfg.get("mtp_depth"):     # MTP depths: those whose block (h.{L+k-1}), tensors (mtp.{k-1}.) or loss appear
        blocks = [int(m) - cfg["n_layer"] + 1 for n in names for m in re.findall(r"(?:^|/)h\.(\d+)", n)]
        own = [int(m) + 1 for n in names for m in re.findall(r"(?:^|/)mtp\.(\d+)\.", n)]
        losses = [int(m) for n in names for m in re.findall(r"/mtp/loss_(\d+)$", n)]
        cfg["mtp_depth"] = min(cfg["mtp_depth"], max(blocks + own + losses + [0]))
    for key, pattern in (("n_layer", r"(?:^|/)h\.(\d+)"), ("n_experts", r"experts\.(\d+)\.")):
        if key in cfg:
            found = [int(m) for n in names for m in re.findall(pattern, n)]
            least = 1 if key == "n_experts" and cfg[key] > 0 else 0      # a mixture stays one
            cfg[key] = min(cfg[key], max([f + 1 for f in found] + [least]))
    return cfg


# --------------------------------------------------------------------------- depth


def step_depth(cfg: dict) -> int:
    """Depth units one training step adds: the embedding, L blocks, ln_f,
    the head, the loss; backward back through them; the norm; the update.
    A DeepSeek-V3's MTP depths lengthen the chain by a block each."""
    return 2 * ds.n_blocks(cfg) + 9


def depth(name: str, cfg: dict) -> int:
    """How many dependent stages of the computation lie between the trace's
    inputs (tokens, initial parameters, masks: depth 0) and ``name``.

    One unit per stage a tensor must pass through, counted as a block, not
    as a GEMM: within a block the chain is fixed, so what separates an
    early tensor from a late one is the number of blocks (and of steps)
    behind it. Forward: ``act/emb`` 1, ``act/h.i`` i+2, ``act/ln_f`` L+2,
    ``logits`` L+3, ``loss`` L+4. Backward mirrors it: the gradient of
    ``ln_f`` L+5, of block i L+5+(L-i), ``wpe`` 2L+6, ``wte`` 2L+7;
    ``grad_norm`` 2L+8; the updated parameters 2L+9 = one step. Step s
    adds (s-1) steps. ``lr`` is a formula of s (depth 1); names outside
    the format count as the end of their step.

    With D multi-token prediction depths the chain is B = L + D blocks
    long: depth k's block (``h.{L+k-1}``) runs after the main ``logits``,
    at L+2+k, ``mtp/loss_k`` at L+3+k, ``loss`` at B+4; backward meets the
    depths first (block i, ``mtp.{j}.*`` as its block ``h.{L+j}``:
    B+5+(B-i)), an untied ``lm_head`` with depth 1 (B+5+D-1), ``ln_f``
    after them (B+5+D), and every later figure above has B for L."""
    L, B = cfg["n_layer"], ds.n_blocks(cfg)
    s = step_of(name)
    if s == 0:
        return 0
    rest = name.split("/", 1)[1] if "/" in name else ""
    anchor = fp8_anchor(rest)
    if anchor is not None:                            # an FP8 operand: at the depth of what its GEMM makes
        return depth(f"step_{s}/{anchor}", cfg)
    base = (s - 1) * step_depth(cfg)
    kind, _, what = rest.partition("/")
    if kind == "dropout":
        return 0
    if rest == "lr":
        return 1
    local = {"act/emb": 1, "act/ln_f": L + 2, "logits": L + 3, "loss": B + 4, "grad_norm": 2 * B + 8,
             "mtp/main_loss": L + 4, **{f"mtp/loss_{k}": L + 3 + k for k in range(1, B - L + 1)},
             **dict.fromkeys(MOE_SCALARS, B + 4)}.get(rest)
    if local is None and kind in ("act", "moe") and what.startswith("h."):
        i = _block(what)
        local = i + 2 if i < L else i + 3                         # an MTP depth's block runs after ln_f
    elif local is None and kind == "grad":
        if what.startswith("h.") or what.startswith("mtp."):
            local = B + 5 + (B - (_block(what) + (L if what.startswith("mtp.") else 0)))
        else:
            local = {"lm_head": max(B + 5, 2 * B - L + 4), "ln_f.weight": 2 * B - L + 5, "ln_f.bias": L + 5,
                     "wpe": 2 * B + 6, "wte": 2 * B + 7}.get(what)
    elif local is None and kind == "param":
        local = step_depth(cfg)
    return base + (local if local is not None else step_depth(cfg))


def _block(what: str) -> int:
    """The block number of ``h.3.attn.c_attn.weight`` or ``h.3`` (3), 0 if unreadable."""
    part = what.split(".")[1] if what.count(".") >= 1 else ""
    return int(part) if part.isdigit() else 0


def block_shapes(cfg: dict, i: int) -> dict:
    """{suffix: shape} of a Llama-like block i's parameters in declaration
    order: c_attn (h, (n_head + 2 n_kv_head) hd) or MLA's projections
    (deepseek_names.attention_shapes), then c_fc (h, 2 F) and c_proj (F, h)
    or a mixture's router, experts and shared experts."""
    h = cfg["n_embd"]
    if ds.mla(cfg):
        block = ds.attention_shapes(cfg)
    else:
        hd = h // cfg["n_head"]
        qkv = (cfg["n_head"] + 2 * cfg["n_kv_head"]) * hd
        block = {"ln_1.weight": (h,), "attn.c_attn.weight": (h, qkv), "attn.c_proj.weight": (h, h), "ln_2.weight": (h,)}
    F = cfg["ffn_hidden"]
    mlp = ds.mixture_shapes(cfg) if ds.is_moe(cfg, i) else {"mlp.c_fc.weight": (h, 2 * F), "mlp.c_proj.weight": (F, h)}
    return {**block, **mlp}


def param_shapes(cfg: dict) -> dict:
    """{name: shape} of every parameter, in declaration order, weights
    (in, out) as GPT-2's Conv1D holds them (Llama's too: c_attn (h, (n_head
    + 2 n_kv_head) hd), c_fc (h, 2 F), lm_head (V, h) as wte)."""
    V, C, h = cfg["vocab_size"], cfg["n_ctx"], cfg["n_embd"]
    if llama(cfg):
        shapes = {"wte": (V, h)}
        for i in range(cfg["n_layer"]):
            shapes.update({f"h.{i}.{k}": v for k, v in block_shapes(cfg, i).items()})
        shapes = {**shapes, "ln_f.weight": (h,), **({} if tied(cfg) else {"lm_head": (V, h)})}
        for j, i in enumerate(range(cfg["n_layer"], ds.n_blocks(cfg))):      # MTP depth j + 1's block and tensors
            shapes.update({f"h.{i}.{k}": v for k, v in block_shapes(cfg, i).items()})
            shapes.update(ds.mtp_shapes(cfg, j))
        return shapes
    block = {"ln_1.weight": (h,), "ln_1.bias": (h,), "attn.c_attn.weight": (h, 3 * h), "attn.c_attn.bias": (3 * h,),
             "attn.c_proj.weight": (h, h), "attn.c_proj.bias": (h,), "ln_2.weight": (h,), "ln_2.bias": (h,),
             "mlp.c_fc.weight": (h, 4 * h), "mlp.c_fc.bias": (4 * h,), "mlp.c_proj.weight": (4 * h, h),
             "mlp.c_proj.bias": (h,)}
    shapes = {"wte": (V, h), "wpe": (C, h)}
    for i in range(cfg["n_layer"]):
        shapes.update({f"h.{i}.{k}": v for k, v in block.items()})
    return {**shapes, "ln_f.weight": (h,), "ln_f.bias": (h,)}
