"""Multi-head latent attention's local math (DeepSeek-V2/V3), between the
linears a layout owns, with no communication of its own.

The layer, with the linears (x @ W, W stored (in, out)) that a layout
places and the ops of this module between them:

    q path     x (B, T, C) --q_down--> cq (B, T, rq) --rmsnorm (eps LATENT_EPS)--> --q_up--> q
               (q_lora_rank rq = 0: x --q_proj--> q directly)
               q (B, T, nh (dn + dr)), each head's columns [q_nope (dn) | q_pe (dr)]
    kv path    x --kv_down--> ckv (B, T, rkv + dr) = [c_kv | k_pe]  (``split_latent``)
               c_kv --rmsnorm (LATENT_EPS)--> --kv_up--> kv (B, T, nh (dn + dv)), per head [k_nope | v]
               k_pe (B, T, dr): ONE rotary key part shared by every head,
               projected from x straight (not from the latent)
    core       (q, kv, k_pe) --``attention_forward``--> y (B, T, nh dv) --c_proj--> out

The core runs two ways with the same numbers: ``attention_forward`` /
``attention_backward`` (T x T scores, v at its own width dv), or
``pack`` -> any of the project's attention ops (``ops``,
``ops.attention_blocks``, ``parallel.context.RingAttention`` under
context parallelism) -> ``unpack``, with v zero-padded to dn + dr.

q_down and kv_down are small and replicated; q_up, q_proj and kv_up are
column-sharded by heads (each head's columns are contiguous, so a rank's
heads are a contiguous column range); c_proj is row-sharded, as Llama's.
The core works on any subset of heads, so a layout calls it on its own.

Under tensor parallelism the one thing that is NOT local: ``k_pe``'s
gradient is a sum over all heads, and a rank computes the sum over its
own heads only; the layout must all-reduce it over the head-splitting
ranks before kv_down's backward (the bug torchtitan PR #1373's review
found after ~1,000 steps). kv_up's input gradient dc_kv is partial in
the same way (as any column-sharded linear's): joining the two partial
sums first (``join_latent_grads``) makes it one all-reduce of rkv + dr
columns.

Rotary: only the dr columns are rotated, at each row's global position,
by ``ops.llama``'s half-split rope. DeepSeek's checkpoints lay the rotary
columns out in interleaved pairs (x0, x1), (x2, x3), ... (config
``rope_interleave``, the default): transformers then rotates
[x_even | x_odd] half-split, and so does ``rotary_forward``; the result
stays in that de-interleaved order for q and k alike, so their dot
products are those of the interleaved rotation.

Softmax scale: ``MlaDims.scale`` = softmax_factor / sqrt(dn + dr), the
factor 1 unless YaRN's mscale_all_dim sets it (``ops.yarn``: DeepSeek-V3's
released config multiplies the scale by (0.1 ln 40 + 1)^2); a caller may
still pass its own. Like ``local.attention_forward``, q is scaled before
the scores (equal to scaling the scores up to rounding).

Generation caches only what kv_down produces, after its norm and rotary:
c_kv (rkv per token) and the rotated k_pe (dr per token) (``LatentCache``);
each step the layout expands the cached latent through kv_up (its heads)
and ``decode_forward`` attends the new queries to it.

Formats: the direct core is written for float32 and float64 (what its
tests check); 16-bit activations take the packed path, whose ops keep
their statistics in float32.

Shapes: B rows, T query positions, S key positions, nh local heads, dn
nope, dr rope, dv value head sizes, rkv the kv latent rank.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..device.arrays import array_module
from .llama import rope_backward, rope_forward
from .local import batched_matmul, causal_softmax, causal_softmax_backward


# The latent norms' epsilon: DeepSeek's reference code and transformers build
# q_a_layernorm and kv_a_layernorm with RMSNorm's default 1e-6, whatever the
# config's rms_norm_eps (which only the block and final norms use).
LATENT_EPS = 1e-6


@dataclass(frozen=True)
class MlaDims:
    """Head sizes of MLA: dn (qk_nope_head_dim), dr (qk_rope_head_dim),
    dv (v_head_dim), the latent ranks rq (q_lora_rank, 0: none) and rkv
    (kv_lora_rank), whether the rotary columns are interleaved, and the
    softmax scale's factor over 1/sqrt(dn + dr) (YaRN's
    ``ops.yarn.YarnScaling.softmax_factor``; 1 without YaRN)."""
    nope: int
    rope: int
    v: int
    kv_rank: int
    q_rank: int = 0
    interleaved: bool = True
    softmax_factor: float = 1.0

    @property
    def qk(self) -> int:
        """One head's query/key width dn + dr."""
        return self.nope + self.rope

    @property
    def scale(self) -> float:
        """The softmax scale softmax_factor / sqrt(dn + dr)."""
        return self.softmax_factor / math.sqrt(self.qk)


