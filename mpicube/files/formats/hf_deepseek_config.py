"""Hugging Face DeepseekV3 ``config.json``, read and validated into
``DeepseekV3Shape`` (every field mpicube's DeepSeek-V3 needs, named as
the ``--arch deepseek_v3`` options will be), and written back
(``config_json``) so that transformers loads it as
``DeepseekV3ForCausalLM``.

Both spellings are read: transformers' (``rope_parameters``,
``num_nextn_predict_layers``) and DeepSeek's released config
(``rope_scaling``, ``scoring_func``, ``topk_method``, ``seq_aux``,
``aux_loss_alpha``, ``moe_layer_freq``). The rope is the default one or
YaRN (the released DeepSeek-V3 config's ``rope_scaling`` type "yarn",
``ops.yarn``), its fields validated one by one. A configuration this build
does not compute is refused in one line naming the field: another rope
scaling, an unknown YaRN field, a scoring function other than sigmoid, a top-k method
other than the grouped one (``noaux_tc``), attention biases, key/value
heads fewer than the heads, a batch-wise auxiliary loss, MoE layers not
on every layer, sizes that do not divide (experts by groups) or
selections that cannot be made (top-k above what the kept groups hold).

``head_dim`` (transformers writes qk_rope_head_dim there, for its rotary
tables) and ``qk_head_dim`` are derived and not read.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from ...core.config import float_problem
from ...ops.yarn import YarnScaling
from .base import FormatError
from .hf import CONFIG, _shown, read_json

MODEL_TYPE = "deepseek_v3"


@dataclass(frozen=True)
class DeepseekV3Shape:
    """A DeepSeek-V3 model's sizes and routing settings, in mpicube's words."""
    vocab_size: int
    n_layer: int                    # num_hidden_layers (the MTP modules not counted)
    n_head: int
    n_embd: int
    ffn_hidden: int                 # the dense layers' intermediate_size
    n_ctx: int
    q_lora_rank: int                # 0: no q compression (q_proj)
    kv_lora_rank: int
    qk_rope_head_dim: int
    qk_nope_head_dim: int
    v_head_dim: int
    n_routed_experts: int
    moe_ffn_hidden: int             # one routed expert's width (moe_intermediate_size)
    n_shared_experts: int           # the shared MLP is n_shared_experts * moe_ffn_hidden wide
    first_k_dense: int              # layers 0 .. first_k_dense - 1 have a dense MLP
    top_k: int
    n_groups: int
    topk_groups: int
    norm_topk: bool
    routed_scaling_factor: float
    seq_aux_loss_coef: float
    mtp_depth: int
    rope_theta: float
    rope_interleave: bool
    rms_eps: float
    tie_embeddings: bool
    rope_scaling: Optional[YarnScaling] = None     # YaRN, or None: unscaled rope

    @property
    def softmax_factor(self) -> float:
        """MLA's softmax scale over 1/sqrt(qk_head_dim): YaRN's mscale_all_dim correction, or 1."""
        return 1.0 if self.rope_scaling is None else self.rope_scaling.softmax_factor

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    def is_moe(self, layer: int) -> bool:
        """Whether layer ``layer`` (an MTP module's block: n_layer + k) has the mixture of experts."""
        return layer >= self.first_k_dense


def is_deepseek_dir(path: Path) -> bool:
    """Whether the directory's config.json names a DeepseekV3 model."""
    try:
        doc = read_json(Path(path) / CONFIG, "a model configuration")
    except FormatError:
        return False
    return isinstance(doc, dict) and doc.get("model_type") == MODEL_TYPE


def _int(where, doc, key, default=None, low=1):
    value = doc.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        kind = "a positive integer" if low == 1 else f"an integer >= {low}"
        raise FormatError(f"{where}: {key} = {_shown(value)} is not {kind}")
    return value


def _number(where, doc, key, default, positive=True):
    value = doc.get(key, default)
    bad = isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value)
    if bad or (value <= 0 if positive else value < 0):
        raise FormatError(f"{where}: {key} = {_shown(value)} is not a {'positive' if positive else '>= 0'} number")
    return float(value)


def _flag(where, doc, key, default):
    value = doc.get(key, default)
    if not isinstance(value, bool):
        raise FormatError(f"{where}: {key} = {_shown(value)} must be true or false")
    return value


YARN_KEYS = {"rope_type", "type", "rope_theta", "factor", "original_max_position_embeddings", "beta_fast",
             "beta_slow", "mscale", "mscale_all_dim", "attention_factor", "truncate"}


def _yarn(where, field, params) -> YarnScaling:
    """The YaRN settings of the rope object ``params`` (``field`` names it),
    each field checked: finite and positive (factor at least 1, beta_fast
    above beta_slow), original_max_position_embeddings a positive integer,
    truncate true or false; mscale, mscale_all_dim, attention_factor,
    beta_fast and beta_slow may be absent (or null)."""
    unknown = sorted(set(params) - YARN_KEYS)
    if unknown:
        raise FormatError(f"{where}: {field}.{unknown[0]} = {_shown(params[unknown[0]])} is not a YaRN field "
                          "mpicube computes")
    try:
        return YarnScaling.from_dict(params, field, shown=_shown)
    except ValueError as e:
        raise FormatError(f"{where}: {e}") from None


