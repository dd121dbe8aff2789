// CPU kernels for the engine's hot path, built at first use by kernels/cpu_ext.py.
// Each has a PyTorch reference in kernels/ and tests compare the two.
//
// paged_decode: one query token per sequence, keys and values read in place from
//   the block cache (no gather into a padded copy). Work is split over (sequence,
//   kv head); each item streams its keys once for all query heads of its group
//   (GQA), with an online softmax in fp32.
// paged_prefill: fp32 and bf16 prefill chunks (AVX-512), causal over each sequence's cached
//   prefix and itself, in tiles of 16 query rows with one row per vector lane.
// add_rms_norm, rotary, silu_and_mul: one pass each instead of the 5-10 small
//   PyTorch ops of the reference, which at batch 1 cost more than their arithmetic.
// linear_small, linear_amx: linear layers at the few rows of a decode step, where
//   they stream the weights (see each).
// quant_linear, quant_dequantize: int8 and int4 weights (kernels/quant.py).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cmath>
#include <cstring>
#include <algorithm>
#include <limits>
#include <type_traits>
#include <vector>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif
#if defined(__AMX_BF16__) && defined(__AMX_TILE__) && defined(__AVX512BF16__)
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

template <typename T>
static inline float to_f(T x) { return static_cast<float>(x); }

// One block of an online softmax: fold a block's raw scores sh[0..n) into the running max
// m, sum l and accumulator acc[0..head_dim) (rescaled once when the max rises); sh becomes
// the block's unnormalised probabilities. The exponentials get a loop of their own so
// they vectorise.
static inline void softmax_block(float* sh, int64_t n, float& m, float& l, float* acc, int64_t head_dim) {
  float block_max = sh[0];
  for (int64_t t = 1; t < n; ++t) block_max = std::max(block_max, sh[t]);
  if (block_max > m) {
    const float c = std::exp(m - block_max);
    l *= c;
    for (int64_t d = 0; d < head_dim; ++d) acc[d] *= c;
    m = block_max;
  }
  for (int64_t t = 0; t < n; ++t) sh[t] = std::exp(sh[t] - m);
  for (int64_t t = 0; t < n; ++t) l += sh[t];
}

#if defined(__AVX512F__)
// AVX-512 fast path (fp32 or bf16 caches, head_dim a multiple of 32). Sixteen keys are dotted
// side by side and reduced together (one transposed reduction instead of a horizontal one per
// key and head: those were most of the work), the softmax runs sixteen exponentials at a time,
// and the value accumulators stay in registers across a block. With AVX512-BF16, vdpbf16ps
// dots a bf16 cache's pairs in fp32 directly; without it, bf16 widens to fp32 by a shift.
// 64 sequences x 300 tokens, 30 layers, 2 threads, on a 2-core Xeon with AMX: ~21 ms, where
// reducing each key's dot on its own took 44.5 ms. On a 2-core Ice Lake Xeon (AVX-512, no
// BF16), bf16 caches run here 1.85x (64 sequences) and 2.2x (16) as fast as on the scalar
// loop; fp32 runs even with the AVX2 path below (both bound by reading the cache), which
// serves CPUs without AVX-512.

// lane i of the result = the sum of the lanes of a[i].
static inline __m512 transpose_sum16(__m512* a) {
  __m512 b[8], c[4], d[2];
  for (int i = 0; i < 8; ++i)
    b[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]), _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
  for (int i = 0; i < 4; ++i)
    c[i] = _mm512_add_ps(_mm512_shuffle_ps(b[2 * i], b[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(b[2 * i], b[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  for (int i = 0; i < 2; ++i)
    d[i] = _mm512_add_ps(_mm512_shuffle_f32x4(c[2 * i], c[2 * i + 1], 0x88), _mm512_shuffle_f32x4(c[2 * i], c[2 * i + 1], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(d[0], d[1], 0x88), _mm512_shuffle_f32x4(d[0], d[1], 0xDD));
}

// e^x for x <= 88 (0 below -87), as exp_nonpositive below, sixteen at a time; scalef applies 2^n.
static inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  const __m512 rr = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.f / 720);
  p = _mm512_fmadd_ps(p, rr, _mm512_set1_ps(1.f / 120));
  p = _mm512_fmadd_ps(p, rr, _mm512_set1_ps(1.f / 24));
  p = _mm512_fmadd_ps(p, rr, _mm512_set1_ps(1.f / 6));
  p = _mm512_fmadd_ps(p, rr, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, rr, _mm512_set1_ps(1.f));
  p = _mm512_fmadd_ps(p, rr, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}

static inline __mmask16 first_lanes(int64_t k) { return k >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << k) - 1); }

// One block of the online softmax for one head, as softmax_block, sixteen scores at a time.
static inline void softmax_block16(float* sh, int64_t n, float& m, float& l, float* acc, int64_t head_dim) {
  const __m512 neg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  __m512 mx = neg_inf;
  for (int64_t t = 0; t < n; t += 16) mx = _mm512_max_ps(mx, _mm512_mask_loadu_ps(neg_inf, first_lanes(n - t), sh + t));
  const float block_max = _mm512_reduce_max_ps(mx);
  if (block_max > m) {
    const float c = std::exp(m - block_max);
    l *= c;
    const __m512 vc = _mm512_set1_ps(c);
    for (int64_t d = 0; d < head_dim; d += 16) _mm512_storeu_ps(acc + d, _mm512_mul_ps(_mm512_loadu_ps(acc + d), vc));
    m = block_max;
  }
  const __m512 mv = _mm512_set1_ps(m);
  __m512 sum = _mm512_setzero_ps();
  for (int64_t t = 0; t < n; t += 16) {
    const __mmask16 k = first_lanes(n - t);
    const __m512 e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, sh + t), mv));
    _mm512_mask_storeu_ps(sh + t, k, e);
    sum = _mm512_mask_add_ps(sum, k, sum, e);
  }
  l += _mm512_reduce_add_ps(sum);
}

static inline __m512 load_bf16x16(const at::BFloat16* p) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

static inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
static inline __m512 load16(const at::BFloat16* p) { return load_bf16x16(p); }

// Rounded to bf16 to nearest even, as static_cast<at::BFloat16> rounds (NaN aside).
static inline __m256i to_bf16x16(__m512 v) {
#if defined(__AVX512BF16__)
  return (__m256i)_mm512_cvtneps_pbh(v);
#else
  // c10's rounding: add 0x7FFF plus the kept part's lowest bit, keep the top half; NaN stays NaN.
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i top = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(bits, _mm512_set1_epi32(0x7FFF)), odd), 16);
  top = _mm512_mask_mov_epi32(top, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
  return _mm512_cvtepi32_epi16(top);
#endif
}

static inline void store_bf16x16(at::BFloat16* p, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), to_bf16x16(v));
}

// v rounded to bf16 and widened back: the value a bf16 tensor would hold.
static inline __m512 round_bf16x16(__m512 v) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(to_bf16x16(v)), 16));
}

// Scores of n keys (token_stride apart) against `group` query heads (qf: fp32, already
// scaled): s[g * block_size + t], sixteen keys at a time as scores_bf16 below does them.
template <typename T>
static inline void scores16(const float* qf, const T* kb, float* s, int64_t n, int64_t group, int64_t head_dim,
                            int64_t token_stride, int64_t block_size) {
  for (int64_t g = 0; g < group; ++g) {
    const float* qp = qf + g * head_dim;
    float* sg = s + g * block_size;
    int64_t t = 0;
    for (; t < n && t + 16 <= block_size; t += 16) {
      const T* kp = kb + t * token_stride;
      __m512 a[16];
      for (int i = 0; i < 16; ++i) a[i] = _mm512_setzero_ps();
      for (int64_t c = 0; c < head_dim; c += 16) {
        const __m512 qv = _mm512_loadu_ps(qp + c);
        for (int i = 0; i < 16; ++i) a[i] = _mm512_fmadd_ps(qv, load16(kp + i * token_stride + c), a[i]);
      }
      _mm512_mask_storeu_ps(sg + t, first_lanes(n - t), transpose_sum16(a));
    }
    for (; t < n; ++t) {
      const T* kp = kb + t * token_stride;
      __m512 dot = _mm512_setzero_ps();
      for (int64_t c = 0; c < head_dim; c += 16) dot = _mm512_fmadd_ps(_mm512_loadu_ps(qp + c), load16(kp + c), dot);
      sg[t] = _mm512_reduce_add_ps(dot);
    }
  }
}

// acc[g] += sum_t p[g][t] * v[t] for G query heads, 32 dimensions per pass. G is a
// compile-time constant so the 2G accumulators stay in registers: with a run-time head
// count the compiler kept them on the stack and every FMA waited on a store.
template <int G, typename T>
static inline void values_heads16(const T* vb, const float* s, float* acc, int64_t n, int64_t head_dim,
                                  int64_t token_stride, int64_t block_size) {
  for (int64_t c = 0; c < head_dim; c += 32) {
    __m512 r[G][2];
    for (int g = 0; g < G; ++g) {
      r[g][0] = _mm512_loadu_ps(acc + g * head_dim + c);
      r[g][1] = _mm512_loadu_ps(acc + g * head_dim + c + 16);
    }
    for (int64_t t = 0; t < n; ++t) {
      const T* vp = vb + t * token_stride + c;
      const __m512 v0 = load16(vp), v1 = load16(vp + 16);
      for (int g = 0; g < G; ++g) {
        const __m512 p = _mm512_set1_ps(s[g * block_size + t]);
        r[g][0] = _mm512_fmadd_ps(p, v0, r[g][0]);
        r[g][1] = _mm512_fmadd_ps(p, v1, r[g][1]);
      }
    }
    for (int g = 0; g < G; ++g) {
      _mm512_storeu_ps(acc + g * head_dim + c, r[g][0]);
      _mm512_storeu_ps(acc + g * head_dim + c + 16, r[g][1]);
    }
  }
}

template <typename T>
static inline void values16(const T* vb, const float* s, float* acc, int64_t n, int64_t group, int64_t head_dim,
                            int64_t token_stride, int64_t block_size) {
  for (int64_t g0 = 0; g0 < group; g0 += 4) {
    const float* sg = s + g0 * block_size;
    float* ag = acc + g0 * head_dim;
    switch (std::min<int64_t>(4, group - g0)) {
      case 1: values_heads16<1>(vb, sg, ag, n, head_dim, token_stride, block_size); break;
      case 2: values_heads16<2>(vb, sg, ag, n, head_dim, token_stride, block_size); break;
      case 3: values_heads16<3>(vb, sg, ag, n, head_dim, token_stride, block_size); break;
      default: values_heads16<4>(vb, sg, ag, n, head_dim, token_stride, block_size); break;
    }
  }
}
#endif

#if defined(__AVX512BF16__)
// Scaled scores of n keys (token_stride apart) against `group` query heads:
// s[g * block_size + t]. Sixteen keys go together while the block still holds sixteen
// slots from t (the slots past n hold whatever they hold; their lanes are dropped).
static inline void scores_bf16(const at::BFloat16* q, const at::BFloat16* kb, float* s, int64_t n, int64_t group,
                               int64_t head_dim, int64_t token_stride, int64_t block_size, float scale) {
  const __m512 vscale = _mm512_set1_ps(scale);
  for (int64_t g = 0; g < group; ++g) {
    const at::BFloat16* qp = q + g * head_dim;
    float* sg = s + g * block_size;
    int64_t t = 0;
    for (; t < n && t + 16 <= block_size; t += 16) {
      const at::BFloat16* kp = kb + t * token_stride;
      __m512 a[16];
      for (int i = 0; i < 16; ++i) a[i] = _mm512_setzero_ps();
      for (int64_t c = 0; c < head_dim; c += 32) {
        const __m512bh qv = (__m512bh)_mm512_loadu_si512(qp + c);
        for (int i = 0; i < 16; ++i)
          a[i] = _mm512_dpbf16_ps(a[i], qv, (__m512bh)_mm512_loadu_si512(kp + i * token_stride + c));
      }
      _mm512_mask_storeu_ps(sg + t, first_lanes(n - t), _mm512_mul_ps(transpose_sum16(a), vscale));
    }
    for (; t < n; ++t) {
      const at::BFloat16* kp = kb + t * token_stride;
      __m512 dot = _mm512_setzero_ps();
      for (int64_t c = 0; c < head_dim; c += 32)
        dot = _mm512_dpbf16_ps(dot, (__m512bh)_mm512_loadu_si512(qp + c), (__m512bh)_mm512_loadu_si512(kp + c));
      sg[t] = _mm512_reduce_add_ps(dot) * scale;
    }
  }
}
#endif

#if defined(__AVX2__) && defined(__FMA__)
// fp32 fast path (AVX2 + FMA, head_dim a multiple of 32). The generic loop reduces every
// (token, head) dot product horizontally and runs its exponentials one at a time: ~660 cycles
// per token and kv head, 124 ms for 30 layers at 64 sequences x 160 tokens on a 2-core AVX2
// EPYC, where this path takes ~49 ms (bound by reading the cache). Here eight keys are dotted
// side by side and reduced together, exponentials run eight at a time, and values accumulate
// 32 dimensions per register pass.

// The sums of four vectors, as the lanes of one.
static inline __m128 hsum4(__m256 a, __m256 b, __m256 c, __m256 d) {
  const __m256 abcd = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
  return _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1));
}

static inline float hsum(__m256 a) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
}

// e^x for x <= 0 (scores minus their running max): 2^n * p(r) with |r| <= ln2/2 and a
// degree-6 polynomial, relative error ~2e-7; below -87 it flushes to 0.
static inline __m256 exp_nonpositive(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  const __m256 rr = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.f / 720);
  p = _mm256_fmadd_ps(p, rr, _mm256_set1_ps(1.f / 120));
  p = _mm256_fmadd_ps(p, rr, _mm256_set1_ps(1.f / 24));
  p = _mm256_fmadd_ps(p, rr, _mm256_set1_ps(1.f / 6));
  p = _mm256_fmadd_ps(p, rr, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, rr, _mm256_set1_ps(1.f));
  p = _mm256_fmadd_ps(p, rr, _mm256_set1_ps(1.f));
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  const __m256 out = _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
  return _mm256_and_ps(out, _mm256_cmp_ps(x, _mm256_set1_ps(-87.f), _CMP_GT_OQ));
}

// Scores of n keys (token_stride apart) against `group` query heads (qf, already scaled):
// s[g * block_size + t].
static inline void scores_f32(const float* qf, const float* kb, float* s, int64_t n, int64_t group,
                              int64_t head_dim, int64_t token_stride, int64_t block_size) {
  for (int64_t g = 0; g < group; ++g) {
    const float* qp = qf + g * head_dim;
    float* sg = s + g * block_size;
    int64_t t = 0;
    for (; t + 8 <= n; t += 8) {
      const float* kp = kb + t * token_stride;
      __m256 a[8];
      for (int i = 0; i < 8; ++i) a[i] = _mm256_setzero_ps();
      for (int64_t c = 0; c < head_dim; c += 8) {
        const __m256 qv = _mm256_loadu_ps(qp + c);
        for (int i = 0; i < 8; ++i) a[i] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(kp + i * token_stride + c), a[i]);
      }
      _mm_storeu_ps(sg + t, hsum4(a[0], a[1], a[2], a[3]));
      _mm_storeu_ps(sg + t + 4, hsum4(a[4], a[5], a[6], a[7]));
    }
    for (; t < n; ++t) {
      const float* kp = kb + t * token_stride;
      __m256 a = _mm256_setzero_ps();
      for (int64_t c = 0; c < head_dim; c += 8) a = _mm256_fmadd_ps(_mm256_loadu_ps(qp + c), _mm256_loadu_ps(kp + c), a);
      sg[t] = hsum(a);
    }
  }
}

// One block of the online softmax for one head, as softmax_block, eight scores at a time.
static inline void softmax_block_f32(float* sh, int64_t n, float& m, float& l, float* acc, int64_t head_dim) {
  float block_max = sh[0];
  for (int64_t t = 1; t < n; ++t) block_max = std::max(block_max, sh[t]);
  if (block_max > m) {
    const __m256 c = _mm256_set1_ps(std::exp(m - block_max));
    l *= _mm256_cvtss_f32(c);
    for (int64_t d = 0; d < head_dim; d += 8) _mm256_storeu_ps(acc + d, _mm256_mul_ps(_mm256_loadu_ps(acc + d), c));
    m = block_max;
  }
  const __m256 mv = _mm256_set1_ps(m);
  __m256 sum = _mm256_setzero_ps();
  int64_t t = 0;
  for (; t + 8 <= n; t += 8) {
    const __m256 e = exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(sh + t), mv));
    _mm256_storeu_ps(sh + t, e);
    sum = _mm256_add_ps(sum, e);
  }
  l += hsum(sum);
  for (; t < n; ++t) {
    sh[t] = std::exp(sh[t] - m);
    l += sh[t];
  }
}

// acc[g] += sum_t p[g][t] * v[t] for n values, 32 dimensions per pass kept in registers.
static inline void values_f32(const float* vb, const float* s, float* acc, int64_t n, int64_t group,
                              int64_t head_dim, int64_t token_stride, int64_t block_size) {
  for (int64_t g = 0; g < group; ++g) {
    const float* p = s + g * block_size;
    float* ag = acc + g * head_dim;
    for (int64_t c = 0; c < head_dim; c += 32) {
      __m256 r0 = _mm256_loadu_ps(ag + c), r1 = _mm256_loadu_ps(ag + c + 8);
      __m256 r2 = _mm256_loadu_ps(ag + c + 16), r3 = _mm256_loadu_ps(ag + c + 24);
      for (int64_t t = 0; t < n; ++t) {
        const float* vp = vb + t * token_stride + c;
        const __m256 pt = _mm256_broadcast_ss(p + t);
        r0 = _mm256_fmadd_ps(pt, _mm256_loadu_ps(vp), r0);
        r1 = _mm256_fmadd_ps(pt, _mm256_loadu_ps(vp + 8), r1);
        r2 = _mm256_fmadd_ps(pt, _mm256_loadu_ps(vp + 16), r2);
        r3 = _mm256_fmadd_ps(pt, _mm256_loadu_ps(vp + 24), r3);
      }
      _mm256_storeu_ps(ag + c, r0);
      _mm256_storeu_ps(ag + c + 8, r1);
      _mm256_storeu_ps(ag + c + 16, r2);
      _mm256_storeu_ps(ag + c + 24, r3);
    }
  }
}
#endif