# --- the kv latent -------------------------------------------------------------
def split_latent(ckv, kv_rank: int):
    """ckv (B, T, rkv + dr), kv_down's output -> (c_kv (B, T, rkv), k_pe (B, T, dr)) views."""
    return ckv[..., :kv_rank], ckv[..., kv_rank:]


def join_latent_grads(dc_kv, dk_pe):
    """(dc_kv (B, T, rkv), dk_pe (B, T, dr)) -> dckv (B, T, rkv + dr), kv_down's output gradient."""
    return array_module(dc_kv).concatenate([dc_kv, dk_pe], axis=-1)


# --- rotary on the dr columns --------------------------------------------------
def deinterleave(x):
    """x (..., dr) with pairs (x0, x1), (x2, x3), ... -> [x0 x2 ... | x1 x3 ...] (..., dr)."""
    return array_module(x).concatenate([x[..., 0::2], x[..., 1::2]], axis=-1)


def interleave(x):
    """``deinterleave``'s inverse (and transpose): [e | o] (..., dr) -> e0 o0 e1 o1 ..."""
    xp = array_module(x)
    h = x.shape[-1] // 2
    out = xp.empty_like(x)
    out[..., 0::2], out[..., 1::2] = x[..., :h], x[..., h:]
    return out


def rotary_forward(x, cos, sin, interleaved: bool):
    """x (B, T, n, dr), cos/sin (T, dr) (``ops.rope_tables`` at the rows'
    global positions, in x's format) -> rotated (B, T, n, dr), de-interleaved
    first when the columns come in pairs."""
    return rope_forward(deinterleave(x) if interleaved else x, cos, sin)


def rotary_backward(dy, cos, sin, interleaved: bool):
    """dy (B, T, n, dr) -> dx (B, T, n, dr): the rotation's transpose, then the permutation's."""
    dx = rope_backward(dy, cos, sin)
    return interleave(dx) if interleaved else dx


def rotate_k_pe(k_pe, cos, sin, interleaved: bool):
    """k_pe (B, T, dr) -> the rotated shared key part (B, T, dr), what the cache keeps."""
    return rotary_forward(k_pe[:, :, None, :], cos, sin, interleaved)[:, :, 0, :]


# --- the attention core --------------------------------------------------------
@dataclass
class MlaTape:
    """What ``attention_forward`` keeps for backward."""
    q: object            # (B, nh, T, dn + dr) scaled query, rotary part rotated
    k: object            # (B, nh, T, dn + dr) per-head key [k_nope | shared rotated k_pe]
    v: object            # (B, nh, T, dv)
    probs: object        # (B, nh, T, T) causal softmax
    used: object         # (B, nh, T, T) probs after dropout (probs itself without)
    keep_mask: object    # (B, nh, T, T) or None
    keep_prob: float
    cos: object          # (T, dr)
    sin: object          # (T, dr)
    dims: MlaDims
    scale: float