def _rope_of(where, field, params, doc):
    """(rope_theta, YarnScaling or None) of the rope object ``params``."""
    if not isinstance(params, dict):
        raise FormatError(f"{where}: {field} = {_shown(params)} is not a JSON object")
    kind = params.get("rope_type", params.get("type", "default"))
    if kind not in ("default", "yarn"):
        raise FormatError(f"{where}: {field}.rope_type = {_shown(kind)} is not supported: mpicube's DeepSeek-V3 "
                          "rotates unscaled (rope type default) or with YaRN (yarn)")
    theta = params.get("rope_theta", doc.get("rope_theta", 10000.0))
    if why := float_problem("rope_theta", theta):              # the rule every path applies (core.config)
        raise FormatError(f"{where}: rope_theta = {_shown(theta)} is not supported: it {why}")
    return float(theta), (_yarn(where, field, params) if kind == "yarn" else None)


def _rope(where, doc):
    """(rope_theta, YarnScaling or None) from transformers' rope_parameters or
    DeepSeek's rope_scaling (both present: they must agree)."""
    field = "rope_parameters" if doc.get("rope_parameters") is not None else "rope_scaling"
    rope = _rope_of(where, field, doc.get(field) or {}, doc)
    if field == "rope_parameters" and doc.get("rope_scaling"):
        if _rope_of(where, "rope_scaling", doc["rope_scaling"], doc)[1] != rope[1]:
            raise FormatError(f"{where}: rope_scaling = {_shown(doc['rope_scaling'])} disagrees with "
                              "rope_parameters")
    return rope


def _ruled(where, doc, key, default, field) -> float:
    """``doc[key]`` (or ``default``) checked by the float rule of mpicube's
    config ``field`` (core.config.FLOAT_RANGES), as Llama's reader does."""
    value = doc.get(key, default)
    if why := float_problem(field, value):
        raise FormatError(f"{where}: {key} = {_shown(value)} is not supported: it {why}")
    return float(value)