template <typename T>
static void decode_kernel(
    const T* q, const T* k_cache, const T* v_cache, T* out,
    const int32_t* block_tables, const int32_t* seq_lens,
    int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
    int64_t block_size, int64_t table_width, float scale) {
  const int64_t group = num_heads / num_kv_heads;
  const int64_t token_stride = num_kv_heads * head_dim;       // between tokens of a block
  const int64_t block_stride = block_size * token_stride;     // between blocks
  // With enough sequences to go round, one work item takes a whole sequence, so each
  // block is read from memory once for all its kv heads (split by kv head, three passes
  // over the same scattered blocks ran ~2x slower at 64 sequences).
  // A few sequences split by kv head instead, to keep every thread busy.
  const int64_t splits = num_seqs >= 2 * at::get_num_threads() ? 1 : num_kv_heads;
  const int64_t heads_per_item = num_kv_heads / splits;
#if defined(__AVX512F__)
  const bool simd16 = head_dim % 32 == 0;
#elif defined(__AVX2__) && defined(__FMA__)
  const bool f32_simd = std::is_same_v<T, float> && head_dim % 32 == 0;
#endif
  // Contexts differ in length: each thread takes a contiguous run of items holding an equal
  // share of the tokens (plus a block's worth per item for its set-up), not an equal count of
  // items, which leaves one thread with most of the work when long sequences bunch up (30
  // layers at 64 sequences of 32-500 tokens on the AMX Xeon: 31.7 ms, 36.7 by item count).
  const int64_t items = num_seqs * splits;
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), items));
  std::vector<int64_t> bounds(threads + 1, items);
  bounds[0] = 0;
  {
    auto work = [&](int64_t item) { return int64_t(seq_lens[item / splits]) + block_size; };
    int64_t total = 0, done = 0, t = 1;
    for (int64_t item = 0; item < items; ++item) total += work(item);
    for (int64_t item = 0; item < items && t < threads; ++item) {
      done += work(item);
      while (t < threads && done * threads >= total * t) bounds[t++] = item + 1;
    }
  }
  at::parallel_for(0, threads, 1, [&](int64_t first_run, int64_t last_run) {
    const int64_t width = heads_per_item * group;  // query heads handled by one item
    std::vector<float> qf(width * head_dim), acc(width * head_dim), kf(head_dim), m(width), l(width), s(width * block_size);
    for (int64_t item = bounds[first_run]; item < bounds[last_run]; ++item) {
      const int64_t seq = item / splits, kv_first = (item % splits) * heads_per_item;
      const int64_t len = seq_lens[seq];
      const int64_t head_first = kv_first * group;
      for (int64_t h = 0; h < width; ++h) {
        const T* qp = q + (seq * num_heads + head_first + h) * head_dim;
        for (int64_t d = 0; d < head_dim; ++d) qf[h * head_dim + d] = to_f(qp[d]) * scale;
        m[h] = -std::numeric_limits<float>::infinity();
        l[h] = 0.f;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      const int32_t* table = block_tables + seq * table_width;
      for (int64_t start = 0; start < len; start += block_size) {
        const int64_t n = std::min(block_size, len - start);
        const int64_t block_off = table[start / block_size] * block_stride;
        const bool more = start + block_size < len;
        const int64_t next = more ? table[start / block_size + 1] * block_stride + kv_first * head_dim : 0;
        const int64_t row_bytes = heads_per_item * head_dim * int64_t(sizeof(T));
        for (int64_t kh = 0; kh < heads_per_item; ++kh) {
          if (more) {
            // Blocks lie anywhere in the cache, so the hardware prefetcher starts cold at each:
            // ask for the next one's keys and values while this one is worked on (a core alone
            // reads ~6 GB/s of scattered blocks without it). Only this item's heads of each
            // token (split by kv head, items would each fetch the whole block), a share before
            // each head's work: issued all at once, they fill the line-fill buffers and the
            // prefetches themselves stall (a third of the kernel's cycles in a profile; the
            // shares ran 1.1x the single burst on the AMX Xeon).
            for (int64_t t = kh * block_size / heads_per_item; t < (kh + 1) * block_size / heads_per_item; ++t) {
              const char* kr = reinterpret_cast<const char*>(k_cache + next + t * token_stride);
              const char* vr = reinterpret_cast<const char*>(v_cache + next + t * token_stride);
              for (int64_t b = 0; b < row_bytes; b += 64) {
                __builtin_prefetch(kr + b, 0, 3);
                __builtin_prefetch(vr + b, 0, 3);
              }
            }
          }
          const T* kb = k_cache + block_off + (kv_first + kh) * head_dim;
          const T* vb = v_cache + block_off + (kv_first + kh) * head_dim;
          const int64_t h0 = kh * group;
#if defined(__AVX512F__)
          if constexpr (std::is_same_v<T, float> || std::is_same_v<T, at::BFloat16>) {
            if (simd16) {
#if defined(__AVX512BF16__)
              if constexpr (std::is_same_v<T, at::BFloat16>)
                scores_bf16(q + (seq * num_heads + head_first + h0) * head_dim, kb, s.data() + h0 * block_size, n, group,
                            head_dim, token_stride, block_size, scale);
              else
#endif
                scores16(qf.data() + h0 * head_dim, kb, s.data() + h0 * block_size, n, group, head_dim, token_stride,
                         block_size);
              for (int64_t h = h0; h < h0 + group; ++h)
                softmax_block16(s.data() + h * block_size, n, m[h], l[h], acc.data() + h * head_dim, head_dim);
              values16(vb, s.data() + h0 * block_size, acc.data() + h0 * head_dim, n, group, head_dim, token_stride,
                       block_size);
              continue;
            }
          }
#elif defined(__AVX2__) && defined(__FMA__)
          if constexpr (std::is_same_v<T, float>) {
            if (f32_simd) {
              scores_f32(qf.data() + h0 * head_dim, kb, s.data() + h0 * block_size, n, group, head_dim, token_stride,
                         block_size);
              for (int64_t h = h0; h < h0 + group; ++h)
                softmax_block_f32(s.data() + h * block_size, n, m[h], l[h], acc.data() + h * head_dim, head_dim);
              values_f32(vb, s.data() + h0 * block_size, acc.data() + h0 * head_dim, n, group, head_dim, token_stride,
                         block_size);
              continue;
            }
          }
#endif
          // Scores: each key converted to fp32 once, then dotted with every query head of its group.
          for (int64_t t = 0; t < n; ++t) {
            const T* kp = kb + t * token_stride;
            for (int64_t d = 0; d < head_dim; ++d) kf[d] = to_f(kp[d]);
            for (int64_t g = 0; g < group; ++g) {
              const float* qg = qf.data() + (h0 + g) * head_dim;
              float dot = 0.f;
              for (int64_t d = 0; d < head_dim; ++d) dot += qg[d] * kf[d];
              s[(h0 + g) * block_size + t] = dot;
            }
          }
          for (int64_t h = h0; h < h0 + group; ++h)
            softmax_block(s.data() + h * block_size, n, m[h], l[h], acc.data() + h * head_dim, head_dim);
          // Values: each converted once, then accumulated into every query head of its group.
          for (int64_t t = 0; t < n; ++t) {
            const T* vp = vb + t * token_stride;
            for (int64_t d = 0; d < head_dim; ++d) kf[d] = to_f(vp[d]);
            for (int64_t g = 0; g < group; ++g) {
              const float p = s[(h0 + g) * block_size + t];
              float* ah = acc.data() + (h0 + g) * head_dim;
              for (int64_t d = 0; d < head_dim; ++d) ah[d] += p * kf[d];
            }
          }
        }
      }
      for (int64_t h = 0; h < width; ++h) {
        T* op = out + (seq * num_heads + head_first + h) * head_dim;
        const float inv = len > 0 ? 1.f / l[h] : 0.f;
        for (int64_t d = 0; d < head_dim; ++d) op[d] = static_cast<T>(acc[h * head_dim + d] * inv);
      }
    }
  });
}

torch::Tensor paged_decode(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                           torch::Tensor block_tables, torch::Tensor seq_lens, double scale) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4, "q must be [seqs, heads, dim], caches [blocks, block_size, kv_heads, dim]");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "caches must be contiguous");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && k_cache.scalar_type() == v_cache.scalar_type(), "q and caches must share a dtype");
  TORCH_CHECK(block_tables.scalar_type() == torch::kInt32 && seq_lens.scalar_type() == torch::kInt32, "block_tables and seq_lens must be int32");
  q = q.contiguous();
  block_tables = block_tables.contiguous();
  seq_lens = seq_lens.contiguous();
  auto out = torch::empty_like(q);
  const int64_t heads = q.size(1), kv_heads = k_cache.size(2), dim = q.size(2);
  TORCH_CHECK(heads % kv_heads == 0, "heads must be a multiple of kv heads");
  TORCH_CHECK(k_cache.size(3) == dim && v_cache.sizes() == k_cache.sizes(), "caches must be [blocks, block_size, kv_heads, q's head_dim]");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.size(0) == q.size(0) && seq_lens.numel() == q.size(0),
              "one block-table row and one length per query");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode", [&] {
    decode_kernel<scalar_t>(q.data_ptr<scalar_t>(), k_cache.data_ptr<scalar_t>(), v_cache.data_ptr<scalar_t>(),
                            out.data_ptr<scalar_t>(), block_tables.data_ptr<int32_t>(), seq_lens.data_ptr<int32_t>(),
                            q.size(0), heads, kv_heads, dim, k_cache.size(1), block_tables.size(1), static_cast<float>(scale));
  });
  return out;
}

// ---------------------------------------------------------------------------------
// paged_prefill (AVX-512; bf16 dotted in hardware with AVX512-BF16): causal attention of
// prefill chunks over the paged cache, each chunk's queries against its sequence's cached
// prefix and itself.
// PyTorch's CPU flash attention ran SmolLM2's 9/3 heads at 45-80 GFLOP/s on a 2-core
// AVX512-BF16 EPYC (256-token prompts: 1.1 ms a layer; 2048 tokens: 39 ms, more than the
// layer's matmuls), called once per sequence after gathering its blocks.
//
// A work item is (sequence, query head, tile of 16 query rows): one row per lane, so the
// online softmax runs down the lanes with no horizontal reductions. Keys go sixteen at a
// time. Scores: the tile's queries are stored as bf16 pairs per lane (qp[c] lane i = row
// i's dims 2c, 2c+1) and vdpbf16ps dots them against each key's pair c broadcast, giving a
// key's sixteen scores in one register. Values: the probabilities are rounded to bf16 (as
// PyTorch's flash attention does before its second GEMM) and paired by key (lane i = keys
// 2j, 2j+1 of row i), the values paired the same way, and vdpbf16ps accumulates
// acc[d] lane i += p[i][2j] v[2j][d] + p[i][2j+1] v[2j+1][d]. A row's result does not
// depend on the tile or chunk it came in: the same blocks in the same order.
//
// fp32 caches (and bf16 ones on AVX-512 CPUs without AVX512-BF16) take the same tiles in
// fp32 (tile_wide): each group of sixteen keys and values is widened into a scratch block
// once, and FMAs against broadcast key and value elements replace vdpbf16ps; the
// probabilities stay in fp32, as in SDPA's fp32 path.
#if defined(__AVX512F__)
namespace prefill {

constexpr int64_t ROWS = 16;  // query rows per tile, one per lane

struct Scratch {
  std::vector<int32_t> qp;   // [head_dim / 2][16]: the tile's queries, bf16 pairs per lane
  std::vector<int32_t> vp;   // [8][head_dim]: values paired by key, dims in value_dim order
  std::vector<float> acc;    // [head_dim][16]: unnormalised outputs, lanes = rows
  std::vector<float> qf;     // [head_dim][16]: tile_wide's queries, scaled, lanes = rows
  std::vector<float> kf, vf;  // [16][head_dim]: tile_wide's keys and values, widened
  std::vector<float> p;      // [16][16]: tile_wide's probabilities, a key's per row
  explicit Scratch(int64_t head_dim)
      : qp(head_dim / 2 * ROWS), vp(8 * head_dim), acc(head_dim * ROWS), qf(head_dim * ROWS), kf(16 * head_dim),
        vf(16 * head_dim), p(16 * ROWS) {}
};

// Sixteen keys from position start: where each key's and value's row lies (a key past the
// sequence points at its first key, its value at nullptr: those slots may hold NaN), and
// which lanes (rows at positions first_pos + i) see it: pos <= first_pos + i, pos < last_key.
template <typename T>
static inline void keys16(const T* k, const T* v, const int32_t* table, int64_t start, int64_t first_pos,
                          int64_t key_end, int64_t last_key, int64_t token_stride, int64_t block_stride,
                          int64_t block_size, const T** kp, const T** vrow, __mmask16* visible) {
  for (int64_t t = 0; t < 16; ++t) {
    const int64_t pos = start + t;
    if (pos < key_end) {
      const int64_t off = table[pos / block_size] * block_stride + (pos % block_size) * token_stride;
      kp[t] = k + off;
      vrow[t] = v + off;
    } else {
      kp[t] = k + table[0] * block_stride;  // a real key; its lanes are masked off
      vrow[t] = nullptr;
    }
    const int64_t from = pos - first_pos;
    visible[t] = pos >= last_key ? __mmask16(0) : from <= 0 ? __mmask16(0xFFFF) : __mmask16(0xFFFFu << from);
  }
}

// The online softmax's step for one group of keys, lanes = rows: the running maximum m
// rises to cover the scores s (masked lanes hold -inf); returns the factor that rescales
// what was summed before (exactly 1 where the maximum held).
static inline __m512 raise_max(__m512& m, const __m512* s) {
  __m512 block_max = m;
  for (int t = 0; t < 16; ++t) block_max = _mm512_max_ps(block_max, s[t]);
  const __m512 rescale = exp16(_mm512_sub_ps(m, block_max));
  m = block_max;
  return rescale;
}

// out[i][dim(p)] = acc[p][i] / l[i] for the tile's rows.
template <typename T, typename Dim>
static inline void store_rows(const float* acc, __m512 l, int64_t head_dim, int64_t rows, T* out, int64_t out_row_stride,
                              Dim dim) {
  const __m512 inv = _mm512_div_ps(_mm512_set1_ps(1.f), l);
  alignas(64) float lanes[ROWS];
  for (int64_t p = 0; p < head_dim; ++p) {
    _mm512_store_ps(lanes, _mm512_mul_ps(_mm512_loadu_ps(acc + p * ROWS), inv));
    const int64_t d = dim(p);
    for (int64_t i = 0; i < rows; ++i) out[i * out_row_stride + d] = static_cast<T>(lanes[i]);
  }
}

// One tile in fp32: rows query rows (<= 16) at positions first_pos.. of one query head; the
// same arguments as tile below.
template <typename T>
static void tile_wide(const T* q, int64_t q_row_stride, const T* k, const T* v, const int32_t* table, int64_t rows,
                      int64_t first_pos, int64_t key_end, int64_t head_dim, int64_t token_stride, int64_t block_stride,
                      int64_t block_size, float scale, T* out, int64_t out_row_stride, Scratch& sc) {
  float *qf = sc.qf.data(), *kf = sc.kf.data(), *vf = sc.vf.data(), *acc = sc.acc.data(), *pb = sc.p.data();
  for (int64_t i = 0; i < ROWS; ++i) {
    const T* row = q + std::min(i, rows - 1) * q_row_stride;  // padding lanes repeat the last row
    for (int64_t d = 0; d < head_dim; ++d) qf[d * ROWS + i] = to_f(row[d]) * scale;
  }
  std::fill(sc.acc.begin(), sc.acc.end(), 0.f);
  const __m512 neg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  __m512 m = neg_inf, l = _mm512_setzero_ps();
  const int64_t last_key = std::min(key_end, first_pos + ROWS);
  for (int64_t start = 0; start < last_key; start += 16) {
    const T* kp[16];
    const T* vrow[16];
    __mmask16 visible[16];
    keys16(k, v, table, start, first_pos, key_end, last_key, token_stride, block_stride, block_size, kp, vrow, visible);
    for (int64_t t = 0; t < 16; ++t)
      for (int64_t d = 0; d < head_dim; d += 16) {
        _mm512_storeu_ps(kf + t * head_dim + d, load16(kp[t] + d));
        _mm512_storeu_ps(vf + t * head_dim + d, vrow[t] ? load16(vrow[t] + d) : _mm512_setzero_ps());
      }
    __m512 s[16];
    for (int64_t t = 0; t < 16; t += 8) {
      __m512 a[8];
      for (int u = 0; u < 8; ++u) a[u] = _mm512_setzero_ps();
      for (int64_t d = 0; d < head_dim; ++d) {
        const __m512 qv = _mm512_loadu_ps(qf + d * ROWS);
        for (int u = 0; u < 8; ++u) a[u] = _mm512_fmadd_ps(qv, _mm512_set1_ps(kf[(t + u) * head_dim + d]), a[u]);
      }
      for (int u = 0; u < 8; ++u) s[t + u] = _mm512_mask_mov_ps(neg_inf, visible[t + u], a[u]);
    }
    const __m512 rescale = raise_max(m, s);
    l = _mm512_mul_ps(l, rescale);
    for (int t = 0; t < 16; ++t) {
      const __m512 p = _mm512_maskz_mov_ps(visible[t], exp16(_mm512_sub_ps(s[t], m)));
      l = _mm512_add_ps(l, p);
      _mm512_storeu_ps(pb + t * ROWS, p);
    }
    for (int64_t d0 = 0; d0 < head_dim; d0 += 8) {
      __m512 r[8];
      for (int u = 0; u < 8; ++u) r[u] = _mm512_mul_ps(_mm512_loadu_ps(acc + (d0 + u) * ROWS), rescale);
      for (int64_t t = 0; t < 16; ++t) {
        const __m512 p = _mm512_loadu_ps(pb + t * ROWS);
        for (int u = 0; u < 8; ++u) r[u] = _mm512_fmadd_ps(p, _mm512_set1_ps(vf[t * head_dim + d0 + u]), r[u]);
      }
      for (int u = 0; u < 8; ++u) _mm512_storeu_ps(acc + (d0 + u) * ROWS, r[u]);
    }
  }
  store_rows(acc, l, head_dim, rows, out, out_row_stride, [](int64_t p) { return p; });
}

#if defined(__AVX512BF16__)
// Values are paired by _mm512_unpack{lo,hi}_epi16 within 128-bit lanes, which leaves a
// 32-dim chunk's dims in the order 0-3, 8-11, 16-19, 24-27, then 4-7, 12-15, ...: the
// dim that the accumulator at position p holds.
static inline int64_t value_dim(int64_t p) { return 32 * (p / 32) + 8 * ((p % 16) / 4) + 4 * ((p % 32) / 16) + p % 4; }

static inline int32_t pair_at(const at::BFloat16* p, int64_t c) {
  int32_t v;
  std::memcpy(&v, p + 2 * c, sizeof v);
  return v;
}

// One tile: rows query rows (<= 16) at positions first_pos.., of one query head, whose
// keys and values lie at k/v (this kv head's offset already applied) + table[t / block_size]
// * block_stride + (t % block_size) * token_stride; keys < key_end are the sequence's.
static void tile(const at::BFloat16* q, int64_t q_row_stride, const at::BFloat16* k, const at::BFloat16* v,
                 const int32_t* table, int64_t rows, int64_t first_pos, int64_t key_end, int64_t head_dim,
                 int64_t token_stride, int64_t block_stride, int64_t block_size, float scale, at::BFloat16* out,
                 int64_t out_row_stride, Scratch& sc) {
  const int64_t pairs = head_dim / 2;
  for (int64_t i = 0; i < ROWS; ++i) {
    const at::BFloat16* row = q + std::min(i, rows - 1) * q_row_stride;  // padding lanes repeat the last row
    for (int64_t c = 0; c < pairs; ++c) sc.qp[c * ROWS + i] = pair_at(row, c);
  }
  std::fill(sc.acc.begin(), sc.acc.end(), 0.f);
  const __m512 neg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  const __m512 vscale = _mm512_set1_ps(scale);
  __m512 m = neg_inf, l = _mm512_setzero_ps();
  // Word k of the result takes word idx[k]: keys 2j's and 2j+1's probabilities, lane by lane.
  alignas(64) int16_t interleave[32];
  for (int i = 0; i < 16; ++i) interleave[2 * i] = int16_t(i), interleave[2 * i + 1] = int16_t(16 + i);
  const __m512i pair_up = _mm512_load_si512(interleave);
  const at::BFloat16 zero_row[128] = {};  // values of keys past the sequence's end (their slots may hold NaN)

  const int64_t last_key = std::min(key_end, first_pos + ROWS);  // the tile's last row sees keys < this
  for (int64_t start = 0; start < last_key; start += 16) {
    const at::BFloat16* kp[16];
    const at::BFloat16* vrow[16];
    __mmask16 visible[16];
    keys16(k, v, table, start, first_pos, key_end, last_key, token_stride, block_stride, block_size, kp, vrow, visible);
    for (int64_t t = 0; t < 16; ++t) vrow[t] = vrow[t] ? vrow[t] : zero_row;
    __m512 s[16];
    for (int64_t t = 0; t < 16; t += 8) {
      __m512 a[8];
      for (int u = 0; u < 8; ++u) a[u] = _mm512_setzero_ps();
      for (int64_t c = 0; c < pairs; ++c) {
        const __m512bh qv = (__m512bh)_mm512_loadu_si512(sc.qp.data() + c * ROWS);
        for (int u = 0; u < 8; ++u) a[u] = _mm512_dpbf16_ps(a[u], qv, (__m512bh)_mm512_set1_epi32(pair_at(kp[t + u], c)));
      }
      for (int u = 0; u < 8; ++u) s[t + u] = _mm512_mask_mul_ps(neg_inf, visible[t + u], a[u], vscale);
    }
    const __m512 rescale = raise_max(m, s);
    l = _mm512_mul_ps(l, rescale);
    __m512i pp[8];
    for (int j = 0; j < 8; ++j) {
      const __m512 p0 = _mm512_maskz_mov_ps(visible[2 * j], exp16(_mm512_sub_ps(s[2 * j], m)));
      const __m512 p1 = _mm512_maskz_mov_ps(visible[2 * j + 1], exp16(_mm512_sub_ps(s[2 * j + 1], m)));
      const __m512i both = (__m512i)_mm512_cvtne2ps_pbh(p1, p0);  // words 0-15: p0, 16-31: p1
      pp[j] = _mm512_permutexvar_epi16(pair_up, both);
      // The sum takes the probabilities as rounded, so the weights used sum to l.
      const __m512i wide0 = _mm512_slli_epi32(pp[j], 16), wide1 = _mm512_and_si512(pp[j], _mm512_set1_epi32(int(0xFFFF0000u)));
      l = _mm512_add_ps(l, _mm512_add_ps(_mm512_castsi512_ps(wide0), _mm512_castsi512_ps(wide1)));
    }
    for (int j = 0; j < 8; ++j) {
      for (int64_t c = 0; c < head_dim; c += 32) {
        const __m512i a0 = _mm512_loadu_si512(vrow[2 * j] + c), a1 = _mm512_loadu_si512(vrow[2 * j + 1] + c);
        _mm512_storeu_si512(sc.vp.data() + j * head_dim + c, _mm512_unpacklo_epi16(a0, a1));
        _mm512_storeu_si512(sc.vp.data() + j * head_dim + c + 16, _mm512_unpackhi_epi16(a0, a1));
      }
    }
    for (int64_t p0 = 0; p0 < head_dim; p0 += 16) {
      __m512 r[16];
      for (int u = 0; u < 16; ++u) r[u] = _mm512_mul_ps(_mm512_loadu_ps(sc.acc.data() + (p0 + u) * ROWS), rescale);
      for (int j = 0; j < 8; ++j) {
        const int32_t* vj = sc.vp.data() + j * head_dim + p0;
        for (int u = 0; u < 16; ++u) r[u] = _mm512_dpbf16_ps(r[u], (__m512bh)pp[j], (__m512bh)_mm512_set1_epi32(vj[u]));
      }
      for (int u = 0; u < 16; ++u) _mm512_storeu_ps(sc.acc.data() + (p0 + u) * ROWS, r[u]);
    }
  }
  store_rows(sc.acc.data(), l, head_dim, rows, out, out_row_stride, value_dim);
}
#endif  // __AVX512BF16__

}  // namespace prefill
#endif  // __AVX512F__

// Whether paged_prefill runs here for this dtype: fp32 or bf16 on AVX-512 (bf16's dots in
// hardware with AVX512-BF16), head_dim a multiple of 32 up to 128.
bool paged_prefill_available(at::ScalarType dtype, int64_t head_dim) {
#if defined(__AVX512F__)
  return (dtype == at::kFloat || dtype == at::kBFloat16) && head_dim % 32 == 0 && head_dim <= 128;
#else
  (void)dtype;
  (void)head_dim;
  return false;
#endif
}

