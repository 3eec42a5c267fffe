/* Causal attention within each sequence of a packed row (engine/packedattention.py), forward and backward.

   The packed row's sequences lie end to end; cu[s] .. cu[s + 1] are sequence s's tokens. A query sees the
   keys of its own sequence up to itself, the last `window` of them (window <= 0: all). Query head h reads
   key/value head h / (heads / kv_heads), as Hugging Face's repeat_kv lays them out. Each (sequence, key/value
   head) is one unit of work, its query heads in order, its query rows in chunks of CHUNK: scores, softmax
   and products of a chunk are small matmuls (MR x NR register tiles of fused multiply-adds) over the keys
   the chunk sees, so nothing is computed for padding and the upper triangle is skipped tile by tile. The
   backward recomputes the probabilities from the saved log-sum-exp (as flash attention does), so the
   forward keeps one float per query row and head. A unit's sums run in one order whatever the thread
   count; results differ from torch's scaled_dot_product_attention by rounding only. */
#include <stdint.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#include "simd.h"

#define MR 6     /* rows of a register tile */
#define NR 16    /* columns of a register tile: two vectors */
#define CHUNK 48 /* query rows whose scores are held at once */

static const int32_t lane_table[16] = {-1, -1, -1, -1, -1, -1, -1, -1, 0, 0, 0, 0, 0, 0, 0, 0};

static inline __m256i lanes(int n) { /* the first n lanes (0 <= n <= 8) */
  return _mm256_loadu_si256((const __m256i*)(lane_table + 8 - n));
}

/* C[r][c] (+)= sum over k in [k0, k1) of A[r][k] * B[k][c], r < rows <= MR, c < cols <= NR; A[r][k] at
   a[r * ars + k * aks], B[k][c] at b[k * brs + c], C[r][c] at c[r * crs + c]; added to C where `add`. */
