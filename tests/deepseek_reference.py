"""A serial NumPy DeepSeek-V3 forward assembled from mpicube's ops
(``ops.mla``, ``ops.deepseek_router``, ``ops.mtp``, RMSNorm, SwiGLU,
cross-entropy) on whole tensors named as ``files.formats.hf_deepseek``
names them: the target the model's integration of DeepSeek-V3 must meet
on every layout, checked here against transformers' float64
DeepseekV3ForCausalLM (tests/test_hf_deepseek.py).

Not a model implementation: no backward, no layouts, no caches; each
linear is a plain x @ W.
"""

from __future__ import annotations

import numpy as np

from mpicube import ops
from mpicube.ops import deepseek_router as router
from mpicube.ops import mla, mtp


def dims_of(d) -> mla.MlaDims:
    """MlaDims of a DeepseekV3Shape (YaRN's softmax factor included)."""
    return mla.MlaDims(nope=d.qk_nope_head_dim, rope=d.qk_rope_head_dim, v=d.v_head_dim, kv_rank=d.kv_lora_rank,
                       q_rank=d.q_lora_rank, interleaved=d.rope_interleave, softmax_factor=d.softmax_factor)


def rope_tables(d, positions):
    """(cos, sin) (T, dr) of a DeepseekV3Shape at ``positions`` (T,), YaRN's scaling applied where set."""
    return ops.rope_tables(positions, d.qk_rope_head_dim, d.rope_theta, d.rope_scaling)


def rms(x, w, eps):
    """RMSNorm over the last axis, whole (serial) width."""
    return ops.rmsnorm_forward(x, w, x.shape[-1], eps)[0]


def mla_project(h, t, pre, d):
    """h (B, T, C) normed input -> (q (B, T, nh (dn + dr)), normed c_kv (B, T, rkv), un-rotated k_pe (B, T, dr))."""
    if d.q_lora_rank:
        cq = h @ t[pre + "attn.q_down.weight"]                                   # (B, T, rq)
        q = rms(cq, t[pre + "attn.q_norm.weight"], mla.LATENT_EPS) @ t[pre + "attn.q_up.weight"]
    else:
        q = h @ t[pre + "attn.q_proj.weight"]                                    # (B, T, nh (dn + dr))
    c_kv, k_pe = mla.split_latent(h @ t[pre + "attn.kv_down.weight"], d.kv_lora_rank)   # (B, T, rkv), (B, T, dr)
    return q, rms(c_kv, t[pre + "attn.kv_norm.weight"], mla.LATENT_EPS), k_pe


def mla_forward(h, t, pre, d, cos, sin):
    """h (B, T, C) normed input, t {name: tensor}, pre "h.{i}." -> attention output (B, T, C) before the residual."""
    q, c_kv, k_pe = mla_project(h, t, pre, d)
    kv = c_kv @ t[pre + "attn.kv_up.weight"]                                     # (B, T, nh (dn + dv))
    y, _ = mla.attention_forward(q, kv, k_pe, d.n_head, dims_of(d), cos, sin)     # (B, T, nh dv)
    return y @ t[pre + "attn.c_proj.weight"]


def mla_decode(h, t, pre, d, cache, q0, cos, sin):
    """The generation step: h (B, t, C) normed input of positions q0 .. q0 + t - 1,
    cos/sin (t, dr) of those; appends their latent and rotated key to ``cache``
    (an ``ops.mla.LatentCache``) and attends to everything cached -> (B, t, C)."""
    dims = dims_of(d)
    q, c_kv, k_pe = mla_project(h, t, pre, d)
    cache.append(c_kv, mla.rotate_k_pe(k_pe, cos, sin, dims.interleaved))
    lat, k_rot = cache.view()                                                    # (B, S, rkv), (B, S, dr)
    y = mla.decode_forward(q, lat @ t[pre + "attn.kv_up.weight"], k_rot, d.n_head, dims, cos, sin, q0)
    return y @ t[pre + "attn.c_proj.weight"]


def swiglu_mlp(h, w_fc, w_proj):
    """h (n, C) -> (n, C) through [gate | up] and down."""
    return ops.swiglu_forward(h @ w_fc)[0] @ w_proj


def moe_forward(h, t, pre, d, record=None):
    """h (B, T, C) -> the routed experts' weighted sum plus the shared experts (B, T, C)."""
    B, T, C = h.shape
    x = h.reshape(-1, C)                                                         # (n, C)
    logits = x @ t[pre + "moe.router.weight"]                                    # (n, E)
    scores, chosen, weights, _ = router.route(logits, t[pre + "moe.router.score_bias"], d.top_k, d.n_groups,
                                              d.topk_groups, d.norm_topk, d.routed_scaling_factor)
    if record is not None:
        record.append((chosen, weights))
    out = np.zeros_like(x)                                                       # (n, C)
    for e in range(d.n_routed_experts):
        rows, k = np.nonzero(chosen == e)
        if rows.size:
            y = swiglu_mlp(x[rows], t[f"{pre}moe.experts.{e}.c_fc.weight"], t[f"{pre}moe.experts.{e}.c_proj.weight"])
            out[rows] += weights[rows, k][:, None] * y
    if d.n_shared_experts:
        out += swiglu_mlp(x, t[pre + "moe.shared.c_fc.weight"], t[pre + "moe.shared.c_proj.weight"])
    return out.reshape(B, T, C)