#if defined(__AVX512F__)
// Every prefill tile of the batch, spread over the threads.
template <typename T, typename Tile>
static void prefill_tiles(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                          const torch::Tensor& block_tables, const torch::Tensor& query_start_loc,
                          const torch::Tensor& seq_lens, int64_t num_decodes, float scale, torch::Tensor& out, Tile tile) {
  const int64_t num_seqs = seq_lens.numel(), heads = q.size(1), head_dim = q.size(2);
  const int64_t block_size = k_cache.size(1), kv_heads = k_cache.size(2);
  const int32_t* starts = query_start_loc.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  struct Item { int64_t seq, head, row; };
  std::vector<Item> items;
  for (int64_t s = num_decodes; s < num_seqs; ++s) {
    const int64_t qlen = starts[s + 1] - starts[s];
    TORCH_CHECK(qlen >= 0 && qlen <= lens[s] && starts[s + 1] <= q.size(0), "a chunk longer than its sequence or past q");
    for (int64_t h = 0; h < heads; ++h)
      for (int64_t r = 0; r < qlen; r += prefill::ROWS) items.push_back({s, h, r});
  }
  const T* qd = q.data_ptr<T>();
  const T* kd = k_cache.data_ptr<T>();
  const T* vd = v_cache.data_ptr<T>();
  T* od = out.data_ptr<T>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int64_t group = heads / kv_heads, token_stride = kv_heads * head_dim, block_stride = block_size * token_stride;
  const int64_t q_stride = q.stride(0), table_stride = block_tables.stride(0);
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), items.size()));
  // Items alternate between threads: neighbours (the same sequence and head, one tile on)
  // cost about the same, so each thread gets an even share of every sequence.
  at::parallel_for(0, threads, 1, [&](int64_t first, int64_t last) {
    prefill::Scratch sc(head_dim);
    for (int64_t t = first; t < last; ++t)
      for (int64_t i = t; i < int64_t(items.size()); i += threads) {
        const Item& it = items[i];
        const int64_t qlen = starts[it.seq + 1] - starts[it.seq], len = lens[it.seq];
        const int64_t row0 = starts[it.seq] + it.row, kv = it.head / group;
        tile(qd + row0 * q_stride + it.head * head_dim, q_stride, kd + kv * head_dim, vd + kv * head_dim,
             tables + it.seq * table_stride, std::min(prefill::ROWS, qlen - it.row), len - qlen + it.row, len, head_dim,
             token_stride, block_stride, block_size, scale, od + row0 * heads * head_dim + it.head * head_dim,
             heads * head_dim, sc);
      }
  });
}
#endif

// Prefill rows of out (the sequences from num_decodes on; their rows of q from
// query_start_loc[num_decodes]) for an fp32 or bf16 batch; the decodes' rows are left as they are.
torch::Tensor paged_prefill(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor block_tables,
                            torch::Tensor query_start_loc, torch::Tensor seq_lens, int64_t num_decodes, double scale,
                            torch::Tensor out) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4, "q must be [tokens, heads, dim], caches [blocks, block_size, kv_heads, dim]");
  const auto dtype = q.scalar_type();
  TORCH_CHECK(paged_prefill_available(dtype, q.size(2)),
              "paged_prefill needs AVX-512, fp32 or bf16, and head_dim a multiple of 32 up to 128");
  TORCH_CHECK(k_cache.scalar_type() == dtype && v_cache.scalar_type() == dtype && out.scalar_type() == dtype,
              "q, caches and out must share a dtype");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && v_cache.sizes() == k_cache.sizes(), "caches must be contiguous and alike");
  TORCH_CHECK(out.is_contiguous() && out.sizes() == q.sizes(), "out must be contiguous and shaped like q");
  TORCH_CHECK(block_tables.scalar_type() == torch::kInt32 && seq_lens.scalar_type() == torch::kInt32 &&
                  query_start_loc.scalar_type() == torch::kInt32,
              "block_tables, query_start_loc and seq_lens must be int32");
  if (q.stride(2) != 1 || q.stride(1) != q.size(2)) q = q.contiguous();
  block_tables = block_tables.contiguous();
  seq_lens = seq_lens.contiguous();
  query_start_loc = query_start_loc.contiguous();
  const int64_t num_seqs = seq_lens.numel(), heads = q.size(1), kv_heads = k_cache.size(2);
  TORCH_CHECK(heads % kv_heads == 0 && k_cache.size(3) == q.size(2), "heads must be a multiple of kv heads, head_dim q's");
  TORCH_CHECK(query_start_loc.numel() == num_seqs + 1 && block_tables.size(0) == num_seqs && num_decodes <= num_seqs,
              "one block-table row and one length per sequence, and query_start_loc one longer");
#if defined(__AVX512F__)
  const float s = static_cast<float>(scale);
  if (dtype == at::kFloat) {
    prefill_tiles<float>(q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, num_decodes, s, out,
                         prefill::tile_wide<float>);
  } else {
#if defined(__AVX512BF16__)
    prefill_tiles<at::BFloat16>(q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, num_decodes, s, out,
                                prefill::tile);
#else
    prefill_tiles<at::BFloat16>(q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, num_decodes, s, out,
                                prefill::tile_wide<at::BFloat16>);
#endif
  }
#endif
  return out;
}


// ---------------------------------------------------------------------------------
// add_rms_norm: residual += x (rounded to the dtype, as the reference does), then
// out = weight * dtype(residual * rsqrt(mean(residual^2) + eps)). Returns out.
template <typename T>
static void add_rms_norm_kernel(const T* x, T* residual, const T* weight, T* out, int64_t rows, int64_t dim, float eps, bool add) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> buf(dim);
#if defined(__AVX512F__)
    // bf16, sixteen at a time (the scalar loop takes ~5 cycles per element converting).
    if constexpr (std::is_same_v<T, at::BFloat16>) {
      if (dim % 16 == 0) {
        for (int64_t r = begin; r < end; ++r) {
          T* res = residual + r * dim;
          __m512 sq = _mm512_setzero_ps();
          for (int64_t d = 0; d < dim; d += 16) {
            __m512 v = load_bf16x16(res + d);
            if (add) {
              v = round_bf16x16(_mm512_add_ps(v, load_bf16x16(x + r * dim + d)));
              store_bf16x16(res + d, v);
            }
            _mm512_storeu_ps(buf.data() + d, v);
            sq = _mm512_fmadd_ps(v, v, sq);
          }
          const __m512 inv = _mm512_set1_ps(1.f / std::sqrt(_mm512_reduce_add_ps(sq) / static_cast<float>(dim) + eps));
          for (int64_t d = 0; d < dim; d += 16)
            store_bf16x16(out + r * dim + d,
                          _mm512_mul_ps(load_bf16x16(weight + d), round_bf16x16(_mm512_mul_ps(_mm512_loadu_ps(buf.data() + d), inv))));
        }
        return;
      }
    }
#endif
    for (int64_t r = begin; r < end; ++r) {
      T* res = residual + r * dim;
      float sq = 0.f;
      for (int64_t d = 0; d < dim; ++d) {
        float v = to_f(res[d]);
        if (add) {
          const T rounded = static_cast<T>(v + to_f(x[r * dim + d]));
          res[d] = rounded;
          v = to_f(rounded);
        }
        buf[d] = v;
        sq += v * v;
      }
      const float inv = 1.f / std::sqrt(sq / static_cast<float>(dim) + eps);
      T* o = out + r * dim;
      for (int64_t d = 0; d < dim; ++d) o[d] = static_cast<T>(to_f(weight[d]) * to_f(static_cast<T>(buf[d] * inv)));
    }
  });
}

torch::Tensor add_rms_norm(torch::Tensor x, torch::Tensor residual, torch::Tensor weight, double eps, bool add) {
  TORCH_CHECK(residual.is_contiguous() && weight.is_contiguous(), "residual and weight must be contiguous");
  TORCH_CHECK(x.sizes() == residual.sizes(), "x and residual must have the same shape");
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == residual.size(-1), "weight must be [hidden]");
  TORCH_CHECK(x.scalar_type() == residual.scalar_type() && weight.scalar_type() == residual.scalar_type(), "x, residual and weight must share a dtype");
  x = x.contiguous();
  auto out = torch::empty_like(residual);
  const int64_t dim = residual.size(-1), rows = residual.numel() / dim;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, residual.scalar_type(), "add_rms_norm", [&] {
    add_rms_norm_kernel<scalar_t>(x.data_ptr<scalar_t>(), residual.data_ptr<scalar_t>(), weight.data_ptr<scalar_t>(),
                                  out.data_ptr<scalar_t>(), rows, dim, static_cast<float>(eps), add);
  });
  return out;
}

// One head's dim values from src rotated by a token's angles (c, s: dim / 2 each) into dst,
// rotate-half layout; src may be dst.
template <typename T>
static inline void rotate_head(const T* src, T* dst, const float* c, const float* s, int64_t half) {
#if defined(__AVX512F__)
  if constexpr (std::is_same_v<T, at::BFloat16>) {
    if (half % 16 == 0) {
      for (int64_t i = 0; i < half; i += 16) {
        const __m512 a = load_bf16x16(src + i), b = load_bf16x16(src + i + half);
        const __m512 ci = _mm512_loadu_ps(c + i), si = _mm512_loadu_ps(s + i);
        store_bf16x16(dst + i, _mm512_fmsub_ps(a, ci, _mm512_mul_ps(b, si)));
        store_bf16x16(dst + i + half, _mm512_fmadd_ps(b, ci, _mm512_mul_ps(a, si)));
      }
      return;
    }
  }
#endif
  for (int64_t i = 0; i < half; ++i) {
    const float a = to_f(src[i]), b = to_f(src[i + half]);
    dst[i] = static_cast<T>(a * c[i] - b * s[i]);
    dst[i + half] = static_cast<T>(b * c[i] + a * s[i]);
  }
}

// rotary: x[token, head, :] rotated in place by the token's angle.
template <typename T>
static void rotary_kernel(T* x, const float* cos, const float* sin, int64_t tokens, int64_t heads, int64_t dim) {
  const int64_t half = dim / 2;
  at::parallel_for(0, tokens, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t)
      for (int64_t h = 0; h < heads; ++h) rotate_head(x + (t * heads + h) * dim, x + (t * heads + h) * dim, cos + t * half, sin + t * half, half);
  });
}

torch::Tensor rotary(torch::Tensor x, torch::Tensor cos, torch::Tensor sin) {
  TORCH_CHECK(cos.scalar_type() == torch::kFloat && sin.scalar_type() == torch::kFloat, "cos and sin must be fp32");
  TORCH_CHECK(x.dim() == 3 && x.size(2) % 2 == 0, "x must be [tokens, heads, even head_dim]");
  TORCH_CHECK(cos.dim() == 2 && cos.size(0) == x.size(0) && cos.size(1) == x.size(2) / 2 && sin.sizes() == cos.sizes(),
              "cos and sin must be [tokens, head_dim / 2]");
  x = x.contiguous();
  cos = cos.contiguous();
  sin = sin.contiguous();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rotary", [&] {
    rotary_kernel<scalar_t>(x.data_ptr<scalar_t>(), cos.data_ptr<float>(), sin.data_ptr<float>(), x.size(0), x.size(1), x.size(2));
  });
  return x;
}

// A step's cache slots as contiguous int64, each checked to lie inside the cache (a
// negative slot is a token that owns none and is skipped by the caller).
static torch::Tensor checked_slots(torch::Tensor slots, const torch::Tensor& cache) {
  slots = slots.to(torch::kLong).contiguous();
  const int64_t* slot = slots.data_ptr<int64_t>();
  const int64_t num_slots = cache.size(0) * cache.size(1);
  for (int64_t t = 0; t < slots.numel(); ++t) TORCH_CHECK(slot[t] < num_slots, "slot ", slot[t], " is outside the cache");
  return slots;
}

// rotary_write_kv: a fused q/k/v projection's output row per token ([heads | kv_heads |
// kv_heads] x dim) in one pass: q rotated into a new [tokens, heads, dim], k rotated and v
// copied straight into the token's cache slot (a negative slot skips both). In the model
// it stands for a split, three views, two rotary calls and write_kv, which cost ~100 us a
// layer at a 64-token step, most of it Python and allocations.
template <typename T>
static void rotary_write_kv_kernel(const T* qkv, const float* cos, const float* sin, T* q, T* k_cache, T* v_cache,
                                   const int64_t* slot, int64_t tokens, int64_t heads, int64_t kv_heads, int64_t dim) {
  const int64_t half = dim / 2, width = (heads + 2 * kv_heads) * dim, kv_row = kv_heads * dim;
  at::parallel_for(0, tokens, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const T* row = qkv + t * width;
      const float *c = cos + t * half, *s = sin + t * half;
      for (int64_t h = 0; h < heads; ++h) rotate_head(row + h * dim, q + (t * heads + h) * dim, c, s, half);
      if (slot[t] < 0) continue;
      for (int64_t h = 0; h < kv_heads; ++h) rotate_head(row + (heads + h) * dim, k_cache + slot[t] * kv_row + h * dim, c, s, half);
      std::memcpy(v_cache + slot[t] * kv_row, row + (heads + kv_heads) * dim, kv_row * sizeof(T));
    }
  });
}

torch::Tensor rotary_write_kv(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin, torch::Tensor k_cache,
                              torch::Tensor v_cache, torch::Tensor slots, int64_t num_heads) {
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.is_contiguous() && v_cache.sizes() == k_cache.sizes(),
              "caches must be contiguous [blocks, block_size, kv_heads, head_dim]");
  const int64_t kv_heads = k_cache.size(2), dim = k_cache.size(3), tokens = qkv.size(0);
  TORCH_CHECK(qkv.dim() == 2 && qkv.size(1) == (num_heads + 2 * kv_heads) * dim && dim % 2 == 0,
              "qkv must be [tokens, (heads + 2 * kv_heads) * head_dim], head_dim even");
  TORCH_CHECK(qkv.scalar_type() == k_cache.scalar_type() && v_cache.scalar_type() == k_cache.scalar_type(),
              "qkv and caches must share a dtype");
  TORCH_CHECK(cos.scalar_type() == torch::kFloat && sin.scalar_type() == torch::kFloat && cos.dim() == 2 &&
              cos.size(0) == tokens && cos.size(1) == dim / 2 && sin.sizes() == cos.sizes(),
              "cos and sin must be fp32 [tokens, head_dim / 2]");
  TORCH_CHECK(slots.dim() == 1 && slots.size(0) == tokens, "one slot per token");
  qkv = qkv.contiguous();
  cos = cos.contiguous();
  sin = sin.contiguous();
  slots = checked_slots(slots, k_cache);
  const int64_t* slot = slots.data_ptr<int64_t>();
  auto q = torch::empty({tokens, num_heads, dim}, qkv.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, qkv.scalar_type(), "rotary_write_kv", [&] {
    rotary_write_kv_kernel<scalar_t>(qkv.data_ptr<scalar_t>(), cos.data_ptr<float>(), sin.data_ptr<float>(),
                                     q.data_ptr<scalar_t>(), k_cache.data_ptr<scalar_t>(), v_cache.data_ptr<scalar_t>(), slot,
                                     tokens, num_heads, kv_heads, dim);
  });
  return q;
}

// silu_and_mul: out[n, i] = silu(x[n, i]) * x[n, i + inter].
#if defined(__AVX512F__)
// silu(a) * up, sixteen lanes in fp32.
static inline __m512 silu_mul16(__m512 a, __m512 up) {
  const __m512 e = exp16(_mm512_min_ps(_mm512_sub_ps(_mm512_setzero_ps(), a), _mm512_set1_ps(80.f)));
  // 1 / (1 + e) by a reciprocal estimate and one Newton step (~2^-23): a divide kept the
  // loop at ~2 cycles per element.
  const __m512 den = _mm512_add_ps(_mm512_set1_ps(1.f), e);
  __m512 rcp = _mm512_rcp14_ps(den);
  rcp = _mm512_mul_ps(rcp, _mm512_fnmadd_ps(den, rcp, _mm512_set1_ps(2.f)));
  return _mm512_mul_ps(_mm512_mul_ps(a, rcp), up);
}
#endif

template <typename T>
static void silu_and_mul_kernel(const T* x, T* out, int64_t rows, int64_t inter) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
#if defined(__AVX512F__)
    if constexpr (std::is_same_v<T, at::BFloat16>) {
      if (inter % 16 == 0) {
        for (int64_t r = begin; r < end; ++r) {
          const T* g = x + r * 2 * inter;
          for (int64_t i = 0; i < inter; i += 16)
            store_bf16x16(out + r * inter + i, silu_mul16(load_bf16x16(g + i), load_bf16x16(g + inter + i)));
        }
        return;
      }
    }
#endif
    for (int64_t r = begin; r < end; ++r) {
      const T* g = x + r * 2 * inter;
      const T* u = g + inter;
      T* o = out + r * inter;
      for (int64_t i = 0; i < inter; ++i) {
        const float a = to_f(g[i]);
        // Clamped: under -ffast-math, a / (1 + inf) for gates below about -88 came out NaN.
        o[i] = static_cast<T>(a / (1.f + std::exp(std::min(-a, 80.f))) * to_f(u[i]));
      }
    }
  });
}

torch::Tensor silu_and_mul(torch::Tensor x) {
  x = x.contiguous();
  const int64_t inter = x.size(-1) / 2, rows = x.numel() / x.size(-1);
  auto sizes = x.sizes().vec();
  sizes.back() = inter;
  auto out = torch::empty(sizes, x.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "silu_and_mul", [&] {
    silu_and_mul_kernel<scalar_t>(x.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), rows, inter);
  });
  return out;
}

// linear_small: out = x @ w.T (+ bias) for a few rows of x, fp32. At one to a few tokens a
// step is a matrix-vector product that streams every weight from memory once; oneDNN and
// MKL read them at ~11 GB/s on a 2-core AVX2 EPYC that reads ~21 GB/s. Four weight rows
// stream side by side against two rows of x at a time (the weights stay in L1 for the
// next two), each thread on its own contiguous run of rows.
static void linear_small_kernel(const float* x, const float* w, const float* bias, float* out, int64_t m, int64_t n,
                                int64_t k) {
  at::parallel_for(0, (n + 3) / 4, 16, [&](int64_t begin, int64_t end) {
    for (int64_t quad = begin; quad < end; ++quad) {
      const int64_t r0 = quad * 4, rows = std::min<int64_t>(4, n - r0);
      for (int64_t i = 0; i < m; i += 2) {
        const int64_t xs = std::min<int64_t>(2, m - i);
        float sums[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
#if defined(__AVX2__) && defined(__FMA__)
        if (rows == 4 && k % 8 == 0) {
          const float* w0 = w + r0 * k;
          const float* x0 = x + i * k;
          const float* x1 = x + (i + xs - 1) * k;  // the same row again when only one is left
          __m256 a00 = _mm256_setzero_ps(), a01 = a00, a02 = a00, a03 = a00;
          __m256 a10 = a00, a11 = a00, a12 = a00, a13 = a00;
          for (int64_t c = 0; c < k; c += 8) {
            const __m256 v0 = _mm256_loadu_ps(x0 + c), v1 = _mm256_loadu_ps(x1 + c);
            const __m256 q0 = _mm256_loadu_ps(w0 + c), q1 = _mm256_loadu_ps(w0 + k + c);
            const __m256 q2 = _mm256_loadu_ps(w0 + 2 * k + c), q3 = _mm256_loadu_ps(w0 + 3 * k + c);
            a00 = _mm256_fmadd_ps(v0, q0, a00);
            a01 = _mm256_fmadd_ps(v0, q1, a01);
            a02 = _mm256_fmadd_ps(v0, q2, a02);
            a03 = _mm256_fmadd_ps(v0, q3, a03);
            a10 = _mm256_fmadd_ps(v1, q0, a10);
            a11 = _mm256_fmadd_ps(v1, q1, a11);
            a12 = _mm256_fmadd_ps(v1, q2, a12);
            a13 = _mm256_fmadd_ps(v1, q3, a13);
          }
          _mm_storeu_ps(sums[0], hsum4(a00, a01, a02, a03));
          _mm_storeu_ps(sums[1], hsum4(a10, a11, a12, a13));
        } else
#endif
        {
          for (int64_t j = 0; j < xs; ++j)
            for (int64_t r = 0; r < rows; ++r) {
              const float* wr = w + (r0 + r) * k;
              const float* xr = x + (i + j) * k;
              float acc = 0.f;
              for (int64_t c = 0; c < k; ++c) acc += xr[c] * wr[c];
              sums[j][r] = acc;
            }
        }
        for (int64_t j = 0; j < xs; ++j)
          for (int64_t r = 0; r < rows; ++r) out[(i + j) * n + r0 + r] = sums[j][r] + (bias ? bias[r0 + r] : 0.f);
      }
    }
  });
}

#if defined(__AVX512F__)
// acc + a[2i] * b[2i] + a[2i + 1] * b[2i + 1] in lane i, for 32 bf16 pairs: vdpbf16ps with
// AVX512-BF16; without it, each bf16 widened to fp32 (the even ones by a shift, the odd ones
// by masking off their neighbour) and two FMAs. Products of bf16 values are exact in fp32.
static inline __m512 dot_pairs_bf16(__m512 acc, __m512i a, __m512i b) {
#if defined(__AVX512BF16__)
  return _mm512_dpbf16_ps(acc, (__m512bh)a, (__m512bh)b);
#else
  const __m512i high = _mm512_set1_epi32(int(0xFFFF0000u));
  acc = _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_slli_epi32(a, 16)), _mm512_castsi512_ps(_mm512_slli_epi32(b, 16)), acc);
  return _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_and_si512(a, high)), _mm512_castsi512_ps(_mm512_and_si512(b, high)), acc);