static inline __attribute__((always_inline)) void tile(const float* a, long ars, long aks, const float* b,
                                                       long brs, long k0, long k1, float* c, long crs, int rows,
                                                       int cols, const int full, int add) {
  const float* ar[MR];
  for (int r = 0; r < MR; r++) ar[r] = a + (r < rows ? r : rows - 1) * ars;
  const __m256i m0 = lanes(cols < 8 ? cols : 8), m1 = lanes(cols > 8 ? cols - 8 : 0);
  __m256 acc[MR][2];
  for (int r = 0; r < MR; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  for (long k = k0; k < k1; k++) {
    const float* bk = b + k * brs;
    const __m256 b0 = full ? _mm256_loadu_ps(bk) : _mm256_maskload_ps(bk, m0);
    const __m256 b1 = full ? _mm256_loadu_ps(bk + 8) : _mm256_maskload_ps(bk + 8, m1);
    for (int r = 0; r < MR; r++) {
      const __m256 x = _mm256_broadcast_ss(ar[r] + k * aks);
      acc[r][0] = _mm256_fmadd_ps(x, b0, acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(x, b1, acc[r][1]);
    }
  }
  for (int r = 0; r < rows; r++) {
    float* cr = c + r * crs;
    if (full) {
      _mm256_storeu_ps(cr, add ? _mm256_add_ps(_mm256_loadu_ps(cr), acc[r][0]) : acc[r][0]);
      _mm256_storeu_ps(cr + 8, add ? _mm256_add_ps(_mm256_loadu_ps(cr + 8), acc[r][1]) : acc[r][1]);
    } else {
      _mm256_maskstore_ps(cr, m0, add ? _mm256_add_ps(_mm256_maskload_ps(cr, m0), acc[r][0]) : acc[r][0]);
      _mm256_maskstore_ps(cr + 8, m1, add ? _mm256_add_ps(_mm256_maskload_ps(cr + 8, m1), acc[r][1]) : acc[r][1]);
    }
  }
}

enum shape { FULL, LOWER_C, LOWER_A, UPPER_A };

/* C (m x n) = A (m x kdim) B (kdim x n), or C += A B where `add`; strides as for tile. Where the product
   is triangular (`off`: row r's diagonal is at column / k = r + off), the zero part is skipped: LOWER_C:
   only C[r][c] with c <= r + off is wanted (tiles wholly above are left as they were); LOWER_A: A[r][k] =
   0 for k > r + off; UPPER_A: A[r][k] = 0 for k < r + off (rows with no k left as they were). */
static void gemm(long m, long n, long kdim, const float* a, long ars, long aks, const float* b, long brs,
                 float* c, long crs, enum shape shape, long off, int add) {
  for (long r0 = 0; r0 < m; r0 += MR) {
    const int rows = m - r0 < MR ? (int)(m - r0) : MR;
    long k0 = 0, k1 = kdim;
    if (shape == LOWER_A && r0 + rows + off < k1) k1 = r0 + rows + off;
    if (shape == UPPER_A && r0 + off > 0) k0 = r0 + off;
    if (k1 <= k0) continue;
    for (long c0 = 0; c0 < n; c0 += NR) {
      if (shape == LOWER_C && c0 > r0 + rows - 1 + off) break;
      const int cols = n - c0 < NR ? (int)(n - c0) : NR;
      const float* ab = a + r0 * ars;
      float* cb = c + r0 * crs + c0;
      if (cols == NR)
        tile(ab, ars, aks, b + c0, brs, k0, k1, cb, crs, rows, NR, 1, add);
      else
        tile(ab, ars, aks, b + c0, brs, k0, k1, cb, crs, rows, cols, 0, add);
    }
  }
}

/* Where the pointers of one (sequence, key/value head, query head) lie; rows and keys count from the
   sequence's first token. q/k/v/out/dout: element (token t, dim i) at base[t * *_ts + i]. */
typedef struct {
  const float *q, *k, *v, *out, *dout;
  long q_ts, k_ts, v_ts, o_ts;
  float* lse;  /* one per query row */
  long n, d;
  float scale;
  long window; /* <= 0: none */
} unit;

static inline long first_key(const unit* u, long i) { /* the first key query i sees */
  return u->window > 0 && i - u->window + 1 > 0 ? i - u->window + 1 : 0;
}

static void transpose(const float* x, long ts, long n, long d, float* xt, long ldn) {
  for (long t = 0; t < n; t++)
    for (long i = 0; i < d; i++) xt[i * ldn + t] = x[t * ts + i];
}

/* The chunk's scores (rows x width, keys kbeg..; s rows of lds >= width rounded up to 8 floats) turned
   into probabilities in place: exp(scale s - lse) where lse is given (backward), else softmax, its lse
   written. Keys a query does not see get 0. */
static void probabilities(const unit* u, long i0, long rows, long kbeg, long width, const float* kt, long ldn,
                          float* s, long lds, int given) {
  gemm(rows, width, u->d, u->q + i0 * u->q_ts, u->q_ts, 1, kt + kbeg, ldn, s, lds, LOWER_C, i0 - kbeg, 0);
  const __m256 scale = _mm256_set1_ps(u->scale), lane = _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7);
  for (long r = 0; r < rows; r++) {
    const long i = i0 + r, lo = first_key(u, i) - kbeg, hi = i - kbeg + 1; /* visible: [lo, hi) */
    const long end = (hi + 7) / 8 * 8; /* lanes outside [lo, hi) are read (their tiles may not have been
                                          computed) but never used: masked, then set to 0 */
    float* sr = s + r * lds;
    const __m256 vlo = _mm256_set1_ps((float)lo), vhi = _mm256_set1_ps((float)hi);
#define VISIBLE(j) \
  _mm256_and_ps(_mm256_cmp_ps(_mm256_add_ps(_mm256_set1_ps((float)(j)), lane), vlo, _CMP_GE_OQ), \
                _mm256_cmp_ps(_mm256_add_ps(_mm256_set1_ps((float)(j)), lane), vhi, _CMP_LT_OQ))
    __m256 top = _mm256_set1_ps(-INFINITY);
    for (long j = lo / 8 * 8; j < end; j += 8) {
      const __m256 x = _mm256_mul_ps(_mm256_loadu_ps(sr + j), scale);
      _mm256_storeu_ps(sr + j, x);
      top = _mm256_max_ps(top, _mm256_blendv_ps(_mm256_set1_ps(-INFINITY), x, VISIBLE(j)));
    }
    __m128 t4 = _mm_max_ps(_mm256_castps256_ps128(top), _mm256_extractf128_ps(top, 1));
    t4 = _mm_max_ps(t4, _mm_movehl_ps(t4, t4));
    const float most = _mm_cvtss_f32(_mm_max_ss(t4, _mm_movehdup_ps(t4)));
    const __m256 shift = _mm256_set1_ps(given ? u->lse[i] : most);
    __m256 acc = _mm256_setzero_ps();
    for (long j = 0; j < end; j += 8) {
      const __m256 e = _mm256_blendv_ps(_mm256_setzero_ps(), exp8(_mm256_sub_ps(_mm256_loadu_ps(sr + j), shift)),
                                        VISIBLE(j));
      _mm256_storeu_ps(sr + j, e);
      acc = _mm256_add_ps(acc, e);
    }
#undef VISIBLE
    for (long j = end; j < width; j++) sr[j] = 0.0f;
    if (!given) {
      const float sum = hsum8(acc);
      const __m256 inv = _mm256_set1_ps(1.0f / sum);
      for (long j = lo / 8 * 8; j < end; j += 8) _mm256_storeu_ps(sr + j, _mm256_mul_ps(_mm256_loadu_ps(sr + j), inv));
      u->lse[i] = most + logf(sum);
    }
  }
}

static void forward_head(const unit* u, const float* kt, long ldn, float* s, float* out) {
  for (long i0 = 0; i0 < u->n; i0 += CHUNK) {
    const long rows = u->n - i0 < CHUNK ? u->n - i0 : CHUNK;
    const long kbeg = first_key(u, i0), width = i0 + rows - kbeg;
    probabilities(u, i0, rows, kbeg, width, kt, ldn, s, ldn, 0);
    gemm(rows, u->d, width, s, ldn, 1, u->v + kbeg * u->v_ts, u->v_ts, out + i0 * u->o_ts, u->o_ts, LOWER_A,
         i0 - kbeg, 0);
  }
}

/* dq (n x d, row stride dq_ts) written; dk, dv (n x d) added to. */
static void backward_head(const unit* u, const float* kt, const float* vt, long ldn, float* p, float* ds,
                          float* dq, long dq_ts, float* dk, long dk_ts, float* dv, long dv_ts) {
  for (long i0 = 0; i0 < u->n; i0 += CHUNK) {
    const long rows = u->n - i0 < CHUNK ? u->n - i0 : CHUNK;
    const long kbeg = first_key(u, i0), width = i0 + rows - kbeg, off = i0 - kbeg;
    probabilities(u, i0, rows, kbeg, width, kt, ldn, p, ldn, 1);
    const float* dout = u->dout + i0 * u->o_ts;
    gemm(rows, width, u->d, dout, u->o_ts, 1, vt + kbeg, ldn, ds, ldn, LOWER_C, off, 0); /* dP = dO V^T */
    const __m256 scale = _mm256_set1_ps(u->scale);
    for (long r = 0; r < rows; r++) { /* dS = P (dP - rowsum(dO o O)) scale, 0 where P is (never read dP) */
      const long i = i0 + r, end = (i - kbeg + 1 + 7) / 8 * 8;
      float* dr = ds + r * ldn;
      const float* pr = p + r * ldn;
      const __m256 dot = _mm256_set1_ps(dot_n(u->dout + i * u->o_ts, u->out + i * u->o_ts, u->d));
      for (long j = 0; j < end; j += 8) {
        const __m256 pj = _mm256_loadu_ps(pr + j);
        const __m256 x = _mm256_mul_ps(_mm256_mul_ps(pj, _mm256_sub_ps(_mm256_loadu_ps(dr + j), dot)), scale);
        const __m256 unseen = _mm256_cmp_ps(pj, _mm256_setzero_ps(), _CMP_EQ_OQ);
        _mm256_storeu_ps(dr + j, _mm256_blendv_ps(x, _mm256_setzero_ps(), unseen));
      }
      for (long j = end; j < width; j++) dr[j] = 0.0f;
    }
    gemm(rows, u->d, width, ds, ldn, 1, u->k + kbeg * u->k_ts, u->k_ts, dq + i0 * dq_ts, dq_ts, LOWER_A, off,
         0); /* dQ = dS K */
    gemm(width, u->d, rows, ds, 1, ldn, u->q + i0 * u->q_ts, u->q_ts, dk + kbeg * dk_ts, dk_ts, UPPER_A, -off,
         1); /* dK += dS^T Q */
    gemm(width, u->d, rows, p, 1, ldn, dout, u->o_ts, dv + kbeg * dv_ts, dv_ts, UPPER_A, -off, 1); /* dV += P^T dO */
  }
}

/* Strides, in floats, of one tensor in the packed layout: element (head h, token t, dim i) at
   base[h * hs + t * ts + i]. */
typedef struct {
  long hs, ts;
} strides;

static unit unit_of(const float* q, strides qs, const float* k, strides ks, const float* v, strides vs,
                    const float* out, const float* dout, strides os, float* lse, long total, long h, long hk,
                    long start, long n, long d, float scale, long window) {
  unit u = {q + h * qs.hs + start * qs.ts,   k + hk * ks.hs + start * ks.ts, v + hk * vs.hs + start * vs.ts,
            out + h * os.hs + start * os.ts, dout ? dout + h * os.hs + start * os.ts : 0,
            qs.ts, ks.ts, vs.ts, os.ts, lse + h * total + start, n, d, scale, window};
  return u;
}

/* Floats of scratch each thread needs for sequences up to `longest` tokens. */
long gpufleet_attention_scratch(long d, long longest) {
  const long ldn = (longest + 7) / 8 * 8;
  return 2 * d * ldn + 2 * CHUNK * ldn;
}

static float* thread_scratch(float* scratch, long d, long longest) {
#ifdef _OPENMP
  return scratch + omp_get_thread_num() * gpufleet_attention_scratch(d, longest);
#else
  return scratch;
#endif
}

/* Every (sequence, key/value head) unit, forward (dout == 0: out and lse written) or backward (dq, dk, dv
   written); st: head and token strides of q, k, v, out (and dout), dq, dk, dv. */
static void each_unit(const float* q, const float* k, const float* v, float* out, const float* dout, float* lse,
                      const int32_t* cu, long sequences, long heads, long kv_heads, long d, const long* st,
                      float scale, long window, float* dq, float* dk, float* dv, long longest, float* scratch,
                      int threads) {
  const strides qs = {st[0], st[1]}, ks = {st[2], st[3]}, vs = {st[4], st[5]}, os = {st[6], st[7]};
  const long total = cu[sequences], group = heads / kv_heads;
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads) if (threads > 1)
  for (long w = 0; w < sequences * kv_heads; w++) {
    const long s = w / kv_heads, hk = w % kv_heads, start = cu[s], n = cu[s + 1] - cu[s];
    if (n <= 0) continue;
    const long ldn = (n + 7) / 8 * 8;
    float *kt = thread_scratch(scratch, d, longest), *vt = kt + d * ldn, *p = vt + d * ldn, *ds = p + CHUNK * ldn;
    transpose(k + hk * ks.hs + start * ks.ts, ks.ts, n, d, kt, ldn);
    float *dkh = 0, *dvh = 0;
    if (dout) {
      transpose(v + hk * vs.hs + start * vs.ts, vs.ts, n, d, vt, ldn);
      dkh = dk + hk * st[10] + start * st[11], dvh = dv + hk * st[12] + start * st[13];
      for (long t = 0; t < n; t++) {
        memset(dkh + t * st[11], 0, d * sizeof(float));
        memset(dvh + t * st[13], 0, d * sizeof(float));
      }
    }
    for (long h = hk * group; h < (hk + 1) * group; h++) {
      unit u = unit_of(q, qs, k, ks, v, vs, out, dout, os, lse, total, h, hk, start, n, d, scale, window);
      if (dout)
        backward_head(&u, kt, vt, ldn, p, ds, dq + h * st[8] + start * st[9], st[9], dkh, st[11], dvh, st[13]);
      else
        forward_head(&u, kt, ldn, p, out + h * os.hs + start * os.ts);
    }
  }
}