def _heads(q, kv, k_pe, n_head: int, dims: MlaDims, cos_q, sin_q, cos_k, sin_k):
    """The per-head query, key and value (B, nh, T|S, .) from the projections."""
    xp = array_module(q)
    B, T, _ = q.shape
    S = kv.shape[1]
    q4 = q.reshape(B, T, n_head, dims.qk)                                        # (B, T, nh, dn + dr)
    kv4 = kv.reshape(B, S, n_head, dims.nope + dims.v)                           # (B, S, nh, dn + dv)
    q_rot = rotary_forward(q4[..., dims.nope:], cos_q, sin_q, dims.interleaved)  # (B, T, nh, dr)
    qh = xp.concatenate([q4[..., :dims.nope], q_rot], axis=-1)                   # (B, T, nh, dn + dr)
    k_rot = k_pe if cos_k is None else rotate_k_pe(k_pe, cos_k, sin_k, dims.interleaved)   # (B, S, dr)
    kh = xp.empty((B, S, n_head, dims.qk), dtype=kv.dtype)                       # (B, S, nh, dn + dr)
    kh[..., :dims.nope] = kv4[..., :dims.nope]
    kh[..., dims.nope:] = k_rot[:, :, None, :]                                   # shared by every head
    vh = kv4[..., dims.nope:]                                                     # (B, S, nh, dv)
    return qh.transpose(0, 2, 1, 3), kh.transpose(0, 2, 1, 3), vh.transpose(0, 2, 1, 3)


def attention_forward(q, kv, k_pe, n_head: int, dims: MlaDims, cos, sin, scale: float = None,
                      keep_mask=None, keep_prob: float = 1.0):
    """Causal MLA over one sequence chunk: q (B, T, nh (dn + dr)) (q_up's or
    q_proj's columns of nh local heads), kv (B, T, nh (dn + dv)) (kv_up's),
    k_pe (B, T, dr) un-rotated (kv_down's last dr columns), cos/sin (T, dr)
    -> (y (B, T, nh dv), MlaTape). ``keep_mask`` (B, nh, T, T) drops
    attention probabilities (None: no dropout), as ``local.attention_forward``."""
    scale = dims.scale if scale is None else scale
    qh, kh, vh = _heads(q, kv, k_pe, n_head, dims, cos, sin, cos, sin)          # (B, nh, T, .)
    B, _, T, _ = qh.shape
    qh = qh * qh.dtype.type(scale)                                               # (B, nh, T, dn + dr) scaled copy
    probs = batched_matmul(qh, kh.swapaxes(-1, -2))                              # (B, nh, T, T) scores
    causal_softmax(probs.reshape(-1, T, T))
    used = probs if keep_mask is None else probs * keep_mask * (1.0 / keep_prob)
    y = array_module(q).empty((B, T, n_head, dims.v), dtype=q.dtype)            # (B, T, nh, dv)
    batched_matmul(used, vh, out=y.transpose(0, 2, 1, 3))
    tape = MlaTape(qh, kh, vh, probs, used, keep_mask, keep_prob, cos, sin, dims, scale)
    return y.reshape(B, T, n_head * dims.v), tape


def attention_backward(dy, tape: MlaTape):
    """dy (B, T, nh dv) -> (dq (B, T, nh (dn + dr)), dkv (B, T, nh (dn + dv)),
    dk_pe (B, T, dr)). dk_pe sums over the LOCAL heads only: a layout that
    splits heads all-reduces it (see the module's docstring)."""
    xp = array_module(dy)
    dims = tape.dims
    B, nh, T, _ = tape.q.shape
    dy4 = dy.reshape(B, T, nh, dims.v).transpose(0, 2, 1, 3)                    # (B, nh, T, dv)
    dv = batched_matmul(tape.used.swapaxes(-1, -2), dy4)                         # (B, nh, T, dv)
    ds = batched_matmul(dy4, tape.v.swapaxes(-1, -2))                            # (B, nh, T, T) d probs
    if tape.keep_mask is not None:
        ds *= tape.keep_mask
        ds *= 1.0 / tape.keep_prob
    causal_softmax_backward(ds.reshape(-1, T, T), tape.probs.reshape(-1, T, T))  # -> d scores, in place
    dq4 = batched_matmul(ds, tape.k).transpose(0, 2, 1, 3)                       # (B, T, nh, dn + dr) unscaled
    dk4 = batched_matmul(ds.swapaxes(-1, -2), tape.q).transpose(0, 2, 1, 3)      # (B, T, nh, dn + dr)
    dq = xp.empty((B, T, nh, dims.qk), dtype=dy.dtype)                          # (B, T, nh, dn + dr)
    dq[..., :dims.nope] = dq4[..., :dims.nope] * tape.scale
    dq[..., dims.nope:] = rotary_backward(dq4[..., dims.nope:] * tape.scale, tape.cos, tape.sin, dims.interleaved)
    dkv = xp.empty((B, T, nh, dims.nope + dims.v), dtype=dy.dtype)             # (B, T, nh, dn + dv)
    dkv[..., :dims.nope] = dk4[..., :dims.nope]
    dkv[..., dims.nope:] = dv.transpose(0, 2, 1, 3)
    dk_rot = dk4[..., dims.nope:].sum(axis=2)                                    # (B, T, dr) over local heads
    dk_pe = rotary_backward(dk_rot[:, :, None, :], tape.cos, tape.sin, dims.interleaved)[:, :, 0, :]
    return dq.reshape(B, T, nh * dims.qk), dkv.reshape(B, T, nh * (dims.nope + dims.v)), dk_pe