#endif
}

// The same for bf16 (AVX-512, k a multiple of 32): x's and the weights' bf16 pairs dotted in
// fp32 (dot_pairs_bf16), and each output is rounded to bf16 once, as oneDNN rounds it. On a
// 2-core AMX Xeon oneDNN ran a one-token pass over SmolLM2's weights 1.45x slower than
// this (bench/linear_small.py --dtype bfloat16). The engine takes it where bf16 is only
// emulated (AVX-512 without AVX512-BF16): with AVX512-BF16, oneDNN ran as fast at one row
// on a Zen 5 EPYC, and sums a row alike at every row count (kernels/linear.py).
// XS rows of x (1 to 4) against four weight rows wr[0..3]: sums[j][r].
template <int XS>
static inline void dot_rows_bf16(const at::BFloat16* x, const at::BFloat16* const* wr, int64_t k, float sums[4][4]) {
  __m512 a[XS][4];
  for (int j = 0; j < XS; ++j)
    for (int r = 0; r < 4; ++r) a[j][r] = _mm512_setzero_ps();
  for (int64_t c = 0; c < k; c += 32) {
    __m512i v[XS];
    for (int j = 0; j < XS; ++j) v[j] = _mm512_loadu_si512(x + j * k + c);
    for (int r = 0; r < 4; ++r) {
      const __m512i q = _mm512_loadu_si512(wr[r] + c);
      for (int j = 0; j < XS; ++j) a[j][r] = dot_pairs_bf16(a[j][r], v[j], q);
    }
  }
  for (int j = 0; j < XS; ++j)
    for (int r = 0; r < 4; ++r) sums[j][r] = _mm512_reduce_add_ps(a[j][r]);
}

static void linear_small_bf16_kernel(const at::BFloat16* x, const at::BFloat16* w, const at::BFloat16* bias,
                                     at::BFloat16* out, int64_t m, int64_t n, int64_t k) {
#if defined(__AVX512BF16__)
  constexpr int X_ROWS = 2;
#else
  // Widening costs two ops per loaded vector: four rows of x share each widened weight vector.
  constexpr int X_ROWS = 4;
#endif
  at::parallel_for(0, (n + 3) / 4, 16, [&](int64_t begin, int64_t end) {
    for (int64_t quad = begin; quad < end; ++quad) {
      const int64_t r0 = quad * 4, rows = std::min<int64_t>(4, n - r0);
      // Past the last weight row, repeat it: its sums are computed and dropped.
      const at::BFloat16* wr[4];
      for (int64_t r = 0; r < 4; ++r) wr[r] = w + (r0 + std::min(r, rows - 1)) * k;
      for (int64_t i = 0; i < m; i += X_ROWS) {
        const int64_t xs = std::min<int64_t>(X_ROWS, m - i);
        float sums[4][4];
        switch (xs) {
          case 1: dot_rows_bf16<1>(x + i * k, wr, k, sums); break;
          case 2: dot_rows_bf16<2>(x + i * k, wr, k, sums); break;
          case 3: dot_rows_bf16<3>(x + i * k, wr, k, sums); break;
          default: dot_rows_bf16<X_ROWS>(x + i * k, wr, k, sums); break;
        }
        for (int64_t j = 0; j < xs; ++j)
          for (int64_t r = 0; r < rows; ++r)
            out[(i + j) * n + r0 + r] = static_cast<at::BFloat16>(sums[j][r] + (bias ? to_f(bias[r0 + r]) : 0.f));
      }
    }
  });
}
#endif

// Whether linear_small takes bf16 on this build (AVX-512 and the input width a multiple of 32).
bool linear_small_bf16(int64_t in_features) {
#if defined(__AVX512F__)
  return in_features % 32 == 0;
#else
  (void)in_features;
  return false;
#endif
}

// Whether this build dots bf16 natively (AVX512-BF16) rather than widened to fp32.
bool bf16_native() {
#if defined(__AVX512BF16__)
  return true;
#else
  return false;
#endif
}

bool avx512() {
#if defined(__AVX512F__)
  return true;
#else
  return false;
#endif
}

// A linear layer's bias, checked against x and n (undefined when there is none), and its
// output: x's shape with the last dimension n.
static torch::Tensor checked_bias(const c10::optional<torch::Tensor>& bias, const torch::Tensor& x, int64_t n) {
  if (!bias.has_value() || !bias->defined()) return torch::Tensor();
  TORCH_CHECK(bias->scalar_type() == x.scalar_type() && bias->numel() == n, "bias must be [out_features] in x's dtype");
  return bias->contiguous();
}

static torch::Tensor linear_out(const torch::Tensor& x, int64_t n) {
  auto sizes = x.sizes().vec();
  sizes.back() = n;
  return torch::empty(sizes, x.options());
}

torch::Tensor linear_small(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(x.scalar_type() == w.scalar_type(), "x and w must share a dtype");
  TORCH_CHECK(x.scalar_type() == torch::kFloat || (x.scalar_type() == torch::kBFloat16 && linear_small_bf16(w.size(-1))),
              "linear_small takes fp32, and bf16 where the CPU has AVX-512 and in_features is a multiple of 32");
  TORCH_CHECK(w.dim() == 2 && w.is_contiguous(), "w must be a contiguous [out_features, in_features]");
  TORCH_CHECK(x.size(-1) == w.size(1), "x's last dimension must be w's in_features");
  x = x.contiguous();
  const int64_t k = w.size(1), n = w.size(0), m = x.numel() / k;
  torch::Tensor bias_c = checked_bias(bias, x, n);
  auto out = linear_out(x, n);
#if defined(__AVX512F__)
  if (x.scalar_type() == torch::kBFloat16) {
    linear_small_bf16_kernel(x.data_ptr<at::BFloat16>(), w.data_ptr<at::BFloat16>(),
                             bias_c.defined() ? bias_c.data_ptr<at::BFloat16>() : nullptr, out.data_ptr<at::BFloat16>(), m, n, k);
    return out;
  }
#endif
  linear_small_kernel(x.data_ptr<float>(), w.data_ptr<float>(), bias_c.defined() ? bias_c.data_ptr<float>() : nullptr,
                      out.data_ptr<float>(), m, n, k);
  return out;
}

#if defined(__AMX_BF16__) && defined(__AMX_TILE__) && defined(__AVX512BF16__)
#define HAVE_AMX 1
// linear_amx: out = x @ w.T (+ bias) in bf16 on AMX's tile units, for the rows of a decode
// step. oneDNN runs these shapes on AMX too, but at 2-64 rows it read SmolLM2's weights at
// 8-13 GB/s where this reads them at 16-24 (1.3-1.7x, 30 layers' weights each once, so they
// stream from memory as in a step; bench/linear_small.py --dtype bfloat16). The weights are
// repacked once (kernels.linear.pack_amx): [out/16][in/32] tiles of 16 rows (pairs of inputs)
// x 16 columns (outputs) x 2, the layout TDPBF16PS takes its second operand in, each 1 KB
// tile contiguous and a column block's tiles one after another, so a thread streams its
// share of the weights front to back. Each thread takes 32 outputs at a time and, for every
// two 16-row blocks of x, keeps four fp32 accumulator tiles; x's last m % 16 rows are copied
// into a zero-padded tile of their own. Sums are fp32 and rounded to bf16 once, as oneDNN does.
// A gated form takes a SwiGLU's gate_up weight and writes silu(gate) * up instead (see
// amx_store_silu): the activation in the epilogue, no intermediate written and read back.

struct TileConfig {
  uint8_t palette_id = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// The CPU has AMX-BF16 and Linux lets this process use the tile registers (asked once; a
// kernel or VM that has not enabled them says no, and the caller keeps oneDNN).
static bool amx_usable() {
  static const bool ok = [] {
    unsigned a, b, c, d;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !(d & (1u << 22)) || !(d & (1u << 24))) return false;
    constexpr long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
  }();
  return ok;
}

// Tiles 0-3 accumulate two row blocks x two column blocks, 4 and 5 hold x's rows, 6 and 7 the
// weights; every tile is 16 rows of 64 bytes.
static void amx_configure() {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.rows[t] = 16;
    cfg.colsb[t] = 64;
  }
  _tile_loadconfig(&cfg);
}

// rows of two stored accumulator tiles (c[r] columns 0-15, c[16 + r] columns 16-31) plus
// bias, rounded to bf16, into out (row stride n).
static inline void amx_store_rows(const float (*c)[16], int rows, const at::BFloat16* bias, at::BFloat16* out, int64_t n) {
  const __m512 b0 = bias ? load_bf16x16(bias) : _mm512_setzero_ps();
  const __m512 b1 = bias ? load_bf16x16(bias + 16) : _mm512_setzero_ps();
  for (int r = 0; r < rows; ++r) {
    store_bf16x16(out + r * n, _mm512_add_ps(_mm512_load_ps(c[r]), b0));
    store_bf16x16(out + r * n + 16, _mm512_add_ps(_mm512_load_ps(c[16 + r]), b1));
  }
}

// BLOCKS (1 or 2) 16-row blocks of x (a0, a1; row stride k) against the two 16-column
// weight blocks w0, w1 over all kb tiles of k: fp32 sums into c[block][column block * 16 + row].
template <int BLOCKS>
static inline void amx_dot(const at::BFloat16* a0, const at::BFloat16* a1, const at::BFloat16* w0, const at::BFloat16* w1,
                           int64_t kb, int64_t k, float (*c)[32][16]) {
  _tile_zero(0);
  _tile_zero(1);
  if (BLOCKS == 2) {
    _tile_zero(2);
    _tile_zero(3);
  }
  for (int64_t j = 0; j < kb; ++j) {
    _tile_loadd(4, a0 + j * 32, k * 2);
    _tile_loadd(6, w0 + j * 512, 64);
    _tile_loadd(7, w1 + j * 512, 64);
    _tile_dpbf16ps(0, 4, 6);
    if (BLOCKS == 2) _tile_loadd(5, a1 + j * 32, k * 2);
    _tile_dpbf16ps(1, 4, 7);
    if (BLOCKS == 2) {
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
  }
  _tile_stored(0, c[0][0], 64);
  _tile_stored(1, c[0][16], 64);
  if (BLOCKS == 2) {
    _tile_stored(2, c[1][0], 64);
    _tile_stored(3, c[1][16], 64);
  }
}

// The gated form (gate_up's weights packed with gate and up blocks alternating): the pair's
// two column blocks are 16 outputs' gate and up, rounded to bf16 as a separate projection's
// output would be, and out gets silu(gate) * up, as silu_and_mul would write it.
static inline void amx_store_silu(const float (*c)[16], int rows, at::BFloat16* out, int64_t n) {
  for (int r = 0; r < rows; ++r)
    store_bf16x16(out + r * n, silu_mul16(round_bf16x16(_mm512_load_ps(c[r])), round_bf16x16(_mm512_load_ps(c[16 + r]))));
}

template <bool GATED>
static void linear_amx_kernel(const at::BFloat16* x, const at::BFloat16* w, const at::BFloat16* bias, at::BFloat16* out,
                              int64_t m, int64_t n, int64_t k) {
  const int64_t kb = k / 32, blocks = (m + 15) / 16, out_cols = GATED ? n / 2 : n;
  const int tail = m % 16;
  std::vector<at::BFloat16> pad(tail ? 16 * k : 0, at::BFloat16(0.f));
  if (tail) std::memcpy(pad.data(), x + (m - tail) * k, tail * k * sizeof(at::BFloat16));
  auto rows_of = [&](int64_t b) { return (tail && b == blocks - 1) ? pad.data() : x + b * 16 * k; };
  auto count = [&](int64_t b) { return (tail && b == blocks - 1) ? tail : 16; };
  at::parallel_for(0, n / 32, 1, [&](int64_t begin, int64_t end) {
    amx_configure();  // tile state is per thread
    alignas(64) float c[2][32][16];
    for (int64_t p = begin; p < end; ++p) {
      const at::BFloat16* w0 = w + 2 * p * kb * 512;
      const at::BFloat16* w1 = w0 + kb * 512;
      const at::BFloat16* bias_p = bias ? bias + p * 32 : nullptr;
      at::BFloat16* out_p = out + p * (GATED ? 16 : 32);
      auto emit = [&](const float (*cb)[16], int64_t b) {
        if constexpr (GATED) amx_store_silu(cb, count(b), out_p + b * 16 * out_cols, out_cols);
        else amx_store_rows(cb, count(b), bias_p, out_p + b * 16 * out_cols, out_cols);
      };
      int64_t b = 0;
      for (; b + 1 < blocks; b += 2) {
        amx_dot<2>(rows_of(b), rows_of(b + 1), w0, w1, kb, k, c);
        emit(c[0], b);
        emit(c[1], b + 1);
      }
      if (b < blocks) {  // an odd block left
        amx_dot<1>(rows_of(b), nullptr, w0, w1, kb, k, c);
        emit(c[0], b);
      }
    }
    _tile_release();
  });
}
#endif

// Whether linear_amx runs here: built for a CPU with AMX-BF16 and allowed to use it.
bool linear_amx_available() {
#if defined(HAVE_AMX)
  return amx_usable();
#else
  return false;
#endif
}

torch::Tensor linear_amx(torch::Tensor x, torch::Tensor packed, c10::optional<torch::Tensor> bias, bool silu_mul) {
  TORCH_CHECK(linear_amx_available(), "linear_amx needs a CPU with AMX-BF16 that this process may use");
  TORCH_CHECK(x.scalar_type() == torch::kBFloat16 && packed.scalar_type() == torch::kBFloat16, "linear_amx takes bf16");
  TORCH_CHECK(packed.dim() == 4 && packed.size(0) % 2 == 0 && packed.size(2) == 16 && packed.size(3) == 32 && packed.is_contiguous(),
              "packed must be kernels.linear.pack_amx's [out/16, in/32, 16, 32] with out a multiple of 32");
  const int64_t n = packed.size(0) * 16, k = packed.size(1) * 32;
  TORCH_CHECK(x.size(-1) == k, "x's last dimension (", x.size(-1), ") must be the weight's in_features (", k, ")");
  x = x.contiguous();
  const int64_t m = x.numel() / k;
  torch::Tensor bias_c;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(!silu_mul, "linear_amx's silu_mul form takes no bias");
    TORCH_CHECK(bias->scalar_type() == torch::kBFloat16 && bias->numel() == n, "bias must be [out_features] in bf16");
    bias_c = bias->contiguous();
  }
  auto sizes = x.sizes().vec();
  sizes.back() = silu_mul ? n / 2 : n;
  auto out = torch::empty(sizes, x.options());
#if defined(HAVE_AMX)
  if (m > 0) {
    const at::BFloat16 *xp = x.data_ptr<at::BFloat16>(), *wp = packed.data_ptr<at::BFloat16>();
    const at::BFloat16* bp = bias_c.defined() ? bias_c.data_ptr<at::BFloat16>() : nullptr;
    if (silu_mul) linear_amx_kernel<true>(xp, wp, bp, out.data_ptr<at::BFloat16>(), m, n, k);
    else linear_amx_kernel<false>(xp, wp, bp, out.data_ptr<at::BFloat16>(), m, n, k);
  }
#endif
  return out;
}

// argmax_rows: each row's index of its largest value, the first of ties (and the first NaN,
// as torch.max takes NaN for the largest): greedy sampling's one pass over the logits.
// torch's max(-1) took 1.2-1.3 ms for 64 rows of SmolLM2's 49,152 bf16 logits, 1% of a step.
// By the bits: the module is built with -ffast-math, under which std::isnan is always false.
static inline bool is_nan_bits(float v) {
  uint32_t u;
  std::memcpy(&u, &v, sizeof(u));
  return (u & 0x7fffffffu) > 0x7f800000u;
}

template <typename T>
static int64_t argmax_row(const T* x, int64_t cols) {
  int64_t best = 0, c = 0;
  float top = to_f(x[0]);
#if defined(__AVX512F__)
  if constexpr (std::is_same_v<T, at::BFloat16>) {
    if (cols >= 16) {
      __m512 mx = load_bf16x16(x);
      __m512i idx = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), at = idx;
      __mmask16 nan = _mm512_cmp_ps_mask(mx, mx, _CMP_UNORD_Q);
      const __m512i step = _mm512_set1_epi32(16);
      for (c = 16; c + 16 <= cols; c += 16) {
        const __m512 v = load_bf16x16(x + c);
        at = _mm512_add_epi32(at, step);
        const __mmask16 gt = _mm512_cmp_ps_mask(v, mx, _CMP_GT_OQ);
        mx = _mm512_mask_blend_ps(gt, mx, v);
        idx = _mm512_mask_blend_epi32(gt, idx, at);
        nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
      }
      if (nan) {  // rare: find the first NaN the plain way
        for (int64_t i = 0; i < cols; ++i)
          if (is_nan_bits(to_f(x[i]))) return i;
      }
      top = _mm512_reduce_max_ps(mx);
      // The smallest index among the lanes holding the maximum.
      const __mmask16 at_top = _mm512_cmp_ps_mask(mx, _mm512_set1_ps(top), _CMP_EQ_OQ);
      best = _mm512_mask_reduce_min_epi32(at_top, idx);
    }
  }
#endif
  for (; c < cols; ++c) {
    const float v = to_f(x[c]);
    if (is_nan_bits(v)) {
      if (!is_nan_bits(top)) best = c, top = v;
    } else if (v > top && !is_nan_bits(top)) {
      best = c, top = v;
    }
  }
  return best;
}

torch::Tensor argmax_rows(torch::Tensor x) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) > 0, "x must be [rows, cols] with cols > 0");
  x = x.contiguous();
  const int64_t rows = x.size(0), cols = x.size(1);
  auto out = torch::empty({rows}, x.options().dtype(torch::kLong));
  int64_t* o = out.data_ptr<int64_t>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "argmax_rows", [&] {
    const scalar_t* p = x.data_ptr<scalar_t>();
    at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) o[r] = argmax_row(p + r * cols, cols);
    });
  });
  return out;
}

// write_kv: each token's keys and values copied into its cache slot (slot = block *
// block_size + offset; a negative slot skips the token). index_copy_ took 15-30 us a layer
// for a step's few dozen tokens, about what the copies take in all.
void write_kv(torch::Tensor key, torch::Tensor value, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor slots) {
  TORCH_CHECK(key.dim() == 3 && value.sizes() == key.sizes(), "key and value must be [tokens, kv_heads, head_dim]");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.is_contiguous() && v_cache.sizes() == k_cache.sizes() &&
              k_cache.size(2) == key.size(1) && k_cache.size(3) == key.size(2), "caches must be contiguous [blocks, block_size, kv_heads, head_dim]");
  TORCH_CHECK(key.scalar_type() == k_cache.scalar_type() && value.scalar_type() == k_cache.scalar_type() &&
              v_cache.scalar_type() == k_cache.scalar_type(), "key, value and caches must share a dtype");
  TORCH_CHECK(slots.dim() == 1 && slots.size(0) == key.size(0), "one slot per token");
  // Rows may be strided (value is a column slice of the fused qkv output); each row's heads must be contiguous.
  if (key.stride(2) != 1 || key.stride(1) != key.size(2)) key = key.contiguous();
  if (value.stride(2) != 1 || value.stride(1) != value.size(2)) value = value.contiguous();
  slots = checked_slots(slots, k_cache);
  const int64_t tokens = key.size(0), row = key.size(1) * key.size(2);
  const int64_t* slot = slots.data_ptr<int64_t>();
  const int64_t bytes = row * key.element_size();
  const char* kp = static_cast<const char*>(key.data_ptr());
  const char* vp = static_cast<const char*>(value.data_ptr());
  char* kc = static_cast<char*>(k_cache.data_ptr());
  char* vc = static_cast<char*>(v_cache.data_ptr());
  const int64_t ks = key.stride(0) * key.element_size(), vs = value.stride(0) * value.element_size();
  for (int64_t t = 0; t < tokens; ++t) {
    if (slot[t] < 0) continue;
    std::memcpy(kc + slot[t] * bytes, kp + t * ks, bytes);
    std::memcpy(vc + slot[t] * bytes, vp + t * vs, bytes);
  }
}

// The compute functions run without the GIL (NOGIL): they touch no Python object, and holding it
// through a step's kernels kept the web process's event loop waiting for whole steps (py-spy
// --gil: the engine thread held the GIL in linear_small for 222 of 810 samples while streams and
// admissions waited behind it).
// quant_linear: out = x @ W.T (+ bias) with W in groups of 32 weights along a row, each group
// w = d * q + m (q in 0..255 for int8, 0..15 for int4), the layout of kernels/quant.py.
// int8 (d and m fp32): each weight widened to fp32 in registers and dotted with x in fp32, so
//   the layer computes what x @ dequantized(W).T does. Quantizing x to int8 as well (an integer
//   dot per group) moved the packaged model's greedy output off the unquantized one's at the
//   first token on 4 of 5 chat prompts.
// int4 (d and m fp16, Q4_1's form): x is quantized per row and group of 32 to int8 (xd * xq), as
//   llama.cpp's Q4_1 x Q8_1 does, and a group's dot is one integer dot of 32 unsigned-by-signed
//   byte pairs (AVX512-VNNI's vpdpbusd, AVX-VNNI's, or AVX2's widening madd), scaled by d * xd,
//   plus m * xd * sum(xq).
// At the rows of a decode step the weights stream at 10 (int8) or 5 (int4) bits each where
// bf16's stream at 16.
// int4 bytes: in each group's 16 bytes, byte j holds q[j] in its low nibble and q[j + 16] in its high one.