def block_forward(x, t, pre, d, layer, cos, sin, record=None, cache=None, q0=0):
    """One pre-norm block: x (B, T, C) -> (B, T, C); with ``cache``, the
    generation step at positions q0 .. (``mla_decode``)."""
    h = rms(x, t[pre + "ln_1.weight"], d.rms_eps)
    x = x + (mla_forward(h, t, pre, d, cos, sin) if cache is None else mla_decode(h, t, pre, d, cache, q0, cos, sin))
    h = rms(x, t[pre + "ln_2.weight"], d.rms_eps)
    if d.is_moe(layer):
        return x + moe_forward(h, t, pre, d, record)
    return x + swiglu_mlp(h.reshape(-1, d.n_embd), t[pre + "mlp.c_fc.weight"],
                          t[pre + "mlp.c_proj.weight"]).reshape(h.shape)


def logits_of(h, t, d):
    """h (B, T, C) normed -> logits (B, T, V)."""
    return h @ (t["wte"] if d.tie_embeddings else t["lm_head"]).T


def mean_ce(logits, targets, valid=None):
    """(sum of per-token cross-entropies over the valid positions, their count)."""
    V = logits.shape[-1]
    loss = ops.cross_entropy_forward(logits.reshape(-1, V), targets.reshape(-1), 0, V)[0]   # (n,)
    keep = np.ones(loss.shape, bool) if valid is None else valid.reshape(-1)
    return float(loss[keep].sum()), int(keep.sum())


def forward(t, d, ids, targets, mtp_depth=0, mtp_weight=0.3, record=None):
    """ids, targets (B, T) -> (loss, main loss, [depth losses]): loss =
    main + (mtp_weight / D) sum_k L_k, each normalised over its own tokens;
    MTP depths drafting from the main model's final-normed state (what
    transformers feeds its MtpLayer)."""
    T = ids.shape[1]
    cos, sin = rope_tables(d, np.arange(T))                                      # (T, dr)
    x = t["wte"][ids]                                                            # (B, T, C)
    for i in range(d.n_layer):
        x = block_forward(x, t, f"h.{i}.", d, i, cos, sin, record)
    h = rms(x, t["ln_f.weight"], d.rms_eps)                                      # (B, T, C)
    main_sum, main_n = mean_ce(logits_of(h, t, d), targets)
    sums, counts, prev = [], [], h
    for k in range(mtp_depth):
        pre = f"mtp.{k}."
        tok, tgt, valid = mtp.depth_tokens(targets, k + 1)
        u, _ = mtp.input_forward(prev, t["wte"][tok], t[pre + "hnorm.weight"], t[pre + "enorm.weight"], d.n_embd,
                                 d.rms_eps)
        z = block_forward(mtp.project_forward(u, t[pre + "proj.weight"]), t, f"h.{d.n_layer + k}.", d, d.n_layer + k,
                          cos, sin, record)
        prev = rms(z, t[pre + "ln_f.weight"], d.rms_eps)
        s, n = mean_ce(logits_of(prev, t, d), tgt, valid)
        sums.append(s)
        counts.append(n)
    loss, depth_losses, _ = mtp.combine_losses(main_sum, sums, main_n, counts, mtp_weight) if mtp_depth else \
        (main_sum / main_n, [], None)
    return loss, main_sum / main_n, depth_losses


def greedy(t, d, prompt, n_new):
    """prompt (B, P) -> (B, P + n_new) by greedy decoding through the
    compressed cache: the prompt in one step, then one token a step."""
    B, P = prompt.shape
    caches = [mla.LatentCache(np, B, P + n_new, dims_of(d), np.float64) for _ in range(d.n_layer)]
    cos, sin = rope_tables(d, np.arange(P + n_new))                              # (P + n, dr)
    out, q0, step = prompt, 0, prompt
    for _ in range(n_new):
        q1 = q0 + step.shape[1]
        x = t["wte"][step]                                                       # (B, t, C)
        for i in range(d.n_layer):
            x = block_forward(x, t, f"h.{i}.", d, i, cos[q0:q1], sin[q0:q1], cache=caches[i], q0=q0)
        logits = logits_of(rms(x[:, -1:], t["ln_f.weight"], d.rms_eps), t, d)    # (B, 1, V)
        step = logits.argmax(-1)                                                 # (B, 1)
        out, q0 = np.concatenate([out, step], axis=1), q1
    return out
