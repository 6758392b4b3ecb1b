"""transformers' float64 models made float64 throughout, for the tests that
compare mpicube with Hugging Face to 1e-12 (test_hf_llama, test_hf_mixtral,
test_hf_deepseek, test_generate).

transformers casts to float32 inside a "float64" model on purpose (for
16-bit training): RMSNorm's statistics, the rotary frequencies and angles
(``torch.float`` in its rope functions), eager attention's softmax and the
routers (Mixtral's softmax, DeepSeek's sigmoid and its float32 weights).
That costs about 1e-9 of the loss, and would hide a real error of that
size. ``patch`` replaces those forwards in one modeling module with the
same arithmetic in float64; the rotary tables come from transformers' own
rope functions (default, llama3, yarn) run with ``torch.float`` and
``torch.float32`` read as float64 (``Float64Torch``), times their
attention factor, so the frequencies compared are still transformers'.

Only tests import this module (it needs torch); every patch is made
through a ``pytest.MonkeyPatch`` and undone with it.
"""

from __future__ import annotations


class Float64Torch:
    """torch, except that ``torch.float`` and ``torch.float32`` are float64:
    transformers' rope functions build their frequencies (and YaRN its
    ramp) in those dtypes, so with this in their module's place they run
    their own formula in float64."""

    def __init__(self, torch):
        self._torch, self.float, self.float32 = torch, torch.float64, torch.float64

    def __getattr__(self, name):
        return getattr(self._torch, name)


def rope_parameters(torch, config, wide=True):
    """(inv_freq (hd/2,), attention factor) of transformers' rope function
    for ``config``'s rope type, run in float64 when ``wide`` (else as
    transformers runs it: the float32 buffer a model holds)."""
    from transformers import modeling_rope_utils as rope_utils

    params = config.rope_parameters
    kind = params.get("rope_type", "default")
    if kind == "default":           # each model's own default is an arange in torch.float: the same formula here
        dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        dtype = torch.float64 if wide else torch.float32
        return 1.0 / params["rope_theta"] ** (torch.arange(0, dim, 2, dtype=dtype) / dim), 1.0
    saved = rope_utils.torch
    rope_utils.torch = Float64Torch(torch) if wide else torch
    try:
        inv_freq, factor = rope_utils.ROPE_INIT_FUNCTIONS[kind](config)
    finally:
        rope_utils.torch = saved
    return inv_freq, float(factor)


def patch(monkeypatch, torch, modeling):
    """Make ``modeling`` (e.g. transformers.models.llama.modeling_llama)
    compute its RMSNorm, rotary tables, eager attention and router (where
    it has them) in float64, through ``monkeypatch``."""
    F = torch.nn.functional

    def rms_forward(self, x):
        variance = x.pow(2).mean(-1, keepdim=True)
        return self.weight * (x * torch.rsqrt(variance + self.variance_epsilon))

    def rope_forward(self, x, position_ids):
        inv_freq, factor = rope_parameters(torch, self.config)                    # (hd/2,) float64
        angles = position_ids[..., None].double() * inv_freq                       # (B, T, hd/2)
        angles = torch.cat((angles, angles), dim=-1)                               # (B, T, hd)
        return (angles.cos() * factor).to(x.dtype), (angles.sin() * factor).to(x.dtype)

    def eager(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
        groups = query.shape[1] // key.shape[1]                                    # grouped-query heads
        key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
        w = torch.matmul(query, key.transpose(2, 3)) * scaling                    # (B, nh, T, S)
        if attention_mask is not None:
            w = w + attention_mask[:, :, :, :key.shape[-2]]
        w = F.softmax(w, dim=-1)                                                   # in the model's float64
        return torch.matmul(w, value).transpose(1, 2).contiguous(), w

    def softmax_router(self, hidden_states):
        """Mixtral's: softmax over the experts, top k, renormalised."""
        logits = F.linear(hidden_states.reshape(-1, self.hidden_dim), self.weight)   # (n, E)
        top, index = torch.topk(torch.softmax(logits, dim=-1), self.top_k, dim=-1)
        return logits, top / top.sum(dim=-1, keepdim=True), index

    def grouped_router(self, hidden_states):
        """DeepSeek-V3's: sigmoid scores, the top groups (sum of a group's two
        best) and top k chosen on score + bias, weights from the scores."""
        logits = F.linear(hidden_states.view(-1, self.hidden_dim), self.weight.double())   # (n, E)
        scores = logits.sigmoid()
        choice = scores + self.e_score_correction_bias.double()
        per_group = self.num_experts // self.num_group
        groups = choice.view(-1, self.num_group, per_group).topk(2, dim=-1)[0].sum(-1)   # (n, G)
        kept = torch.topk(groups, k=self.topk_group, dim=-1, sorted=False)[1]
        mask = torch.zeros_like(groups).scatter_(1, kept, 1)
        mask = mask.unsqueeze(-1).expand(-1, self.num_group, per_group).reshape(-1, self.num_experts)
        choice = choice.masked_fill(~mask.bool(), float("-inf"))
        top = torch.topk(choice, k=self.top_k, dim=-1, sorted=False)[1]
        w = scores.gather(1, top)
        if self.norm_topk_prob:
            w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
        return logits, w * self.routed_scaling_factor, top

    routers = {"TopkRouter": grouped_router, "TopKRouter": softmax_router}
    patched = []
    for name in dir(modeling):
        cls = getattr(modeling, name)
        if not isinstance(cls, type) or getattr(cls, "__module__", None) != modeling.__name__:
            continue
        if name.endswith("RMSNorm"):
            monkeypatch.setattr(cls, "forward", rms_forward)
        elif name.endswith("RotaryEmbedding"):
            monkeypatch.setattr(cls, "forward", rope_forward)
        elif any(name.endswith(suffix) for suffix in routers):
            monkeypatch.setattr(cls, "forward", routers[next(s for s in routers if name.endswith(s))])
        else:
            continue
        patched.append(name)
    if hasattr(modeling, "eager_attention_forward"):
        monkeypatch.setattr(modeling, "eager_attention_forward", eager)
        patched.append("eager_attention_forward")
    assert any(n.endswith("RMSNorm") for n in patched) and any(n.endswith("RotaryEmbedding") for n in patched), \
        (modeling.__name__, patched)
    return patched