// Per row of x and group of 32: xq (int8), xd (the scale) and xs = xd * sum(xq).
#if defined(__AVX2__) && defined(__FMA__)
static inline __m256 load8_f32(const float* p) { return _mm256_loadu_ps(p); }
static inline __m256 load8_f32(const at::BFloat16* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

// One group of 32: what the scalar loop below computes, with the same rounding (cvtps rounds to
// nearest even, as nearbyint does), 8 lanes at a time: scalar, it was 5% of an interleaved int4
// prefill's linear time at 512 rows.
template <typename T>
static inline void quantize_group(const T* src, int8_t* dst, float& d_out, float& s_out) {
  __m256 v[4];
  __m256 amax = _mm256_setzero_ps();
  const __m256 sign = _mm256_set1_ps(-0.f);
  for (int i = 0; i < 4; ++i) {
    v[i] = load8_f32(src + 8 * i);
    amax = _mm256_max_ps(_mm256_andnot_ps(sign, v[i]), amax);  // a NaN lane leaves amax, as std::max does
  }
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  m4 = _mm_max_ss(m4, _mm_shuffle_ps(m4, m4, 1));
  const float a = _mm_cvtss_f32(m4);
  const float inv = a > 0.f ? 127.f / a : 0.f;
  __m256i q[4];
  for (int i = 0; i < 4; ++i) q[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], _mm256_set1_ps(inv)));
  // packs work within 128-bit lanes: the dword order 0,2,1,3 afterwards restores the inputs'.
  const __m256i b = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), _mm256_permutevar8x32_epi32(b, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
  const __m256i t = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
  __m128i t4 = _mm_add_epi32(_mm256_castsi256_si128(t), _mm256_extracti128_si256(t, 1));
  t4 = _mm_add_epi32(t4, _mm_shuffle_epi32(t4, 0x4E));
  t4 = _mm_add_epi32(t4, _mm_shuffle_epi32(t4, 0xB1));
  d_out = a / 127.f;
  s_out = d_out * static_cast<float>(_mm_cvtsi128_si32(t4));
}
#endif

template <typename T>
static void quantize_rows(const T* x, int64_t m, int64_t k, int8_t* xq, float* xd, float* xs) {
  const int64_t groups = k / 32;
  at::parallel_for(0, m * groups, 256, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g) {
      const T* src = x + g * 32;
#if defined(__AVX2__) && defined(__FMA__)
      if constexpr (std::is_same_v<T, float> || std::is_same_v<T, at::BFloat16>) {
        quantize_group(src, xq + g * 32, xd[g], xs[g]);
        continue;
      }
#endif
      float amax = 0.f;
      for (int j = 0; j < 32; ++j) amax = std::max(amax, std::fabs(to_f(src[j])));
      const float d = amax / 127.f, inv = amax > 0.f ? 127.f / amax : 0.f;
      int sum = 0;
      for (int j = 0; j < 32; ++j) {
        const int q = static_cast<int>(std::nearbyint(to_f(src[j]) * inv));
        xq[g * 32 + j] = static_cast<int8_t>(q);
        sum += q;
      }
      xd[g] = d;
      xs[g] = d * static_cast<float>(sum);
    }
  });
}

// x in fp32, and each row's sum per group of 32 (for the groups' minimums).
template <typename T>
static void widen_rows(const T* x, int64_t m, int64_t k, float* xf, float* xsum) {
  const int64_t groups = k / 32;
  at::parallel_for(0, m * groups, 256, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g) {
      float sum = 0.f;
      for (int j = 0; j < 32; ++j) sum += (xf[g * 32 + j] = to_f(x[g * 32 + j]));
      xsum[g] = sum;
    }
  });
}

#if defined(__AVX2__) && defined(__FMA__)
// 8 int32 lanes, each the sum of 4 products u[i] * s[i] (u unsigned bytes, here <= 15; s signed).
static inline __m256i dot_u8s8(__m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#elif defined(__AVXVNNI__)
  return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), u, s);
#else
  // u <= 15, |s| <= 127: maddubs' int16 pair sums cannot saturate.
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}

// A group's 32 int4 values as 32 bytes 0..15, in order.
static inline __m256i unpack_int4(const uint8_t* p) {
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m128i low = _mm_set1_epi8(0x0F);
  return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(b, 4), low), _mm_and_si128(b, low));
}

// Eight bytes from p, as fp32.
static inline __m256 widen8(const uint8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
#endif

// int4: XS rows of quantized x (1..4) against 4 weight rows: sums[j][r].
template <int XS>
static inline void int4_dot_rows(const int8_t* xq, const float* xd, const float* xs, int64_t k, const uint8_t* const* wr,
                                 const at::Half* const* dr, const at::Half* const* mr, float sums[4][4]) {
  const int64_t groups = k / 32;
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
  // The scales are widened 8 groups at a time, and the minimums' term, sum over groups of
  // m * xd * sum(xq), is a dot product of its own after the loop: per group and weight row,
  // two scalar conversions and a scalar FMA fewer. A one-row SmolLM2 step spends ~80% of its
  // time here, compute-bound; bench/kernels_ab.py on a 2-core Xeon, 21 turns: 1.13x at 1 row,
  // 1.05x at 2, 1.18x at 5.
  __m256 acc[XS][4];
  for (int j = 0; j < XS; ++j)
    for (int r = 0; r < 4; ++r) acc[j][r] = _mm256_setzero_ps();
  alignas(32) float d[4][8];
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t lane = g & 7;
    if (lane == 0) {
      for (int r = 0; r < 4; ++r) {
        if (g + 8 <= groups) {
          _mm256_store_ps(d[r], _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(dr[r] + g))));
        } else {
          for (int64_t t = g; t < groups; ++t) d[r][t - g] = static_cast<float>(dr[r][t]);
        }
      }
    }
    __m256i w[4];
    for (int r = 0; r < 4; ++r) w[r] = unpack_int4(wr[r] + g * 16);
    for (int j = 0; j < XS; ++j) {
      const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + j * k + g * 32));
      const float dx = xd[j * groups + g];
      for (int r = 0; r < 4; ++r)
        acc[j][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot_u8s8(w[r], xv)), _mm256_set1_ps(d[r][lane] * dx), acc[j][r]);
    }
  }
  for (int r = 0; r < 4; ++r) {
    __m256 low[XS];
    for (int j = 0; j < XS; ++j) low[j] = _mm256_setzero_ps();
    int64_t g = 0;
    for (; g + 8 <= groups; g += 8) {
      const __m256 m = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(mr[r] + g)));
      for (int j = 0; j < XS; ++j) low[j] = _mm256_fmadd_ps(m, _mm256_loadu_ps(xs + j * groups + g), low[j]);
    }
    for (int j = 0; j < XS; ++j) {
      float tail = 0.f;
      for (int64_t t = g; t < groups; ++t) tail += static_cast<float>(mr[r][t]) * xs[j * groups + t];
      sums[j][r] = hsum(acc[j][r]) + hsum(low[j]) + tail;
    }
  }
#else
  for (int j = 0; j < XS; ++j)
    for (int r = 0; r < 4; ++r) {
      float total = 0.f;
      for (int64_t g = 0; g < groups; ++g) {
        const int8_t* xg = xq + j * k + g * 32;
        const uint8_t* p = wr[r] + g * 16;
        int dot = 0;
        for (int c = 0; c < 32; ++c) dot += (c < 16 ? p[c] & 0x0F : p[c - 16] >> 4) * xg[c];
        total += static_cast<float>(dr[r][g]) * xd[j * groups + g] * static_cast<float>(dot);
        total += static_cast<float>(mr[r][g]) * xs[j * groups + g];
      }
      sums[j][r] = total;
    }
#endif
}

// int4 interleaved by 8 weight rows (kernels.quant.interleave): a block of 8 rows, group by group,
// 128 bytes a group: 4 vectors of 32 bytes, vector p's bytes 4i..4i+3 holding row i's weights
// 4p..4p+3 of the group in their low nibbles and 4(p+4)..4(p+4)+3 in their high ones; d and m
// [block][group][8]. Lane i of every vector is then row i: a group's 8 steps of 4 inputs are one
// unsigned-by-signed byte dot each, against 4 bytes of x broadcast, and 8 rows' dots end in one
// vector that takes the 8 rows' scales as they lie. Against int4_dot_rows' form (4 rows of 32
// bytes each, summed across lanes at the end) a 32-input dot takes ~4 instructions where it
// took ~11, and SmolLM2's one-row linears were compute-bound there (a 2-row pass took 1.7x a
// 1-row one on a 2-core Zen 3 EPYC).
// out[j] = sum over groups, in order, of dot * (d * xd) + m * xs: the same operations for a row of
// x whatever rows are beside it, so its 8 outputs have the same bits in any batch. out's rows are
// 16 wide, int4_x16_blocks' width, so quant_rows_x8 holds one array for either.
static constexpr int64_t X8_ROWS = 8, X8_GROUP_BYTES = 128;

template <int XS>
static inline void int4_x8_block(const int8_t* xq, const float* xd, const float* xs, int64_t k, const uint8_t* w,
                                 const at::Half* d, const at::Half* mn, float out[][2 * X8_ROWS]) {
  const int64_t groups = k / 32;
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
  __m256 acc[XS];
  for (int j = 0; j < XS; ++j) acc[j] = _mm256_setzero_ps();
  const __m256i nibble = _mm256_set1_epi8(0x0F);
#if !(defined(__AVX512VNNI__) && defined(__AVX512VL__)) && !defined(__AVXVNNI__)
  const __m256i ones = _mm256_set1_epi16(1);
#endif
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* wg = w + g * X8_GROUP_BYTES;
    __m256i v[8];
    for (int p = 0; p < 4; ++p) {
      const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wg + 32 * p));
      v[p] = _mm256_and_si256(b, nibble);
      v[p + 4] = _mm256_and_si256(_mm256_srli_epi16(b, 4), nibble);
    }
    const __m256 dv = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(d + g * X8_ROWS)));
    const __m256 mv = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(mn + g * X8_ROWS)));
#pragma GCC unroll 4
    for (int j = 0; j < XS; ++j) {
      const int8_t* xg = xq + j * k + g * 32;
#if (defined(__AVX512VNNI__) && defined(__AVX512VL__)) || defined(__AVXVNNI__)
      __m256i s = _mm256_setzero_si256();
#pragma GCC unroll 8
      for (int t = 0; t < 8; ++t) {
        int32_t four;
        std::memcpy(&four, xg + 4 * t, 4);
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
        s = _mm256_dpbusd_epi32(s, v[t], _mm256_set1_epi32(four));
#else
        s = _mm256_dpbusd_avx_epi32(s, v[t], _mm256_set1_epi32(four));
#endif
      }
#else
      // Each int16 lane: 8 pair sums of u <= 15 by |s| <= 127, at most 8 * 3,810 = 30,480: no
      // overflow before the one widening madd.
      __m256i part[2];
#pragma GCC unroll 8
      for (int t = 0; t < 8; ++t) {
        int32_t four;
        std::memcpy(&four, xg + 4 * t, 4);
        const __m256i p = _mm256_maddubs_epi16(v[t], _mm256_set1_epi32(four));
        part[t & 1] = t < 2 ? p : _mm256_add_epi16(part[t & 1], p);
      }
      const __m256i s = _mm256_madd_epi16(_mm256_add_epi16(part[0], part[1]), ones);
#endif
      // The group's term whole, then one add to the row's sum: the chain across groups is an
      // add, not two FMAs.
      const int64_t at = j * groups + g;
      const __m256 term = _mm256_fmadd_ps(mv, _mm256_set1_ps(xs[at]),
                                          _mm256_mul_ps(_mm256_cvtepi32_ps(s), _mm256_mul_ps(dv, _mm256_set1_ps(xd[at]))));
      acc[j] = _mm256_add_ps(acc[j], term);
    }
  }
  for (int j = 0; j < XS; ++j) _mm256_storeu_ps(out[j], acc[j]);
#else
  for (int j = 0; j < XS; ++j)
    for (int i = 0; i < X8_ROWS; ++i) {
      float total = 0.f;
      for (int64_t g = 0; g < groups; ++g) {
        const uint8_t* wg = w + g * X8_GROUP_BYTES;
        int dot = 0;
        for (int c = 0; c < 32; ++c) {
          const int step = c / 4, byte = wg[32 * (step % 4) + 4 * i + c % 4];
          dot += (step < 4 ? byte & 0x0F : byte >> 4) * xq[j * k + g * 32 + c];
        }
        const int64_t at = j * groups + g;
        total += std::fma(static_cast<float>(mn[g * X8_ROWS + i]), xs[at],
                          static_cast<float>(dot) * (static_cast<float>(d[g * X8_ROWS + i]) * xd[at]));
      }
      out[j][i] = total;
    }
#endif
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__F16C__)
#define HAVE_X16 1
// Two neighbouring blocks of int4_x8_block's layout at once, 16 rows in 16 lanes of 512 bits
// (block b in lanes 0-7, block b + 1 in 8-15), each lane the very operations int4_x8_block's
// does for its row, so each output has the bits it has there (integer sums in two chains: the
// same int32). Over SmolLM2's 30 layers and LM head on a 2-core Zen 4 EPYC (AVX512-VNNI), its
// time over int4_x8_block's: 1.25-1.3x at 1 row (kept there), 0.9x at 8, 0.8x at 16, 0.75x at
// 32; one chain of 8 dots a group instead of two, 1.5x at 1 row and 0.85x at 16. The one row
// is the memory's: with the layers in cache it took 0.85x at 1 row and 0.7x at 4, from memory
// 1.2-1.4x at 1 row, reading two blocks' bytes in lockstep where the one-block form reads one
// stream (prefetching further ahead, none, or per group did not close it). Over
// quant_gemm's (bf16 dots over dequantized panels): 0.65x at 24 rows, 0.7x at 32, 0.75x at 64,
// 0.8x at 128, 0.8-0.85x at 256-2,048, so without AMX int4 takes this kernel at every row
// count (kernels/quant.py, int4_linear_rows).
// On a 2-core AMX Xeon (480 MB of L3, the int4 model always in cache), over int4_x8_block's:
// 0.8x at 8-32 rows, 0.88x at 4, level at 1-2 (X16_ROWS stays 8: Zen 4 reads from memory).
template <int XS>
static inline void int4_x16_blocks(const int8_t* xq, const float* xd, const float* xs, int64_t k, const uint8_t* w,
                                   const uint8_t* w1, const at::Half* d, const at::Half* d1, const at::Half* mn,
                                   const at::Half* mn1, float out[][2 * X8_ROWS]) {
  const int64_t groups = k / 32;
  __m512 acc[XS];
  for (int j = 0; j < XS; ++j) acc[j] = _mm512_setzero_ps();
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  auto halves = [](const at::Half* a, const at::Half* b) {
    return _mm512_cvtph_ps(_mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(a))),
                                                   _mm_loadu_si128(reinterpret_cast<const __m128i*>(b)), 1));
  };
  for (int64_t g = 0; g < groups; ++g) {
    __m512i v[8];
    for (int p = 0; p < 4; ++p) {
      const __m512i b = _mm512_inserti64x4(
          _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + g * X8_GROUP_BYTES + 32 * p))),
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w1 + g * X8_GROUP_BYTES + 32 * p)), 1);
      v[p] = _mm512_and_si512(b, nibble);
      v[p + 4] = _mm512_and_si512(_mm512_srli_epi16(b, 4), nibble);
    }
    const __m512 dv = halves(d + g * X8_ROWS, d1 + g * X8_ROWS);
    const __m512 mv = halves(mn + g * X8_ROWS, mn1 + g * X8_ROWS);
#pragma GCC unroll 4
    for (int j = 0; j < XS; ++j) {
      const int8_t* xg = xq + j * k + g * 32;
      __m512i part[2];
#pragma GCC unroll 8
      for (int t = 0; t < 8; ++t) {
        int32_t four;
        std::memcpy(&four, xg + 4 * t, 4);
        part[t & 1] = _mm512_dpbusd_epi32(t < 2 ? _mm512_setzero_si512() : part[t & 1], v[t], _mm512_set1_epi32(four));
      }
      const __m512i s = _mm512_add_epi32(part[0], part[1]);
      const int64_t at = j * groups + g;
      const __m512 term = _mm512_fmadd_ps(mv, _mm512_set1_ps(xs[at]),
                                          _mm512_mul_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(dv, _mm512_set1_ps(xd[at]))));
      acc[j] = _mm512_add_ps(acc[j], term);
    }
  }
  for (int j = 0; j < XS; ++j) _mm512_storeu_ps(out[j], acc[j]);
}
#endif

// The minimums' term of an int8 row's dot, sum over groups of m[g] * xs[g], compiled once: folded
// into int8_dot_rows' loop, -ffast-math let each row count's copy sum it its own way, so a row's
// output changed with the rows beside it in the call (420 of 420 rows checked, fp32 x), and a
// speculative verifying pass disagreed with the decode step it stands for.
__attribute__((noinline)) static float min_term(const float* m, const float* xs, int64_t groups) {
  int64_t g = 0;
  float total = 0.f;
#if defined(__AVX2__) && defined(__FMA__)
  __m256 acc = _mm256_setzero_ps();
  for (; g + 8 <= groups; g += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(m + g), _mm256_loadu_ps(xs + g), acc);
  total = hsum(acc);
#endif
  for (; g < groups; ++g) total += m[g] * xs[g];
  return total;
}

// int8: XS rows of fp32 x (1..4) against 4 weight rows: sums[j][r].
template <int XS>
static inline void int8_dot_rows(const float* x, const float* xsum, int64_t k, const uint8_t* const* wr,
                                 const float* const* dr, const float* const* mr, float sums[4][4]) {
  const int64_t groups = k / 32;
#if defined(__AVX512F__)
  // 16 weights a conversion: a third of the instructions of the AVX2 path below, which ran a
  // one-row pass over SmolLM2's layers no faster than oneDNN's bf16 on a 2-core Zen 4 EPYC.
  __m512 acc[XS][4];
  for (int j = 0; j < XS; ++j)
    for (int r = 0; r < 4; ++r) acc[j][r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    for (int r = 0; r < 4; ++r) {
      const uint8_t* p = wr[r] + g * 32;
      const __m512 w0 = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
      const __m512 w1 = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16))));
      const __m512 d = _mm512_set1_ps(dr[r][g]);
      for (int j = 0; j < XS; ++j) {
        const float* xg = x + j * k + g * 32;
        const __m512 t = _mm512_fmadd_ps(w1, _mm512_loadu_ps(xg + 16), _mm512_mul_ps(w0, _mm512_loadu_ps(xg)));
        acc[j][r] = _mm512_fmadd_ps(t, d, acc[j][r]);
      }
    }
  }
  for (int j = 0; j < XS; ++j)
    for (int r = 0; r < 4; ++r) sums[j][r] = _mm512_reduce_add_ps(acc[j][r]) + min_term(mr[r], xsum + j * groups, groups);
#elif defined(__AVX2__) && defined(__FMA__)
  __m256 acc[XS][4];
  for (int j = 0; j < XS; ++j)
    for (int r = 0; r < 4; ++r) acc[j][r] = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    for (int r = 0; r < 4; ++r) {
      const uint8_t* p = wr[r] + g * 32;
      const __m256 w0 = widen8(p), w1 = widen8(p + 8), w2 = widen8(p + 16), w3 = widen8(p + 24);
      const __m256 d = _mm256_set1_ps(dr[r][g]);
      for (int j = 0; j < XS; ++j) {
        const float* xg = x + j * k + g * 32;
        __m256 t = _mm256_mul_ps(w0, _mm256_loadu_ps(xg));
        t = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xg + 8), t);
        t = _mm256_fmadd_ps(w2, _mm256_loadu_ps(xg + 16), t);
        t = _mm256_fmadd_ps(w3, _mm256_loadu_ps(xg + 24), t);
        acc[j][r] = _mm256_fmadd_ps(t, d, acc[j][r]);
      }
    }
  }
  for (int j = 0; j < XS; ++j)
    for (int r = 0; r < 4; ++r) sums[j][r] = hsum(acc[j][r]) + min_term(mr[r], xsum + j * groups, groups);
#else
  for (int j = 0; j < XS; ++j)
    for (int r = 0; r < 4; ++r) {
      float total = 0.f;
      for (int64_t g = 0; g < groups; ++g) {
        float dot = 0.f;
        for (int c = 0; c < 32; ++c) dot += static_cast<float>(wr[r][g * 32 + c]) * x[j * k + g * 32 + c];
        total += dr[r][g] * dot + mr[r][g] * xsum[j * groups + g];
      }
      sums[j][r] = total;
    }
#endif
}

// f(std::integral_constant<int, XS>) for XS = rows (1..4): the dot kernels take x's row count as a
// template argument, so each count's loops unroll.
template <typename F>
static inline void for_rows(int64_t rows, F&& f) {
  switch (rows) {
    case 1: f(std::integral_constant<int, 1>{}); break;
    case 2: f(std::integral_constant<int, 2>{}); break;
    case 3: f(std::integral_constant<int, 3>{}); break;
    default: f(std::integral_constant<int, 4>{}); break;
  }
}

