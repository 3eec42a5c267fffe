/* out (M x 16*N16, row stride ldc) = x (M x K, row stride ldx) @ W (+ bias), float32, x86-64 AVX2 + FMA.

   A decode step multiplies a few rows (one per sequence) by every weight of the model, so each weight is
   read from memory once per step and used for only M rows: a general GEMM (MKL, OpenBLAS) spends much
   of that step re-packing the weight and waiting for it. Here the weight is packed once per rollout
   (engine/cpu_kernels.py: W (K x N) as N16 panels of 16 columns, P[n][k][0..15], zero-padded past N), and a
   panel (K x 16) is streamed in order, prefetched 16 KiB ahead, and used from L1 by every block of rows:
   up to 6 rows x 16 columns of accumulators (12 ymm registers). A block of r rows is r x 2 chains of
   fused multiply-adds: below 4 rows the chains' latency, not the FMA units, bounds its time, so where 6-row
   blocks would leave 1-3 rows the rows are split evenly instead (13 rows as 5 + 4 + 4 took 0.88x the time
   of 6 + 6 + 1, 7 rows as 4 + 3 0.90x of 6 + 1; 16 rows stay 6 + 6 + 4, 5% faster than 6 + 5 + 5).

   Every output element is one sequential fused multiply-add sum over k (then + bias), computed by one
   thread: the result does not depend on the thread count or on the other rows. OpenMP threads (the
   caller passes torch's thread count) split the panels. */
#include "simd.h"

#ifndef PREFETCH_FLOATS
#define PREFETCH_FLOATS 4096
#endif

#define DECL(r) __m256 a##r = _mm256_setzero_ps(), b##r = a##r;
#define FMA(r)                                                  \
  {                                                             \
    __m256 xr = _mm256_broadcast_ss(x + (long)(r) * ldx + k); \
    a##r = _mm256_fmadd_ps(xr, w0, a##r);                       \
    b##r = _mm256_fmadd_ps(xr, w1, b##r);                       \
  }
