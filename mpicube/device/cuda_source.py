"""The CUDA C++ source of mpicube's GPU kernels, compiled by mpicube.device.cuda_kernels.

One translation unit, compiled once per storage type: ``scalar_t`` is float
or double and ``acc_t`` is the type that row sums accumulate in (double for
both: these kernels are bound by memory traffic, so the wider adds cost
nothing that shows, and the sums then match mpicube.device.fused's, which also
accumulate in float64; 16-bit storage would use float).

Why it is written the way it is:
- No includes and nothing NVRTC lacks, so tests/cuda_emu.py can compile the
  same text with g++ against a small emulation of the CUDA built-ins
  (threads, ``__syncthreads``, warp shuffles) and run it on a CPU: the
  kernels' index arithmetic and reductions are tested without a GPU.
- Every kernel is ``extern "C"`` (unmangled names for RawModule.get_function)
  and loops grid-stride, so any grid size is correct; the launcher caps it.
- Row kernels give a block to a row; blockDim is a multiple of 32 (at most
  1024). A block reduction is a warp xor-butterfly, then every thread adds
  the per-warp partials in warp order: a fixed order, so sums are the same
  bit for bit on every run.
- Elementwise chains follow the association order of the NumPy/CuPy array
  path in mpicube.ops, so they differ from it only by contractions into
  fused multiply-adds and by tanh/exp implementations.
- Nothing is atomic: the embedding gradient sums each run of equal rows in
  one thread, in the order the caller sorted them.
"""

from __future__ import annotations

import math

import numpy as np

_GELU_C = 0.044715
_GELU_S = math.sqrt(2.0 / math.pi)

# The constants are pasted as Python reprs of the float64 values the array
# path uses (repr round-trips exactly), then cast to scalar_t, just as the
# array path casts its Python scalars to the arrays' dtype.
_CONSTANTS = {
    "@GELU_C@": repr(_GELU_C),
    "@GELU_S@": repr(_GELU_S),
    "@GELU_C3@": repr(3 * _GELU_C),
    "@GELU_S_HALF@": repr(_GELU_S * 0.5),
    "@TWO_POW_M53@": repr(2.0 ** -53),
}

_TYPES = {"float32": ("float", "double"), "float64": ("double", "double")}