// Rows of 4 weights at a time, each thread its own run of them; x's rows 4 at a time against each.
static constexpr int64_t QUANT_PREFETCH_QUADS = 2;
template <typename S, typename T, typename Dot>
static void quant_rows(int64_t m, int64_t n, int64_t row_bytes, int64_t groups, const uint8_t* qw, const S* scales,
                       const S* mins, const T* bias, T* out, Dot dot) {
  at::parallel_for(0, (n + 3) / 4, 8, [&](int64_t begin, int64_t end) {
    for (int64_t quad = begin; quad < end; ++quad) {
      const int64_t r0 = quad * 4, rows = std::min<int64_t>(4, n - r0);
      // Past the last weight row, repeat it: its sums are computed and dropped.
      const uint8_t* wr[4];
      const S* dr[4];
      const S* mr[4];
      for (int64_t r = 0; r < 4; ++r) {
        const int64_t row = r0 + std::min(r, rows - 1);
        wr[r] = qw + row * row_bytes;
        dr[r] = scales + row * groups;
        mr[r] = mins + row * groups;
      }
      // The weights two quads ahead, asked for now: a one-row int4 pass over SmolLM2's 30
      // layers took 10.1 ms with only the hardware's prefetcher and 6.4 ms with this on a 2-core
      // AMX Xeon (int4 batch-1 decode 70 -> 85-92 tok/s); one quad ahead 5.8-6.2 ms, eight 6.3-7.3.
      if (quad + QUANT_PREFETCH_QUADS < end) {
        const int64_t ahead = (quad + QUANT_PREFETCH_QUADS) * 4;
        const char* w = reinterpret_cast<const char*>(qw + ahead * row_bytes);
        for (int64_t b = 0; b < 4 * row_bytes; b += 64) __builtin_prefetch(w + b, 0, 3);
        const char* d = reinterpret_cast<const char*>(scales + ahead * groups);
        const char* mn = reinterpret_cast<const char*>(mins + ahead * groups);
        for (int64_t b = 0; b < 4 * groups * static_cast<int64_t>(sizeof(S)); b += 64) {
          __builtin_prefetch(d + b, 0, 3);
          __builtin_prefetch(mn + b, 0, 3);
        }
      }
      for (int64_t i = 0; i < m; i += 4) {
        const int64_t xs_rows = std::min<int64_t>(4, m - i);
        float sums[4][4];
        dot(i, xs_rows, wr, dr, mr, sums);
        for (int64_t j = 0; j < xs_rows; ++j)
          for (int64_t r = 0; r < rows; ++r)
            out[(i + j) * n + r0 + r] = static_cast<T>(sums[j][r] + (bias ? to_f(bias[r0 + r]) : 0.f));
      }
    }
  });
}

static void check_quantized(const torch::Tensor& qweight, const torch::Tensor& scales, const torch::Tensor& mins, int64_t bits,
                            int64_t k) {
  TORCH_CHECK(bits == 8 || bits == 4, "bits must be 8 or 4");
  TORCH_CHECK(k % 32 == 0, "in_features must be a multiple of 32 (the quantization group)");
  TORCH_CHECK(qweight.scalar_type() == torch::kByte && qweight.dim() == 2 && qweight.is_contiguous() &&
                  qweight.size(1) == (bits == 8 ? k : k / 2),
              "qweight must be a contiguous uint8 [out_features, in_features / (8 / bits)]");
  const auto scale_type = bits == 8 ? torch::kFloat : torch::kHalf;
  const int64_t n = qweight.size(0);
  for (const auto* t : {&scales, &mins})
    TORCH_CHECK(t->scalar_type() == scale_type && t->is_contiguous() && t->numel() == n * (k / 32),
                "scales and mins must be contiguous [out_features, in_features / 32], fp32 (int8) or fp16 (int4)");
}

// A call's x (contiguous) against quantized weights, checked: its rows, the bias and the output.
struct QuantCall {
  torch::Tensor x, bias, out;
  int64_t m, n, k;
};

static QuantCall quant_call(torch::Tensor x, const torch::Tensor& qweight, const torch::Tensor& scales,
                            const torch::Tensor& mins, const c10::optional<torch::Tensor>& bias, int64_t bits) {
  const int64_t k = x.size(-1);
  check_quantized(qweight, scales, mins, bits, k);
  x = x.contiguous();
  const int64_t n = qweight.size(0);
  torch::Tensor bias_c = checked_bias(bias, x, n);
  torch::Tensor out = linear_out(x, n);
  return {x, bias_c, out, x.numel() / k, n, k};
}

// Blocks of 8 weight rows interleaved (int4_x8_block), each thread its own run of them; x's rows 4
// at a time against each.
static constexpr int64_t X8_PREFETCH_BLOCKS = 2;
// From this many rows of x, int4_x16_blocks takes blocks two at a time (where built).
static constexpr int64_t X16_ROWS = 8;
template <typename T>
static void quant_rows_x8(int64_t m, int64_t n, int64_t k, const int8_t* xq, const float* xd, const float* xs,
                          const uint8_t* qw, const at::Half* scales, const at::Half* mins, const T* bias, T* out) {
  const int64_t groups = k / 32, block_bytes = groups * X8_GROUP_BYTES, block_scales = groups * X8_ROWS;
  at::parallel_for(0, n / X8_ROWS, 8, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin, span = 1; b < end; b += span) {
#if defined(HAVE_X16)
      span = m >= X16_ROWS && b + 1 < end ? 2 : 1;
#endif
      for (int64_t ahead = b + X8_PREFETCH_BLOCKS; ahead < std::min(b + X8_PREFETCH_BLOCKS + span, end); ++ahead) {
        const char* w = reinterpret_cast<const char*>(qw + ahead * block_bytes);
        for (int64_t at = 0; at < block_bytes; at += 64) __builtin_prefetch(w + at, 0, 3);
        const char* d = reinterpret_cast<const char*>(scales + ahead * block_scales);
        const char* mn = reinterpret_cast<const char*>(mins + ahead * block_scales);
        for (int64_t at = 0; at < block_scales * 2; at += 64) {
          __builtin_prefetch(d + at, 0, 3);
          __builtin_prefetch(mn + at, 0, 3);
        }
      }
      const uint8_t* w = qw + b * block_bytes;
      const at::Half* d = scales + b * block_scales;
      const at::Half* mn = mins + b * block_scales;
      for (int64_t i = 0; i < m; i += 4) {
        const int64_t rows = std::min<int64_t>(4, m - i);
        float sums[4][2 * X8_ROWS];
        const int8_t* qi = xq + i * k;
        const float* di = xd + i * groups;
        const float* si = xs + i * groups;
#if defined(HAVE_X16)
        if (span == 2) {
          for_rows(rows, [&](auto xs_rows) {
            int4_x16_blocks<xs_rows()>(qi, di, si, k, w, w + block_bytes, d, d + block_scales, mn, mn + block_scales, sums);
          });
        } else
#endif
        for_rows(rows, [&](auto xs_rows) { int4_x8_block<xs_rows()>(qi, di, si, k, w, d, mn, sums); });
        for (int64_t j = 0; j < rows; ++j)
          for (int64_t r = 0; r < span * X8_ROWS; ++r) {
            const int64_t col = b * X8_ROWS + r;
            out[(i + j) * n + col] = static_cast<T>(sums[j][r] + (bias ? to_f(bias[col]) : 0.f));
          }
      }
    }
  });
}

// int8 interleaved into quant_gemm's panels (kernels.quant.interleave): blocks of 16 weight
// rows, [n / 16][k / 2][16][2] bytes, d and m [n / 16][k / 32][16].
static constexpr int64_t P8_ROWS = 16;

static void check_interleaved(int64_t bits, int64_t n, bool interleaved) {
  TORCH_CHECK(!interleaved || (bits == 4 && n % X8_ROWS == 0) || (bits == 8 && n % P8_ROWS == 0),
              "interleaved weights are int4 with out_features a multiple of 8 or int8 with a multiple of 16 "
              "(kernels.quant.interleave)");
}

torch::Tensor quant_linear(torch::Tensor x, torch::Tensor qweight, torch::Tensor scales, torch::Tensor mins,
                           c10::optional<torch::Tensor> bias, int64_t bits, bool interleaved) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat || x.scalar_type() == torch::kBFloat16, "quant_linear takes fp32 or bf16 x");
  auto [xc, bias_c, out, m, n, k] = quant_call(x, qweight, scales, mins, bias, bits);
  check_interleaved(bits, n, interleaved);
  TORCH_CHECK(bits == 4 || !interleaved, "quant_linear reads int8 rows as they are: int8 in panels is quant_gemm's");
  x = xc;
  const int64_t groups = k / 32;
  const uint8_t* qw = qweight.data_ptr<uint8_t>();
  auto f32 = x.options().dtype(torch::kFloat);
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, x.scalar_type(), "quant_linear", [&] {
    const scalar_t* b = bias_c.defined() ? bias_c.data_ptr<scalar_t>() : nullptr;
    if (bits == 8) {
      auto xf = torch::empty({m, k}, f32);
      auto xsum = torch::empty({m, groups}, f32);
      widen_rows<scalar_t>(x.data_ptr<scalar_t>(), m, k, xf.data_ptr<float>(), xsum.data_ptr<float>());
      const float* xp = xf.data_ptr<float>();
      const float* sp = xsum.data_ptr<float>();
      quant_rows<float, scalar_t>(m, n, k, groups, qw, scales.data_ptr<float>(), mins.data_ptr<float>(), b,
                                  out.data_ptr<scalar_t>(),
                                  [&](int64_t i, int64_t rows, const uint8_t* const* wr, const float* const* dr,
                                      const float* const* mr, float sums[4][4]) {
                                    const float* xi = xp + i * k;
                                    const float* si = sp + i * groups;
                                    for_rows(rows, [&](auto xs_rows) { int8_dot_rows<xs_rows()>(xi, si, k, wr, dr, mr, sums); });
                                  });
    } else {
      auto xq = torch::empty({m, k}, x.options().dtype(torch::kChar));
      auto xd = torch::empty({m, groups}, f32);
      auto xs = torch::empty({m, groups}, f32);
      quantize_rows<scalar_t>(x.data_ptr<scalar_t>(), m, k, xq.data_ptr<int8_t>(), xd.data_ptr<float>(), xs.data_ptr<float>());
      const int8_t* qp = xq.data_ptr<int8_t>();
      const float* dp = xd.data_ptr<float>();
      const float* sp = xs.data_ptr<float>();
      if (interleaved) {
        quant_rows_x8<scalar_t>(m, n, k, qp, dp, sp, qw, scales.data_ptr<at::Half>(), mins.data_ptr<at::Half>(), b,
                                out.data_ptr<scalar_t>());
        return;
      }
      quant_rows<at::Half, scalar_t>(m, n, k / 2, groups, qw, scales.data_ptr<at::Half>(), mins.data_ptr<at::Half>(), b,
                                     out.data_ptr<scalar_t>(),
                                     [&](int64_t i, int64_t rows, const uint8_t* const* wr, const at::Half* const* dr,
                                         const at::Half* const* mr, float sums[4][4]) {
                                       const int8_t* qi = qp + i * k;
                                       const float* di = dp + i * groups;
                                       const float* si = sp + i * groups;
                                       for_rows(rows, [&](auto xs_rows) { int4_dot_rows<xs_rows()>(qi, di, si, k, wr, dr, mr, sums); });
                                     });
    }
  });
  return out;
}

// Interleaved int4 (int4_x8_block's layout): where row `row`'s group g starts. Vector p's 4
// bytes (at x8_bytes + 32 p) hold weights 4p.. (low) and 4p + 16.. (high): the standard bytes
// 4p..4p + 3.
static inline const uint8_t* x8_bytes(const uint8_t* qw, int64_t groups, int64_t row, int64_t g) {
  return qw + ((row / X8_ROWS) * groups + g) * X8_GROUP_BYTES + 4 * (row % X8_ROWS);
}

// The index of that group's d and m.
static inline int64_t x8_index(int64_t groups, int64_t row, int64_t g) {
  return ((row / X8_ROWS) * groups + g) * X8_ROWS + row % X8_ROWS;
}

// Row `row`'s group g: its 16 bytes in the standard order (byte j: weight j low, j + 16 high)
// into `bytes`, and the index of its d and m.
static inline int64_t x8_group(const uint8_t* qw, int64_t groups, int64_t row, int64_t g, uint8_t* bytes) {
  const uint8_t* wg = x8_bytes(qw, groups, row, g);
  for (int p = 0; p < 4; ++p) std::memcpy(bytes + 4 * p, wg + 32 * p, 4);
  return x8_index(groups, row, g);
}

// int8 in panels: row `row`'s group g, its 32 bytes gathered in order into `bytes`, and the
// index of its d and m.
static inline int64_t p8_group(const uint8_t* qw, int64_t k, int64_t row, int64_t g, uint8_t* bytes) {
  const uint8_t* block = qw + (row / P8_ROWS) * P8_ROWS * k + 2 * (row % P8_ROWS);
  for (int64_t t = 0; t < 16; ++t) std::memcpy(bytes + 2 * t, block + (g * 16 + t) * 2 * P8_ROWS, 2);
  return ((row / P8_ROWS) * (k / 32) + g) * P8_ROWS + row % P8_ROWS;
}

// Either interleaved form's group: its bytes in the standard order into `bytes` (32 of them for
// int8, 16 for int4), and the index of its d and m.
static inline int64_t gathered_group(const uint8_t* qw, int64_t bits, int64_t k, int64_t row, int64_t g, uint8_t* bytes) {
  return bits == 8 ? p8_group(qw, k, row, g, bytes) : x8_group(qw, k / 32, row, g, bytes);
}

// Weight rows [c0, c0 + cols) of W as fp32 into buf (row-major, cols x k): quant_dequantize's
// fp32 copy and quant_gemm_f32's panels.
static void dequant_rows_f32(const uint8_t* qw, const void* scales, const void* mins, int64_t bits, int64_t k,
                             int64_t c0, int64_t cols, float* buf, bool interleaved) {
  const int64_t groups = k / 32, row_bytes = bits == 8 ? k : k / 2;
  alignas(32) uint8_t gathered[32];
  for (int64_t r = 0; r < cols; ++r) {
    const int64_t row = c0 + r;
    float* dst = buf + r * k;
    for (int64_t g = 0; g < groups; ++g) {
      // The group's bytes (32 of int8, 16 of int4) and its scale's index.
      int64_t at = row * groups + g;
      const uint8_t* p = qw + row * row_bytes + g * (bits == 8 ? 32 : 16);
      if (interleaved) {
        at = gathered_group(qw, bits, k, row, g, gathered);
        p = gathered;
      }
      const float d = bits == 8 ? static_cast<const float*>(scales)[at] : static_cast<float>(static_cast<const at::Half*>(scales)[at]);
      const float base = bits == 8 ? static_cast<const float*>(mins)[at] : static_cast<float>(static_cast<const at::Half*>(mins)[at]);
#if defined(__AVX2__) && defined(__FMA__)
      const __m256 dv = _mm256_set1_ps(d), mv = _mm256_set1_ps(base);
      if (bits == 8) {
        for (int c = 0; c < 32; c += 8) _mm256_storeu_ps(dst + g * 32 + c, _mm256_fmadd_ps(widen8(p + c), dv, mv));
      } else {
        const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
        const __m128i low = _mm_set1_epi8(0x0F);
        alignas(16) uint8_t levels[32];
        _mm_store_si128(reinterpret_cast<__m128i*>(levels), _mm_and_si128(b, low));
        _mm_store_si128(reinterpret_cast<__m128i*>(levels + 16), _mm_and_si128(_mm_srli_epi16(b, 4), low));
        for (int c = 0; c < 32; c += 8) _mm256_storeu_ps(dst + g * 32 + c, _mm256_fmadd_ps(widen8(levels + c), dv, mv));
      }
#else
      for (int c = 0; c < 32; ++c) {
        const int level = bits == 8 ? p[c] : (c < 16 ? p[c] & 0x0F : p[c - 16] >> 4);
        dst[g * 32 + c] = std::fma(d, static_cast<float>(level), base);
      }
#endif
    }
  }
}

// All n weight rows as fp32 into o (row-major, n x k), on the pool's threads.
static void dequant_all_f32(const torch::Tensor& qweight, const torch::Tensor& scales, const torch::Tensor& mins,
                            int64_t bits, int64_t k, bool interleaved, float* o) {
  const uint8_t* qw = qweight.data_ptr<uint8_t>();
  at::parallel_for(0, qweight.size(0), 16, [&](int64_t begin, int64_t end) {
    dequant_rows_f32(qw, scales.data_ptr(), mins.data_ptr(), bits, k, begin, end - begin, o + begin * k, interleaved);
  });
}

// The weights back in `dtype`, [out_features, in_features]: for long prefill chunks where bf16 is
// not native (oneDNN's GEMM over them), and for the embedding's lookups.
torch::Tensor quant_dequantize(torch::Tensor qweight, torch::Tensor scales, torch::Tensor mins, int64_t bits,
                               int64_t in_features, at::ScalarType dtype, bool interleaved) {
  const int64_t k = in_features;
  check_quantized(qweight, scales, mins, bits, k);
  TORCH_CHECK(dtype == torch::kFloat || dtype == torch::kBFloat16, "quant_dequantize gives fp32 or bf16");
  const int64_t n = qweight.size(0), groups = k / 32, row_bytes = bits == 8 ? k : k / 2;
  check_interleaved(bits, n, interleaved);
  auto out = torch::empty({n, k}, qweight.options().dtype(dtype));
  const uint8_t* qw = qweight.data_ptr<uint8_t>();
  if (dtype == torch::kFloat) {
    dequant_all_f32(qweight, scales, mins, bits, k, interleaved, out.data_ptr<float>());
    return out;
  }
  at::BFloat16* o = out.data_ptr<at::BFloat16>();
  at::parallel_for(0, n * groups, 512, [&](int64_t begin, int64_t end) {
    alignas(32) uint8_t gathered[32];
    for (int64_t g = begin; g < end; ++g) {
      const int64_t row = g / groups, col = g % groups;
      const uint8_t* p = qw + row * row_bytes + col * (bits == 8 ? 32 : 16);
      const int64_t at = interleaved ? gathered_group(qw, bits, k, row, col, gathered) : g;
      if (interleaved) p = gathered;
      const float d = bits == 8 ? scales.data_ptr<float>()[at] : static_cast<float>(scales.data_ptr<at::Half>()[at]);
      const float base = bits == 8 ? mins.data_ptr<float>()[at] : static_cast<float>(mins.data_ptr<at::Half>()[at]);
      at::BFloat16* dst = o + g * 32;
      for (int c = 0; c < 32; ++c) {
        const int q = bits == 8 ? p[c] : (c < 16 ? p[c] & 0x0F : p[c - 16] >> 4);
        dst[c] = static_cast<at::BFloat16>(d * static_cast<float>(q) + base);
      }
    }
  });
  return out;
}

// A buffer per thread and purpose, kept between calls: no allocation or zeroing per call.
template <int PURPOSE>
static uint32_t* scratch(int64_t words) {
  thread_local std::vector<uint32_t> buffer;
  if (static_cast<int64_t>(buffer.size()) < words) buffer.resize(words);
  return buffer.data();
}

// quant_gemm_f32: out = x @ W.T (+ bias) for fp32 x over int8 or int4 weights, more rows than
// quant_linear takes, where there is no quant_gemm (no AVX512-BF16: the engine runs fp32).
// Below QUANT_F32_WHOLE_ROWS each thread dequantizes QUANT_F32_PANEL weight rows at a time into
// an fp32 buffer of its own (147-393 KB at SmolLM2's widths, in L2) and multiplies x by it with
// ATen's GEMM, writing the panel's columns of out in place. From QUANT_F32_STANDING_ROWS the
// panel takes x transposed (W_panel @ x.T, then copied to out's columns): MKL's x @ W_panel.T
// fell from ~100 to 20 GFLOP/s at 16 rows and up on a 2-core Ice Lake Xeon (AVX-512), where
// W_panel @ x.T held 100-125; below 16 rows it ran 1.8x the other's time. From
// QUANT_F32_WHOLE_ROWS (a long prefill chunk) the layer is dequantized whole, into a buffer kept
// between calls up to QUANT_F32_KEPT_WEIGHTS (16 MB; past it a fresh one), for one GEMM: the
// panels ran 2.0x oneDNN's fp32 time over SmolLM2's layers at 2,048 rows on that Xeon, the whole
// layer 0.9-1.0x (dequantizing costs ~30 ms a pass over the model, the GEMM 1.7-2.1 s).
// Dequantizing each layer whole into a fresh copy at every row count ran 0.7-0.8x fp32's speed
// at 33-256 rows on a 2-core Zen 1 EPYC (AVX2; offline int8 0.59x fp32 there).
static constexpr int64_t QUANT_F32_PANEL = 64;
static constexpr int64_t QUANT_F32_STANDING_ROWS = 16;
static constexpr int64_t QUANT_F32_WHOLE_ROWS = 128;
static constexpr int64_t QUANT_F32_KEPT_WEIGHTS = 1 << 22;

