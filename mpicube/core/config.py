"""Configuration dataclasses: the model's shape and the training options."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Optional

from .deepseek_moe import BIAS_UPDATES, DEEPSEEK_MOE, DEEPSEEK_OPTIONS, ROUTERS, deepseek_fields  # noqa: F401
from .errors import ConfigError
from .floats import FLOAT_RANGES, float_problem  # noqa: F401 (config.float_problem: the checks' callers)

ARCHS = ("gpt2", "llama", "deepseek_v3")
LLAMA_LIKE = ("llama", "deepseek_v3")    # RMSNorm, rotary positions, SwiGLU, no biases, untied head
SIZES = ("vocab_size", "n_ctx", "n_layer", "n_head", "n_embd")   # every architecture's, always stored


MAX_DIM = 2**31 - 1        # any one model dimension, at most (shapes are int32-sized everywhere), context included



MLA_FIELDS = ("q_lora_rank", "kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim", "rope_interleave")
MOE_FIELDS = ("n_experts", "top_k", "norm_topk", "capacity_factor", "router_aux_loss_coef", "router_z_loss_coef")
MIXTRAL = {"n_experts": 8, "top_k": 2}         # --arch mixtral: Llama with Mixtral's MoE defaults


def family_fields(arch="gpt2", n_kv_head=None, ffn_hidden=None, rope_theta=None, rms_eps=None,
                  tie_embeddings=False, q_lora_rank=None, kv_lora_rank=None, qk_rope_head_dim=None,
                  qk_nope_head_dim=None, v_head_dim=None, rope_interleave=None, mtp_depth=None,
                  mtp_loss_weight=None, **moe) -> dict:
    """ModelConfig's keyword arguments for the command line's family options
    (None: not given), or a ConfigError (exit 2) naming an option that does
    not apply to the family or is not positive. ``moe``: the mixture of
    experts' options (``MOE_FIELDS``; ``--arch mixtral`` is llama with
    ``MIXTRAL``'s defaults), checked by ``moe_fields``."""
    given = dict(n_kv_head=n_kv_head, ffn_hidden=ffn_hidden, rope_theta=rope_theta, rms_eps=rms_eps)
    mla = dict(q_lora_rank=q_lora_rank, kv_lora_rank=kv_lora_rank, qk_rope_head_dim=qk_rope_head_dim,
               qk_nope_head_dim=qk_nope_head_dim, v_head_dim=v_head_dim, rope_interleave=rope_interleave)
    mtp = dict(mtp_depth=mtp_depth, mtp_loss_weight=mtp_loss_weight)
    if arch != "deepseek_v3" and (stray := [k for k, v in {**mla, **mtp}.items() if v is not None]):
        raise ConfigError(f"--{stray[0].replace('_', '-')} applies to --arch deepseek_v3 only, not {arch}")
    if arch == "deepseek_v3":
        if n_kv_head is not None:
            raise ConfigError("--n-kv-head does not apply to --arch deepseek_v3 (its heads share one latent)")
        if moe.get("n_experts") is not None and moe.get("router") is None:
            moe = {**moe, "router": "sigmoid"}      # DeepSeekMoE's router is this family's default
        for key, value in given.items():
            if key in FLOAT_RANGES and value is not None and (why := float_problem(key, value)):
                raise ConfigError(f"--{key.replace('_', '-')} {why}")
            if value is not None and not value > 0:
                raise ConfigError(f"--{key.replace('_', '-')} must be positive, got {value}")
        return {"arch": "deepseek_v3", "tie_embeddings": bool(tie_embeddings),
                **{k: v for k, v in given.items() if v is not None}, **mla_fields(**mla), **moe_fields(**moe),
                **mtp_fields(**mtp)}
    if arch not in ("llama", "mixtral"):
        stray = [k for k, v in given.items() if v is not None] + (["tie_embeddings"] if tie_embeddings else [])
        stray += [k for k, v in moe.items() if v not in (None, False)]
        if stray:
            raise ConfigError(f"--{stray[0].replace('_', '-')} applies to --arch llama or mixtral only, not gpt2")
        return {}
    for key, value in given.items():
        if key in FLOAT_RANGES and value is not None and (why := float_problem(key, value)):
            raise ConfigError(f"--{key.replace('_', '-')} {why}")
        if value is not None and not value > 0:
            raise ConfigError(f"--{key.replace('_', '-')} must be positive, got {value}")
    return {"arch": "llama", "tie_embeddings": bool(tie_embeddings), **{k: v for k, v in given.items() if v is not None},
            **moe_fields(arch == "mixtral", **moe)}