/* q (heads, total, d), k and v (kv_heads, total, d), out (heads, total, d): any strides with the last
   dimension contiguous (st: head and token strides of q, k, v, out); lse (heads, total) contiguous,
   written; scratch: gpufleet_attention_scratch(d, longest) floats for each thread. */
void gpufleet_attention_forward(const float* q, const float* k, const float* v, const int32_t* cu, long sequences,
                                long heads, long kv_heads, long d, const long* st, float scale, long window,
                                float* out, float* lse, long longest, float* scratch, int threads) {
  each_unit(q, k, v, out, 0, lse, cu, sequences, heads, kv_heads, d, st, scale, window, 0, 0, 0, longest, scratch,
            threads);
}

/* As the forward, with dout like out (st[6..7] its strides too); dq like q, dk and dv like k and v, written
   (st[8..13]: their head and token strides). */
void gpufleet_attention_backward(const float* q, const float* k, const float* v, const float* out,
                                 const float* dout, const float* lse, const int32_t* cu, long sequences, long heads,
                                 long kv_heads, long d, const long* st, float scale, long window, float* dq,
                                 float* dk, float* dv, long longest, float* scratch, int threads) {
  each_unit(q, k, v, (float*)out, dout, (float*)lse, cu, sequences, heads, kv_heads, d, st, scale, window, dq, dk, dv,
            longest, scratch, threads);
}
