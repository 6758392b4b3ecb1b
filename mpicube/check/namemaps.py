"""Another codebase's parameters under the trace's names, and back.

Half of an adapter from a framework to a trace is name mapping: which
tensor is ``h.0.attn.c_attn.weight``, whether it must be transposed (an
``nn.Linear`` holds (out, in), the trace (in, out)), whether it is made of
separate q, k and v projections, or a Megatron-style fused q/k/v whose rows
go ``[q | k | v]`` per head. A ``NameMap`` is that knowledge as data: one
``Rule`` per trace parameter, each a pure function of numpy arrays both
ways, so it is tested without any framework installed and the same map
serves parameters and their gradients.

Shipped maps: ``nanogpt`` (Karpathy's nanoGPT ``GPT``), ``hf_gpt2``
(transformers' ``GPT2LMHeadModel``), ``split_qkv`` (nanoGPT with
``q_proj``/``k_proj``/``v_proj`` linears), ``megatron_gpt2``
(megatron-core ``GPTModel`` names, fused ``linear_qkv``) and ``hf_llama``
(transformers' ``LlamaForCausalLM``: q/k/v_proj into ``c_attn`` with
grouped-query widths, gate/up_proj into ``c_fc``, every linear transposed),
``hf_mixtral_hub`` (a ``MixtralForCausalLM`` file's per-expert
``block_sparse_moe.experts.{e}.w1/w2/w3`` and ``gate``) and ``hf_mixtral``
(transformers 5's in-memory Mixtral: every expert of a layer in one fused
``mlp.experts.gate_up_proj`` (E, 2F, h) and ``down_proj`` (E, h, F)); ``hf_deepseek_v3``
and ``hf_deepseek_v3_hub`` (``DeepseekV3ForCausalLM``: namemaps_deepseek.py). A map that
misses a parameter, or a framework tensor no rule uses, is bad input naming it. The
machinery (``Rule``, ``NameMap``) is namemap.py's.
"""

from __future__ import annotations

from ..core.errors import UserError
from .namemap import NameMap, Rule  # noqa: F401 (namemaps.Rule, namemaps.NameMap: where users find them)
from .names import BLOCK_ACTS, BLOCK_PARAMS, forward_param_order, moe, tied
from .namemaps_deepseek import hf_deepseek_v3, hf_deepseek_v3_hub


def _gpt2(cfg: dict, name: str, prefix: str, block: str, kinds: dict, aliases=(), acts=None) -> NameMap:
    """A GPT-2 map whose framework names are the trace's under a prefix;
    ``kinds`` {block parameter: kind} for the tensors that are not "same"."""
    rules = {"wte": Rule((prefix + "wte.weight",)), "wpe": Rule((prefix + "wpe.weight",))}
    for i in range(cfg["n_layer"]):
        for p in BLOCK_PARAMS:
            rules[f"h.{i}.{p}"] = Rule((f"{prefix}{block}.{i}.{p}",), kinds.get(p, "same"))
    rules.update({n: Rule((prefix + n,)) for n in ("ln_f.weight", "ln_f.bias")})
    assert list(rules) == forward_param_order(cfg)
    return NameMap(name, rules, tuple(aliases), acts or {})


def _gpt2_acts(cfg, prefix):
    """The modules whose outputs are the trace's activations (names.act_names):
    the embedding dropout, each block's norms, its attention and MLP modules
    (whose outputs include the residual dropout, as nanoGPT's and HF's do),
    the block itself, and ln_f."""
    acts = {"emb": prefix + "drop"}
    for i in range(cfg["n_layer"]):
        acts.update({f"h.{i}.{a}": f"{prefix}h.{i}.{a}" for a in BLOCK_ACTS})
        acts[f"h.{i}"] = f"{prefix}h.{i}"
    return {**acts, "ln_f": prefix + "ln_f"}


LINEAR_WEIGHTS = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")


def nanogpt(cfg: dict) -> NameMap:
    """nanoGPT's ``GPT``: ``transformer.`` names, nn.Linear weights (out, in), lm_head tied to wte."""
    return _gpt2(cfg, "nanogpt", "transformer.", "h", dict.fromkeys(LINEAR_WEIGHTS, "transpose"),
                 aliases=("lm_head.weight",), acts=_gpt2_acts(cfg, "transformer."))


