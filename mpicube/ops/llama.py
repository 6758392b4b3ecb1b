"""The Llama family's local ops: RMSNorm, rotary position embeddings and
the SwiGLU gate, as forward/backward pairs with no communication of their
own (docs/design.md section 2 is their numerics contract).

* RMSNorm's statistics run in float32 or wider whatever the activations'
  format (16-bit inputs are upcast, as Hugging Face does), the weight is
  applied after normalising, and a hidden size split over ranks arrives as
  ``allsum``, as LayerNorm's does.
* Rotary embeddings use Hugging Face's half-split convention: head columns
  [x1 | x2] rotate as (x1 cos - x2 sin, x2 cos + x1 sin), i.e.
  ``x cos + rotate_half(x) sin`` with ``rotate_half(x) = [-x2 | x1]``. The
  angles are computed on the host in float64 from each row's global
  position, so every layout and split of the sequence rotates a row alike;
  Llama 3's frequency scaling is applied to the inverse frequencies there,
  and so is YaRN's (``ops.yarn``, with its factor on the tables).
* SwiGLU: silu(gate) * up on the two halves of one linear's output.

Shapes: B rows, T positions, C local hidden width, nh local heads, hd head size.
"""

from __future__ import annotations

import numpy as np

from ..device.arrays import array_module, identity
from ..device.precision import is_half, narrow, up
from .local import column_dots, rowdot
from .yarn import YarnScaling, yarn_inv_freq


# --- RMSNorm -------------------------------------------------------------------
def rmsnorm_forward(x, gamma, n_hidden: int, eps: float, allsum=identity):
    """x (B, T, C) -> (y (B, T, C), (xhat, rstd)): y = gamma * x / sqrt(mean(x^2) + eps),
    the mean over the full hidden size ``n_hidden`` of which this rank holds C."""
    if is_half(x.dtype):                     # statistics in float32, as every op here does
        y, (xhat, rstd) = rmsnorm_forward(up(x), up(gamma), n_hidden, eps, allsum)
        return narrow(y, x.dtype), (narrow(xhat, x.dtype), rstd)
    ms = allsum(rowdot(x, x)[..., None]) / n_hidden                   # (B, T, 1) mean square
    rstd = 1.0 / (ms + eps) ** 0.5                                    # (B, T, 1)
    xhat = x * rstd                                                   # (B, T, C)
    return xhat * gamma, (xhat, rstd)


def rmsnorm_backward(dy, cache, gamma, dgamma, n_hidden: int, allsum=identity):
    """dy (B, T, C) -> dx (B, T, C); adds into dgamma (C,).
    dx = rstd (g - xhat mean(g xhat)), g = dy * gamma."""
    xhat, rstd = cache
    if is_half(dy.dtype):
        return narrow(rmsnorm_backward(up(dy), (up(xhat), rstd), up(gamma), dgamma, n_hidden, allsum), dy.dtype)
    C = dy.shape[-1]
    dgamma += column_dots(dy.reshape(-1, C), xhat.reshape(-1, C))
    g = dy * gamma                                                    # (B, T, C)
    mean_gx = allsum(rowdot(g, xhat)[..., None]) / n_hidden           # (B, T, 1)
    g -= xhat * mean_gx
    g *= rstd
    return g


# --- rotary position embeddings ------------------------------------------------
def rope_inv_freq(head_dim: int, theta: float, scaling=None):
    """(hd/2,) float64 inverse frequencies theta^(-2m/hd), m < hd/2, on the
    host; with ``scaling`` = (factor, low_freq_factor, high_freq_factor,
    original context L), Llama 3's rule on each frequency's wavelength
    w = 2 pi / f: w < L / high_freq_factor (fast): f; w > L /
    low_freq_factor (slow): f / factor; between: (1 - s) f / factor + s f,
    s = (L / w - low_freq_factor) / (high_freq_factor - low_freq_factor),
    which meets the other two at the band's ends (s = 0 and s = 1). With
    ``scaling`` an ``ops.yarn.YarnScaling``: YaRN's frequencies."""
    if isinstance(scaling, YarnScaling):
        return yarn_inv_freq(head_dim, theta, scaling)
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)   # (hd/2,)
    if scaling is None:
        return inv_freq
    factor, low, high, context = scaling
    wavelen = 2 * np.pi / inv_freq                                                     # (hd/2,)
    s = (context / wavelen - low) / (high - low)                                      # (hd/2,) 1 fast, 0 slow
    blended = (1.0 - s) * inv_freq / factor + s * inv_freq
    slow = inv_freq / factor
    return np.where(wavelen < context / high, inv_freq, np.where(wavelen > context / low, slow, blended))


def rope_tables(positions, head_dim: int, theta: float, scaling=None):
    """(cos, sin), each (T, hd) float64 on the host, for the global
    ``positions`` (T,): angle[t, m] = pos[t] * inv_freq[m] for m < hd/2
    (``rope_inv_freq``), repeated over both halves (Hugging Face's layout);
    YaRN's tables are multiplied by its ``table_factor``."""
    inv_freq = rope_inv_freq(head_dim, theta, scaling)                                  # (hd/2,)
    angles = np.asarray(positions, dtype=np.float64)[:, None] * inv_freq[None, :]      # (T, hd/2)
    angles = np.concatenate([angles, angles], axis=1)                                   # (T, hd)
    if isinstance(scaling, YarnScaling) and scaling.table_factor != 1.0:
        return np.cos(angles) * scaling.table_factor, np.sin(angles) * scaling.table_factor
    return np.cos(angles), np.sin(angles)


def rotate_half(x):
    """x (..., hd) -> [-x2 | x1] (..., hd)."""
    xp = array_module(x)
    h = x.shape[-1] // 2
    return xp.concatenate([-x[..., h:], x[..., :h]], axis=-1)


def rope_forward(x, cos, sin):
    """x (B, T, nh, hd), cos/sin (T, hd) in x's format -> x cos + rotate_half(x) sin."""
    return x * cos[:, None, :] + rotate_half(x) * sin[:, None, :]


def rope_backward(dy, cos, sin):
    """dy (B, T, nh, hd) -> dx: the rotation's transpose, dy cos - rotate_half(dy sin)
    (rotate_half's transpose is its negative)."""
    return dy * cos[:, None, :] - rotate_half(dy * sin[:, None, :])


# --- SwiGLU --------------------------------------------------------------------
def swiglu_forward(f):
    """f (..., 2 F) as [gate | up] -> (y (..., F) = silu(gate) * up, saved)."""
    xp = array_module(f)
    F = f.shape[-1] // 2
    gate, upper = f[..., :F], f[..., F:]
    sig = 1.0 / (1.0 + xp.exp(-up(gate)))                             # (..., F) in float32 or wider
    silu = narrow(up(gate) * sig, f.dtype)
    return silu * upper, (gate, upper, narrow(sig, f.dtype), silu)


def swiglu_backward(dy, saved):
    """dy (..., F) -> df (..., 2 F) = [d gate | d up]."""
    xp = array_module(dy)
    gate, upper, sig, silu = saved
    dgate = dy * upper * sig * (1.0 + gate * (1.0 - sig))             # silu'(g) = s (1 + g (1 - s))
    return xp.concatenate([dgate, dy * silu], axis=-1)