#define STORE(r)                                     \
  {                                                  \
    if (bias) {                                      \
      a##r = _mm256_add_ps(a##r, c0);                \
      b##r = _mm256_add_ps(b##r, c1);                \
    }                                                \
    _mm256_storeu_ps(out + (long)(r) * ldc, a##r);     \
    _mm256_storeu_ps(out + (long)(r) * ldc + 8, b##r); \
  }
#define BLOCK(name, DECLS, FMAS, STORES)                                                          \
  static void name(int K, const float* x, long ldx, const float* p, const float* bias, float* out, \
                   long ldc) {                                                                    \
    DECLS                                                                                         \
    for (int k = 0; k < K; k++) {                                                                 \
      __builtin_prefetch(p + (long)k * 16 + PREFETCH_FLOATS);                                     \
      __m256 w0 = _mm256_loadu_ps(p + (long)k * 16), w1 = _mm256_loadu_ps(p + (long)k * 16 + 8);  \
      FMAS                                                                                        \
    }                                                                                             \
    __m256 c0 = _mm256_setzero_ps(), c1 = c0;                                                     \
    if (bias) {                                                                                   \
      c0 = _mm256_loadu_ps(bias);                                                                 \
      c1 = _mm256_loadu_ps(bias + 8);                                                             \
    }                                                                                             \
    STORES                                                                                        \
  }

BLOCK(rows1, DECL(0), FMA(0), STORE(0))
BLOCK(rows2, DECL(0) DECL(1), FMA(0) FMA(1), STORE(0) STORE(1))
BLOCK(rows3, DECL(0) DECL(1) DECL(2), FMA(0) FMA(1) FMA(2), STORE(0) STORE(1) STORE(2))
BLOCK(rows4, DECL(0) DECL(1) DECL(2) DECL(3), FMA(0) FMA(1) FMA(2) FMA(3),
      STORE(0) STORE(1) STORE(2) STORE(3))
BLOCK(rows5, DECL(0) DECL(1) DECL(2) DECL(3) DECL(4), FMA(0) FMA(1) FMA(2) FMA(3) FMA(4),
      STORE(0) STORE(1) STORE(2) STORE(3) STORE(4))
BLOCK(rows6, DECL(0) DECL(1) DECL(2) DECL(3) DECL(4) DECL(5),
      FMA(0) FMA(1) FMA(2) FMA(3) FMA(4) FMA(5),
      STORE(0) STORE(1) STORE(2) STORE(3) STORE(4) STORE(5))

typedef void (*block_fn)(int, const float*, long, const float*, const float*, float*, long);
static const block_fn BLOCKS[7] = {0, rows1, rows2, rows3, rows4, rows5, rows6};

void gpufleet_gemm(int M, int K, int N16, const float* x, long ldx, const float* packed, const float* bias,
                   float* out, long ldc, int threads) {
  const int blocks = (M + 5) / 6, even = M > 6 && M % 6 < 4; /* 13 = 5 + 4 + 4, 16 = 6 + 6 + 4 */
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
  for (int n = 0; n < N16; n++) {
    const float* panel = packed + (long)n * K * 16;
    const float* panel_bias = bias ? bias + (long)n * 16 : 0;
    for (int b = 0, r = 0; b < blocks; b++) {
      int rows = even ? M / blocks + (b < M % blocks) : (M - r < 6 ? M - r : 6);
      BLOCKS[rows](K, x + (long)r * ldx, ldx, panel, panel_bias, out + (long)r * ldc + (long)n * 16, ldc);
      r += rows;
    }
  }
}

/* ---- One decode step of a Llama / Qwen2 / Qwen3 / Mistral model (engine/fastdecode.py's step, in C) ----

   The same arithmetic as FastDecoder.step (and so as the Hugging Face modules), op for op, on
   preallocated buffers: RMSNorm, the q/k/v projection, Qwen3's q/k norm, RoPE from the caller's cos /
   signed-sin rows, the new key and value written into the cache at `position`, attention of the one
   query per row over positions 0..position (plus the additive key mask of padded prompts), the output
   projection and residual, RMSNorm, gate/up, silu(gate) * up, down and residual; then the final norm
   and the LM head. Sums run in a different order than ATen's kernels: float32 logits agree to ~1e-6. */
#include <math.h>

typedef struct {
  const float *input_norm, *post_norm, *qk_norm; /* qk_norm: (heads + kv_heads) x head_dim, or NULL */
  const float *qkv, *qkv_bias, *o, *o_bias, *gate_up, *gate_up_bias, *down, *down_bias; /* packed */
  float *k_cache, *v_cache; /* (rows, kv_heads, capacity, head_dim), contiguous */
} gf_layer;

typedef struct {
  int rows, layers, hidden, heads, kv_heads, head_dim, intermediate, capacity, position, vocab16, threads;
  float eps, qk_eps, scaling;
  const long long *token, *token_position; /* rows: the token fed to each row and its position */
  const float *embed;       /* embed_rows x hidden: the input embeddings */
  const float *cos, *sin;   /* capacity x head_dim tables: cos and signed sin (see fastdecode_ops.rope) */
  const float *key_mask;    /* rows x capacity, additive, or NULL */
  const float *final_norm, *head, *head_bias;
  const gf_layer* layer;
  float *x;                 /* rows x hidden: the token embeddings, then the hidden states */
  float *normed, *qkv, *attn, *gate_up, *act, *proj; /* scratch, see fastdecode_native.py */
  float* logits;            /* rows x 16 * vocab16 */
  long long embed_rows;
} gf_step;

#define PAD16(n) (((n) + 15) / 16 * 16)

/* out = weight * (x * rsqrt(mean(x^2) + eps)) over n values (HF *RMSNorm in float32). */
static void rms_norm(const float* x, const float* weight, float eps, int n, float* out) {
  float sum = 0.0f;
  for (int i = 0; i < n; i++) sum += x[i] * x[i];
  float scale = 1.0f / sqrtf(sum / (float)n + eps);
  for (int i = 0; i < n; i++) out[i] = weight[i] * (x[i] * scale);
}

/* x * cos + rotate_half(x) * sin, in place over one head (signed_sin = cat(-sin, sin)). */
static void rope(float* x, const float* cos, const float* signed_sin, int d) {
  const int half = d / 2;
  for (int i = 0; i < half; i++) {
    const float lo = x[i], hi = x[i + half];
    x[i] = lo * cos[i] + hi * signed_sin[i];
    x[i + half] = hi * cos[i + half] + lo * signed_sin[i + half];
  }
}

/* q . k over d values: 8 lanes, two accumulators, then the lanes summed. */
static inline float dot(const float* q, const float* k, int d) {
  __m256 a = _mm256_setzero_ps(), b = a;
  int i = 0;
  for (; i + 16 <= d; i += 16) {
    a = _mm256_fmadd_ps(_mm256_loadu_ps(q + i), _mm256_loadu_ps(k + i), a);
    b = _mm256_fmadd_ps(_mm256_loadu_ps(q + i + 8), _mm256_loadu_ps(k + i + 8), b);
  }
  for (; i + 8 <= d; i += 8) a = _mm256_fmadd_ps(_mm256_loadu_ps(q + i), _mm256_loadu_ps(k + i), a);
  float sum = hsum8(_mm256_add_ps(a, b));
  for (; i < d; i++) sum += q[i] * k[i];
  return sum;
}

/* `dot` of q with 4 keys in a row (k, k + d, ...), for d a multiple of 16: the same two accumulators and
   sum per key, so the same bits, but 8 independent chains of fused multiply-adds instead of 2. */
static inline void dot4(const float* q, const float* k, int d, float* out) {
  __m256 a0 = _mm256_setzero_ps(), b0 = a0, a1 = a0, b1 = a0, a2 = a0, b2 = a0, a3 = a0, b3 = a0;
  for (int i = 0; i < d; i += 16) {
    __m256 q0 = _mm256_loadu_ps(q + i), q1 = _mm256_loadu_ps(q + i + 8);
    a0 = _mm256_fmadd_ps(q0, _mm256_loadu_ps(k + i), a0);
    b0 = _mm256_fmadd_ps(q1, _mm256_loadu_ps(k + i + 8), b0);
    a1 = _mm256_fmadd_ps(q0, _mm256_loadu_ps(k + d + i), a1);
    b1 = _mm256_fmadd_ps(q1, _mm256_loadu_ps(k + d + i + 8), b1);
    a2 = _mm256_fmadd_ps(q0, _mm256_loadu_ps(k + 2 * d + i), a2);
    b2 = _mm256_fmadd_ps(q1, _mm256_loadu_ps(k + 2 * d + i + 8), b2);
    a3 = _mm256_fmadd_ps(q0, _mm256_loadu_ps(k + 3 * d + i), a3);
    b3 = _mm256_fmadd_ps(q1, _mm256_loadu_ps(k + 3 * d + i + 8), b3);
  }
  out[0] = hsum8(_mm256_add_ps(a0, b0));
  out[1] = hsum8(_mm256_add_ps(a1, b1));
  out[2] = hsum8(_mm256_add_ps(a2, b2));
  out[3] = hsum8(_mm256_add_ps(a3, b3));
}

/* out[0 .. 8n-1] = inv * sum_j p[j] v_j[0 .. 8n-1] (v_j = values + j * d), n = 4 or 8 registers of
   sums, each a chain of fused multiply-adds over j in order (the compiler unrolls the constant n). */
static inline void weighted_sum(const float* p, const float* values, int d, int length, float inv, const int n,
                                float* out) {
  __m256 acc[8];
  for (int r = 0; r < n; r++) acc[r] = _mm256_setzero_ps();
  for (int j = 0; j < length; j++) {
    const float* v = values + (long)j * d;
    __m256 pj = _mm256_set1_ps(p[j]);
    for (int r = 0; r < n; r++) acc[r] = _mm256_fmadd_ps(pj, _mm256_loadu_ps(v + 8 * r), acc[r]);
  }
  __m256 inv8 = _mm256_set1_ps(inv);
  for (int r = 0; r < n; r++) _mm256_storeu_ps(out + 8 * r, _mm256_mul_ps(acc[r], inv8));
}

/* One query head against keys / values 0..length-1 of its key/value head: the scores (4 keys at a time),
   their softmax (exp 8 at a time), then out = sum_j p_j v_j with 8 floats of out per register, 64 (or
   32) at a time: 8 (4) independent chains over j. Each score and each output is the same sum in the same
   order whatever the blocking. */
static void attend(const gf_step* s, const float* q, const float* keys, const float* values,
                   const float* mask, int length, float* out) {
  int d = s->head_dim;
  float scores[length];
  float top = -INFINITY;
  int j = 0;
  if (d % 16 == 0)
    for (; j + 4 <= length; j += 4) dot4(q, keys + (long)j * d, d, scores + j);
  for (; j < length; j++) scores[j] = dot(q, keys + (long)j * d, d);
  for (j = 0; j < length; j++) {
    scores[j] = scores[j] * s->scaling + (mask ? mask[j] : 0.0f);
    if (scores[j] > top) top = scores[j];
  }
  j = 0;
  __m256 sum8 = _mm256_setzero_ps(), top8 = _mm256_set1_ps(top);
  for (; j + 8 <= length; j += 8) {
    __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(scores + j), top8));
    _mm256_storeu_ps(scores + j, e);
    sum8 = _mm256_add_ps(sum8, e);
  }
  float total = hsum8(sum8);
  for (; j < length; j++) total += (scores[j] = expf(scores[j] - top));
  const float inv = 1.0f / total;
  int i = 0;
  for (; i + 64 <= d; i += 64) weighted_sum(scores, values + i, d, length, inv, 8, out + i);
  for (; i + 32 <= d; i += 32) weighted_sum(scores, values + i, d, length, inv, 4, out + i);
  for (; i < d; i++) {
    float sum = 0.0f;
    for (j = 0; j < length; j++) sum += scores[j] * values[(long)j * d + i];
    out[i] = sum * inv;
  }
}

