"""Name maps of transformers' ``DeepseekV3ForCausalLM`` (``namemaps.MAPS``
serves them by name; the trace's side: check/deepseek_names.py).

Per layer i, with p = ``model.layers.{i}.``, every nn.Linear (out, in)
transposed to the trace's (in, out):

    h.{i}.ln_1.weight           p input_layernorm.weight
    h.{i}.attn.q_down.weight    p self_attn.q_a_proj.weight^T         \\ with a q rank
    h.{i}.attn.q_norm.weight    p self_attn.q_a_layernorm.weight       |
    h.{i}.attn.q_up.weight      p self_attn.q_b_proj.weight^T         /
    h.{i}.attn.q_proj.weight    p self_attn.q_proj.weight^T            without one
    h.{i}.attn.kv_down.weight   p self_attn.kv_a_proj_with_mqa.weight^T
    h.{i}.attn.kv_norm.weight   p self_attn.kv_a_layernorm.weight
    h.{i}.attn.kv_up.weight     p self_attn.kv_b_proj.weight^T
    h.{i}.attn.c_proj.weight    p self_attn.o_proj.weight^T
    h.{i}.ln_2.weight           p post_attention_layernorm.weight
    h.{i}.mlp.c_fc / c_proj     p mlp.[gate_proj | up_proj]^T / down_proj^T      dense layers
    h.{i}.moe.router.weight     p mlp.gate.weight^T                              MoE layers
    h.{i}.moe.experts.{e}.*     the experts (below)
    h.{i}.moe.shared.c_fc       p mlp.shared_experts.[gate_proj | up_proj]^T
    h.{i}.moe.shared.c_proj     p mlp.shared_experts.down_proj^T
    moe/h.{i}.bias (a record)   p mlp.gate.e_score_correction_bias               a buffer

``kv_a_proj_with_mqa`` is one matrix holding two things: its first
kv_lora_rank rows make the kv latent (normed, then expanded by kv_b_proj
into every head's k_nope and v), its last qk_rope_head_dim rows the
rotary key every head shares (k_pe). mpicube's ``kv_down`` is the same
matrix, so the map transposes it whole and splits nothing: the trace's
columns [:kv_lora_rank] are the latent's, [kv_lora_rank:] k_pe's, in
HF's row order (k_pe's columns still interleaved where ``rope_interleave``
says so, as transformers stores them). A wrong k_pe gradient therefore
shows in the last qk_rope_head_dim columns of ``grad/h.{i}.attn.kv_down.weight``,
which ``compare`` says (check/diagnose.py). A framework that keeps the
two as separate linears maps them with a "concat" rule of widths
(kv_lora_rank, qk_rope_head_dim).

The routed experts come two ways, as Mixtral's do: ``hf_deepseek_v3_hub``
reads a hub file's per-expert ``mlp.experts.{e}.gate_proj/up_proj/down_proj``,
``hf_deepseek_v3`` transformers 5's in-memory fused
``mlp.experts.gate_up_proj`` (E, 2F, h), rows [gate | up], and
``mlp.experts.down_proj`` (E, h, F).

With ``mtp_depth`` D, MTP depth k is HF's layer L + k - 1 (DeepSeek's
checkpoints; transformers' DeepseekV3 skips it on load), with q =
``model.layers.{L+k-1}.``:

    h.{L+k-1}.*                 q ...: the layer table above, the block's own
    mtp.{k-1}.enorm.weight      q enorm.weight
    mtp.{k-1}.hnorm.weight      q hnorm.weight
    mtp.{k-1}.proj.weight       q eh_proj.weight^T       (2C, C): rows [embedding | hidden]
    mtp.{k-1}.ln_f.weight       q shared_head.norm.weight
    (a copy, checked)           q embed_tokens.weight       = model.embed_tokens.weight
    (a copy, checked)           q shared_head.head.weight   = lm_head.weight (embed_tokens tied)

The depth shares the embedding and the head with the main model (the
DeepSeek-V3 report; mpicube's wte and lm_head get every depth's gradient),
so the file's two copies are no trace tensors of their own: they are the
map's ``copies``, optional, checked equal to the shared tensor where
present (a copy that differs is a different model, which mapping it
would hide; two rules onto one trace name would also split a shared
gradient between them), and written by ``from_trace``, as
files/formats/hf_deepseek.py reads and writes them. transformers has no
module of the MTP layer, so the map's ``acts`` are the main blocks'.
"""

from __future__ import annotations

from ..core.errors import UserError
from .deepseek_names import is_moe, mla, mtp_depth, n_blocks
from .namemap import NameMap, Rule
from .names import forward_param_order, tied