MLA_DEFAULTS = {"q_lora_rank": 0, "kv_lora_rank": 32, "qk_rope_head_dim": 8, "qk_nope_head_dim": 16,
                "v_head_dim": 16, "rope_interleave": True}     # --arch deepseek_v3's, for a small model


def mla_fields(**given) -> dict:
    """ModelConfig's multi-head latent attention fields from the command
    line's options (None: ``MLA_DEFAULTS``), or a ConfigError naming the
    option: ranks and head sizes positive (the q rank may be 0: no q
    compression), the rotary size even."""
    out = {k: (MLA_DEFAULTS[k] if given.get(k) is None else given[k]) for k in MLA_FIELDS}
    for key in MLA_FIELDS[:5]:
        value, low = out[key], 0 if key == "q_lora_rank" else 1
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= MAX_DIM:
            raise ConfigError(f"--{key.replace('_', '-')} must be an integer of at least {low}, got {value!r}")
    if out["qk_rope_head_dim"] % 2:
        raise ConfigError(f"--qk-rope-head-dim must be even (rotary pairs), got {out['qk_rope_head_dim']}")
    out["rope_interleave"] = bool(out["rope_interleave"])
    return out


def mtp_fields(mtp_depth=None, mtp_loss_weight=None) -> dict:
    """ModelConfig's multi-token prediction fields from --mtp-depth and
    --mtp-loss-weight (None: not given), or a ConfigError naming the
    option: a depth of at least 0, a finite weight of at least 0 that only
    means something with a depth."""
    if mtp_depth is not None and (isinstance(mtp_depth, bool) or not isinstance(mtp_depth, int)
                                  or not 0 <= mtp_depth <= MAX_DIM):
        raise ConfigError(f"--mtp-depth must be an integer of at least 0, got {mtp_depth!r}")
    if mtp_loss_weight is not None:
        if not mtp_depth:
            raise ConfigError("--mtp-loss-weight needs --mtp-depth (at least 1 multi-token prediction depth)")
        if not (math.isfinite(mtp_loss_weight) and mtp_loss_weight >= 0):
            raise ConfigError(f"--mtp-loss-weight must be a finite number of at least 0, got {mtp_loss_weight}")
    out = {"mtp_depth": mtp_depth} if mtp_depth else {}
    if mtp_loss_weight is not None:
        out["mtp_loss_weight"] = float(mtp_loss_weight)
    return out