static void attention_block(const gf_step* s, const gf_layer* l) {
  int d = s->head_dim, heads = s->heads, kv = s->kv_heads, groups = heads / kv, t = s->position;
  int width = PAD16((heads + 2 * kv) * d);
  long row_cache = (long)kv * s->capacity * d, head_cache = (long)s->capacity * d;
#pragma omp parallel for schedule(static) num_threads(s->threads) if (s->threads > 1)
  for (int b = 0; b < s->rows; b++) {
    float* q = s->qkv + (long)b * width;  /* heads x d, then kv x d keys, then kv x d values */
    float* k = q + heads * d;
    float* v = k + kv * d;
    if (l->qk_norm)
      for (int h = 0; h < heads + kv; h++) rms_norm(q + h * d, l->qk_norm + h * d, s->qk_eps, d, q + h * d);
    long at = (long)s->token_position[b] * d;
    for (int h = 0; h < heads + kv; h++) rope(q + h * d, s->cos + at, s->sin + at, d);
    for (int g = 0; g < kv; g++) {
      float* kc = l->k_cache + b * row_cache + g * head_cache;
      float* vc = l->v_cache + b * row_cache + g * head_cache;
      for (int i = 0; i < d; i++) {
        kc[(long)t * d + i] = k[g * d + i];
        vc[(long)t * d + i] = v[g * d + i];
      }
      for (int h = g * groups; h < (g + 1) * groups; h++)
        attend(s, q + h * d, kc, vc, s->key_mask ? s->key_mask + (long)b * s->capacity : 0, t + 1,
               s->attn + (long)b * heads * d + h * d);
    }
  }
}

