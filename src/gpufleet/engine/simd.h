/* What engine/cpu_kernels.c (the decode step), engine/layer_kernels.c (the training layers) and
   engine/attention_kernels.c (a packed row's attention) share: AVX2 + FMA intrinsics, a vectorised exp, a lane
   sum and a dot product. */
#ifndef GPUFLEET_SIMD_H
#define GPUFLEET_SIMD_H
#include <immintrin.h>
#include <math.h>

/* exp for the SwiGLU and the decode step's softmax: Cephes' expf (range reduction by ln 2 in two parts,
   degree-5 polynomial), within 2 ulp over [-88.4, 88.4]; inputs are clamped there (neither needs more). */
static inline __m256 exp8(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-88.3762626647949f)), _mm256_set1_ps(88.3762626647949f));
  __m256 fx = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
  __m256 y = _mm256_set1_ps(1.9875691500E-4f);
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507E-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073E-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894E-2f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459E-1f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201E-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
  __m256i n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(fx), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(n));
}

/* The sum of the 8 lanes. */
static inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

/* The dot product of n floats: 8 lanes of fused multiply-adds, then the lanes' sum, then the tail. */
static inline float dot_n(const float* a, const float* b, long n) {
  __m256 acc = _mm256_setzero_ps();
  long i = 0;
  for (; i + 8 <= n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
  float sum = hsum8(acc);
  for (; i < n; i++) sum += a[i] * b[i];
  return sum;
}

#endif