# --- the same core through the project's attention ops --------------------------
def pack(q, kv, k_pe, n_head: int, dims: MlaDims, cos, sin):
    """The projections as the packed qkv (B, T, 3 nh hd), hd = dn + dr,
    that every attention op of the project takes (``ops`` T x T,
    ``ops.attention_blocks``, ``parallel.context.RingAttention``): q and
    k as ``attention_forward`` builds them, v zero-padded from dv to hd
    columns. Those ops scale by 1/sqrt(hd) = 1/sqrt(dn + dr), MLA's scale
    (q is multiplied by ``dims.softmax_factor`` first where YaRN sets one),
    and the padded columns of their output are exactly zero (p @ 0), so
    ``unpack`` gives the same numbers as ``attention_forward`` at the
    price of (dn + dr) / dv times the p @ v work. Needs dv <= dn + dr
    (DeepSeek-V3: 128 <= 192)."""
    if dims.v > dims.qk:
        raise ValueError(f"v_head_dim {dims.v} exceeds qk_nope_head_dim + qk_rope_head_dim {dims.qk}")
    xp = array_module(q)
    qh, kh, vh = _heads(q, kv, k_pe, n_head, dims, cos, sin, cos, sin)          # (B, nh, T, .)
    B, _, T, hd = qh.shape
    qkv = xp.zeros((B, T, 3, n_head, hd), dtype=q.dtype)                          # (B, T, 3, nh, hd)
    if dims.softmax_factor != 1.0:
        qh = qh * qh.dtype.type(dims.softmax_factor)                             # (B, nh, T, hd)
    qkv[:, :, 0], qkv[:, :, 1] = qh.transpose(0, 2, 1, 3), kh.transpose(0, 2, 1, 3)
    qkv[:, :, 2, :, :dims.v] = vh.transpose(0, 2, 1, 3)
    return qkv.reshape(B, T, 3 * n_head * hd)


def unpack(y, n_head: int, dims: MlaDims):
    """The packed op's output y (B, T, nh hd) -> (B, T, nh dv), each head's first dv columns."""
    B, T, _ = y.shape
    return y.reshape(B, T, n_head, dims.qk)[..., :dims.v].reshape(B, T, n_head * dims.v)


def unpack_backward(dy, dims: MlaDims):
    """dy (B, T, nh dv) -> (B, T, nh hd), zero in the padded columns."""
    xp = array_module(dy)
    B, T, _ = dy.shape
    n_head = dy.shape[-1] // dims.v
    out = xp.zeros((B, T, n_head, dims.qk), dtype=dy.dtype)                       # (B, T, nh, hd)
    out[..., :dims.v] = dy.reshape(B, T, n_head, dims.v)
    return out.reshape(B, T, n_head * dims.qk)