def moe_fields(mixtral=False, n_experts=None, top_k=None, no_norm_topk=False, capacity_factor=None,
               router_aux_loss_coef=None, router_z_loss_coef=None, **deepseek) -> dict:
    """ModelConfig's mixture-of-experts fields from the command line's
    options (None: not given), or a ConfigError naming the option: top-k
    in 1..E, a positive capacity factor, coefficients >= 0. Without
    --n-experts (and not mixtral) every other MoE option is refused."""
    n = n_experts if n_experts is not None else (MIXTRAL["n_experts"] if mixtral else 0)
    if not n:
        stray = [k for k, v in (("top_k", top_k), ("no_norm_topk", no_norm_topk or None),
                                ("capacity_factor", capacity_factor), ("router_aux_loss_coef", router_aux_loss_coef),
                                ("router_z_loss_coef", router_z_loss_coef)) if v is not None]
        stray += [k for k, v in deepseek.items() if v is not None]
        if n_experts is not None:
            raise ConfigError(f"--n-experts must be at least 1, got {n_experts}")
        if stray:
            raise ConfigError(f"--{stray[0].replace('_', '-')} needs --n-experts (a mixture of experts)")
        return {}
    k = top_k if top_k is not None else MIXTRAL["top_k"]
    if n < 1:
        raise ConfigError(f"--n-experts must be at least 1, got {n}")
    if not 1 <= k <= n:
        raise ConfigError(f"--top-k {k} must be from 1 to --n-experts {n}")
    if capacity_factor is not None and not (math.isfinite(capacity_factor) and capacity_factor > 0):
        raise ConfigError(f"--capacity-factor must be positive (omit it for dropless dispatch), got {capacity_factor}")
    for name, value in (("router_aux_loss_coef", router_aux_loss_coef), ("router_z_loss_coef", router_z_loss_coef)):
        if value is not None and (why := float_problem(name, value)):
            raise ConfigError(f"--{name.replace('_', '-')} {why}")
    out = {"n_experts": n, "top_k": k, "norm_topk": not no_norm_topk}
    if capacity_factor is not None:
        out["capacity_factor"] = float(capacity_factor)
    if router_aux_loss_coef is not None:
        out["router_aux_loss_coef"] = float(router_aux_loss_coef)
    if router_z_loss_coef is not None:
        out["router_z_loss_coef"] = float(router_z_loss_coef)
    return {**out, **deepseek_fields(n, k, out, **deepseek)}


