"""The parts of a trace's names that DeepSeek-V3 adds (``arch``
"deepseek_v3", and DeepSeekMoE's options on any mixture): multi-head
latent attention's parameters in place of Llama's fused q/k/v, a mixture
whose first ``first_k_dense`` blocks stay dense, shared experts beside
the routed ones, and the sigmoid router's extra records.

Why a module of its own: ``names`` orders every family's tensors, and
the latent projections, the layer-dependent MLP and the router's bias
would double it; this module knows only DeepSeek's shapes and orders
(model/families/deepseek_v3.py and model/moe.py declare the same, and
tests/test_check_maps.py checks that they agree) and imports nothing of
``names``, which asks it.

The sigmoid router's records (docs/trace-format.md), per MoE layer i of
step s: ``moe/h.{i}.bias`` (E,) the choice bias in use (before this
step's update), ``moe/h.{i}.scores`` (B, T, E) the sigmoid scores,
beside Mixtral's logits, chosen experts and weights; after the step's
optimizer update ``moe/h.{i}.bias_update`` (E,), the bias after the
step minus the bias in use: rate x sign(mean load - load) from the loads
of the whole global batch (less its mean under --bias-update centred).
"""

from __future__ import annotations

# a deepseek_v3 trace's config adds these to Llama's (core.config.MLA_FIELDS)
MLA_KEYS = {"q_lora_rank": int, "kv_lora_rank": int, "qk_rope_head_dim": int, "qk_nope_head_dim": int,
            "v_head_dim": int, "rope_interleave": bool}
# DeepSeekMoE's options of any mixture, stored only where they differ from these (core.deepseek_moe.DEEPSEEK_MOE)
MOE_DEFAULTS = {"router": "softmax", "n_groups": 1, "topk_groups": 1, "routed_scaling_factor": 1.0,
                "n_shared_experts": 0, "moe_ffn_hidden": 0, "first_k_dense": 0, "bias_update_rate": 0.0,
                "bias_update": "plain", "seq_aux_loss_coef": 0.0}
SIGMOID_ROUTER = ("bias", "logits", "scores", "experts", "weights")    # in the order computed
BIAS_UPDATE = "bias_update"


def mla(cfg: dict) -> bool:
    return cfg.get("arch") == "deepseek_v3"


def sigmoid(cfg: dict) -> bool:
    """Whether the mixture routes on sigmoid scores plus a bias (DeepSeek-V3's router)."""
    return cfg.get("router", "softmax") == "sigmoid"


def is_moe(cfg: dict, i: int) -> bool:
    """Whether block i's MLP is a mixture (the first ``first_k_dense`` stay dense)."""
    return cfg.get("n_experts", 0) > 0 and i >= cfg.get("first_k_dense", 0)


def attention_shapes(cfg: dict) -> dict:
    """{suffix after ``h.{i}.``: shape} of an MLA block's norms and
    attention, in declaration order: ln_1, the q path (q_down, q_norm,
    q_up with a q rank; q_proj without), kv_down (h, kv rank + rope: the
    latent's columns, then the rotary key's), kv_norm, kv_up (the heads'
    [k_nope | v] columns), c_proj, ln_2."""
    h, nh = cfg["n_embd"], cfg["n_head"]
    dn, dr, dv, rq, rkv = (cfg[k] for k in ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "q_lora_rank",
                                             "kv_lora_rank"))
    q = ({"attn.q_down.weight": (h, rq), "attn.q_norm.weight": (rq,), "attn.q_up.weight": (rq, nh * (dn + dr))}
         if rq else {"attn.q_proj.weight": (h, nh * (dn + dr))})
    return {"ln_1.weight": (h,), **q, "attn.kv_down.weight": (h, rkv + dr), "attn.kv_norm.weight": (rkv,),
            "attn.kv_up.weight": (rkv, nh * (dn + dv)), "attn.c_proj.weight": (nh * dv, h), "ln_2.weight": (h,)}


def attention_backward(cfg: dict) -> list:
    """An MLA block's attention parameters in the order backward completes
    them: c_proj, then the kv path back to kv_down (the rotary key's
    gradient, summed over every head, joins the latent's there), the q
    path back to its first projection, ln_1 last."""
    q = ["attn.q_up.weight", "attn.q_norm.weight", "attn.q_down.weight"] if cfg["q_lora_rank"] else \
        ["attn.q_proj.weight"]
    return ["attn.c_proj.weight", "attn.kv_up.weight", "attn.kv_norm.weight", "attn.kv_down.weight", *q,
            "ln_1.weight"]