def hf_gpt2(cfg: dict) -> NameMap:
    """transformers' ``GPT2LMHeadModel``: Conv1D weights are already (in, out), lm_head tied."""
    return _gpt2(cfg, "hf_gpt2", "transformer.", "h", {}, aliases=("lm_head.weight",),
                 acts=_gpt2_acts(cfg, "transformer."))


def split_qkv(cfg: dict) -> NameMap:
    """nanoGPT with separate ``attn.q_proj``/``k_proj``/``v_proj`` linears instead of ``c_attn``."""
    m = nanogpt(cfg)
    m.name = "split_qkv"
    for i in range(cfg["n_layer"]):
        base = f"transformer.h.{i}.attn."
        m.rules[f"h.{i}.attn.c_attn.weight"] = Rule(tuple(base + f"{x}_proj.weight" for x in "qkv"), "concat")
        m.rules[f"h.{i}.attn.c_attn.bias"] = Rule(tuple(base + f"{x}_proj.bias" for x in "qkv"), "concat")
    return m


def megatron_gpt2(cfg: dict) -> NameMap:
    """megatron-core ``GPTModel`` names: fused ``linear_qkv`` with rows
    ``[q|k|v]`` per head (n_head, 3, head_dim), nn.Linear-style (out, in)
    weights, untied output layer absent (shared with the embedding)."""
    L, nh = cfg["n_layer"], cfg["n_head"]
    rules = {"wte": Rule(("embedding.word_embeddings.weight",)),
             "wpe": Rule(("embedding.position_embeddings.weight",))}
    theirs = {"ln_1": "input_layernorm", "attn.c_attn": "self_attention.linear_qkv",
              "attn.c_proj": "self_attention.linear_proj", "ln_2": "pre_mlp_layernorm",
              "mlp.c_fc": "mlp.linear_fc1", "mlp.c_proj": "mlp.linear_fc2"}
    for i in range(L):
        for p in BLOCK_PARAMS:
            module, _, kind = p.rpartition(".")
            source = f"decoder.layers.{i}.{theirs[module]}.{kind}"
            if module == "attn.c_attn":                    # weight and bias: rows per head
                rules[f"h.{i}.{p}"] = Rule((source,), "heads", nh)
            else:
                rules[f"h.{i}.{p}"] = Rule((source,), "transpose" if p in LINEAR_WEIGHTS else "same")
    rules.update({f"ln_f.{k}": Rule((f"decoder.final_layernorm.{k}",)) for k in ("weight", "bias")})
    assert list(rules) == forward_param_order(cfg)
    return NameMap("megatron_gpt2", rules, ("output_layer.weight",))