def pack_backward(dqkv, n_head: int, dims: MlaDims, cos, sin):
    """dqkv (B, T, 3 nh hd) -> (dq, dkv, dk_pe) as ``attention_backward``
    returns them (dk_pe summed over the local heads only)."""
    xp = array_module(dqkv)
    B, T, _ = dqkv.shape
    g = dqkv.reshape(B, T, 3, n_head, dims.qk)                                    # (B, T, 3, nh, hd)
    dq = xp.empty((B, T, n_head, dims.qk), dtype=dqkv.dtype)                      # (B, T, nh, dn + dr)
    dq[..., :dims.nope] = g[:, :, 0, :, :dims.nope]
    dq[..., dims.nope:] = rotary_backward(g[:, :, 0, :, dims.nope:], cos, sin, dims.interleaved)
    if dims.softmax_factor != 1.0:
        dq *= dq.dtype.type(dims.softmax_factor)
    dkv = xp.empty((B, T, n_head, dims.nope + dims.v), dtype=dqkv.dtype)         # (B, T, nh, dn + dv)
    dkv[..., :dims.nope] = g[:, :, 1, :, :dims.nope]
    dkv[..., dims.nope:] = g[:, :, 2, :, :dims.v]
    dk_rot = g[:, :, 1, :, dims.nope:].sum(axis=2)                                # (B, T, dr) over local heads
    dk_pe = rotary_backward(dk_rot[:, :, None, :], cos, sin, dims.interleaved)[:, :, 0, :]
    return dq.reshape(B, T, -1), dkv.reshape(B, T, -1), dk_pe


# --- generation with the compressed cache --------------------------------------
class LatentCache:
    """MLA's generation cache: per token only the normed kv latent c_kv
    (rkv) and the rotated shared key part k_pe (dr), not nh (dn + dr + dv)
    keys and values. Preallocated for ``capacity`` positions."""

    def __init__(self, xp, batch: int, capacity: int, dims: MlaDims, dtype):
        self.c_kv = xp.zeros((batch, capacity, dims.kv_rank), dtype=dtype)     # (B, Tmax, rkv)
        self.k_pe = xp.zeros((batch, capacity, dims.rope), dtype=dtype)        # (B, Tmax, dr) rotated
        self.length = 0

    def append(self, c_kv, k_pe_rot):
        """Store the next t positions: c_kv (B, t, rkv) normed, k_pe_rot (B, t, dr)."""
        t = c_kv.shape[1]
        if self.length + t > self.c_kv.shape[1]:
            raise ValueError(f"the latent cache holds {self.c_kv.shape[1]} positions; {self.length + t} asked")
        self.c_kv[:, self.length:self.length + t] = c_kv
        self.k_pe[:, self.length:self.length + t] = k_pe_rot
        self.length += t

    def view(self):
        """(c_kv (B, S, rkv), k_pe (B, S, dr)) of the S = length positions stored."""
        return self.c_kv[:, :self.length], self.k_pe[:, :self.length]


def decode_forward(q, kv, k_pe_rot, n_head: int, dims: MlaDims, cos_q, sin_q, q0: int, scale: float = None):
    """New queries q (B, t, nh (dn + dr)) at global positions q0 .. q0 + t - 1
    (cos_q/sin_q (t, dr) of those positions) against every cached position:
    kv (B, S, nh (dn + dv)) = kv_up(cached c_kv) for the local heads, and
    k_pe_rot (B, S, dr) the cached rotated key, S = q0 + t (the new
    positions appended first) -> y (B, t, nh dv). Query i sees keys <= q0 + i."""
    xp = array_module(q)
    scale = dims.scale if scale is None else scale
    qh, kh, vh = _heads(q, kv, k_pe_rot, n_head, dims, cos_q, sin_q, None, None)   # (B, nh, t|S, .)
    B, _, t, _ = qh.shape
    S = kh.shape[2]
    s = batched_matmul(qh * qh.dtype.type(scale), kh.swapaxes(-1, -2))           # (B, nh, t, S)
    rows = xp.arange(q0, q0 + t).reshape(-1, 1)
    cols = xp.arange(S).reshape(1, -1)
    s = s + xp.where(cols > rows, -xp.inf, 0.0).astype(s.dtype)                 # (B, nh, t, S)
    s = xp.exp(s - s.max(-1, keepdims=True))
    s /= s.sum(-1, keepdims=True)
    y = batched_matmul(s, vh)                                                    # (B, nh, t, dv)
    return y.transpose(0, 2, 1, 3).reshape(B, t, n_head * dims.v)