@dataclass(frozen=True)
class RopeScaling:
    """Llama 3's rotary frequency scaling (Hugging Face's ``rope_type``
    "llama3"): wavelengths longer than ``original_max_position_embeddings``
    / ``low_freq_factor`` are stretched ``factor`` times, those shorter than
    it / ``high_freq_factor`` are kept, and the band between is blended
    smoothly (``ops.llama.rope_inv_freq``). Held as a value so that a
    configuration stays hashable and prints by name."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int

    KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")

    @classmethod
    def from_dict(cls, d, where: str = "rope_scaling") -> "RopeScaling":
        """The scaling of a JSON object holding the four KEYS (and perhaps
        rope_type "llama3", rope_theta), or a ValueError naming the field
        ``where.key`` that is missing or out of range."""
        if not isinstance(d, dict):
            raise ValueError(f"{where} must be a JSON object, got {d!r}")
        values = {}
        for key in cls.KEYS:
            value = d.get(key)
            kind = int if key == "original_max_position_embeddings" else (int, float)
            if isinstance(value, bool) or not isinstance(value, kind) or not (math.isfinite(value) and value > 0):
                what = "a positive integer" if kind is int else "a positive number"
                raise ValueError(f"{where}.{key} must be {what}, got {value!r}")
            values[key] = value if kind is int else float(value)
        if values["factor"] < 1:
            raise ValueError(f"{where}.factor must be at least 1 (it stretches wavelengths), got {values['factor']!r}")
        if not values["low_freq_factor"] < values["high_freq_factor"]:
            raise ValueError(f"{where}.low_freq_factor {values['low_freq_factor']!r} must be less than "
                             f"high_freq_factor {values['high_freq_factor']!r}")
        return cls(**values)

    def to_dict(self) -> dict:
        """As Hugging Face writes it (``rope_type`` first)."""
        return {"rope_type": "llama3", **{k: getattr(self, k) for k in self.KEYS}}

    def as_tuple(self) -> tuple:
        """(factor, low_freq_factor, high_freq_factor, original_max_position_embeddings), for ``ops``."""
        return tuple(getattr(self, k) for k in self.KEYS)


@dataclass(frozen=True)
class ModelConfig:
    """The model's hyper-parameters (docs/design.md section 2): GPT-2's five
    sizes, and the settings of the Llama family (``arch`` "llama"). Their
    defaults are GPT-2's, so a GPT-2 configuration reads, prints and stores
    exactly as before the Llama fields existed (``to_dict`` leaves them out).

    ``n_kv_head`` 0 means as many key/value heads as query heads;
    ``ffn_hidden`` 0 means the architecture's rule (``ffn``);
    ``tie_embeddings`` None means the architecture's default (``tied``);
    ``rope_scaling`` None means plain rotary frequencies (Llama 3's scaling
    comes from a Hugging Face config.json only)."""

    vocab_size: int = 256
    n_ctx: int = 64
    n_layer: int = 4
    n_head: int = 12
    n_embd: int = 144
    arch: str = "gpt2"
    n_kv_head: int = 0
    ffn_hidden: int = 0
    rope_theta: float = 10000.0
    rms_eps: float = 1e-6
    tie_embeddings: Optional[bool] = None
    rope_scaling: Optional[RopeScaling] = None
    n_experts: int = 0                  # 0: a dense SwiGLU MLP; else a mixture of experts (docs/moe.md)
    top_k: int = 2                      # experts per token
    norm_topk: bool = True              # Mixtral: the top-k probabilities renormalised to sum to 1
    capacity_factor: float = 0.0        # 0: dropless; else at most ceil(F K N / E) tokens per expert
    router_aux_loss_coef: float = 0.02  # the load-balancing loss's weight (HF Mixtral's default)
    router_z_loss_coef: float = 0.0     # the router z-loss's weight
    router: str = "softmax"             # softmax: Mixtral's top-k; sigmoid: DeepSeek-V3's (docs/moe.md)
    n_groups: int = 1                   # sigmoid router: the experts' groups (group-limited routing)
    topk_groups: int = 1                # sigmoid router: groups a token's experts may come from
    routed_scaling_factor: float = 1.0  # sigmoid router: the routed experts' weights times this
    n_shared_experts: int = 0           # always-on SwiGLU experts, one of width n x moe_ffn (HF's shared_experts)
    moe_ffn_hidden: int = 0             # an expert's SwiGLU width; 0: ffn
    first_k_dense: int = 0              # the first k blocks keep the dense MLP
    bias_update_rate: float = 0.0       # aux-loss-free balancing: bias += rate sign(mean load - load) a step
    bias_update: str = "plain"          # plain (the report's) or centred (torchtitan's, zero-mean update)
    seq_aux_loss_coef: float = 0.0      # the sequence-wise auxiliary loss's weight (sigmoid router)
    q_lora_rank: int = 0                # deepseek_v3's multi-head latent attention (ops/mla.py): 0, no q latent
    kv_lora_rank: int = 0               # the kv latent's rank
    qk_rope_head_dim: int = 0           # the rotary key part shared by every head
    qk_nope_head_dim: int = 0           # each head's non-rotary query/key part
    v_head_dim: int = 0                 # each head's value width
    rope_interleave: bool = True        # the rotary columns in interleaved pairs (DeepSeek's checkpoints)
    mtp_depth: int = 0                  # deepseek_v3's multi-token prediction modules (ops/mtp.py); 0: none
    mtp_loss_weight: float = 0.3        # their losses' weight: main + weight / depth * sum (the report's first 0.3)

    @property
    def moe(self) -> bool:
        """Whether each block's MLP is a mixture of experts."""
        return self.n_experts > 0

    def is_moe(self, layer: int) -> bool:
        """Whether block ``layer``'s MLP is a mixture (the first ``first_k_dense`` stay dense)."""
        return self.moe and layer >= self.first_k_dense

    @property
    def n_blocks(self) -> int:
        """The transformer blocks the model holds: n_layer, and one per
        multi-token prediction depth after them (``h.{n_layer + k - 1}``)."""
        return self.n_layer + self.mtp_depth

    @property
    def moe_ffn(self) -> int:
        """A routed expert's SwiGLU width (--moe-ffn-hidden; else ffn)."""
        return self.moe_ffn_hidden or self.ffn

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @property
    def llama(self) -> bool:
        """Llama-like: RMSNorm, rotary positions, SwiGLU, no biases, an untied head (llama, deepseek_v3)."""
        return self.arch in LLAMA_LIKE

    @property
    def mla(self) -> bool:
        """Multi-head latent attention (deepseek_v3)."""
        return self.arch == "deepseek_v3"

    @property
    def kv_heads(self) -> int:
        """Key/value heads (grouped-query attention when fewer than n_head)."""
        return self.n_kv_head or self.n_head

    @property
    def ffn(self) -> int:
        """The MLP's hidden width: GPT-2's 4h, or Llama's rule (two thirds of
        4h, rounded up to a multiple of 256, as Meta's reference code) unless
        ``ffn_hidden`` says otherwise."""
        if self.ffn_hidden:
            return self.ffn_hidden
        if not self.llama:
            return 4 * self.n_embd
        return 256 * math.ceil(int(8 * self.n_embd / 3) / 256)

    @property
    def tied(self) -> bool:
        """Whether the LM head is the token embedding (GPT-2: always; Llama: only with --tie-embeddings)."""
        return (not self.llama) if self.tie_embeddings is None else bool(self.tie_embeddings)

    def to_dict(self) -> dict:
        """GPT-2: its five sizes only (as every stored configuration before
        Llama); Llama: every field, the architecture's defaults resolved."""
        d = asdict(self)
        if not self.llama:
            return {k: d[k] for k in SIZES}
        d.update(n_kv_head=self.kv_heads, ffn_hidden=self.ffn, tie_embeddings=self.tied)
        if self.rope_scaling is None:    # left out, so that unscaled models store as they always did
            del d["rope_scaling"]
        else:
            d["rope_scaling"] = self.rope_scaling.to_dict()
        if not self.moe:                 # a dense Llama stores as before the MoE fields existed
            for key in MOE_FIELDS:
                d.pop(key)
        for key, default in DEEPSEEK_MOE.items():   # a Mixtral stores as before DeepSeek's options existed
            kept_groups = key == "topk_groups" and self.moe and self.n_groups != 1   # its default is n_groups
            if not kept_groups and (not self.moe or d[key] == default):
                d.pop(key)
        if not self.mla:                 # a Llama stores as before the MLA fields existed
            for key in MLA_FIELDS:
                d.pop(key)
        if not self.mtp_depth:           # a model without MTP stores as before its fields existed
            del d["mtp_depth"], d["mtp_loss_weight"]
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "ModelConfig":
        """The sizes of a stored configuration (a checkpoint's ``config``
        attribute), each an integer of at least 1; a ValueError names the
        first that is not. Nothing is converted: 32.7, "32" or true as a
        width is a damaged file, not 32 or 1."""
        values = {}
        for name in SIZES:
            if name not in d:
                raise ValueError(f"{name} is missing")
            value = d[name]
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
            values[name] = value
        arch = d.get("arch", "gpt2")
        if arch not in ARCHS:
            raise ValueError(f"arch must be one of {', '.join(ARCHS)}, got {arch!r}")
        if arch in LLAMA_LIKE:
            for name, kind in (("n_kv_head", int), ("ffn_hidden", int), ("rope_theta", float), ("rms_eps", float),
                               ("tie_embeddings", bool)):
                value = d.get(name)
                if name in FLOAT_RANGES and (why := float_problem(name, value)):
                    raise ValueError(f"{name} {why}")
                ok = isinstance(value, bool) if kind is bool else (
                    not isinstance(value, bool) and isinstance(value, (int, float) if kind is float else int)
                    and value > 0)
                if not ok:
                    raise ValueError(f"{name} must be {'true or false' if kind is bool else 'a positive number'}, "
                                     f"got {value!r}")
                values[name] = value
            if d.get("rope_scaling") is not None:
                if arch == "deepseek_v3":
                    raise ValueError("rope_scaling of a deepseek_v3 model (YaRN) is not stored in checkpoints yet")
                values["rope_scaling"] = RopeScaling.from_dict(d["rope_scaling"])
            if arch == "deepseek_v3":
                try:
                    values.update(mla_fields(**{k: d.get(k) for k in MLA_FIELDS}))
                except ConfigError as exc:
                    raise ValueError(str(exc).replace("--", "").replace("-", "_")) from None
            values["arch"] = arch
            if arch == "deepseek_v3" and d.get("mtp_depth"):
                values.update(_mtp_from_dict(d))
            if d.get("n_experts"):
                values.update(_moe_from_dict(d))
        return cls(**values)

    def _mlp_params(self) -> int:
        """Every block's MLP parameters: a dense SwiGLU, or a mixture (router, routed and shared experts)."""
        h = self.n_embd
        dense = 3 * h * self.ffn
        mixture = 3 * h * self.moe_ffn * (self.n_experts + self.n_shared_experts) + h * self.n_experts
        return sum(mixture if self.is_moe(i) else dense for i in range(self.n_blocks))

    def n_params(self) -> int:
        """Logical parameter count (tied head counted once)."""
        h, L = self.n_embd, self.n_layer
        if self.mla:       # the latent projections and their norms, c_proj, two norms, a SwiGLU MLP
            nh, qk, rq, rkv = self.n_head, self.qk_nope_head_dim + self.qk_rope_head_dim, self.q_lora_rank, \
                self.kv_lora_rank
            q = (h * rq + rq + rq * nh * qk) if rq else h * nh * qk
            kv = h * (rkv + self.qk_rope_head_dim) + rkv + rkv * nh * (self.qk_nope_head_dim + self.v_head_dim)
            per_layer = 2 * h + q + kv + nh * self.v_head_dim * h
            mtp = self.mtp_depth * (per_layer + 3 * h + 2 * h * h)    # a block, three norms and W (2C, C) a depth
            return self.vocab_size * h * (1 if self.tied else 2) + L * per_layer + self._mlp_params() + h + mtp
        if self.llama:     # no biases, no position table; two RMSNorm weights per layer, three MLP matrices
            kv = self.kv_heads * self.head_dim
            per_layer = 2 * h + h * (h + 2 * kv) + h * h
            return self.vocab_size * h * (1 if self.tied else 2) + L * per_layer + self._mlp_params() + h
        per_layer = 2 * 2 * h + (h * 3 * h + 3 * h) + (h * h + h) + (h * 4 * h + 4 * h) + (4 * h * h + h)
        return self.vocab_size * h + self.n_ctx * h + L * per_layer + 2 * h