def parse_config(path, doc) -> DeepseekV3Shape:
    """The DeepseekV3Shape of a DeepseekV3 ``config.json`` (parsed JSON
    ``doc`` of the directory ``path``), or a FormatError naming the field."""
    where = Path(path) / CONFIG
    if not isinstance(doc, dict):
        raise FormatError(f"{where}: not a JSON object")
    if doc.get("model_type") != MODEL_TYPE:
        raise FormatError(f"{where}: model_type = {_shown(doc.get('model_type'))} is not {MODEL_TYPE!r}")
    refusals = [
        ("scoring_func", doc.get("scoring_func", "sigmoid") != "sigmoid", "DeepSeek-V3's router scores with a sigmoid"),
        ("topk_method", doc.get("topk_method", "noaux_tc") != "noaux_tc",
         "mpicube's router takes the group-limited top-k on the bias-corrected scores (noaux_tc)"),
        ("attention_bias", doc.get("attention_bias", False) is not False, "mpicube's MLA has no biases"),
        ("hidden_act", doc.get("hidden_act", "silu") != "silu", "mpicube's SwiGLU gates with SiLU"),
        ("moe_layer_freq", doc.get("moe_layer_freq", 1) != 1, "every layer from first_k_dense_replace on is MoE"),
        ("seq_aux", doc.get("seq_aux", True) is not True and doc.get("aux_loss_alpha", 0.0),
         "mpicube's auxiliary loss is the sequence-wise one"),
        ("partial_rotary_factor", doc.get("partial_rotary_factor", 1.0) != 1.0,
         "MLA's rotary part is qk_rope_head_dim"),
    ]
    for key, refused, why in refusals:
        if refused:
            raise FormatError(f"{where}: {key} = {_shown(doc.get(key))} is not supported: {why}")
    v = {ours: _int(where, doc, theirs) for ours, theirs in [
        ("vocab_size", "vocab_size"), ("n_layer", "num_hidden_layers"), ("n_head", "num_attention_heads"),
        ("n_embd", "hidden_size"), ("ffn_hidden", "intermediate_size"), ("n_ctx", "max_position_embeddings"),
        ("kv_lora_rank", "kv_lora_rank"), ("qk_rope_head_dim", "qk_rope_head_dim"),
        ("qk_nope_head_dim", "qk_nope_head_dim"), ("v_head_dim", "v_head_dim"),
        ("n_routed_experts", "n_routed_experts"), ("moe_ffn_hidden", "moe_intermediate_size")]}
    q_rank = doc.get("q_lora_rank")
    v["q_lora_rank"] = 0 if q_rank is None else _int(where, doc, "q_lora_rank")   # null: a plain q_proj
    if v["qk_rope_head_dim"] % 2:
        raise FormatError(f"{where}: qk_rope_head_dim = {v['qk_rope_head_dim']} is not even (rotary pairs)")
    kv = doc.get("num_key_value_heads", v["n_head"])
    if kv not in (None, v["n_head"]):
        raise FormatError(f"{where}: num_key_value_heads = {_shown(kv)} is not supported: MLA expands every head's "
                          f"keys and values from the latent (num_attention_heads {v['n_head']})")
    E = v["n_routed_experts"]
    v["n_shared_experts"] = _int(where, doc, "n_shared_experts", 0, low=0)
    v["first_k_dense"] = _int(where, doc, "first_k_dense_replace", 0, low=0)
    if v["first_k_dense"] > v["n_layer"]:
        raise FormatError(f"{where}: first_k_dense_replace = {v['first_k_dense']} exceeds num_hidden_layers "
                          f"{v['n_layer']}")
    G = _int(where, doc, "n_group", 1)
    if E % G:
        raise FormatError(f"{where}: n_group = {G} does not divide n_routed_experts {E}")
    if E // G < 2:
        raise FormatError(f"{where}: n_group = {G} leaves {E // G} expert per group; a group's score is the sum of "
                          "its two best experts")
    Kg = _int(where, doc, "topk_group", 1)
    if Kg > G:
        raise FormatError(f"{where}: topk_group = {Kg} exceeds n_group {G}")
    K = _int(where, doc, "num_experts_per_tok", 1)
    if K > Kg * (E // G):
        raise FormatError(f"{where}: num_experts_per_tok = {K} exceeds the {Kg * (E // G)} experts its topk_group "
                          f"{Kg} groups hold")
    mtp = doc.get("num_nextn_predict_layers", doc.get("num_mtp_layers", 0))
    mtp_key = "num_nextn_predict_layers" if "num_nextn_predict_layers" in doc else "num_mtp_layers"
    if isinstance(mtp, bool) or not isinstance(mtp, int) or mtp < 0:
        raise FormatError(f"{where}: {mtp_key} = {_shown(mtp)} is not an integer >= 0")
    coef = _ruled(where, doc, "aux_loss_alpha", 0.0, "router_aux_loss_coef")
    theta, scaling = _rope(where, doc)
    return DeepseekV3Shape(
        **v, top_k=K, n_groups=G, topk_groups=Kg, norm_topk=_flag(where, doc, "norm_topk_prob", True),
        routed_scaling_factor=_number(where, doc, "routed_scaling_factor", 1.0), seq_aux_loss_coef=coef,
        mtp_depth=mtp, rope_theta=theta, rope_interleave=_flag(where, doc, "rope_interleave", True),
        rms_eps=_ruled(where, doc, "rms_norm_eps", 1e-6, "rms_eps"),
        tie_embeddings=_flag(where, doc, "tie_word_embeddings", False), rope_scaling=scaling)


def read_config(path) -> DeepseekV3Shape:
    """The DeepseekV3Shape of the directory ``path``'s config.json."""
    path = Path(path)
    return parse_config(path, read_json(path / CONFIG, "a model configuration"))


def config_json(d: DeepseekV3Shape, dtype: str = "float32") -> dict:
    """A config.json that transformers loads as ``DeepseekV3ForCausalLM``
    and ``parse_config`` reads back as ``d``: transformers' spelling, plus
    DeepSeek's ``scoring_func``/``topk_method``/``aux_loss_alpha``/``seq_aux``
    (which transformers keeps as unknown keys)."""
    return {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": MODEL_TYPE,
        "vocab_size": d.vocab_size,
        "hidden_size": d.n_embd,
        "intermediate_size": d.ffn_hidden,
        "moe_intermediate_size": d.moe_ffn_hidden,
        "num_hidden_layers": d.n_layer,
        "num_attention_heads": d.n_head,
        "num_key_value_heads": d.n_head,
        "max_position_embeddings": d.n_ctx,
        "q_lora_rank": d.q_lora_rank or None,
        "kv_lora_rank": d.kv_lora_rank,
        "qk_rope_head_dim": d.qk_rope_head_dim,
        "qk_nope_head_dim": d.qk_nope_head_dim,
        "v_head_dim": d.v_head_dim,
        "n_routed_experts": d.n_routed_experts,
        "n_shared_experts": d.n_shared_experts,
        "first_k_dense_replace": d.first_k_dense,
        "num_experts_per_tok": d.top_k,
        "n_group": d.n_groups,
        "topk_group": d.topk_groups,
        "norm_topk_prob": d.norm_topk,
        "routed_scaling_factor": d.routed_scaling_factor,
        "scoring_func": "sigmoid",
        "topk_method": "noaux_tc",
        "seq_aux": True,
        "aux_loss_alpha": d.seq_aux_loss_coef,
        "num_nextn_predict_layers": d.mtp_depth,
        "rope_parameters": {**(d.rope_scaling.to_dict() if d.rope_scaling else {"rope_type": "default"}),
                            "rope_theta": d.rope_theta},
        "rope_interleave": d.rope_interleave,
        "rms_norm_eps": d.rms_eps,
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "tie_word_embeddings": d.tie_embeddings,
        "initializer_range": 0.02,
        "bos_token_id": None,
        "eos_token_id": None,
        "dtype": dtype,
    }