SOURCE = r"""
typedef @SCALAR@ scalar_t;   // storage
typedef @ACC@ acc_t;         // row sums

__device__ __forceinline__ float math_exp(float x) { return expf(x); }
__device__ __forceinline__ double math_exp(double x) { return exp(x); }
__device__ __forceinline__ float math_tanh(float x) { return tanhf(x); }
__device__ __forceinline__ double math_tanh(double x) { return tanh(x); }
__device__ __forceinline__ float math_sqrt(float x) { return sqrtf(x); }
__device__ __forceinline__ double math_sqrt(double x) { return sqrt(x); }

// max that lets a NaN through, as the array path's max does
template <typename V>
__device__ __forceinline__ V max_nan(V a, V b) { return (b > a || b != b) ? b : a; }

// Every lane ends with the same value: lanes l and l^offset combine the same
// two operands, and IEEE addition is commutative bit for bit.
template <typename V>
__device__ __forceinline__ V warp_sum(V v) {
    for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
    return v;
}

template <typename V>
__device__ __forceinline__ V warp_max(V v) {
    for (int offset = 16; offset > 0; offset >>= 1) v = max_nan(v, __shfl_xor_sync(0xffffffffu, v, offset));
    return v;
}

// Reduce over the whole block; every thread returns the result.
// partial: __shared__ V[32], free again when this returns.
template <typename V>
__device__ V block_sum(V v, V* partial) {
    v = warp_sum(v);
    if ((threadIdx.x & 31) == 0) partial[threadIdx.x >> 5] = v;
    __syncthreads();
    V total = partial[0];
    for (unsigned w = 1; w < (blockDim.x >> 5); ++w) total += partial[w];
    __syncthreads();
    return total;
}

template <typename V>
__device__ V block_max(V v, V* partial) {
    v = warp_max(v);
    if ((threadIdx.x & 31) == 0) partial[threadIdx.x >> 5] = v;
    __syncthreads();
    V top = partial[0];
    for (unsigned w = 1; w < (blockDim.x >> 5); ++w) top = max_nan(top, partial[w]);
    __syncthreads();
    return top;
}

// ---- LayerNorm, in the stages between its all-reduces: rows of `width` -------------

// out[r] = sum_c x[r, c]
extern "C" __global__ void row_sums(const scalar_t* x, scalar_t* out, long long rows, long long width) {
    __shared__ acc_t partial[32];
    for (long long r = blockIdx.x; r < rows; r += gridDim.x) {
        acc_t acc = 0;
        for (long long c = threadIdx.x; c < width; c += blockDim.x) acc += (acc_t)x[r * width + c];
        acc = block_sum(acc, partial);
        if (threadIdx.x == 0) out[r] = (scalar_t)acc;
    }
}

// xc = x - mean[r]; sumsq[r] = sum_c xc^2
extern "C" __global__ void center_rows(const scalar_t* x, const scalar_t* mean, scalar_t* xc, scalar_t* sumsq,
                                       long long rows, long long width) {
    __shared__ acc_t partial[32];
    for (long long r = blockIdx.x; r < rows; r += gridDim.x) {
        const scalar_t mu = mean[r];
        acc_t acc = 0;
        for (long long c = threadIdx.x; c < width; c += blockDim.x) {
            const scalar_t d = x[r * width + c] - mu;
            xc[r * width + c] = d;
            acc += (acc_t)d * (acc_t)d;
        }
        acc = block_sum(acc, partial);
        if (threadIdx.x == 0) sumsq[r] = (scalar_t)acc;
    }
}

// xhat *= rstd[r] (in place); y = xhat gamma + beta
extern "C" __global__ void normalize_rows(scalar_t* xhat, const scalar_t* rstd, const scalar_t* gamma,
                                          const scalar_t* beta, scalar_t* y, long long rows, long long width) {
    for (long long r = blockIdx.x; r < rows; r += gridDim.x) {
        const scalar_t s = rstd[r];
        for (long long c = threadIdx.x; c < width; c += blockDim.x) {
            const scalar_t h = xhat[r * width + c] * s;
            xhat[r * width + c] = h;
            y[r * width + c] = h * gamma[c] + beta[c];
        }
    }
}

// sums[r] = (sum_c dy gamma, sum_c dy gamma xhat); sums is (rows, 2)
extern "C" __global__ void layernorm_grad_sums(const scalar_t* dy, const scalar_t* gamma, const scalar_t* xhat,
                                               scalar_t* sums, long long rows, long long width) {
    __shared__ acc_t partial[32];
    for (long long r = blockIdx.x; r < rows; r += gridDim.x) {
        acc_t s0 = 0, s1 = 0;
        for (long long c = threadIdx.x; c < width; c += blockDim.x) {
            const scalar_t g = dy[r * width + c] * gamma[c];
            s0 += (acc_t)g;
            s1 += (acc_t)g * (acc_t)xhat[r * width + c];
        }
        s0 = block_sum(s0, partial);
        s1 = block_sum(s1, partial);
        if (threadIdx.x == 0) {
            sums[2 * r] = (scalar_t)s0;
            sums[2 * r + 1] = (scalar_t)s1;
        }
    }
}

// dx = (dy gamma - means[r, 0] - xhat means[r, 1]) rstd[r]; means is (rows, 2)
extern "C" __global__ void layernorm_grad_input(const scalar_t* dy, const scalar_t* gamma, const scalar_t* xhat,
                                                const scalar_t* rstd, const scalar_t* means, scalar_t* dx,
                                                long long rows, long long width) {
    for (long long r = blockIdx.x; r < rows; r += gridDim.x) {
        const scalar_t m0 = means[2 * r], m1 = means[2 * r + 1], s = rstd[r];
        for (long long c = threadIdx.x; c < width; c += blockDim.x) {
            const long long i = r * width + c;
            dx[i] = (dy[i] * gamma[c] - m0 - xhat[i] * m1) * s;
        }
    }
}

// ---- causal softmax over (M, T, T): row r is query position r % T ------------------
// Columns 0..i are kept, the rest become 0 without being read.

extern "C" __global__ void softmax_causal(scalar_t* s, long long rows, long long width) {
    __shared__ scalar_t tops[32];
    __shared__ acc_t partial[32];
    for (long long r = blockIdx.x; r < rows; r += gridDim.x) {
        scalar_t* row = s + r * width;
        const long long last = r % width;
        scalar_t top = row[0];
        for (long long j = threadIdx.x; j <= last; j += blockDim.x) top = max_nan(top, row[j]);
        top = block_max(top, tops);
        acc_t total = 0;
        for (long long j = threadIdx.x; j <= last; j += blockDim.x) {
            const scalar_t e = math_exp(row[j] - top);
            row[j] = e;
            total += (acc_t)e;
        }
        const acc_t inv = (acc_t)1 / block_sum(total, partial);
        for (long long j = threadIdx.x; j <= last; j += blockDim.x) row[j] = (scalar_t)((acc_t)row[j] * inv);
        for (long long j = last + 1 + threadIdx.x; j < width; j += blockDim.x) row[j] = (scalar_t)0;
    }
}

// d <- p (d - sum_j d p) on the causal part, 0 above it (d: gradient w.r.t. p, in place)
extern "C" __global__ void softmax_causal_backward(scalar_t* d, const scalar_t* p, long long rows, long long width) {
    __shared__ acc_t partial[32];
    for (long long r = blockIdx.x; r < rows; r += gridDim.x) {
        scalar_t* drow = d + r * width;
        const scalar_t* prow = p + r * width;
        const long long last = r % width;
        acc_t dot = 0;
        for (long long j = threadIdx.x; j <= last; j += blockDim.x) dot += (acc_t)drow[j] * (acc_t)prow[j];
        dot = block_sum(dot, partial);
        for (long long j = threadIdx.x; j <= last; j += blockDim.x)
            drow[j] = (scalar_t)((acc_t)prow[j] * ((acc_t)drow[j] - dot));
        for (long long j = last + 1 + threadIdx.x; j < width; j += blockDim.x) drow[j] = (scalar_t)0;
    }
}

// ---- softmax cross-entropy over a vocabulary block: columns >= n_real are padding --

// out[r] = max over real columns (lowest, i.e. -inf, if there are none)
extern "C" __global__ void masked_row_max(const scalar_t* z, scalar_t* out, long long rows, long long width,
                                          long long n_real, scalar_t lowest) {
    __shared__ scalar_t tops[32];
    for (long long r = blockIdx.x; r < rows; r += gridDim.x) {
        scalar_t top = lowest;
        for (long long c = threadIdx.x; c < n_real; c += blockDim.x) top = max_nan(top, z[r * width + c]);
        top = block_max(top, tops);
        if (threadIdx.x == 0) out[r] = top;
    }
}

// probs = exp(z - row_max[r]) on real columns, 0 on padding; sum_exp[r] = row sum
extern "C" __global__ void exp_rows(const scalar_t* z, const scalar_t* row_max, scalar_t* probs, scalar_t* sum_exp,
                                    long long rows, long long width, long long n_real) {
    __shared__ acc_t partial[32];
    for (long long r = blockIdx.x; r < rows; r += gridDim.x) {
        const scalar_t top = row_max[r];
        acc_t total = 0;
        for (long long c = threadIdx.x; c < n_real; c += blockDim.x) {
            const scalar_t e = math_exp(z[r * width + c] - top);
            probs[r * width + c] = e;
            total += (acc_t)e;
        }
        for (long long c = n_real + threadIdx.x; c < width; c += blockDim.x) probs[r * width + c] = (scalar_t)0;
        total = block_sum(total, partial);
        if (threadIdx.x == 0) sum_exp[r] = (scalar_t)total;
    }
}

// ---- embedding gradient, deterministic: target[row] += values[i] ------------------
// sorted_rows[q] = rows[order[q]], sorted by (row, i); rows outside [0, vocab)
// are skipped. Block q works only if q starts a run of equal rows; it then
// adds the run's values in that order, one column per thread: no atomics.

extern "C" __global__ void scatter_add_rows(scalar_t* target, const scalar_t* values, const long long* order,
                                            const long long* sorted_rows, long long n, long long width,
                                            long long vocab) {
    for (long long q = blockIdx.x; q < n; q += gridDim.x) {
        const long long row = sorted_rows[q];
        if ((q > 0 && sorted_rows[q - 1] == row) || row < 0 || row >= vocab) continue;
        for (long long c = threadIdx.x; c < width; c += blockDim.x) {
            scalar_t acc = target[row * width + c];
            for (long long k = q; k < n && sorted_rows[k] == row; ++k) acc += values[order[k] * width + c];
            target[row * width + c] = acc;
        }
    }
}

// ---- elementwise ---------------------------------------------------------------------

// t = tanh(s (x + 0.044715 x^3)), y = 0.5 x (1 + t)
extern "C" __global__ void gelu_forward(const scalar_t* x, scalar_t* t, scalar_t* y, long long n) {
    const scalar_t c = (scalar_t)@GELU_C@, s = (scalar_t)@GELU_S@;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
        const scalar_t a = x[i];
        const scalar_t th = math_tanh((a * a * c + (scalar_t)1) * a * s);
        t[i] = th;
        y[i] = (th + (scalar_t)1) * a * (scalar_t)0.5;
    }
}

// dx = dy (0.5 (1 + t) + 0.5 x (1 - t^2) s (1 + 3 * 0.044715 x^2))
extern "C" __global__ void gelu_backward(const scalar_t* dy, const scalar_t* x, const scalar_t* t, scalar_t* dx,
                                         long long n) {
    const scalar_t c3 = (scalar_t)@GELU_C3@, s_half = (scalar_t)@GELU_S_HALF@;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
        const scalar_t a = x[i], th = t[i];
        const scalar_t w = (a * a * c3 + (scalar_t)1) * a * s_half;
        dx[i] = ((((scalar_t)1 - th * th) * w + (scalar_t)0.5) + th * (scalar_t)0.5) * dy[i];
    }
}

// one AdamW update: g * grad_scale feeds m and v; p <- keep p - step m / (sqrt(v) + eps)
extern "C" __global__ void adamw(scalar_t* p, const scalar_t* g, scalar_t* m, scalar_t* v, scalar_t b1,
                                 scalar_t one_minus_b1, scalar_t b2, scalar_t one_minus_b2, scalar_t step,
                                 scalar_t eps, scalar_t keep, scalar_t grad_scale, long long n) {
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
        const scalar_t gi = g[i] * grad_scale;
        const scalar_t mi = b1 * m[i] + one_minus_b1 * gi;
        const scalar_t vi = b2 * v[i] + one_minus_b2 * gi * gi;
        m[i] = mi;
        v[i] = vi;
        p[i] = keep * p[i] - step * mi / (math_sqrt(vi) + eps);
    }
}

// out = 1 where uniform(key, counter) >= p else 0; uniform is mpicube.ops.rng's:
// the SplitMix64 finaliser of counter * golden + key (wrapping), top 53 bits / 2^53.
// The counter of element i of the (n0, n1, n2, n3) block is t0[i0] + t1[i1] + t2[i2]
// + t3[i3] (wrapping), t_d the global index along d times its stride: no counter array.
extern "C" __global__ void dropout_keep(const unsigned long long* t0, const unsigned long long* t1,
                                        const unsigned long long* t2, const unsigned long long* t3,
                                        scalar_t* out, unsigned long long key, double p,
                                        long long n1, long long n2, long long n3, long long n) {
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
        const long long i3 = i % n3, r3 = i / n3;
        const long long i2 = r3 % n2, r2 = r3 / n2;
        const long long i1 = r2 % n1, i0 = r2 / n1;
        unsigned long long x = (t0[i0] + t1[i1] + t2[i2] + t3[i3]) * 0x9E3779B97F4A7C15ull + key;
        x ^= x >> 30;
        x *= 0xBF58476D1CE4E5B9ull;
        x ^= x >> 27;
        x *= 0x94D049BB133111EBull;
        x ^= x >> 31;
        const double u = (double)(x >> 11) * @TWO_POW_M53@;
        out[i] = u >= p ? (scalar_t)1 : (scalar_t)0;
    }
}
"""


def source(dtype) -> str:
    """The kernels' source for storage dtype float32 or float64."""
    scalar, acc = _TYPES[np.dtype(dtype).name]
    text = SOURCE.replace("@SCALAR@", scalar).replace("@ACC@", acc)
    for token, value in _CONSTANTS.items():
        text = text.replace(token, value)
    return text
