"""DeepSeekMoE's options of a mixture of experts (docs/moe.md,
"DeepSeekMoE"): their defaults, and the checks of the command line's
values (``deepseek_fields``), which ``config.moe_fields`` calls for any
family with experts."""

from __future__ import annotations

from .errors import ConfigError
from .floats import float_problem

# DeepSeekMoE's options of the mixture (docs/moe.md, "DeepSeekMoE"): stored only where they differ from
# these defaults, so that a Mixtral configuration stores as before they existed
DEEPSEEK_MOE = {"router": "softmax", "n_groups": 1, "topk_groups": 1, "routed_scaling_factor": 1.0,
                "n_shared_experts": 0, "moe_ffn_hidden": 0, "first_k_dense": 0, "bias_update_rate": 0.0,
                "bias_update": "plain", "seq_aux_loss_coef": 0.0}
ROUTERS = ("softmax", "sigmoid")             # Mixtral's softmax top-k; DeepSeek-V3's sigmoid, bias-steered
BIAS_UPDATES = ("plain", "centred")         # the report's sign rule; torchtitan's zero-mean variant
DEEPSEEK_OPTIONS = tuple(DEEPSEEK_MOE)      # their command-line options, as click names them
SIGMOID_ONLY = ("n_groups", "topk_groups", "routed_scaling_factor", "bias_update_rate", "bias_update",
                "seq_aux_loss_coef")


def bias_names(cfg) -> list:
    """The names of a ModelConfig's router bias buffers (``h.{i}.moe.router.score_bias``,
    one per mixture block under the sigmoid router, an MTP depth's block
    included; none under softmax):
    what a model file holds besides its parameters."""
    if cfg.router != "sigmoid":
        return []
    return [f"h.{i}.moe.router.score_bias" for i in range(cfg.n_blocks) if cfg.is_moe(i)]


def deepseek_fields(n: int, k: int, given: dict, router=None, n_groups=None, topk_groups=None,
                    routed_scaling_factor=None, n_shared_experts=None, moe_ffn_hidden=None, first_k_dense=None,
                    bias_update_rate=None, bias_update=None, seq_aux_loss_coef=None) -> dict:
    """The DeepSeekMoE fields of a mixture of ``n`` experts, top ``k``
    (``DEEPSEEK_MOE``; None: not given), or a ConfigError naming the
    option: the groups divide the experts, at most --n-groups kept, top-k
    within the experts the kept groups hold; the sigmoid router's options
    refused under the softmax router, and the softmax router's losses
    (--router-aux-loss-coef, --router-z-loss-coef) under the sigmoid one."""
    kind = router if router is not None else "softmax"
    if kind not in ROUTERS:
        raise ConfigError(f"--router must be one of {', '.join(ROUTERS)}, got {kind!r}")
    values = dict(n_groups=n_groups, topk_groups=topk_groups, routed_scaling_factor=routed_scaling_factor,
                  bias_update_rate=bias_update_rate, bias_update=bias_update, seq_aux_loss_coef=seq_aux_loss_coef)
    if kind == "softmax":
        stray = [key for key in SIGMOID_ONLY if values[key] is not None]
        if stray:
            raise ConfigError(f"--{stray[0].replace('_', '-')} needs --router sigmoid (DeepSeek's router)")
    else:
        for key in ("router_aux_loss_coef", "router_z_loss_coef"):
            if given.get(key):
                raise ConfigError(f"--{key.replace('_', '-')} applies to --router softmax only "
                                  f"(the sigmoid router's loss is --seq-aux-loss-coef)")
    out = {"router": kind} if kind != "softmax" else {}
    if kind == "sigmoid":   # the softmax router's losses have no meaning on sigmoid scores
        out.update(router_aux_loss_coef=0.0, router_z_loss_coef=0.0)
    sizes = dict(n_groups=n_groups, topk_groups=topk_groups, n_shared_experts=n_shared_experts,
                 moe_ffn_hidden=moe_ffn_hidden, first_k_dense=first_k_dense)
    for key, value in sizes.items():
        low = 0 if key in ("n_shared_experts", "moe_ffn_hidden", "first_k_dense") else 1
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < low):
            raise ConfigError(f"--{key.replace('_', '-')} must be {'at least 0' if low == 0 else 'positive'}, "
                              f"got {value}")
    groups = n_groups if n_groups is not None else 1
    kept = topk_groups if topk_groups is not None else groups
    if n % groups:
        raise ConfigError(f"--n-groups {groups} must divide --n-experts (--n-routed-experts) {n}")
    if kept > groups:
        raise ConfigError(f"--topk-groups {kept} must be at most --n-groups {groups}")
    if k > kept * (n // groups):
        raise ConfigError(f"--top-k {k} is more than the {kept * (n // groups)} experts that --topk-groups {kept} "
                          f"of --n-groups {groups} hold")
    if groups != 1:
        out.update(n_groups=groups, topk_groups=kept)
    for key in ("routed_scaling_factor", "bias_update_rate", "seq_aux_loss_coef"):
        value = values[key]
        if value is not None and (why := float_problem(key, value)):
            raise ConfigError(f"--{key.replace('_', '-')} {why}")
        if value is not None and value != DEEPSEEK_MOE[key]:
            out[key] = float(value)
    if bias_update is not None:
        if bias_update not in BIAS_UPDATES:
            raise ConfigError(f"--bias-update must be one of {', '.join(BIAS_UPDATES)}, got {bias_update!r}")
        if bias_update != "plain":
            out["bias_update"] = bias_update
    for key in ("n_shared_experts", "moe_ffn_hidden", "first_k_dense"):
        if sizes[key]:
            out[key] = int(sizes[key])
    return out
