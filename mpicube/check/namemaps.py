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
``mlp.experts.gate_up_proj`` (E, 2F, h) and ``down_proj`` (E, h, F)). A map that misses
a parameter, or a framework tensor no rule uses, is bad input naming it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..core.errors import UserError
from .names import BLOCK_ACTS, BLOCK_PARAMS, forward_param_order, llama, moe, tied
from .shards import Shard, Sharded


@dataclass
class Rule:
    """How one trace parameter is made from framework tensors ``sources``:
    ``kind`` "same", "transpose" (an (out, in) linear), "concat" (separate
    q, k, v linears, each (out, in): transposed and side by side),
    "heads" (Megatron's fused q/k/v, rows (n_head, 3, head_dim)) or
    "expert" (slice ``expert`` of a fused (E, out, in) experts tensor,
    transposed: several rules read one source, NameMap.from_trace stacks
    their slices back)."""

    sources: tuple
    kind: str = "same"
    n_head: int = 0
    widths: tuple = ()            # "concat": each source's output width, when they differ (GQA's q, k, v)
    expert: int = -1              # "expert": which (E, out, in) slice of a fused experts tensor, transposed

    def offset(self, k: int, width: int) -> int:
        """Where source k's outputs start among the concatenated columns."""
        return sum(self.widths[:k]) if self.widths else k * width

    def to_trace(self, parts: list) -> np.ndarray:
        if self.kind == "same":
            return parts[0]
        if self.kind == "transpose":
            return parts[0].T
        if self.kind == "expert":                           # (E, out, in) -> expert's (in, out)
            return parts[0][self.expert].T
        if self.kind == "concat":                           # [q | k | v]: weights (in, 3h), biases (3h,)
            return np.concatenate([p.T for p in parts], axis=-1)
        if self.kind == "heads":                            # (nh*3*hd, ...) -> (3*nh*hd, ...) -> weights (in, out)
            w = parts[0]
            rows = w.shape[0]
            regrouped = w.reshape(self.n_head, 3, rows // (3 * self.n_head), *w.shape[1:]).swapaxes(0, 1)
            return regrouped.reshape(w.shape).T
        raise ValueError(self.kind)

    def shard_to_trace(self, k: int, index: tuple, block: np.ndarray, shape: tuple) -> tuple:
        """(trace index, trace block) of a block of source ``k`` (logical
        ``shape``) held at global ``index`` (one integer array per
        dimension): the same conversion as ``to_trace``, done on the
        indices, so a rank's shard maps without the whole tensor."""
        index = tuple(np.asarray(ix, dtype=np.int64) for ix in index)
        if self.kind == "same":
            return index, block
        if self.kind == "transpose":
            return index[::-1], block.T
        if self.kind == "expert":                           # this expert's rows of a (E, out, in) block
            at = np.flatnonzero(index[0] == self.expert)     # none: an empty block (dropped by shards_to_trace)
            return (index[2], index[1][:len(index[1]) * at.size]), (block[at[0]] if at.size else block[0, :0]).T
        if self.kind == "concat":                           # part k's outputs start after the parts before it
            out = index[0] + self.offset(k, shape[0])
            return ((index[1], out) if block.ndim == 2 else (out,)), block.T
        if self.kind == "heads":                            # row (j*3 + p)*hd + d -> column p*h + j*hd + d
            hd = shape[0] // (3 * self.n_head)
            r = index[0]
            col = (r // hd) % 3 * (self.n_head * hd) + r // (3 * hd) * hd + r % hd
            return ((index[1], col) if block.ndim == 2 else (col,)), block.T
        raise ValueError(self.kind)

    def from_trace(self, value: np.ndarray) -> list:
        if self.kind == "same":
            return [value]
        if self.kind in ("transpose", "expert"):
            return [value.T]
        if self.kind == "concat":
            cuts = np.cumsum(self.widths)[:-1] if self.widths else len(self.sources)
            return [p.T for p in np.split(value, cuts, axis=-1)]
        if self.kind == "heads":
            w = value.T                                     # (3*nh*hd, ...) trace order
            rows = w.shape[0]
            regrouped = w.reshape(3, self.n_head, rows // (3 * self.n_head), *w.shape[1:]).swapaxes(0, 1)
            return [np.ascontiguousarray(regrouped.reshape(w.shape))]
        raise ValueError(self.kind)


@dataclass
class NameMap:
    """{trace name: Rule} over a model config, plus the framework names that
    alias another (a tied LM head) and so map to nothing. ``acts`` names
    the modules whose outputs are the trace's activations."""

    name: str
    rules: dict
    aliases: tuple = ()
    acts: dict = field(default_factory=dict)          # {"emb": module path, "h.0": ..., "ln_f": ...}

    def sources(self, names=None) -> set:
        """The framework names the rules of ``names`` (default: all) read,
        e.g. to put the trace's ``decay`` list into an optimizer's groups."""
        return {s for n, rule in self.rules.items() if names is None or n in names for s in rule.sources}

    def check_names(self, framework_names, what: str = "model") -> None:
        """Every framework tensor used by exactly the rules; bad input naming the first that is not."""
        have = set(framework_names)
        missing = sorted(self.sources() - have)
        if missing:
            raise UserError(f"name map {self.name}: the {what} has no {missing[0]!r}")
        unused = sorted(have - self.sources() - set(self.aliases))
        if unused:
            raise UserError(f"name map {self.name}: the {what}'s {unused[0]!r} maps to no trace tensor")

    def to_trace(self, tensors: dict, what: str = "model") -> dict:
        """{framework name: array} -> {trace name: array}, declaration order."""
        self.check_names(tensors, what)
        return {name: rule.to_trace([np.asarray(tensors[s]) for s in rule.sources])
                for name, rule in self.rules.items()}

    def shards_to_trace(self, shards: dict, shapes: dict, what: str = "model") -> dict:
        """{framework name: [Shard]} with their logical ``shapes`` -> {trace
        name: Sharded}: each rank's blocks under the trace's names and
        indices, for compare to put together (shards.py)."""
        self.check_names(shards, what)
        out = {}
        for name, rule in self.rules.items():
            pieces = []
            for k, source in enumerate(rule.sources):
                for s in shards[source]:
                    index, block = rule.shard_to_trace(k, s.index, np.asarray(s.data), tuple(shapes[source]))
                    if block.size or not np.asarray(s.data).size:     # a fused tensor's block of other experts: none
                        pieces.append(Shard(s.rank, index, block, s.placement, s.coords))
            full = [np.asarray(shapes[s]) for s in rule.sources]
            out[name] = Sharded(tuple(rule.to_trace([np.empty(tuple(f)) for f in full]).shape), pieces)
        return out

    def from_trace(self, tensors: dict) -> dict:
        """{trace name: array} -> {framework name: array} (to load initial parameters)."""
        out, fused = {}, {}
        for name, rule in self.rules.items():
            if name not in tensors:
                raise UserError(f"name map {self.name}: no trace tensor {name!r} to load")
            parts = rule.from_trace(np.asarray(tensors[name]))
            if rule.kind == "expert":                       # one slice of a fused experts tensor
                fused.setdefault(rule.sources[0], {})[rule.expert] = parts[0]
                continue
            out.update(zip(rule.sources, parts))
        for source, slices in fused.items():                # (E, out, in), experts in order
            out[source] = np.stack([slices[e] for e in range(len(slices))])
        return out


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
    if not llama(cfg):
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
        "hf_llama": hf_llama, "hf_mixtral": hf_mixtral, "hf_mixtral_hub": hf_mixtral_hub}