static void add_rows(float* x, const float* y, int rows, int n, int ldy) {
  for (int b = 0; b < rows; b++)
    for (int i = 0; i < n; i++) x[(long)b * n + i] += y[(long)b * ldy + i];
}

static void norm_rows(const gf_step* s, const float* weight) {
  for (int b = 0; b < s->rows; b++)
    rms_norm(s->x + (long)b * s->hidden, weight, s->eps, s->hidden, s->normed + (long)b * s->hidden);
}

/* Returns 0; or, computing nothing, 1 + b when row b's token is not an embedding row, or 1 + rows + b
   when row b's position is outside the cache (and the RoPE tables). */
int gpufleet_decode_step(const gf_step* s) {
  int n = s->rows, hidden = s->hidden, inter = s->intermediate, d = s->head_dim;
  int qkv16 = PAD16((s->heads + 2 * s->kv_heads) * d) / 16, hidden16 = PAD16(hidden) / 16;
  int gate_up16 = PAD16(2 * inter) / 16, q_dim = s->heads * d;
  for (int b = 0; b < n; b++) {
    if (s->token[b] < 0 || s->token[b] >= s->embed_rows) return 1 + b;
    if (s->token_position[b] < 0 || s->token_position[b] >= s->capacity) return 1 + n + b;
  }
  for (int b = 0; b < n; b++)  /* the embedding of each row's token */
    for (int i = 0; i < hidden; i++) s->x[(long)b * hidden + i] = s->embed[s->token[b] * hidden + i];
  for (int i = 0; i < s->layers; i++) {
    const gf_layer* l = s->layer + i;
    norm_rows(s, l->input_norm);
    gpufleet_gemm(n, hidden, qkv16, s->normed, hidden, l->qkv, l->qkv_bias, s->qkv, qkv16 * 16, s->threads);
    attention_block(s, l);
    gpufleet_gemm(n, q_dim, hidden16, s->attn, q_dim, l->o, l->o_bias, s->proj, hidden16 * 16, s->threads);
    add_rows(s->x, s->proj, n, hidden, hidden16 * 16);
    norm_rows(s, l->post_norm);
    gpufleet_gemm(n, hidden, gate_up16, s->normed, hidden, l->gate_up, l->gate_up_bias, s->gate_up,
                  gate_up16 * 16, s->threads);
    for (int b = 0; b < n; b++) {  /* silu(gate) * up = gate / (1 + exp(-gate)) * up */
      const float* gate = s->gate_up + (long)b * gate_up16 * 16;
      const float* up = gate + inter;
      float* out = s->act + (long)b * inter;
      int i = 0;
      for (; i + 8 <= inter; i += 8) {
        __m256 g = _mm256_loadu_ps(gate + i);
        __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), g));
        __m256 silu = _mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.0f), e));
        _mm256_storeu_ps(out + i, _mm256_mul_ps(silu, _mm256_loadu_ps(up + i)));
      }
      for (; i < inter; i++) out[i] = gate[i] / (1.0f + expf(-gate[i])) * up[i];
    }
    gpufleet_gemm(n, inter, hidden16, s->act, inter, l->down, l->down_bias, s->proj, hidden16 * 16, s->threads);
    add_rows(s->x, s->proj, n, hidden, hidden16 * 16);
  }
  norm_rows(s, s->final_norm);
  gpufleet_gemm(n, hidden, s->vocab16, s->normed, hidden, s->head, s->head_bias, s->logits, s->vocab16 * 16,
                s->threads);
  return 0;
}