torch::Tensor quant_gemm_f32(torch::Tensor x, torch::Tensor qweight, torch::Tensor scales, torch::Tensor mins,
                             c10::optional<torch::Tensor> bias, int64_t bits, bool interleaved) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat, "quant_gemm_f32 takes fp32 x");
  auto [xc, bias_c, out, m, n, k] = quant_call(x, qweight, scales, mins, bias, bits);
  check_interleaved(bits, n, interleaved);
  x = xc;
  const auto x2 = x.view({m, k});
  auto out2 = out.view({m, n});
  if (m >= QUANT_F32_WHOLE_ROWS) {
    const auto w = n * k <= QUANT_F32_KEPT_WEIGHTS ? torch::from_blob(scratch<5>(n * k), {n, k}, x.options())
                                                   : torch::empty({n, k}, x.options());
    dequant_all_f32(qweight, scales, mins, bits, k, interleaved, w.data_ptr<float>());
    if (bias_c.defined()) at::addmm_out(out2, bias_c, x2, w.t());
    else at::mm_out(out2, x2, w.t());
    return out;
  }
  const int64_t panels = (n + QUANT_F32_PANEL - 1) / QUANT_F32_PANEL;
  const uint8_t* qw = qweight.data_ptr<uint8_t>();
  const bool stand = m >= QUANT_F32_STANDING_ROWS;
  const auto xt = stand ? x2.t().contiguous() : x2;
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    // The pool's threads do not inherit the caller's inference mode, and out may be an
    // inference tensor: ATen refuses to write one outside it.
    c10::InferenceMode inference;
    float* buf = reinterpret_cast<float*>(scratch<3>(QUANT_F32_PANEL * k));
    float* prod = stand ? reinterpret_cast<float*>(scratch<4>(QUANT_F32_PANEL * m)) : nullptr;
    for (int64_t panel = begin; panel < end; ++panel) {
      const int64_t c0 = panel * QUANT_F32_PANEL, cols = std::min(QUANT_F32_PANEL, n - c0);
      dequant_rows_f32(qw, scales.data_ptr(), mins.data_ptr(), bits, k, c0, cols, buf, interleaved);
      const auto w = torch::from_blob(buf, {cols, k}, x.options());
      // Inside the parallel region ATen's GEMM runs on this thread alone; out's columns
      // [c0, c0 + cols) are a matrix of leading dimension n, written where they lie.
      auto part = out2.narrow(1, c0, cols);
      if (stand) {
        auto wx = torch::from_blob(prod, {cols, m}, x.options());
        at::mm_out(wx, w, xt);
        if (bias_c.defined()) at::add_out(part, wx.t(), bias_c.narrow(0, c0, cols));
        else part.copy_(wx.t());
      } else if (bias_c.defined()) {
        at::addmm_out(part, bias_c.narrow(0, c0, cols), x2, w.t());
      } else {
        at::mm_out(part, x2, w.t());
      }
    }
  });
  return out;
}

// quant_gemm: out = x @ W.T (+ bias) for bf16 x over int8 or int4 weights, at any row count,
// where the CPU dots bf16 natively (AVX512-BF16). Each thread dequantizes a panel of 32
// weight rows into a bf16 buffer of its own (36-96 KB at SmolLM2's widths, in cache), exactly
// as quant_dequantize rounds them and laid out input pair by input pair, and runs every row of
// x against it: 12 rows of x by 32 outputs in 24 fp32 accumulators, each step one 64-byte load
// per 16 outputs, a broadcast pair of x per row and a vdpbf16ps per row and 16 outputs. Each
// output is one lane's sum over the inputs in order, whatever the rows around it, rounded to
// bf16 once: a row gets the same bits in any batch. Against oneDNN's bf16 GEMM over SmolLM2's
// layers on a 2-core Zen 4 EPYC (weights cycling through memory as in a step): 1.15x at 64
// rows, 0.98-1.08x at 256-1,024. The path before, dequantizing each layer into a fresh bf16
// copy for oneDNN, cost ~60 ms a step, as much as the 64-row GEMM. A dot-product form (4 x 4
// outputs, lanes along the inputs, summed across at the end) ran 0.79x oneDNN at 256-1,024
// rows: the sums across lanes and its scalar epilogue. Where AMX is usable the same panels
// feed AMX's tiles instead (quant_gemm_amx_*, below).
#if defined(__AVX512BF16__)
#define HAVE_QUANT_GEMM 1

// 32 weights of a group, dequantized and rounded to bf16, as quant_gemm's panels and
// quant_dequantize's bf16 copy both hold them.
static inline __m512i dequant32(__m512 lo, __m512 hi, float d, float m) {
  const __m512 dv = _mm512_set1_ps(d), mv = _mm512_set1_ps(m);
  return (__m512i)_mm512_cvtne2ps_pbh(_mm512_fmadd_ps(hi, dv, mv), _mm512_fmadd_ps(lo, dv, mv));
}

static inline __m512i dequant32_int8(const uint8_t* p, float d, float m) {
  const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16))));
  return dequant32(lo, hi, d, m);
}

static inline __m512i dequant32_int4(__m128i b, float d, float m) {
  const __m128i low = _mm_set1_epi8(0x0F);
  const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(b, low)));
  const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(b, 4), low)));
  return dequant32(lo, hi, d, m);
}

static inline __m512i dequant32_int4(const uint8_t* p, float d, float m) {
  return dequant32_int4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)), d, m);
}

// Interleaved int4's group g of weight row `row` (x8_group's bytes, gathered in registers),
// dequantized.
static inline __m512i dequant32_x8(const uint8_t* qw, const at::Half* scales, const at::Half* mins, int64_t groups,
                                   int64_t row, int64_t g) {
  const uint8_t* wg = x8_bytes(qw, groups, row, g);
  int32_t e[4];
  for (int p = 0; p < 4; ++p) std::memcpy(&e[p], wg + 32 * p, 4);
  const int64_t at = x8_index(groups, row, g);
  return dequant32_int4(_mm_setr_epi32(e[0], e[1], e[2], e[3]), static_cast<float>(scales[at]), static_cast<float>(mins[at]));
}

// Weight row `row` of W, group g, dequantized.
static inline __m512i dequant_group(const uint8_t* qw, const void* scales, const void* mins, int64_t bits, int64_t k,
                                    int64_t row, int64_t g, bool interleaved) {
  const int64_t groups = k / 32, at = row * groups + g;
  if (bits == 8 && interleaved) {
    alignas(32) uint8_t bytes[32];
    const int64_t i = p8_group(qw, k, row, g, bytes);
    return dequant32_int8(bytes, static_cast<const float*>(scales)[i], static_cast<const float*>(mins)[i]);
  }
  if (bits == 8)
    return dequant32_int8(qw + row * k + g * 32, static_cast<const float*>(scales)[at], static_cast<const float*>(mins)[at]);
  if (interleaved)
    return dequant32_x8(qw, static_cast<const at::Half*>(scales), static_cast<const at::Half*>(mins), groups, row, g);
  return dequant32_int4(qw + row * (k / 2) + g * 16, static_cast<float>(static_cast<const at::Half*>(scales)[at]),
                        static_cast<float>(static_cast<const at::Half*>(mins)[at]));
}

static constexpr int64_t PANEL_COLS = 32, TILE_ROWS = 12, FUSED_ROWS = 2;
// 32-bit words ahead of a panel's input pair that panel_tile asks for: linear_panels over
// SmolLM2's layers streamed from memory on a 2-core Zen 5 EPYC, time with none over with 2,048
// (4,096 and 8,192 the same): 1.0x at 1 row, 1.07x at 4, 1.47x at 16, 1.28x at 32, 1.15x at 64
// (a panel's first tile of rows waited on memory). quant_gemm's panels are in cache: no effect.
static constexpr int64_t PANEL_PREFETCH_WORDS = 2048;

// 16 vectors of 16 32-bit lanes transposed in place: lane j of v[i] <-> lane i of v[j].
static inline void transpose16x16(__m512i* v) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(v[i], v[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(v[i], v[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    v[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    v[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    v[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    v[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  // v[4b + c] now holds, in each 128-bit quarter q, rows 4b..4b+3 of column 4q + c: gather
  // column 4q + c's four quarters from v[c], v[4 + c], v[8 + c] and v[12 + c].
  for (int i = 0; i < 16; ++i) t[i] = v[i];
  for (int c = 0; c < 4; ++c) {
    const __m512i a = _mm512_shuffle_i32x4(t[c], t[4 + c], 0x44), b = _mm512_shuffle_i32x4(t[c], t[4 + c], 0xEE);
    const __m512i d = _mm512_shuffle_i32x4(t[8 + c], t[12 + c], 0x44), e = _mm512_shuffle_i32x4(t[8 + c], t[12 + c], 0xEE);
    v[c] = _mm512_shuffle_i32x4(a, d, 0x88);
    v[4 + c] = _mm512_shuffle_i32x4(a, d, 0xDD);
    v[8 + c] = _mm512_shuffle_i32x4(b, e, 0x88);
    v[12 + c] = _mm512_shuffle_i32x4(b, e, 0xDD);
  }
}

// Rows ahead of the one being dequantized whose bytes are asked for: a one-row int8 pass over
// SmolLM2's 30 layers on AMX, 23.5 -> 18-19.5 ms on a 2-core Xeon at 8 rows ahead, ~20 ms at
// 32-64 (at 64 rows, compute-bound, no change).
static constexpr int64_t DEQUANT_PREFETCH_ROWS = 8;

// A group's weight bytes `ahead` and, every 16 groups, its scales' and minimums' line there.
template <typename S>
static inline void prefetch_group(const uint8_t* ahead, const S* d, const S* mn, int64_t g, int64_t scales_ahead) {
  __builtin_prefetch(ahead, 0, 3);
  if ((g & 15) == 0) {
    __builtin_prefetch(d + g + scales_ahead, 0, 3);
    __builtin_prefetch(mn + g + scales_ahead, 0, 3);
  }
}

// Weight row `row` of W dequantized to bf16 into dst (k values).
template <int BITS>
static inline void dequant_row(const uint8_t* qw, const void* scales, const void* mins, int64_t k, int64_t row,
                               at::BFloat16* dst, bool interleaved) {
  const int64_t groups = k / 32;
  if (BITS == 4 && interleaved) {  // the next block's bytes of the same group, 8 rows ahead
    const auto* d = static_cast<const at::Half*>(scales);
    const auto* mn = static_cast<const at::Half*>(mins);
    for (int64_t g = 0; g < groups; ++g) {
      __builtin_prefetch(x8_bytes(qw, groups, row, g) + groups * X8_GROUP_BYTES, 0, 3);
      _mm512_storeu_si512(dst + g * 32, dequant32_x8(qw, d, mn, groups, row, g));
    }
    return;
  }
  if constexpr (BITS == 8) {
    const uint8_t* q = qw + row * k;
    const float* d = static_cast<const float*>(scales) + row * groups;
    const float* mn = static_cast<const float*>(mins) + row * groups;
    for (int64_t g = 0; g < groups; ++g) {
      prefetch_group(q + g * 32 + DEQUANT_PREFETCH_ROWS * k, d, mn, g, DEQUANT_PREFETCH_ROWS * groups);
      _mm512_storeu_si512(dst + g * 32, dequant32_int8(q + g * 32, d[g], mn[g]));
    }
  } else {
    const uint8_t* q = qw + row * (k / 2);
    const at::Half* d = static_cast<const at::Half*>(scales) + row * groups;
    const at::Half* mn = static_cast<const at::Half*>(mins) + row * groups;
    for (int64_t g = 0; g < groups; ++g) {
      prefetch_group(q + g * 16 + DEQUANT_PREFETCH_ROWS * (k / 2), d, mn, g, DEQUANT_PREFETCH_ROWS * groups);
      _mm512_storeu_si512(dst + g * 32, dequant32_int4(q + g * 16, static_cast<float>(d[g]), static_cast<float>(mn[g])));
    }
  }
}

// Rows [c0, c0 + 32) of W into buf (row-major, 32 x k), row by row: the 32 rows' bytes are one
// stretch of memory read front to back. Rows past the last output repeat it.
static inline void dequant_rows32(const uint8_t* qw, const void* scales, const void* mins, int64_t bits, int64_t k, int64_t c0,
                                  int64_t cols, at::BFloat16* buf, bool interleaved) {
  for (int64_t r = 0; r < PANEL_COLS; ++r) {
    const int64_t row = c0 + std::min(r, cols - 1);
    if (bits == 8 && interleaved) {
      for (int64_t g = 0; g < k / 32; ++g) _mm512_storeu_si512(buf + r * k + g * 32, dequant_group(qw, scales, mins, 8, k, row, g, true));
    } else if (bits == 8) dequant_row<8>(qw, scales, mins, k, row, buf + r * k, false);
    else dequant_row<4>(qw, scales, mins, k, row, buf + r * k, interleaved);
  }
}

// Weight rows [c0, c0 + cols) of W, dequantized into panel[in / 2][PANEL_COLS] (pairs of bf16;
// columns past the last are copies of it, computed and dropped).
static void dequantize_panel(const uint8_t* qw, const void* scales, const void* mins, int64_t bits, int64_t k, int64_t c0,
                             int64_t cols, uint32_t* panel, bool interleaved) {
  for (int64_t half = 0; half < PANEL_COLS / 16; ++half)
    for (int64_t g = 0; g < k / 32; ++g) {
      __m512i v[16];
      for (int64_t r = 0; r < 16; ++r) {
        const int64_t row = c0 + std::min(half * 16 + r, cols - 1);
        v[r] = dequant_group(qw, scales, mins, bits, k, row, g, interleaved);
      }
      transpose16x16(v);
      for (int64_t p = 0; p < 16; ++p) _mm512_storeu_si512(panel + (g * 16 + p) * PANEL_COLS + half * 16, v[p]);
    }
}

// bias[c0 .. c0 + 16) where mask has the lane, widened to fp32; zeros without a bias.
static inline __m512 masked_bias(const at::BFloat16* bias, int64_t c0, __mmask16 mask) {
  if (!bias) return _mm512_setzero_ps();
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, bias + c0)), 16));
}

// Accumulators a[j][h] (16 outputs from c0, `cols` of them real) plus the bias, each rounded to
// bf16 once, into rows j of out.
template <int MR, int H>
static inline void store_outputs(const __m512 (&a)[MR][H], int h, const at::BFloat16* bias, at::BFloat16* out, int64_t n,
                                 int64_t c0, int64_t cols) {
  const __mmask16 mask = first_lanes(cols);
  const __m512 b = masked_bias(bias, c0, mask);
  for (int j = 0; j < MR; ++j)
    _mm256_mask_storeu_epi16(out + j * n + c0, mask, (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(a[j][h], b)));
}

// MR rows of x against the panel's outputs c0..c0 + cols, stored with the bias.
template <int MR>
static inline void panel_tile(const at::BFloat16* x, int64_t k, const uint32_t* panel, const at::BFloat16* bias, at::BFloat16* out,
                              int64_t n, int64_t c0, int64_t cols) {
  __m512 a[MR][2];
  for (int j = 0; j < MR; ++j) a[j][0] = a[j][1] = _mm512_setzero_ps();
  const int32_t* xp = reinterpret_cast<const int32_t*>(x);
  const int64_t stride = k / 2;
  for (int64_t kp = 0; kp < k / 2; ++kp) {
    __builtin_prefetch(panel + kp * PANEL_COLS + PANEL_PREFETCH_WORDS, 0, 3);
    __builtin_prefetch(panel + kp * PANEL_COLS + PANEL_PREFETCH_WORDS + 16, 0, 3);
    const __m512bh w0 = (__m512bh)_mm512_loadu_si512(panel + kp * PANEL_COLS);
    const __m512bh w1 = (__m512bh)_mm512_loadu_si512(panel + kp * PANEL_COLS + 16);
    for (int j = 0; j < MR; ++j) {
      const __m512bh xb = (__m512bh)_mm512_set1_epi32(xp[j * stride + kp]);
      a[j][0] = _mm512_dpbf16_ps(a[j][0], xb, w0);
      a[j][1] = _mm512_dpbf16_ps(a[j][1], xb, w1);
    }
  }
  for (int h = 0; h < 2 && cols > h * 16; ++h) store_outputs<MR>(a, h, bias, out, n, c0 + h * 16, cols - h * 16);
}

// f(std::integral_constant<int, rows>) for rows in 1..MAX: a switch over a kernel's row counts.
template <int MAX, typename F>
static inline void up_to_rows(int64_t rows, F&& f) {
  if constexpr (MAX > 1) {
    if (rows < MAX) return up_to_rows<MAX - 1>(rows, f);
  }
  f(std::integral_constant<int, MAX>{});
}

// Every row of x against the panel's outputs c0..c0 + cols, TILE_ROWS rows at a time.
static void panel_rows(const at::BFloat16* x, int64_t m, int64_t k, const uint32_t* panel, const at::BFloat16* bias,
                       at::BFloat16* out, int64_t n, int64_t c0, int64_t cols) {
  for (int64_t i = 0; i < m; i += TILE_ROWS) {
    const at::BFloat16* xi = x + i * k;
    at::BFloat16* oi = out + i * n;
    up_to_rows<TILE_ROWS>(std::min<int64_t>(TILE_ROWS, m - i),
                          [&](auto rows) { panel_tile<rows()>(xi, k, panel, bias, oi, n, c0, cols); });
  }
}

// One or two rows of x against 16 outputs, the weights dequantized and transposed in
// registers: the panel's sums in the panel's order, without writing and reading back a panel.
// SmolLM2's 30 layers at one row: 10.2 ms, against 10.9 through panels and 6.5 for
// quant_linear's fp32 dots, which need no transpose but sum in another order.
template <int MR>
static inline void fused_block(const at::BFloat16* x, int64_t k, const uint8_t* qw, const void* scales, const void* mins,
                               int64_t bits, bool interleaved, const at::BFloat16* bias, at::BFloat16* out, int64_t n,
                               int64_t c0, int64_t cols) {
  __m512 a[MR][1];
  for (int j = 0; j < MR; ++j) a[j][0] = _mm512_setzero_ps();
  const int32_t* xp = reinterpret_cast<const int32_t*>(x);
  const int64_t stride = k / 2;
  for (int64_t g = 0; g < k / 32; ++g) {
    __m512i v[16];
    for (int64_t r = 0; r < 16; ++r) v[r] = dequant_group(qw, scales, mins, bits, k, c0 + std::min(r, cols - 1), g, interleaved);
    transpose16x16(v);
    for (int p = 0; p < 16; ++p)
      for (int j = 0; j < MR; ++j)
        a[j][0] = _mm512_dpbf16_ps(a[j][0], (__m512bh)_mm512_set1_epi32(xp[j * stride + g * 16 + p]), (__m512bh)v[p]);
  }
  store_outputs<MR>(a, 0, bias, out, n, c0, std::min<int64_t>(cols, 16));
}

// Bytes ahead in each of a panel's two blocks that int8 in panels asks for: SmolLM2's layers
// streamed from memory at one row on a 2-core Zen 5 EPYC, 6.4 ms with none, 5.6 at 512, 5.1 at
// 1,024, 4.75 at 2,048, 4.8 at 4,096 (bf16's panels 4.2).
static constexpr int64_t P8_PREFETCH_BYTES = 2048;

// int8 in panels (kernels.quant.interleave, P8_ROWS-row blocks): a block's input pair kp is 32
// bytes, 16 outputs' two weights each, which widen, scale and round into the panel's vector
// for those outputs as they lie: the bits dequantize_panel gives (dequant32's fma and one
// rounding), without its gathers and transpose.
struct P8Scales {
  __m512 dlo, dhi, mlo, mhi;  // lanes 2i and 2i + 1: output i's (lo) or 8 + i's (hi) d and m
};

static inline P8Scales p8_scales(const float* d, const float* mn) {
  const __m512i lo = _mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
  const __m512i hi = _mm512_add_epi32(lo, _mm512_set1_epi32(8));
  const __m512 dv = _mm512_loadu_ps(d), mv = _mm512_loadu_ps(mn);
  return {_mm512_permutexvar_ps(lo, dv), _mm512_permutexvar_ps(hi, dv), _mm512_permutexvar_ps(lo, mv),
          _mm512_permutexvar_ps(hi, mv)};
}

static inline __m512i p8_vector(const uint8_t* p, const P8Scales& s) {
  const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16))));
  return (__m512i)_mm512_cvtne2ps_pbh(_mm512_fmadd_ps(hi, s.dhi, s.mhi), _mm512_fmadd_ps(lo, s.dlo, s.mlo));
}

// MR rows of x against the panel of outputs c0..c0 + 32, its weights dequantized in registers
// as each input pair comes: panel_tile's sums in its order, with no panel read back. `keep`,
// where more rows follow, takes the dequantized panel for them.
template <int MR>
static inline void p8_tile(const at::BFloat16* x, int64_t k, const uint8_t* qw, const float* scales, const float* mins,
                           const at::BFloat16* bias, at::BFloat16* out, int64_t n, int64_t c0, uint32_t* keep) {
  const int64_t groups = k / 32;
  const uint8_t* q[2] = {qw + c0 * k, qw + (c0 + P8_ROWS) * k};
  const float* d[2] = {scales + c0 * groups, scales + (c0 + P8_ROWS) * groups};
  const float* mn[2] = {mins + c0 * groups, mins + (c0 + P8_ROWS) * groups};
  __m512 a[MR][2];
  for (int j = 0; j < MR; ++j) a[j][0] = a[j][1] = _mm512_setzero_ps();
  const int32_t* xp = reinterpret_cast<const int32_t*>(x);
  const int64_t stride = k / 2;
  for (int64_t g = 0; g < groups; ++g) {
    const P8Scales s0 = p8_scales(d[0] + g * P8_ROWS, mn[0] + g * P8_ROWS);
    const P8Scales s1 = p8_scales(d[1] + g * P8_ROWS, mn[1] + g * P8_ROWS);
    for (int64_t kp = g * 16; kp < g * 16 + 16; ++kp) {
      if ((kp & 1) == 0) {  // a 64-byte line holds two input pairs of a block
        __builtin_prefetch(q[0] + kp * 32 + P8_PREFETCH_BYTES, 0, 3);
        __builtin_prefetch(q[1] + kp * 32 + P8_PREFETCH_BYTES, 0, 3);
      }
      const __m512bh w0 = (__m512bh)p8_vector(q[0] + kp * 32, s0);
      const __m512bh w1 = (__m512bh)p8_vector(q[1] + kp * 32, s1);
      if (keep) {
        _mm512_storeu_si512(keep + kp * PANEL_COLS, (__m512i)w0);
        _mm512_storeu_si512(keep + kp * PANEL_COLS + 16, (__m512i)w1);
      }
      for (int j = 0; j < MR; ++j) {
        const __m512bh xb = (__m512bh)_mm512_set1_epi32(xp[j * stride + kp]);
        a[j][0] = _mm512_dpbf16_ps(a[j][0], xb, w0);
        a[j][1] = _mm512_dpbf16_ps(a[j][1], xb, w1);
      }
    }
  }
  for (int h = 0; h < 2; ++h) store_outputs<MR>(a, h, bias, out, n, c0 + h * 16, 16);
}