def hf_llama(cfg: dict) -> NameMap:
    """transformers' ``LlamaForCausalLM`` (and tools/torch_trace.py's Llama,
    which uses its names): nn.Linear weights (out, in) transposed; ``c_attn``
    is [q_proj | k_proj | v_proj] with n_head, n_kv_head and n_kv_head heads
    of head_dim columns, ``c_fc`` [gate_proj | up_proj] (docs/llama.md); no
    biases; ``lm_head`` its own unless tied. No q/k permutation: both rotate
    the two halves of each head (``rotate_half``)."""
    if cfg.get("arch") != "llama":
        raise UserError("name map hf_llama: the trace's model is not a Llama (its config has no arch llama)")
    hd, F = cfg["n_embd"] // cfg["n_head"], cfg["ffn_hidden"]
    rules = {"wte": Rule(("model.embed_tokens.weight",))}
    acts = {"emb": "model.embed_tokens"}
    for i in range(cfg["n_layer"]):
        p = f"model.layers.{i}."
        rules.update({
            f"h.{i}.ln_1.weight": Rule((p + "input_layernorm.weight",)),
            f"h.{i}.attn.c_attn.weight": Rule(tuple(p + f"self_attn.{x}_proj.weight" for x in "qkv"), "concat",
                                              widths=(cfg["n_head"] * hd, cfg["n_kv_head"] * hd,
                                                      cfg["n_kv_head"] * hd)),
            f"h.{i}.attn.c_proj.weight": Rule((p + "self_attn.o_proj.weight",), "transpose"),
            f"h.{i}.ln_2.weight": Rule((p + "post_attention_layernorm.weight",)),
            f"h.{i}.mlp.c_fc.weight": Rule((p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"), "concat",
                                           widths=(F, F)),
            f"h.{i}.mlp.c_proj.weight": Rule((p + "mlp.down_proj.weight",), "transpose")})
        acts.update({f"h.{i}.ln_1": p + "input_layernorm", f"h.{i}.attn": p + "self_attn",
                     f"h.{i}.ln_2": p + "post_attention_layernorm", f"h.{i}.mlp": p + "mlp", f"h.{i}": p[:-1]})
    rules["ln_f.weight"] = Rule(("model.norm.weight",))
    acts["ln_f"] = "model.norm"
    if not tied(cfg):
        rules["lm_head"] = Rule(("lm_head.weight",))
    assert list(rules) == forward_param_order(cfg)
    return NameMap("hf_llama", rules, () if not tied(cfg) else ("lm_head.weight",), acts)


def _hf_mixtral(cfg: dict, name: str, moe_module: str, expert_rules) -> NameMap:
    """hf_llama's map with each block's MLP replaced by a mixture: the
    router ``{moe_module}.gate`` (E, h) transposed, and the experts'
    rules from ``expert_rules(prefix, e)`` -> {suffix after ``h.{i}.moe.experts.{e}.``: Rule}."""
    if not moe(cfg):
        raise UserError(f"name map {name}: the trace's model is not a mixture of experts (its config has no "
                        f"n_experts)")
    if cfg.get("n_shared_experts") or cfg.get("first_k_dense") or cfg.get("router", "softmax") != "softmax":
        raise UserError(f"name map {name}: the trace's mixture is DeepSeekMoE's (a sigmoid router, shared experts "
                        f"or dense first blocks), which Mixtral has not")
    m = hf_llama({k: v for k, v in cfg.items() if k != "n_experts"})
    m.name, rules = name, {}
    for trace_name, rule in m.rules.items():
        block, _, rest = trace_name.partition(".mlp.")
        if not rest:
            rules[trace_name] = rule
            continue
        if rest != "c_fc.weight":
            continue
        i = int(block.split(".")[1])
        p = f"model.layers.{i}.{moe_module}."
        rules[f"{block}.moe.router.weight"] = Rule((p + "gate.weight",), "transpose")
        for e in range(cfg["n_experts"]):
            rules.update({f"{block}.moe.experts.{e}.{k}": r for k, r in expert_rules(p, e).items()})
        m.acts[f"h.{i}.mlp"] = p[:-1]
    m.rules = rules
    assert list(rules) == forward_param_order(cfg)
    return m


def hf_mixtral_hub(cfg: dict) -> NameMap:
    """A ``MixtralForCausalLM`` as the hub's files hold it (and
    transformers 4): per layer ``block_sparse_moe.gate`` (E, h) and per
    expert ``w1`` (gate, (F, h)), ``w3`` (up) and ``w2`` (down, (h, F)),
    nn.Linear-style; ``c_fc`` is [w1^T | w3^T] (docs/moe.md)."""
    F = cfg.get("ffn_hidden", 0)
    return _hf_mixtral(cfg, "hf_mixtral_hub", "block_sparse_moe", lambda p, e: {
        "c_fc.weight": Rule((f"{p}experts.{e}.w1.weight", f"{p}experts.{e}.w3.weight"), "concat", widths=(F, F)),
        "c_proj.weight": Rule((f"{p}experts.{e}.w2.weight",), "transpose")})


def hf_mixtral(cfg: dict) -> NameMap:
    """transformers 5's in-memory ``MixtralForCausalLM``: per layer
    ``mlp.gate.weight`` (E, h) and the experts fused, ``mlp.experts.gate_up_proj``
    (E, 2F, h) whose rows are [gate | up] and ``mlp.experts.down_proj`` (E, h,
    F); expert e's trace weights are slice e transposed. (Its
    ``save_pretrained`` writes the hub's per-expert form: hf_mixtral_hub.)"""
    return _hf_mixtral(cfg, "hf_mixtral", "mlp", lambda p, e: {
        "c_fc.weight": Rule((p + "experts.gate_up_proj",), "expert", expert=e),
        "c_proj.weight": Rule((p + "experts.down_proj",), "expert", expert=e)})


MAPS = {"nanogpt": nanogpt, "hf_gpt2": hf_gpt2, "split_qkv": split_qkv, "megatron_gpt2": megatron_gpt2,
        "hf_llama": hf_llama, "hf_mixtral": hf_mixtral, "hf_mixtral_hub": hf_mixtral_hub,
        "hf_deepseek_v3": hf_deepseek_v3, "hf_deepseek_v3_hub": hf_deepseek_v3_hub}