/* ---- sampling: what engine/sampling.py computes with torch ops, bit for bit --------------------------- */
#include <float.h>
#include <stdint.h>

/* Before the softmax: the suppressed columns of each row at the lowest float (suppress_logits), then
   every logit divided by the temperature (next_tokens: IEEE division, correctly rounded, as torch's). */
void gpufleet_sample_prepare(float* logits, long rows, long vocab, const int64_t* suppress, long n_suppress,
                             float temperature) {
    for (long r = 0; r < rows; r++) {
        float* row = logits + r * vocab;
        for (long j = 0; j < n_suppress; j++) row[suppress[j]] = -FLT_MAX;
        if (temperature != 1.0f)
            for (long i = 0; i < vocab; i++) row[i] = row[i] / temperature;
    }
}

/* After the softmax: per row the first index whose float64 running sum of the probabilities exceeds
   u * total (torch's CPU cumsum adds in order in double; searchsorted right=True, clamped to the last
   index). uniforms[r * ustride] is row r's draw. */
static long pick_row(const float* row, long vocab, double u) {
    double total = 0.0;
    for (long i = 0; i < vocab; i++) total += (double)row[i];
    const double target = u * total;
    double sum = 0.0;
    for (long i = 0; i < vocab; i++) {
        sum += (double)row[i];
        if (sum > target) return i;
    }
    return vocab - 1;
}

void gpufleet_sample_pick(const float* probs, long rows, long vocab, const double* uniforms, long ustride,
                          int64_t* out) {
    for (long r = 0; r < rows; r++) out[r] = pick_row(probs + r * vocab, vocab, uniforms[r * ustride]);
}

/* One step t of the CPU decode loop after its softmax (engine/nativeloop.py), for the n rows the decoder
   still runs: rows[i] is the batch row of decoder row i. A row done before this step gets the pad token,
   a live one its pick (uniforms[rows[i] * ustride]); the token goes to out[rows[i] * out_stride + t] and
   to next[i] (the token fed at step t + 1), whose position positions[i] advances by one from step 1 on.
   A live row that picks EOS is done from here: done[row] = 1, finish[row] = t. Returns the rows still live. */
long gpufleet_sample_advance(const float* probs, long n, long vocab, const double* uniforms, long ustride,
                             const int64_t* rows, long t, int64_t eos, int64_t pad, int64_t* out, long out_stride,
                             uint8_t* done, int64_t* finish, int64_t* next, int64_t* positions) {
    long live = 0;
    for (long i = 0; i < n; i++) {
        const int64_t r = rows[i];
        int64_t token = pad;
        if (!done[r]) {
            token = pick_row(probs + i * vocab, vocab, uniforms[r * ustride]);
            if (token == eos) {
                done[r] = 1;
                finish[r] = t;
            } else {
                live++;
            }
        }
        out[r * out_stride + t] = token;
        next[i] = token;
        if (t > 0) positions[i]++;
    }
    return live;
}