static void quant_gemm_p8(const at::BFloat16* x, const uint8_t* qw, const float* scales, const float* mins,
                          const at::BFloat16* bias, at::BFloat16* out, int64_t m, int64_t n, int64_t k) {
  if (m == 0) return;
  at::parallel_for(0, n / PANEL_COLS, 1, [&](int64_t begin, int64_t end) {
    uint32_t* panel = m > TILE_ROWS ? scratch<0>(PANEL_COLS * k / 2) : nullptr;
    for (int64_t p = begin; p < end; ++p) {
      const int64_t c0 = p * PANEL_COLS;
      if (m <= TILE_ROWS) {
        up_to_rows<TILE_ROWS>(m, [&](auto rows) { p8_tile<rows()>(x, k, qw, scales, mins, bias, out, n, c0, nullptr); });
      } else {  // the first tile's rows dequantize the panel for the rest
        p8_tile<TILE_ROWS>(x, k, qw, scales, mins, bias, out, n, c0, panel);
        panel_rows(x + TILE_ROWS * k, m - TILE_ROWS, k, panel, bias, out + TILE_ROWS * n, n, c0, PANEL_COLS);
      }
    }
  });
}

#if defined(HAVE_AMX)
// quant_gemm on AMX's tile units, at every row count where AMX is usable. Each thread takes 32
// outputs at a time and dequantizes their weights into a buffer of its own; TDPBF16PS runs x
// against it, four fp32 accumulator tiles per two 16-output and two 16-row blocks. Two forms:
// - up to AMX_WEIGHTS_FIRST_ROWS rows the weights are the tiles' first operand (16 outputs x
//   32 inputs), so a dequantized group of 32 is a tile row as it comes, read row by row, with
//   no transpose; x, packed once per call as pack_amx packs a weight, is the second. Each
//   accumulator tile is transposed to rows of x as it is stored, a cost per 16 x 16 outputs;
// - above, x is the first operand as it lies and the weights are transposed into input pairs
//   (dequantize_panel's layout: pack_amx's tiles at a stride of 128 bytes), as linear_amx runs
//   bf16.
// Over SmolLM2's layers on a 2-core AMX Xeon (480 MB of L3: bf16 weights never leave the
// cache, so dequantizing can only add work): 0.4x linear_amx at 1-8 rows, 0.6x at 32-128,
// 0.7-0.97x at 256-1,024, where the vdpbf16ps panels ran 0.2x at 64 rows, the weights-first
// form 0.8x at 1,024 (its transposed stores) and the rows-first 0.25x at one row (its
// transposes). Both sum an output as one chain of TDPBF16PS over the inputs in order, of the
// same pairs' products, whatever the rows beside it: a row gets the same bits in any batch, in
// either form. The crossing, int8 over the 30 layers on a 2-core AMX Xeon (family 6 model 167):
// weights-first 22.5 ms at 64 rows against rows-first 27.0, 33.8 against 30.1 at 96, 40.5
// against 34.8 at 128 (at 128 before, 0.85-0.95x of its time at 96-128 rows now).
static constexpr int64_t AMX_WEIGHTS_FIRST_ROWS = 80;

// x as pack_amx packs a weight: xp[b][i][r][2c + j] = x[16b + c][32i + 2r + j], zero past m.
static void pack_x_amx(const at::BFloat16* x, int64_t m, int64_t k, uint32_t* xp) {
  const int64_t kb = k / 32, blocks = (m + 15) / 16, pairs = k / 2;
  const uint32_t* xs = reinterpret_cast<const uint32_t*>(x);
  std::memset(xp, 0, blocks * kb * 256 * sizeof(uint32_t));
  for (int64_t row = 0; row < m; ++row) {
    uint32_t* dst = xp + (row / 16) * kb * 256 + row % 16;
    for (int64_t p = 0; p < pairs; ++p) dst[p * 16] = xs[row * pairs + p];
  }
}

// Accumulator tile c[row of x][output] plus the bias, rounded to bf16, into `rows` rows of out
// (stride n), outputs c0..c0 + cols: amx_store_rows masked to `cols` outputs.
static inline void amx_store_direct(const float (*c)[16], int64_t rows, const at::BFloat16* bias, at::BFloat16* out, int64_t n,
                                    int64_t c0, int64_t cols) {
  const __mmask16 mask = first_lanes(cols);
  const __m512 b = masked_bias(bias, c0, mask);
  for (int64_t r = 0; r < rows; ++r)
    _mm256_mask_storeu_epi16(out + r * n + c0, mask, (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(_mm512_load_ps(c[r]), b)));
}

// Accumulator tile c[output][row of x], transposed in place to c[row of x][output], then stored
// as amx_store_direct stores.
static inline void amx_store_transposed(float (*c)[16], int64_t rows, const at::BFloat16* bias, at::BFloat16* out, int64_t n,
                                        int64_t c0, int64_t cols) {
  __m512i v[16];
  for (int o = 0; o < 16; ++o) v[o] = _mm512_load_si512(c[o]);
  transpose16x16(v);
  for (int r = 0; r < 16; ++r) _mm512_store_si512(c[r], v[r]);
  amx_store_direct(c, rows, bias, out, n, c0, cols);
}

static inline void amx_zero_accumulators() {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
}

// The four accumulator tiles into c (the last two only where a second block of rows ran).
static inline void amx_store_accumulators(float (*c)[16][16], bool two) {
  _tile_stored(0, c[0], 64);
  _tile_stored(1, c[1], 64);
  if (two) {
    _tile_stored(2, c[2], 64);
    _tile_stored(3, c[3], 64);
  }
}

// Each thread's runs of 32 outputs: run(c0, cols, buffer, c) per panel, with AMX configured,
// the thread's buffer (32 x in bf16) and its four accumulator tiles' memory.
template <typename Run>
static void amx_panels(int64_t n, int64_t k, Run&& run) {
  at::parallel_for(0, (n + PANEL_COLS - 1) / PANEL_COLS, 1, [&](int64_t begin, int64_t end) {
    amx_configure();  // tile state is per thread
    uint32_t* buffer = scratch<0>(PANEL_COLS * k / 2);
    alignas(64) float c[4][16][16];
    for (int64_t p = begin; p < end; ++p) run(p * PANEL_COLS, std::min<int64_t>(PANEL_COLS, n - p * PANEL_COLS), buffer, c);
    _tile_release();
  });
}

static void quant_gemm_amx_weights_first(const at::BFloat16* x, const uint8_t* qw, const void* scales, const void* mins,
                                         int64_t bits, bool interleaved, const at::BFloat16* bias, at::BFloat16* out, int64_t m,
                                         int64_t n, int64_t k) {
  const int64_t kb = k / 32, blocks = (m + 15) / 16;
  uint32_t* xp = scratch<1>(blocks * kb * 256);
  pack_x_amx(x, m, k, xp);
  amx_panels(n, k, [&](int64_t c0, int64_t cols, uint32_t* buffer, float (*c)[16][16]) {
    at::BFloat16* a0 = reinterpret_cast<at::BFloat16*>(buffer);
    const at::BFloat16* a1 = a0 + 16 * k;
    dequant_rows32(qw, scales, mins, bits, k, c0, cols, a0, interleaved);
    for (int64_t b = 0; b < blocks; b += 2) {
      const bool two = b + 1 < blocks;
      amx_zero_accumulators();
      for (int64_t j = 0; j < kb; ++j) {
        _tile_loadd(4, a0 + j * 32, k * 2);
        _tile_loadd(6, xp + (b * kb + j) * 256, 64);
        _tile_loadd(5, a1 + j * 32, k * 2);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 5, 6);
        if (two) {
          _tile_loadd(7, xp + ((b + 1) * kb + j) * 256, 64);
          _tile_dpbf16ps(2, 4, 7);
          _tile_dpbf16ps(3, 5, 7);
        }
      }
      amx_store_accumulators(c, two);
      for (int t = 0; t < (two ? 4 : 2); ++t) {  // tile t: rows of block b + t / 2, outputs half t % 2
        const int64_t row0 = (b + t / 2) * 16, half = t % 2;
        if (cols > half * 16)
          amx_store_transposed(c[t], std::min<int64_t>(16, m - row0), bias, out + row0 * n, n, c0 + half * 16, cols - half * 16);
      }
    }
  });
}

static void quant_gemm_amx_rows_first(const at::BFloat16* x, const uint8_t* qw, const void* scales, const void* mins,
                                      int64_t bits, bool interleaved, const at::BFloat16* bias, at::BFloat16* out, int64_t m,
                                      int64_t n, int64_t k) {
  const int64_t kb = k / 32, blocks = (m + 15) / 16, tail = m % 16;
  std::vector<at::BFloat16> pad(tail ? 16 * k : 0, at::BFloat16(0.f));
  if (tail) std::memcpy(pad.data(), x + (m - tail) * k, tail * k * sizeof(at::BFloat16));
  auto rows_of = [&](int64_t b) { return (tail && b == blocks - 1) ? pad.data() : x + b * 16 * k; };
  auto count = [&](int64_t b) { return (tail && b == blocks - 1) ? tail : int64_t(16); };
  amx_panels(n, k, [&](int64_t c0, int64_t cols, uint32_t* panel, float (*c)[16][16]) {
    dequantize_panel(qw, scales, mins, bits, k, c0, cols, panel, interleaved);
    for (int64_t b = 0; b < blocks; b += 2) {
      const bool two = b + 1 < blocks;
      const at::BFloat16 *x0 = rows_of(b), *x1 = two ? rows_of(b + 1) : nullptr;
      amx_zero_accumulators();
      for (int64_t j = 0; j < kb; ++j) {
        _tile_loadd(4, x0 + j * 32, k * 2);
        _tile_loadd(6, panel + j * 16 * PANEL_COLS, PANEL_COLS * 4);
        _tile_loadd(7, panel + j * 16 * PANEL_COLS + 16, PANEL_COLS * 4);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        if (two) {
          _tile_loadd(5, x1 + j * 32, k * 2);
          _tile_dpbf16ps(2, 5, 6);
          _tile_dpbf16ps(3, 5, 7);
        }
      }
      amx_store_accumulators(c, two);
      for (int t = 0; t < (two ? 4 : 2); ++t) {  // tile t: rows of block b + t / 2, outputs half t % 2
        const int64_t blk = b + t / 2, half = t % 2;
        if (cols > half * 16)
          amx_store_direct(c[t], count(blk), bias, out + blk * 16 * n, n, c0 + half * 16, cols - half * 16);
      }
    }
  });
}
#endif

static void quant_gemm_kernel(const at::BFloat16* x, const uint8_t* qw, const void* scales, const void* mins, int64_t bits,
                              bool interleaved, const at::BFloat16* bias, at::BFloat16* out, int64_t m, int64_t n, int64_t k) {
#if defined(HAVE_AMX)
  if (amx_usable()) {
    if (m <= AMX_WEIGHTS_FIRST_ROWS) quant_gemm_amx_weights_first(x, qw, scales, mins, bits, interleaved, bias, out, m, n, k);
    else quant_gemm_amx_rows_first(x, qw, scales, mins, bits, interleaved, bias, out, m, n, k);
    return;
  }
#endif
  if (bits == 8 && interleaved) {
    quant_gemm_p8(x, qw, static_cast<const float*>(scales), static_cast<const float*>(mins), bias, out, m, n, k);
    return;
  }
  if (m <= FUSED_ROWS) {
    at::parallel_for(0, (n + 15) / 16, 4, [&](int64_t begin, int64_t end) {
      for (int64_t block = begin; block < end; ++block) {
        const int64_t c0 = block * 16, cols = std::min<int64_t>(16, n - c0);
        if (m == 1) fused_block<1>(x, k, qw, scales, mins, bits, interleaved, bias, out, n, c0, cols);
        else fused_block<2>(x, k, qw, scales, mins, bits, interleaved, bias, out, n, c0, cols);
      }
    });
    return;
  }
  const int64_t panels = (n + PANEL_COLS - 1) / PANEL_COLS;
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    uint32_t* panel = scratch<0>(PANEL_COLS * k / 2);
    for (int64_t p = begin; p < end; ++p) {
      const int64_t c0 = p * PANEL_COLS, cols = std::min<int64_t>(PANEL_COLS, n - c0);
      dequantize_panel(qw, scales, mins, bits, k, c0, cols, panel, interleaved);
      panel_rows(x, m, k, panel, bias, out, n, c0, cols);
    }
  });
}

// linear_panels: out = x @ W.T (+ bias) for bf16 x and W where the CPU dots bf16 natively
// (AVX512-BF16), W packed once by kernels.linear.pack_panels into the layout quant_gemm
// dequantizes its panels into: [out / 32][in / 2][32] pairs of bf16, each panel of 32 outputs
// contiguous, so a thread streams its panels front to back and panel_tile runs every row of x
// against each. Each output is one lane's chain over the inputs in order whatever the rows
// around it: a row gets the same bits in any batch.
static void linear_panels_kernel(const at::BFloat16* x, const uint32_t* packed, const at::BFloat16* bias, at::BFloat16* out,
                                 int64_t m, int64_t n, int64_t k) {
  at::parallel_for(0, n / PANEL_COLS, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      const uint32_t* panel = packed + p * (k / 2) * PANEL_COLS;
      panel_rows(x, m, k, panel, bias, out, n, p * PANEL_COLS, PANEL_COLS);
    }
  });
}

#endif

torch::Tensor linear_panels(torch::Tensor x, torch::Tensor packed, c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(x.scalar_type() == torch::kBFloat16 && packed.scalar_type() == torch::kBFloat16, "linear_panels takes bf16");
  TORCH_CHECK(packed.dim() == 4 && packed.is_contiguous() && packed.size(2) == 32 && packed.size(3) == 2,
              "packed must be kernels.linear.pack_panels' [out / 32, in / 2, 32, 2]");
  const int64_t n = packed.size(0) * 32, k = packed.size(1) * 2;
  TORCH_CHECK(x.size(-1) == k && k % 32 == 0, "x's last dimension must be the weight's in_features, a multiple of 32");
  x = x.contiguous();
  const int64_t m = x.numel() / k;
  torch::Tensor bias_c = checked_bias(bias, x, n);
  auto out = linear_out(x, n);
#if defined(HAVE_QUANT_GEMM)
  linear_panels_kernel(x.data_ptr<at::BFloat16>(), reinterpret_cast<const uint32_t*>(packed.data_ptr<at::BFloat16>()),
                       bias_c.defined() ? bias_c.data_ptr<at::BFloat16>() : nullptr, out.data_ptr<at::BFloat16>(), m, n, k);
#else
  (void)m;
  TORCH_CHECK(false, "linear_panels needs AVX512-BF16 (linear_panels_available())");
#endif
  return out;
}

bool quant_gemm_available() {
#if defined(HAVE_QUANT_GEMM)
  return true;
#else
  return false;
#endif
}

// The same build condition as quant_gemm: linear_panels runs quant_gemm's tile.
bool linear_panels_available() { return quant_gemm_available(); }

torch::Tensor quant_gemm(torch::Tensor x, torch::Tensor qweight, torch::Tensor scales, torch::Tensor mins,
                         c10::optional<torch::Tensor> bias, int64_t bits, bool interleaved) {
  TORCH_CHECK(x.scalar_type() == torch::kBFloat16, "quant_gemm takes bf16 x");
  auto [xc, bias_c, out, m, n, k] = quant_call(x, qweight, scales, mins, bias, bits);
  check_interleaved(bits, n, interleaved);
  TORCH_CHECK(bits == 4 || !interleaved || n % (2 * P8_ROWS) == 0,
              "quant_gemm takes int8 in panels with out_features a multiple of 32 (kernels.quant.interleave)");
  x = xc;
  const at::BFloat16* b = bias_c.defined() ? bias_c.data_ptr<at::BFloat16>() : nullptr;
#if defined(HAVE_QUANT_GEMM)
  quant_gemm_kernel(x.data_ptr<at::BFloat16>(), qweight.data_ptr<uint8_t>(), scales.data_ptr(), mins.data_ptr(), bits, interleaved,
                    b, out.data_ptr<at::BFloat16>(), m, n, k);
#else
  // Portable: the same bf16 weights, dotted in fp32 a row at a time (for the tests; the engine
  // takes this op only where quant_gemm_available()).
  auto w = quant_dequantize(qweight, scales, mins, bits, k, torch::kBFloat16, interleaved);
  const at::BFloat16* wp = w.data_ptr<at::BFloat16>();
  const at::BFloat16* xp = x.data_ptr<at::BFloat16>();
  at::BFloat16* o = out.data_ptr<at::BFloat16>();
  at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    for (int64_t c = begin; c < end; ++c)
      for (int64_t i = 0; i < m; ++i) {
        float sum = 0.f;
        for (int64_t t = 0; t < k; ++t) sum += to_f(xp[i * k + t]) * to_f(wp[c * k + t]);
        o[i * n + c] = static_cast<at::BFloat16>(sum + (b ? to_f(b[c]) : 0.f));
      }
  });
#endif
  return out;
}

#define NOGIL py::call_guard<py::gil_scoped_release>()

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("write_kv", &write_kv, NOGIL, "keys and values into their cache slots (CPU)");
  m.def("paged_decode", &paged_decode, NOGIL, "paged decode attention (CPU)");
  m.def("paged_prefill", &paged_prefill, NOGIL, "paged prefill attention for an fp32 or bf16 batch's prefill chunks, into out (CPU)");
  m.def("paged_prefill_available", &paged_prefill_available, "whether paged_prefill runs here for this dtype and head_dim");
  m.def("add_rms_norm", &add_rms_norm, NOGIL, "residual add (in place) and RMSNorm (CPU)");
  m.def("rotary", &rotary, NOGIL, "rotary embedding in place (CPU)");
  m.def("silu_and_mul", &silu_and_mul, NOGIL, "SiLU(gate) * up (CPU)");
  m.def("argmax_rows", &argmax_rows, NOGIL, "each row's index of its largest value, first of ties (CPU)");
  m.def("rotary_write_kv", &rotary_write_kv, NOGIL, "q and k rotated, k and v into their cache slots, from the fused qkv (CPU)");
  m.def("linear_small_bf16", &linear_small_bf16, "whether linear_small takes bf16 weights of this input width here");
  m.def("bf16_native", &bf16_native, "whether this CPU dots bf16 natively (AVX512-BF16)");
  m.def("avx512", &avx512, "whether these kernels were built for AVX-512");
  m.def("linear_amx_available", &linear_amx_available, "whether linear_amx runs here (AMX-BF16, allowed by the OS)");
  m.def("linear_amx", &linear_amx,
        NOGIL, "x @ w.T + bias in bf16 on AMX, w packed by kernels.linear.pack_amx; silu_mul: silu(gate) * up of a gate_up "
        "weight packed with gated=True (CPU)",
        py::arg("x"), py::arg("packed"), py::arg("bias") = py::none(), py::arg("silu_mul") = false);
  m.def("linear_small", &linear_small, NOGIL, "x @ w.T + bias for a few rows of x, fp32 or bf16 (CPU)", py::arg("x"), py::arg("w"),
        py::arg("bias") = py::none());
  m.def("quant_linear", &quant_linear, NOGIL, "x @ W.T + bias, W int8 or int4 in groups of 32 (kernels.quant), x quantized to int8 (CPU)",
        py::arg("x"), py::arg("qweight"), py::arg("scales"), py::arg("mins"), py::arg("bias"), py::arg("bits"),
        py::arg("interleaved") = false);
  m.def("linear_panels_available", &linear_panels_available, "whether linear_panels runs here (AVX512-BF16)");
  m.def("linear_panels", &linear_panels, NOGIL,
        "x @ w.T + bias in bf16, w packed by kernels.linear.pack_panels, any row count (CPU)", py::arg("x"),
        py::arg("packed"), py::arg("bias") = py::none());
  m.def("quant_gemm_available", &quant_gemm_available, "whether quant_gemm runs vectorized here (AVX512-BF16); elsewhere it is a slow portable loop");
  m.def("quant_gemm", &quant_gemm, NOGIL,
        "x @ W.T + bias for bf16 x, W int8 or int4 (kernels.quant) dequantized a panel at a time, any row count (CPU)",
        py::arg("x"), py::arg("qweight"), py::arg("scales"), py::arg("mins"), py::arg("bias"), py::arg("bits"),
        py::arg("interleaved") = false);
  m.def("quant_gemm_f32", &quant_gemm_f32, NOGIL,
        "x @ W.T + bias for fp32 x, W int8 or int4 (kernels.quant) dequantized a panel at a time into ATen's GEMM (CPU)",
        py::arg("x"), py::arg("qweight"), py::arg("scales"), py::arg("mins"), py::arg("bias"), py::arg("bits"),
        py::arg("interleaved") = false);
  m.def("quant_dequantize", &quant_dequantize, NOGIL, "int8 or int4 weights (kernels.quant) back in fp32 or bf16 (CPU)",
        py::arg("qweight"), py::arg("scales"), py::arg("mins"), py::arg("bits"), py::arg("in_features"), py::arg("dtype"),
        py::arg("interleaved") = false);
}