def _mtp_from_dict(d: dict) -> dict:
    """A stored configuration's multi-token prediction fields, checked as damaged-file errors."""
    depth, weight = d.get("mtp_depth"), d.get("mtp_loss_weight", 0.3)
    if isinstance(depth, bool) or not isinstance(depth, int) or depth < 0:
        raise ValueError(f"mtp_depth must be a non-negative integer, got {depth!r}")
    if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not math.isfinite(weight) or weight < 0:
        raise ValueError(f"mtp_loss_weight must be a finite number of at least 0, got {weight!r}")
    return {"mtp_depth": depth, "mtp_loss_weight": float(weight)}


def _moe_from_dict(d: dict) -> dict:
    """The MoE fields of a stored configuration, each checked (ValueError naming the first bad one)."""
    out = {}
    for name, ok in (("n_experts", lambda v: isinstance(v, int) and v >= 1),
                     ("top_k", lambda v: isinstance(v, int) and 1 <= v <= d.get("n_experts", 0)),
                     ("norm_topk", lambda v: v is True or v is False),
                     ("capacity_factor", lambda v: isinstance(v, (int, float)) and math.isfinite(v) and v >= 0),
                     ("router_aux_loss_coef", lambda v: isinstance(v, (int, float)) and math.isfinite(v) and v >= 0),
                     ("router_z_loss_coef", lambda v: isinstance(v, (int, float)) and math.isfinite(v) and v >= 0)):
        value = d.get(name)
        if name in FLOAT_RANGES and (why := float_problem(name, value)):
            raise ValueError(f"{name} {why}")
        if (isinstance(value, bool) and name != "norm_topk") or not ok(value):
            raise ValueError(f"{name} is {value!r}, not a valid mixture-of-experts setting")
        out[name] = value
    stored = {key: d[key] for key in DEEPSEEK_MOE if key in d}
    if stored:                                 # the same checks as the command line's, named by field
        try:
            given = {k: out[k] for k in ("router_aux_loss_coef", "router_z_loss_coef")}
            if stored.get("router", "softmax") == "sigmoid":
                given = {}
            fields = deepseek_fields(out["n_experts"], out["top_k"], given, **stored)
        except ConfigError as e:
            raise ValueError(str(e).replace("--", "").replace("-", "_")) from None
        out.update(fields)
    return out