def _rules(cfg: dict, i: int, expert_rules) -> dict:
    """{suffix after ``h.{i}.``: Rule} of block i."""
    p = f"model.layers.{i}."
    a, m = p + "self_attn.", p + "mlp."
    rules = {"ln_1.weight": Rule((p + "input_layernorm.weight",)),
             "attn.q_down.weight": Rule((a + "q_a_proj.weight",), "transpose"),
             "attn.q_norm.weight": Rule((a + "q_a_layernorm.weight",)),
             "attn.q_up.weight": Rule((a + "q_b_proj.weight",), "transpose"),
             "attn.q_proj.weight": Rule((a + "q_proj.weight",), "transpose"),
             "attn.kv_down.weight": Rule((a + "kv_a_proj_with_mqa.weight",), "transpose"),   # [latent | k_pe]
             "attn.kv_norm.weight": Rule((a + "kv_a_layernorm.weight",)),
             "attn.kv_up.weight": Rule((a + "kv_b_proj.weight",), "transpose"),
             "attn.c_proj.weight": Rule((a + "o_proj.weight",), "transpose"),
             "ln_2.weight": Rule((p + "post_attention_layernorm.weight",))}
    if not is_moe(cfg, i):
        F = cfg["ffn_hidden"]
        rules.update({"mlp.c_fc.weight": Rule((m + "gate_proj.weight", m + "up_proj.weight"), "concat", widths=(F, F)),
                      "mlp.c_proj.weight": Rule((m + "down_proj.weight",), "transpose")})
        return rules
    rules["moe.router.weight"] = Rule((m + "gate.weight",), "transpose")
    for e in range(cfg["n_experts"]):
        rules.update({f"moe.experts.{e}.{k}": r for k, r in expert_rules(m, e).items()})
    S = (cfg.get("moe_ffn_hidden") or cfg["ffn_hidden"]) * cfg.get("n_shared_experts", 0)
    s = m + "shared_experts."
    rules.update({"moe.shared.c_fc.weight": Rule((s + "gate_proj.weight", s + "up_proj.weight"), "concat",
                                                 widths=(S, S)),
                  "moe.shared.c_proj.weight": Rule((s + "down_proj.weight",), "transpose")})
    return rules


def _deepseek(cfg: dict, name: str, expert_rules) -> NameMap:
    """The map over ``cfg`` (a deepseek_v3 trace's config), its rules in
    the trace's declaration order (names.forward_param_order)."""
    if not mla(cfg):
        raise UserError(f"name map {name}: the trace's model is not a DeepSeek-V3 (its config has no arch "
                        f"deepseek_v3)")
    L = cfg["n_layer"]
    blocks = [_rules(cfg, i, expert_rules) for i in range(n_blocks(cfg))]      # the MTP depths' blocks too
    top = {"wte": Rule(("model.embed_tokens.weight",)), "ln_f.weight": Rule(("model.norm.weight",)),
           "lm_head": Rule(("lm_head.weight",))}
    head = "model.embed_tokens.weight" if tied(cfg) else "lm_head.weight"
    copies = {}
    for j in range(mtp_depth(cfg)):               # MTP depth j + 1 is HF's layer L + j
        p = f"model.layers.{L + j}."
        top.update({f"mtp.{j}.enorm.weight": Rule((p + "enorm.weight",)),
                    f"mtp.{j}.hnorm.weight": Rule((p + "hnorm.weight",)),
                    f"mtp.{j}.proj.weight": Rule((p + "eh_proj.weight",), "transpose"),    # rows [emb | hidden]
                    f"mtp.{j}.ln_f.weight": Rule((p + "shared_head.norm.weight",))})
        copies.update({p + "embed_tokens.weight": "model.embed_tokens.weight", p + "shared_head.head.weight": head})
    rules = {}
    for n in forward_param_order(cfg):
        kind, _, rest = n.partition(".")
        rules[n] = blocks[int(rest.split(".", 1)[0])][rest.split(".", 1)[1]] if kind == "h" else top[n]
    acts = {"emb": "model.embed_tokens", "ln_f": "model.norm"}
    buffers = {}
    for i in range(n_blocks(cfg)):
        p = f"model.layers.{i}."
        if i < L:                                 # transformers has no module of an MTP layer to hook
            acts.update({f"h.{i}.ln_1": p + "input_layernorm", f"h.{i}.attn": p + "self_attn",
                         f"h.{i}.ln_2": p + "post_attention_layernorm", f"h.{i}.mlp": p + "mlp", f"h.{i}": p[:-1]})
        if is_moe(cfg, i):
            buffers[p + "mlp.gate.e_score_correction_bias"] = f"moe/h.{i}.bias"
    return NameMap(name, rules, ("lm_head.weight",) if tied(cfg) else (), acts, buffers, copies)


def hf_deepseek_v3_hub(cfg: dict) -> NameMap:
    """A ``DeepseekV3ForCausalLM`` as the hub's files hold it: per expert
    ``mlp.experts.{e}.gate_proj/up_proj/down_proj`` (nn.Linear-style)."""
    F = cfg.get("moe_ffn_hidden") or cfg.get("ffn_hidden", 0)
    return _deepseek(cfg, "hf_deepseek_v3_hub", lambda m, e: {
        "c_fc.weight": Rule((f"{m}experts.{e}.gate_proj.weight", f"{m}experts.{e}.up_proj.weight"), "concat",
                            widths=(F, F)),
        "c_proj.weight": Rule((f"{m}experts.{e}.down_proj.weight",), "transpose")})


def hf_deepseek_v3(cfg: dict) -> NameMap:
    """transformers 5's in-memory ``DeepseekV3ForCausalLM``: a layer's
    experts fused in ``mlp.experts.gate_up_proj`` (E, 2F, h) and
    ``mlp.experts.down_proj`` (E, h, F); expert e's trace weights are slice
    e transposed. (Its ``save_pretrained`` writes the hub's form.)"""
    return _deepseek(cfg, "hf_deepseek_v3", lambda m, e: {
        "c_fc.weight": Rule((m + "experts.gate_up_proj",), "expert", expert=e),
        "c_proj.weight": Rule((m + "experts.down_proj",), "expert", expert=e)})