/* out[c * 16 + r] = src[r][k + c] for r, c in 0..7: an 8 x 8 block of 8 rows, transposed. */
static void transpose8(const float* const* src, long k, float* out) {
  __m256 r0 = _mm256_loadu_ps(src[0] + k), r1 = _mm256_loadu_ps(src[1] + k);
  __m256 r2 = _mm256_loadu_ps(src[2] + k), r3 = _mm256_loadu_ps(src[3] + k);
  __m256 r4 = _mm256_loadu_ps(src[4] + k), r5 = _mm256_loadu_ps(src[5] + k);
  __m256 r6 = _mm256_loadu_ps(src[6] + k), r7 = _mm256_loadu_ps(src[7] + k);
  __m256 t0 = _mm256_unpacklo_ps(r0, r1), t1 = _mm256_unpackhi_ps(r0, r1);
  __m256 t2 = _mm256_unpacklo_ps(r2, r3), t3 = _mm256_unpackhi_ps(r2, r3);
  __m256 t4 = _mm256_unpacklo_ps(r4, r5), t5 = _mm256_unpackhi_ps(r4, r5);
  __m256 t6 = _mm256_unpacklo_ps(r6, r7), t7 = _mm256_unpackhi_ps(r6, r7);
  __m256 u0 = _mm256_shuffle_ps(t0, t2, 0x44), u1 = _mm256_shuffle_ps(t0, t2, 0xEE);
  __m256 u2 = _mm256_shuffle_ps(t1, t3, 0x44), u3 = _mm256_shuffle_ps(t1, t3, 0xEE);
  __m256 u4 = _mm256_shuffle_ps(t4, t6, 0x44), u5 = _mm256_shuffle_ps(t4, t6, 0xEE);
  __m256 u6 = _mm256_shuffle_ps(t5, t7, 0x44), u7 = _mm256_shuffle_ps(t5, t7, 0xEE);
  _mm256_storeu_ps(out + 0 * 16, _mm256_permute2f128_ps(u0, u4, 0x20));
  _mm256_storeu_ps(out + 1 * 16, _mm256_permute2f128_ps(u1, u5, 0x20));
  _mm256_storeu_ps(out + 2 * 16, _mm256_permute2f128_ps(u2, u6, 0x20));
  _mm256_storeu_ps(out + 3 * 16, _mm256_permute2f128_ps(u3, u7, 0x20));
  _mm256_storeu_ps(out + 4 * 16, _mm256_permute2f128_ps(u0, u4, 0x31));
  _mm256_storeu_ps(out + 5 * 16, _mm256_permute2f128_ps(u1, u5, 0x31));
  _mm256_storeu_ps(out + 6 * 16, _mm256_permute2f128_ps(u2, u6, 0x31));
  _mm256_storeu_ps(out + 7 * 16, _mm256_permute2f128_ps(u3, u7, 0x31));
}

/* Pack `count` weights stacked on their out dimension (weight i: rows[i] x in, row stride in) into
   panels (width / 16, in, 16), zero past the total rows: one pass, 16 rows read in order at a time. */
void gpufleet_pack(const float* const* weights, const long* rows, int count, long in, long width,
                   float* panels) {
  const float* src[16];
  int w = 0;
  long row_in_w = 0;
  for (long n = 0; n < width / 16; n++) {
    for (int j = 0; j < 16; j++) {
      while (w < count && row_in_w >= rows[w]) {
        w++;
        row_in_w = 0;
      }
      src[j] = w < count ? weights[w] + row_in_w * in : 0;
      if (w < count) row_in_w++;
    }
    float* out = panels + n * in * 16;
    long k = 0;
    if (src[15])  /* 16 rows: 8 x 8 blocks transposed in registers (the scalar loop ran at ~6 GB/s) */
      for (; k + 8 <= in; k += 8) {
        transpose8(src, k, out + k * 16);
        transpose8(src + 8, k, out + k * 16 + 8);
      }
    for (; k < in; k++)
      for (int j = 0; j < 16; j++) out[k * 16 + j] = src[j] ? src[j][k] : 0.0f;
  }
}
