/* The CPU training forward's RMSNorm, SwiGLU and RoPE, forward and backward (engine/fusedlayers.py). */
#include "simd.h"

/* ---- RMSNorm and SwiGLU ------------------------------------------------------------------------------
   One pass over memory each where torch's autograd makes five to ten. Elementwise results do not depend
   on the thread count; the weight gradient of the norm is summed in blocks of NORM_BLOCK rows, each
   block in row order, then the blocks in order, whatever the thread count. */
#define NORM_BLOCK 32

/* out = weight * (x * rstd) with rstd = 1 / sqrt(mean(x^2) + eps) per row of n values (kept in rstd). */
void gpufleet_rms_forward(const float* x, const float* weight, float eps, long rows, long n, float* out,
                          float* rstd, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1 && rows * n >= 65536)
  for (long r = 0; r < rows; r++) {
    const float* xr = x + r * n;
    float* o = out + r * n;
    const float s = 1.0f / sqrtf(dot_n(xr, xr, n) / (float)n + eps);
    rstd[r] = s;
    for (long i = 0; i < n; i++) o[i] = weight[i] * (xr[i] * s);
  }
}

/* gx = rstd * (weight * gy - xhat * mean(weight * gy * xhat)), xhat = x * rstd; with gw != NULL also
   gw = sum over rows of gy * xhat (partial: ceil(rows / NORM_BLOCK) x n scratch floats). */
void gpufleet_rms_backward(const float* x, const float* weight, const float* rstd, const float* gy, long rows,
                           long n, float* gx, float* gw, float* partial, int threads) {
  const long blocks = (rows + NORM_BLOCK - 1) / NORM_BLOCK;
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1 && rows * n >= 65536)
  for (long b = 0; b < blocks; b++) {
    float* part = gw ? partial + b * n : 0;
    if (part)
      for (long i = 0; i < n; i++) part[i] = 0.0f;
    for (long r = b * NORM_BLOCK; r < rows && r < (b + 1) * NORM_BLOCK; r++) {
      const float *xr = x + r * n, *g = gy + r * n, s = rstd[r];
      float* o = gx + r * n;
      __m256 acc = _mm256_setzero_ps();
      long i = 0;
      for (; i + 8 <= n; i += 8) {
        __m256 wg = _mm256_mul_ps(_mm256_loadu_ps(weight + i), _mm256_loadu_ps(g + i));
        acc = _mm256_fmadd_ps(wg, _mm256_loadu_ps(xr + i), acc);
      }
      float sum = hsum8(acc);
      for (; i < n; i++) sum += weight[i] * g[i] * xr[i];
      const float mean = sum * s / (float)n;
      for (long i = 0; i < n; i++) {
        const float xhat = xr[i] * s;
        o[i] = s * (weight[i] * g[i] - xhat * mean);
        if (part) part[i] += g[i] * xhat;
      }
    }
  }
  if (gw)
    for (long i = 0; i < n; i++) {
      float sum = 0.0f;
      for (long b = 0; b < blocks; b++) sum += partial[b * n + i];
      gw[i] = sum;
    }
}

/* h = silu(g) * u = g / (1 + exp(-g)) * u over `count` values. */
void gpufleet_swiglu_forward(const float* g, const float* u, long count, float* h, int threads) {
  const long vectors = count / 8;
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1 && count >= 65536)
  for (long v = 0; v < vectors; v++) {
    __m256 x = _mm256_loadu_ps(g + v * 8);
    __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), x));
    __m256 silu = _mm256_div_ps(x, _mm256_add_ps(_mm256_set1_ps(1.0f), e));
    _mm256_storeu_ps(h + v * 8, _mm256_mul_ps(silu, _mm256_loadu_ps(u + v * 8)));
  }
  for (long i = vectors * 8; i < count; i++) h[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
}

/* With s = sigmoid(g): gu = gh * g * s, gg = gh * u * s * (1 + g * (1 - s)) (torch's silu_backward). */
void gpufleet_swiglu_backward(const float* g, const float* u, const float* gh, long count, float* gg, float* gu,
                              int threads) {
  const long vectors = count / 8;
  const __m256 one = _mm256_set1_ps(1.0f);
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1 && count >= 65536)
  for (long v = 0; v < vectors; v++) {
    __m256 x = _mm256_loadu_ps(g + v * 8), d = _mm256_loadu_ps(gh + v * 8);
    __m256 s = _mm256_div_ps(one, _mm256_add_ps(one, exp8(_mm256_sub_ps(_mm256_setzero_ps(), x))));
    _mm256_storeu_ps(gu + v * 8, _mm256_mul_ps(_mm256_mul_ps(d, x), s));
    __m256 ds = _mm256_mul_ps(_mm256_mul_ps(d, _mm256_loadu_ps(u + v * 8)), s);
    _mm256_storeu_ps(gg + v * 8, _mm256_mul_ps(ds, _mm256_fmadd_ps(x, _mm256_sub_ps(one, s), one)));
  }
  for (long i = vectors * 8; i < count; i++) {
    const float s = 1.0f / (1.0f + expf(-g[i]));
    gu[i] = gh[i] * g[i] * s;
    gg[i] = gh[i] * u[i] * s * (1.0f + g[i] * (1.0f - s));
  }
}