def mixture_shapes(cfg: dict) -> dict:
    """{suffix: shape} of a mixture's router, routed experts (each a SwiGLU
    of width --moe-ffn-hidden, else ffn_hidden) and shared experts (one
    SwiGLU n_shared times as wide), in declaration order (model/moe.py)."""
    h, E = cfg["n_embd"], cfg["n_experts"]
    F = cfg.get("moe_ffn_hidden") or cfg["ffn_hidden"]
    out = {"moe.router.weight": (h, E)}
    for e in range(E):
        out.update({f"moe.experts.{e}.c_fc.weight": (h, 2 * F), f"moe.experts.{e}.c_proj.weight": (F, h)})
    S = F * cfg.get("n_shared_experts", 0)
    if S:
        out.update({"moe.shared.c_fc.weight": (h, 2 * S), "moe.shared.c_proj.weight": (S, h)})
    return out


def mixture_backward(cfg: dict) -> list:
    """A mixture's parameters in the order backward completes them: the
    shared experts first (their backward runs before the routed ones'),
    the routed experts from the last to the first (c_proj then c_fc), the
    router last (its gradient needs every expert's output gradient)."""
    shared = ["moe.shared.c_proj.weight", "moe.shared.c_fc.weight"] if cfg.get("n_shared_experts", 0) else []
    experts = [f"moe.experts.{e}.{w}.weight" for e in reversed(range(cfg["n_experts"])) for w in ("c_proj", "c_fc")]
    return shared + experts + ["moe.router.weight"]


def router_parts(cfg: dict) -> tuple:
    """The ``moe/h.{i}.*`` records of a mixture layer: Mixtral's three, or
    the sigmoid router's five (SIGMOID_ROUTER)."""
    return SIGMOID_ROUTER if sigmoid(cfg) else ("logits", "experts", "weights")


def bias_update_names(cfg: dict) -> list:
    """``moe/h.{i}.bias_update`` of every sigmoid-routed layer, the MTP
    depths' blocks included (none under softmax)."""
    if not sigmoid(cfg):
        return []
    return [f"moe/h.{i}.{BIAS_UPDATE}" for i in range(n_blocks(cfg)) if is_moe(cfg, i)]


# --------------------------------------------------------------------------- multi-token prediction

MTP_OWN = ("enorm.weight", "hnorm.weight", "proj.weight", "ln_f.weight")   # a depth's own tensors (model/mtp.py)


def mtp_depth(cfg: dict) -> int:
    """D, the multi-token prediction depths of a deepseek_v3 trace (0 without)."""
    return int(cfg.get("mtp_depth") or 0) if mla(cfg) else 0


def n_blocks(cfg: dict) -> int:
    """The blocks a step runs: the L main ones, then depth k's ``h.{L+k-1}``."""
    return cfg["n_layer"] + mtp_depth(cfg)


def mtp_shapes(cfg: dict, j: int) -> dict:
    """{name: shape} of depth j + 1's own tensors, in declaration order:
    the embedding's and the hidden state's norms, the projection W (2C, C)
    (rows [embedding | hidden]) and the output norm."""
    h, p = cfg["n_embd"], f"mtp.{j}."
    return {p + "enorm.weight": (h,), p + "hnorm.weight": (h,), p + "proj.weight": (2 * h, h),
            p + "ln_f.weight": (h,)}


def mtp_params(cfg: dict, block) -> list:
    """The depths' parameters in the model's declaration order (after the
    main model's head): per depth k, its block ``h.{L+k-1}`` (``block(cfg,
    i)`` its suffixes), then ``mtp.{k-1}.*`` (model/families/deepseek_v3.py)."""
    L, names = cfg["n_layer"], []
    for j in range(mtp_depth(cfg)):
        names += [f"h.{L + j}.{s}" for s in block(cfg, L + j)] + list(mtp_shapes(cfg, j))
    return names


def mtp_backward(cfg: dict, block_backward, head: list) -> list:
    """The depths' gradients in the order backward completes them, before
    the main model's ``ln_f``: from depth D back to depth 1, each its
    output norm, its block (``block_backward(cfg, i)``), the projection,
    the embedding's norm (whose gradient then joins wte's), the hidden
    state's norm. ``head`` (an untied ``lm_head``, or nothing) completes
    at depth 1's loss, the last of the head's D + 1 uses, so it goes just
    before depth 1's tensors (first of all with D = 0)."""
    L, names = cfg["n_layer"], []
    for j in reversed(range(mtp_depth(cfg))):
        p = f"mtp.{j}."
        names += (head if j == 0 else []) + [p + "ln_f.weight"] + [f"h.{L + j}.{s}" for s in block_backward(cfg, L + j)]
        names += [p + "proj.weight", p + "enorm.weight", p + "hnorm.weight"]
    return names if names else list(head)