/* ---- RoPE: x * cos + rotate_half(x) * sin, rotate_half(x) = cat(-x2, x1) ----------------------------
   x (B, T, H, D) -> out (B, H, T, D) (the layout attention takes, so the transpose costs nothing); cos, sin
   (B, T, D), or (1, T, D) shared by the rows (cs_batch: the batch stride of cos and sin, 0 then). Each
   output is two rounded products and one rounded sum, in torch's order (no fused multiply-add): the
   same bits as the Hugging Face code. The backward is its transpose: g (B, H, T, D) -> gx (B, T, H, D),
   gx = g * cos + rotate_half^T(g * sin), again two products and one sum, as torch's autograd sums them. */
#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")
/* (clang contracts only within one source expression, and these are separate statements or intrinsics) */

static void rope_row(const float* x, const float* c, const float* s, int d, int sign, float* out) {
  /* sign 1: forward (out = x c + rot(x) s); -1: backward (out = x c + rot^T(x s)) */
  const int half = d / 2;
  int i = 0;
  if (half % 8 == 0) {
    for (; i < half; i += 8) {
      __m256 lo = _mm256_loadu_ps(x + i), hi = _mm256_loadu_ps(x + i + half);
      __m256 c_lo = _mm256_loadu_ps(c + i), c_hi = _mm256_loadu_ps(c + i + half);
      __m256 s_lo = _mm256_loadu_ps(s + i), s_hi = _mm256_loadu_ps(s + i + half);
      __m256 neg = _mm256_set1_ps(-0.0f);
      __m256 a, b;
      if (sign > 0) { /* out_lo = lo c + (-hi) s; out_hi = hi c + lo s */
        a = _mm256_add_ps(_mm256_mul_ps(lo, c_lo), _mm256_mul_ps(_mm256_xor_ps(hi, neg), s_lo));
        b = _mm256_add_ps(_mm256_mul_ps(hi, c_hi), _mm256_mul_ps(lo, s_hi));
      } else { /* gx_lo = g_lo c + g_hi s; gx_hi = g_hi c + -(g_lo s) */
        a = _mm256_add_ps(_mm256_mul_ps(lo, c_lo), _mm256_mul_ps(hi, s_hi));
        b = _mm256_add_ps(_mm256_mul_ps(hi, c_hi), _mm256_xor_ps(_mm256_mul_ps(lo, s_lo), neg));
      }
      _mm256_storeu_ps(out + i, a);
      _mm256_storeu_ps(out + i + half, b);
    }
    return;
  }
  for (; i < half; i++) {
    const float lo = x[i], hi = x[i + half];
    float p, q;
    if (sign > 0) {
      p = lo * c[i];
      q = -hi * s[i];
      out[i] = p + q;
      p = hi * c[i + half];
      q = lo * s[i + half];
      out[i + half] = p + q;
    } else {
      p = lo * c[i];
      q = hi * s[i + half];
      out[i] = p + q;
      p = hi * c[i + half];
      q = -(lo * s[i]);
      out[i + half] = p + q;
    }
  }
}

static void rope(const float* x, const float* cos, const float* sin, long cs_batch, long batch, long tokens,
                 long heads, int d, float* out, int threads, int backward) {
  /* forward: x in (B, T, H, D), out in (B, H, T, D); backward: x in (B, H, T, D), out in (B, T, H, D) */
#pragma omp parallel for collapse(2) num_threads(threads) schedule(static) if (threads > 1 && batch * tokens * heads * d >= 65536)
  for (long b = 0; b < batch; b++)
    for (long h = 0; h < heads; h++)
      for (long t = 0; t < tokens; t++) {
        const long bthd = ((b * tokens + t) * heads + h) * d, bhtd = ((b * heads + h) * tokens + t) * d;
        const float *c = cos + b * cs_batch + t * d, *s = sin + b * cs_batch + t * d;
        if (backward)
          rope_row(x + bhtd, c, s, d, -1, out + bthd);
        else
          rope_row(x + bthd, c, s, d, 1, out + bhtd);
      }
}
#pragma GCC pop_options

void gpufleet_rope_forward(const float* x, const float* cos, const float* sin, long cs_batch, long batch,
                           long tokens, long heads, int d, float* out, int threads) {
  rope(x, cos, sin, cs_batch, batch, tokens, heads, d, out, threads, 0);
}

void gpufleet_rope_backward(const float* g, const float* cos, const float* sin, long cs_batch, long batch,
                            long tokens, long heads, int d, float* gx, int threads) {
  rope(g, cos, sin, cs_batch, batch, tokens, heads, d, gx, threads, 1);
}
