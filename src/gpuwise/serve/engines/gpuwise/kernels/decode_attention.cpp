// The decode step's kernels for CPUs with AVX-512, built and loaded by serve/engines/gpuwise/attention.py, which says why they
// exist; docs/serving.md has their speed.
//
// 1. Attention of one new token per sequence over its cached keys and values.
// q:   [n, H, D] (strided: row q_sn, head q_sh; D contiguous), in T (float or bfloat16)
// k, v: one layer of the paged cache, [blocks, bs, K, D]: row i's position l of key/value head h in block
//       table[i * tb + l / bs], at that block * c_sb + (l % bs) * c_sl + h * c_sh
// lens: [n] how many positions row i attends to (0 .. lens[i]-1)
// out: [n, H, D] (row o_sn, head o_sh)
// Query head j reads key/value head j / (H / K) (grouped-query attention). Scores, softmax and the weighted
// sum run in fp32 whatever T is; the output is rounded to T once.
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#ifdef __AVX512F__
#include <immintrin.h>
#else  // AVX2: the same intrinsics through SIMDe
#include "avx512_on_avx2.h"
#endif

#include <omp.h>
#include <sched.h>
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define GPUWISE_AMX 1
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <new>
#include <utility>
#include <vector>

namespace {

inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }

inline __m512 load16(const c10::BFloat16* p) {
  // a bfloat16 is the high half of a float32
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// the first `count` (< 16) values, zeros after them
inline __m512 load_tail(const float* p, int64_t count) {
  return _mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << count) - 1), p);
}

inline __m512 load_tail(const c10::BFloat16* p, int64_t count) {
  const __m256i h = _mm256_maskz_loadu_epi16(static_cast<__mmask16>((1u << count) - 1), p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// e^x for x <= 0 (a score less the row's max): 2^(x log2 e) = 2^i * 2^f with i an integer, |f| <= 1/2, and 2^f
// by a degree-6 polynomial (its relative error is below float32's 2^-23 on that interval). Below -87 it gives
// e^-87 (1.6e-38) rather than a denormal: nothing that small changes a softmax.
inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.f));
  const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f));
  const __m512 i = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, i);
  __m512 p = _mm512_set1_ps(1.535336188319500e-4f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.339887440266574e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.618437357674640e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.550332471162809e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.402264791363012e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.931472028550421e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, i);
}

constexpr int64_t kMaxChunks = 16;  // head dim up to 256 in 16-float registers

// A work item is a row, all its heads: the keys and values of one position (every head) are contiguous in the
// cache, read in one pass. With fewer rows than two per thread, a (row, key/value head) pair instead.
inline int64_t attend_split(int64_t n, int64_t K, int64_t threads) { return n >= 2 * threads ? 1 : K; }

// Ask for n values from p on into the cache: a row's blocks lie anywhere in the pool, where the hardware's
// prefetcher, which follows one address stream, does not look; the next block's position t is asked for while
// this block's position t is read.
template <typename T>
inline void ahead(const T* p, int64_t n) {
  const char* c = reinterpret_cast<const char*>(p);
  for (int64_t b = 0; b < n * static_cast<int64_t>(sizeof(T)); b += 64) _mm_prefetch(c + b, _MM_HINT_T0);
}

// the work items begin .. end of attend (below), split of them a row
template <typename T>
void attend_items(const T* q, const T* k, const T* v, const int64_t* table, int64_t tb, int64_t bs,
                  const int64_t* lens, T* out, int64_t H, int64_t K, int64_t D, int64_t q_sn, int64_t q_sh,
                  int64_t c_sb, int64_t c_sl, int64_t c_sh, int64_t o_sn, int64_t o_sh, float scale, int64_t split,
                  int64_t begin, int64_t end) {
  const int64_t G = H / K, V = D / 16, per = K / split;
  {
    std::vector<__m512> query(H * V), acc(H * V);
    std::vector<float> scores;
    alignas(64) float lane[kMaxChunks * 16];
    for (int64_t item = begin; item < end; ++item) {
      const int64_t i = item / split, h0 = item % split * per, h1 = h0 + per, L = lens[i];
      const int64_t padded = (L + 15) / 16 * 16;
      scores.resize(H * padded);
      for (int64_t hg = h0 * G; hg < h1 * G; ++hg)
        for (int64_t j = 0; j < V; ++j)
          query[hg * V + j] = _mm512_mul_ps(load16(q + i * q_sn + hg * q_sh + j * 16), _mm512_set1_ps(scale));
      const int64_t* blocks = table + i * tb;
      // a block at a time: its positions are contiguous, l / bs is counted once a block, not once a position
      for (int64_t l0 = 0; l0 < L; l0 += bs) {
        const T* keys = k + blocks[l0 / bs] * c_sb;
        const T* next = l0 + bs < L ? k + blocks[l0 / bs + 1] * c_sb : nullptr;
        for (int64_t t = 0, l = l0; t < bs && l < L; ++t, ++l) {
          if (next != nullptr) ahead(next + t * c_sl + h0 * c_sh, (h1 - h0) * c_sh);
          for (int64_t h = h0; h < h1; ++h) {
            __m512 key[kMaxChunks];
            for (int64_t j = 0; j < V; ++j) key[j] = load16(keys + t * c_sl + h * c_sh + j * 16);
            for (int64_t g = 0; g < G; ++g) {
              const int64_t hg = h * G + g;
              __m512 dot = _mm512_mul_ps(query[hg * V], key[0]);
              for (int64_t j = 1; j < V; ++j) dot = _mm512_fmadd_ps(query[hg * V + j], key[j], dot);
              scores[hg * padded + l] = _mm512_reduce_add_ps(dot);
            }
          }
        }
      }
      for (int64_t hg = h0 * G; hg < h1 * G; ++hg) {
        float* s = scores.data() + hg * padded;
        for (int64_t l = L; l < padded; ++l) s[l] = -INFINITY;
        __m512 top = _mm512_set1_ps(-INFINITY);
        for (int64_t l = 0; l < padded; l += 16) top = _mm512_max_ps(top, _mm512_loadu_ps(s + l));
        const __m512 max = _mm512_set1_ps(_mm512_reduce_max_ps(top));
        __m512 sum = _mm512_setzero_ps();
        for (int64_t l = 0; l < padded; l += 16) {
          const __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(s + l), max));
          _mm512_storeu_ps(s + l, e);
          sum = _mm512_add_ps(sum, e);
        }
        const __m512 inv = _mm512_set1_ps(1.f / _mm512_reduce_add_ps(sum));
        for (int64_t l = 0; l < padded; l += 16) _mm512_storeu_ps(s + l, _mm512_mul_ps(_mm512_loadu_ps(s + l), inv));
      }
      for (auto& a : acc) a = _mm512_setzero_ps();
      for (int64_t l0 = 0; l0 < L; l0 += bs) {
        const T* values = v + blocks[l0 / bs] * c_sb;
        const T* next = l0 + bs < L ? v + blocks[l0 / bs + 1] * c_sb : nullptr;
        for (int64_t t = 0, l = l0; t < bs && l < L; ++t, ++l) {
          if (next != nullptr) ahead(next + t * c_sl + h0 * c_sh, (h1 - h0) * c_sh);
          for (int64_t h = h0; h < h1; ++h) {
            __m512 value[kMaxChunks];
            for (int64_t j = 0; j < V; ++j) value[j] = load16(values + t * c_sl + h * c_sh + j * 16);
            for (int64_t g = 0; g < G; ++g) {
              const int64_t hg = h * G + g;
              const __m512 p = _mm512_set1_ps(scores[hg * padded + l]);
              for (int64_t j = 0; j < V; ++j) acc[hg * V + j] = _mm512_fmadd_ps(p, value[j], acc[hg * V + j]);
            }
          }
        }
      }
      for (int64_t hg = h0 * G; hg < h1 * G; ++hg) {
        for (int64_t j = 0; j < V; ++j) _mm512_store_ps(lane + j * 16, acc[hg * V + j]);
        T* o = out + i * o_sn + hg * o_sh;
        for (int64_t d = 0; d < D; ++d) o[d] = static_cast<T>(lane[d]);
      }
    }
  }
}

template <typename T>
void attend(const T* q, const T* k, const T* v, const int64_t* table, int64_t tb, int64_t bs, const int64_t* lens,
            T* out, int64_t n, int64_t H, int64_t K, int64_t D, int64_t q_sn, int64_t q_sh, int64_t c_sb,
            int64_t c_sl, int64_t c_sh, int64_t o_sn, int64_t o_sh, float scale) {
  const int64_t split = attend_split(n, K, at::get_num_threads());
  at::parallel_for(0, n * split, 1, [&](int64_t begin, int64_t end) {
    attend_items(q, k, v, table, tb, bs, lens, out, H, K, D, q_sn, q_sh, c_sb, c_sl, c_sh, o_sn, o_sh, scale, split,
                 begin, end);
  });
}

// 2. A product of a few rows by a weight: out[m, o] = sum_i x[m, i] w[o, i] (+ bias[o]), m < M <= kMaxRows.
// At a decode step's few rows a product is bound by reading the weight once (oneDNN and MKL reorder or pad
// for blocks of rows and reach a third of the memory's speed there: docs/serving.md). Each thread takes a
// share of the output columns, four weight rows at a time, each read once for every input row; the sums run
// in fp32 and the output is rounded to T once. x: [M, I] and out: [M, O] contiguous; the weight [O, I] is read
// through a format (below): T itself with row stride w_so, or one of llama.cpp's block formats.
constexpr int64_t kMaxRows = 8;
#ifdef __AVX512F__
constexpr int64_t kRowsAtOnce = 4;  // input rows a pass: R x 4 fp32 accumulators stay in registers
#else  // AVX2's 16 registers hold one row's sums (gemv_block_avx2, qgemv_x4_avx2); more spilled (docs/serving.md)
constexpr int64_t kRowsAtOnce = 1;
#endif
constexpr int64_t kBlock = 4;       // weight rows a pass
constexpr int64_t kAhead = 4;       // weight rows ahead that a pass prefetches

// Weight formats, each read 16 values at a time into fp32 (`load`). kPlain: T itself. The others are llama.cpp's
// (ggml-common.h), numbered by ggml's type ids, so that a GGUF's tensors are read as they ship: blocks of 32
// values along a row, Q8_0 {fp16 d; int8 q[32]} is d q; Q4_0 {fp16 d; uint8 q[16]} is (q - 8) d; Q4_1 {fp16 d, m;
// uint8 q[16]} is q d + m; in the 4-bit ones value j < 16 is byte j's low nibble, value 16 + j its high one.
// The quantized weight is dequantized in registers as it is read: no fp32 or bf16 copy of it is kept anywhere.
constexpr int kPlain = 0, kQ4_0 = 2, kQ4_1 = 3, kQ8_0 = 8;
template <typename T>
constexpr bool kInt8Acts = std::is_same<T, c10::BFloat16>::value;  // bf16 products by blocks: int8 activations

inline float half_at(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

template <typename T>
struct Plain {
  const T* w;
  int64_t so;                                        // row stride, in values
  static constexpr int64_t kEvery = 64 / sizeof(T);  // values a cache line holds: each line prefetched once
  static constexpr bool kBlocks = false;
  __m512 load(int64_t row, int64_t i) const { return load16(w + row * so + i); }
  __m512 tail(int64_t row, int64_t i, int64_t count) const { return load_tail(w + row * so + i, count); }
  const void* at(int64_t row, int64_t i) const { return w + row * so + i; }
};

// kPlainX4: T itself laid out four rows at a time (serve/engines/gpuwise/quant.py: interleave_rows): per group of
// 4 rows, each row's values 0-31, then each row's 32-63, ... (O % 4 == 0, I % 32 == 0), so that a pass over a
// group's 4 rows reads one stream, not 4 streams a row apart, which the hardware reads slower
// (benchmarks/weight_read.cpp; docs/serving.md). The same values in the same order as Plain's: the same sums.
template <typename T>
struct PlainX4 {
  const T* w;
  int64_t I;
  static constexpr int64_t kEvery = 64 / sizeof(T);
  static constexpr bool kBlocks = false;
  const T* ptr(int64_t row, int64_t i) const {
    return w + (row >> 2) * 4 * I + (i >> 5) * 128 + (row & 3) * 32 + (i & 31);
  }
  __m512 load(int64_t row, int64_t i) const { return load16(ptr(row, i)); }
  __m512 tail(int64_t, int64_t, int64_t) const { return _mm512_setzero_ps(); }
  const void* at(int64_t row, int64_t i) const { return ptr(row, i); }
};

// the block formats: rows of whole blocks (I % 32 == 0, checked where a call comes in), so no tail
template <int64_t Bytes>
struct Blocks {
  const uint8_t* w;
  int64_t so;                        // row stride, in bytes: I / 32 blocks of `Bytes`
  static constexpr int64_t kEvery = 32;  // a block's start each block: every line is asked for (Bytes < 64)
  static constexpr bool kBlocks = true;
  static constexpr int64_t kBytes = Bytes;
  const uint8_t* block(int64_t row, int64_t i) const { return w + row * so + (i >> 5) * Bytes; }
  __m512 tail(int64_t, int64_t, int64_t) const { return _mm512_setzero_ps(); }
  const void* at(int64_t row, int64_t i) const { return block(row, i); }
};

// Two blocks (64 values) of a row as bytes for an integer dot product with 64 int8 activations (llama.cpp's way
// of multiplying by quantized weights: its vec_dot_q8_0_q8_0 / q4_1_q8_1): `quants2` the weights as unsigned
// bytes (Q8_0: their magnitudes, their signs as a mask moved onto x), `scales2` [d_b, m_b, d_b+1, m_b+1] as
// floats, where m is what a block's sum of x is multiplied by (0 for Q8_0). `two` false: block b is the row's
// last; the second block reads as zeros and nothing past the row is read.
inline uint64_t two_halves(const uint8_t* a, const uint8_t* b) {  // fp16 pairs at a and b: [a0, a1, b0, b1]
  uint32_t lo, hi = 0;
  std::memcpy(&lo, a, 4);
  if (b) std::memcpy(&hi, b, 4);
  return static_cast<uint64_t>(lo) | static_cast<uint64_t>(hi) << 32;
}

// x negated where q is negative: the sign a product of |q| by x needs. AVX2's vpsignb (avx512_on_avx2.h) also
// zeroes x where q is 0, where |q| is 0 too; SIMDe's mask of the signs is a loop over the bytes.
#ifdef __AVX512F__
using Signs = __mmask64;
inline Signs signs(__m512i q) { return _mm512_movepi8_mask(q); }
inline __m512i signed_by(__m512i x, Signs neg) { return _mm512_mask_sub_epi8(x, neg, _mm512_setzero_si512(), x); }
#else
using Signs = __m512i;
inline Signs signs(__m512i q) { return q; }
inline __m512i signed_by(__m512i x, Signs q) { return _mm512_sign_epi8(x, q); }
#endif

struct Q8_0Pair {
  __m512i u;
  Signs neg;
};

inline Q8_0Pair q8_0_quants2(const uint8_t* p, bool two) {
  const __m256i lo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 2));
  const __m256i hi = two ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 36)) : _mm256_setzero_si256();
  const __m512i q = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
  return {_mm512_abs_epi8(q), signs(q)};  // |-128| is 128 as an unsigned byte
}

// u8 x s8 products summed in fours into 16 int32 lanes
inline __m512i dot_u8s8(__m512i u, __m512i s) {
#ifdef __AVX512VNNI__
  return _mm512_dpbusd_epi32(_mm512_setzero_si512(), u, s);
#else  // no VNNI: pairs into int16 (no saturation: |q| <= 128 and |x| <= 127), then pairs of those
  return _mm512_madd_epi16(_mm512_maddubs_epi16(u, s), _mm512_set1_epi16(1));
#endif
}

inline __m512i dot2(const Q8_0Pair& w, __m512i x) {
  return dot_u8s8(w.u, signed_by(x, w.neg));
}

inline __m512i dot2(__m512i w, __m512i x) { return dot_u8s8(w, x); }

// the 16 bytes of nibbles at a (and b) as [a's low nibbles, a's high ones, b's low, b's high]: values 0-31 of
// each block in order
inline __m512i nibbles64(const uint8_t* a, const uint8_t* b) {
  const __m128i va = _mm_loadu_si128(reinterpret_cast<const __m128i*>(a));
  __m512i z = b ? _mm512_mask_broadcast_i32x4(_mm512_broadcast_i32x4(va), 0xFF00,
                                              _mm_loadu_si128(reinterpret_cast<const __m128i*>(b)))
                : _mm512_maskz_broadcast_i32x4(0x00FF, va);
  constexpr long long k4 = 0x0004000400040004ll;  // each 16-bit lane's shift: 4 in the high nibbles' 128 bits
  z = _mm512_srlv_epi16(z, _mm512_set_epi64(k4, k4, 0, 0, k4, k4, 0, 0));
  return _mm512_and_si512(z, _mm512_set1_epi8(0x0F));
}

struct Q8_0 : Blocks<34> {
  static constexpr bool kMin = false;  // no offset: a block's sum is d (q . x)
  using Pair = Q8_0Pair;
  Pair quants2(int64_t row, int64_t b, bool two) const { return q8_0_quants2(w + row * so + b * 34, two); }
  __m128 scales2(int64_t row, int64_t b, bool two) const {
    const uint8_t* p = w + row * so + b * 34;
    const uint64_t h = two_halves(p, two ? p + 34 : nullptr) & 0x0000FFFF0000FFFFull;  // no m: a q's byte
    return _mm_cvtph_ps(_mm_cvtsi64_si128(static_cast<int64_t>(h)));
  }
  // block b of a row: its 32 values before the scale (lo: 0-15, hi: 16-31), its scale, its offset
  void decode(int64_t row, int64_t b, __m512& lo, __m512& hi, float& d, float& m) const {
    const uint8_t* p = w + row * so + b * 34;
    d = half_at(p), m = 0.f;
    lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 2))));
    hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 18))));
  }
  __m512 load(int64_t row, int64_t i) const {
    const uint8_t* b = block(row, i);
    const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 2 + (i & 31)));
    return _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q)), _mm512_set1_ps(half_at(b)));
  }
};

// the 16 nibbles of values i .. i + 15 (i a multiple of 16) of the block at b, from its 16 bytes at b + offset
inline __m512 nibbles(const uint8_t* q, int64_t i) {
  __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q));
  if (i & 16) v = _mm_srli_epi16(v, 4);
  v = _mm_and_si128(v, _mm_set1_epi8(0x0F));
  return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(v));
}

// a 4-bit block's 32 values from its 16 bytes at q: lo the low nibbles, hi the high ones
inline void nibbles32(const uint8_t* q, __m512& lo, __m512& hi) {
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q));
  const __m128i mask = _mm_set1_epi8(0x0F);
  lo = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(v, mask)));
  hi = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(v, 4), mask)));
}

struct Q4_0 : Blocks<18> {
  static constexpr bool kMin = true;  // (q - 8) d: an offset of -8 d times the block's sum of x
  using Pair = __m512i;
  Pair quants2(int64_t row, int64_t b, bool two) const {
    const uint8_t* p = w + row * so + b * 18;
    return nibbles64(p + 2, two ? p + 20 : nullptr);
  }
  __m128 scales2(int64_t row, int64_t b, bool two) const {
    const uint8_t* p = w + row * so + b * 18;
    uint16_t d0, d1 = 0;
    std::memcpy(&d0, p, 2);
    if (two) std::memcpy(&d1, p + 18, 2);
    const uint64_t h = d0 * 0x10001ull | static_cast<uint64_t>(d1) * 0x10001ull << 32;  // [d, d, d', d']
    return _mm_mul_ps(_mm_cvtph_ps(_mm_cvtsi64_si128(static_cast<int64_t>(h))), _mm_setr_ps(1.f, -8.f, 1.f, -8.f));
  }
  void decode(int64_t row, int64_t b, __m512& lo, __m512& hi, float& d, float& m) const {
    const uint8_t* p = w + row * so + b * 18;
    d = half_at(p), m = -8.f * d;
    nibbles32(p + 2, lo, hi);
  }
  __m512 load(int64_t row, int64_t i) const {
    const uint8_t* b = block(row, i);
    const float d = half_at(b);
    return _mm512_fmadd_ps(nibbles(b + 2, i), _mm512_set1_ps(d), _mm512_set1_ps(-8.f * d));
  }
};

struct Q4_1 : Blocks<20> {
  static constexpr bool kMin = true;  // q d + m: an offset of m times the block's sum of x
  using Pair = __m512i;
  Pair quants2(int64_t row, int64_t b, bool two) const {
    const uint8_t* p = w + row * so + b * 20;
    return nibbles64(p + 4, two ? p + 24 : nullptr);
  }
  __m128 scales2(int64_t row, int64_t b, bool two) const {
    const uint8_t* p = w + row * so + b * 20;
    return _mm_cvtph_ps(_mm_cvtsi64_si128(static_cast<int64_t>(two_halves(p, two ? p + 20 : nullptr))));
  }
  void decode(int64_t row, int64_t b, __m512& lo, __m512& hi, float& d, float& m) const {
    const uint8_t* p = w + row * so + b * 20;
    d = half_at(p), m = half_at(p + 2);
    nibbles32(p + 4, lo, hi);
  }
  __m512 load(int64_t row, int64_t i) const {
    const uint8_t* b = block(row, i);
    return _mm512_fmadd_ps(nibbles(b + 4, i), _mm512_set1_ps(half_at(b)), _mm512_set1_ps(half_at(b + 2)));
  }
};

// Q8_0 and Q4_1 with four rows' blocks interleaved (quant.py `interleave`), the same bytes laid out for a product
// of few rows: a thread's share is one address stream, 4 rows' scales are one load, and a row's two blocks are one
// load with nothing to move (docs/serving.md has the speed of each layout). Per group of 4 rows and pair of blocks
// (64 values): the fp16 scales [rows 0-3 of block b, rows 0-3 of block b + 1] (Q4_1: then its minimums, the
// same way), then each row's two blocks' quants: Q8_0's 64 as unsigned bytes (q + 128), Q4_1's 32 bytes of
// nibbles as they ship. Rows come in whole groups (O % 4 == 0) of whole pairs (I % 64 == 0), checked where a
// call comes in. Not ggml types: 100 + the type of the blocks they interleave.
constexpr int kQ8_0x4 = 108, kQ4_1x4 = 103, kPlainX4 = 100;

// what both interleaved formats share: a group of 4 rows is 4 row's bytes, contiguous, in pairs of kPair bytes
template <int64_t Bytes, bool Min>
struct Groups {
  const uint8_t* w;
  int64_t so;  // bytes a row holds (I / 32 * Bytes): a group is 4 so, contiguous
  static constexpr int64_t kEvery = 32;
  static constexpr bool kBlocks = true;
  static constexpr int64_t kBytes = Bytes;
  static constexpr bool kMin = Min;
  static constexpr int64_t kPair = 8 * Bytes;  // bytes of a group's pair of blocks
  const uint8_t* pair(int64_t row, int64_t p) const { return w + (row >> 2) * 4 * so + p * kPair; }
  const void* at(int64_t row, int64_t i) const { return pair(row, i >> 6); }
  __m512 tail(int64_t, int64_t, int64_t) const { return _mm512_setzero_ps(); }
};

struct Q8_0x4 : Groups<34, false> {
  // 16 values of a row as signed bytes, from its unsigned ones at q
  static __m512 values16(const uint8_t* q) {
    const __m128i u = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q));
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_xor_si128(u, _mm_set1_epi8(static_cast<char>(0x80)))));
  }
  void decode(int64_t row, int64_t b, __m512& lo, __m512& hi, float& d, float& m) const {
    const uint8_t* p = pair(row, b >> 1);
    const int64_t r = row & 3, h = b & 1;
    d = half_at(p + 2 * (h * 4 + r)), m = 0.f;
    lo = values16(p + 16 + r * 64 + h * 32), hi = values16(p + 16 + r * 64 + h * 32 + 16);
  }
  __m512 load(int64_t row, int64_t i) const {
    const uint8_t* p = pair(row, i >> 6);
    const int64_t r = row & 3, h = (i >> 5) & 1;
    return _mm512_mul_ps(values16(p + 16 + r * 64 + (i & 63)), _mm512_set1_ps(half_at(p + 2 * (h * 4 + r))));
  }
  // row r's two blocks as 64 unsigned bytes, in the order the x it multiplies comes in (x_order)
  static __m512i quants(const uint8_t* p, int r) { return _mm512_loadu_si512(p + 16 + r * 64); }
  static __m512i x_order(__m512i x) { return x; }
};

struct Q4_1x4 : Groups<20, true> {
  void decode(int64_t row, int64_t b, __m512& lo, __m512& hi, float& d, float& m) const {
    const uint8_t* p = pair(row, b >> 1);
    const int64_t r = row & 3, h = b & 1;
    d = half_at(p + 2 * (h * 4 + r)), m = half_at(p + 16 + 2 * (h * 4 + r));
    nibbles32(p + 32 + r * 32 + h * 16, lo, hi);
  }
  __m512 load(int64_t row, int64_t i) const {
    const uint8_t* p = pair(row, i >> 6);
    const int64_t r = row & 3, h = (i >> 5) & 1;
    return _mm512_fmadd_ps(nibbles(p + 32 + r * 32 + h * 16, i), _mm512_set1_ps(half_at(p + 2 * (h * 4 + r))),
                           _mm512_set1_ps(half_at(p + 16 + 2 * (h * 4 + r))));
  }
  // row r's 32 bytes: low nibbles [block b's values 0-15, b + 1's 0-15], then the high ones [b's 16-31, b + 1's]
  static __m512i quants(const uint8_t* p, int r) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32 + r * 32));
    const __m512i both = _mm512_inserti64x4(_mm512_castsi256_si512(v), _mm256_srli_epi16(v, 4), 1);
    return _mm512_and_si512(both, _mm512_set1_epi8(0x0F));
  }
  // x's 64 values [b 0-15, b 16-31, b+1 0-15, b+1 16-31] in that order: its 2nd and 3rd 16 swapped
  static __m512i x_order(__m512i x) { return _mm512_shuffle_i64x2(x, x, _MM_SHUFFLE(3, 1, 2, 0)); }
};

template <typename W>
constexpr bool kInterleaved = std::is_same<W, Q8_0x4>::value || std::is_same<W, Q4_1x4>::value;

inline bool known_format(int fmt) {
  return fmt == kPlain || fmt == kPlainX4 || fmt == kQ4_0 || fmt == kQ4_1 || fmt == kQ8_0 || fmt == kQ8_0x4 ||
         fmt == kQ4_1x4;
}

// whether a weight [O, I] in format fmt is one the kernels take: a block format's rows whole blocks, an
// interleaved one's whole groups of whole pairs
inline bool takes_shape(int fmt, int64_t O, int64_t I) {
  if (fmt == kPlain) return true;
  if (fmt == kPlainX4) return O % 4 == 0 && I % 32 == 0;
  if (fmt == kQ8_0x4 || fmt == kQ4_1x4) return O % 4 == 0 && I % 64 == 0;
  return I % 32 == 0;
}

// f(the weight at w in format fmt: [O, I], a plain one with row stride w_so)
template <typename T, typename F>
inline void with_weight(int fmt, const void* w, int64_t I, int64_t w_so, F&& f) {
  const auto* b = static_cast<const uint8_t*>(w);
  switch (fmt) {
    case kQ8_0: f(Q8_0{{b, I / 32 * 34}}); break;
    case kQ4_0: f(Q4_0{{b, I / 32 * 18}}); break;
    case kQ4_1: f(Q4_1{{b, I / 32 * 20}}); break;
    case kQ8_0x4: f(Q8_0x4{{b, I / 32 * 34}}); break;
    case kQ4_1x4: f(Q4_1x4{{b, I / 32 * 20}}); break;
    case kPlainX4: f(PlainX4<T>{static_cast<const T*>(w), I}); break;
    default: f(Plain<T>{static_cast<const T*>(w), w_so}); break;
  }
}

// The same for a weight in a block format, a block (32 values) at a time: its values are decoded once for all
// MM input rows, their products with x summed, and the sum scaled by the block's d once (not each value);
// Q4's offset m comes in as m times the block's sum of x (xs[m * I / 32 + b], summed once a product).
template <int MM, typename W, typename B, typename Emit>
inline void qgemv_block(const float* xf, const float* xs, const W& w, const B* bias, int64_t I, int64_t o0,
                        int64_t rows, Emit&& emit) {
  constexpr int64_t R = kBlock;
  const int64_t nb = I / 32;
  __m512 acc[R][MM];
  float off[R][MM];
  for (int64_t r = 0; r < R; ++r)
    for (int m = 0; m < MM; ++m) acc[r][m] = _mm512_setzero_ps(), off[r][m] = 0.f;
  for (int64_t b = 0; b < nb; ++b) {
    if (b * W::kBytes % 64 < W::kBytes)  // this block starts a cache line: the rows ahead's same line asked for
      for (int64_t r = 0; r < R; ++r) _mm_prefetch(static_cast<const char*>(w.at(o0 + kAhead + r, b * 32)), _MM_HINT_T0);
    __m512 lo[R], hi[R];
    float d[R], mins[R];
    for (int64_t r = 0; r < R; ++r) {
      if (r < rows) {
        w.decode(o0 + r, b, lo[r], hi[r], d[r], mins[r]);
      } else {
        lo[r] = hi[r] = _mm512_setzero_ps(), d[r] = mins[r] = 0.f;
      }
    }
    for (int m = 0; m < MM; ++m) {
      const __m512 xlo = _mm512_loadu_ps(xf + m * I + b * 32), xhi = _mm512_loadu_ps(xf + m * I + b * 32 + 16);
      for (int64_t r = 0; r < R; ++r) {
        const __m512 dot = _mm512_fmadd_ps(hi[r], xhi, _mm512_mul_ps(lo[r], xlo));
        acc[r][m] = _mm512_fmadd_ps(dot, _mm512_set1_ps(d[r]), acc[r][m]);
        if constexpr (W::kMin) off[r][m] += mins[r] * xs[m * nb + b];
      }
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    const float b = bias ? static_cast<float>(bias[o0 + r]) : 0.f;
    for (int m = 0; m < MM; ++m) emit(m, o0 + r, _mm512_reduce_add_ps(acc[r][m]) + off[r][m] + b);
  }
}

// each input row's sums of x over the blocks of 32 (what Q4's offsets multiply): xs [M, I / 32]
inline void block_sums(const float* xf, int64_t M, int64_t I, float* xs) {
  for (int64_t m = 0; m < M; ++m)
    for (int64_t b = 0; b < I / 32; ++b)
      xs[m * (I / 32) + b] = _mm512_reduce_add_ps(
          _mm512_add_ps(_mm512_loadu_ps(xf + m * I + b * 32), _mm512_loadu_ps(xf + m * I + b * 32 + 16)));
}

// What a product by a weight in a block format reads of its M input rows of I values besides x itself: their
// block sums (Q4's offsets) and, where the activations are bf16, the rows quantized to int8 a block of 32 at a
// time with a scale each (llama.cpp's Q8_0 of the activations: d = max |x| / 127, q = x / d rounded to nearest
// even), so that a block's products are integer dot products. In bf16 the activations already carry 8 bits of
// mantissa; fp32 products keep fp32 activations (the reference the others are checked against).
struct Acts {
  const float* sums = nullptr;  // [M, I / 32]
  const int8_t* q = nullptr;    // [M, I], or null: multiply in fp32
  const float* d = nullptr;     // [M, I / 32]
  const int32_t* c = nullptr;   // [M, I / 4]: -128 times each four quantized x's sum (Q8_0x4's unsigned quants)
  Acts from(int64_t m0, int64_t I) const {
    return {sums ? sums + m0 * (I / 32) : nullptr, q ? q + m0 * I : nullptr, d ? d + m0 * (I / 32) : nullptr,
            c ? c + m0 * (I / 4) : nullptr};
  }
};

inline void quantize_rows(const float* xf, int64_t M, int64_t I, int8_t* q, float* d) {
  for (int64_t m = 0; m < M; ++m)
    for (int64_t b = 0; b < I / 32; ++b) {
      const float* x = xf + m * I + b * 32;
      const __m512 v0 = _mm512_loadu_ps(x), v1 = _mm512_loadu_ps(x + 16);
      const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
      const float scale = amax / 127.f, inv = scale != 0.f ? 1.f / scale : 0.f;
      int8_t* o = q + m * I + b * 32;
      _mm_storeu_si128(reinterpret_cast<__m128i*>(o),
                       _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(v0, _mm512_set1_ps(inv)))));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(o + 16),
                       _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(v1, _mm512_set1_ps(inv)))));
      d[m * (I / 32) + b] = scale;
    }
}

// the buffers behind one thread's Acts, reused from product to product
struct ActBuffers {
  std::vector<float> sums, d;
  std::vector<int8_t> q;
  std::vector<int32_t> c;
  Acts prepare(int fmt, const float* xf, int64_t M, int64_t I, bool quantize) {
    if (fmt == kPlain || fmt == kPlainX4) return {};
    Acts a;
    if (quantize) {
      q.resize(M * I), d.resize(M * (I / 32));
      quantize_rows(xf, M, I, q.data(), d.data());
      a.q = q.data(), a.d = d.data();
      if (fmt == kQ8_0x4) {
        // (q + 128) . x = q . x + 128 sum(x): the second term taken off where VNNI's sums start
        c.resize(M * (I / 4));
        for (int64_t j = 0; j < M * (I / 4); ++j)
          c[j] = -128 * (q[4 * j] + q[4 * j + 1] + q[4 * j + 2] + q[4 * j + 3]);
        a.c = c.data();
      }
    }
    if (fmt == kQ4_0 || fmt == kQ4_1 || fmt == kQ4_1x4) {
      // the sums of the x the products read: of the quantized x where it is (llama.cpp's Q8_1 s = d sum(q)),
      // so that Q4's offset cancels the error its all-positive q put in (2x nearer the exact product)
      sums.resize(M * (I / 32));
      if (quantize) {
        for (int64_t j = 0; j < M * (I / 32); ++j) {
          int sum = 0;
          for (int64_t i = 0; i < 32; ++i) sum += q[j * 32 + i];
          sums[j] = d[j] * static_cast<float>(sum);
        }
      } else {
        block_sums(xf, M, I, sums.data());
      }
      a.sums = sums.data();
    }
    return a;
  }
};

// qgemv_block on int8 activations: two blocks (64 values) a step, each weight row's two blocks read once for all
// MM input rows; a block's integer sum scaled by d_w d_x, Q4's offset m times the block's sum of x (fp32).
template <int MM, typename W, typename B, typename Emit>
inline void qgemv_i8(const Acts& x, const W& w, const B* bias, int64_t I, int64_t o0, int64_t rows, Emit&& emit) {
  constexpr int64_t R = kBlock;
  const int64_t nb = I / 32;
  const __m512i pick = _mm512_set_epi32(2, 2, 2, 2, 2, 2, 2, 2, 0, 0, 0, 0, 0, 0, 0, 0);  // [d_b x 8, d_b+1 x 8]
  __m512 acc[R][MM];
  __m128 off[R][MM];
  for (int64_t r = 0; r < R; ++r)
    for (int m = 0; m < MM; ++m) acc[r][m] = _mm512_setzero_ps(), off[r][m] = _mm_setzero_ps();
  for (int64_t b = 0; b < nb; b += 2) {
    const bool two = b + 1 < nb;
    for (int64_t k = b; k < b + (two ? 2 : 1); ++k)
      if (k * W::kBytes % 64 < W::kBytes)  // block k starts a cache line: the rows ahead's same line asked for
        for (int64_t r = 0; r < R; ++r)
          _mm_prefetch(static_cast<const char*>(w.at(o0 + kAhead + r, k * 32)), _MM_HINT_T0);
    typename W::Pair q[R];
    __m128 sc[R];
    __m512 dw[R];
    for (int64_t r = 0; r < R; ++r) {
      if (r < rows) {
        q[r] = w.quants2(o0 + r, b, two);
        sc[r] = w.scales2(o0 + r, b, two);
        dw[r] = _mm512_permutexvar_ps(pick, _mm512_castps128_ps512(sc[r]));
      } else {
        q[r] = typename W::Pair{}, sc[r] = _mm_setzero_ps(), dw[r] = _mm512_setzero_ps();
      }
    }
    for (int m = 0; m < MM; ++m) {
      const int8_t* xq = x.q + m * I + b * 32;
      const __m512i xv = two ? _mm512_loadu_si512(xq) : _mm512_maskz_loadu_epi8(0xFFFFFFFFull, xq);
      const float* xd = x.d + m * nb + b;
      const __m512 dx = _mm512_insertf32x8(_mm512_set1_ps(xd[0]), _mm256_set1_ps(two ? xd[1] : 0.f), 1);
      __m128 xs = _mm_setzero_ps();
      if constexpr (W::kMin) {
        const float* s = x.sums + m * nb + b;
        xs = _mm_setr_ps(0.f, s[0], 0.f, two ? s[1] : 0.f);
      }
      for (int64_t r = 0; r < R; ++r) {
        acc[r][m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot2(q[r], xv)), _mm512_mul_ps(dw[r], dx), acc[r][m]);
        if constexpr (W::kMin) off[r][m] = _mm_add_ps(_mm_mul_ps(sc[r], xs), off[r][m]);
      }
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    const float b = bias ? static_cast<float>(bias[o0 + r]) : 0.f;
    for (int m = 0; m < MM; ++m) {
      float o[4];
      _mm_storeu_ps(o, off[r][m]);
      emit(m, o0 + r, _mm512_reduce_add_ps(acc[r][m]) + (o[1] + o[3]) + b);
    }
  }
}

// u8 x s8 products summed in fours onto `start` (16 int32 lanes); u the unsigned quants of Q8_0x4 (q + 128) and
// start -128 x the sums of x in fours, so the result is q . x. Without VNNI, maddubs's int16 pairs would saturate
// on (q + 128) x: the signed quants' magnitudes are multiplied by x carrying their signs instead, start unread.
inline __m512i dot_biased(__m512i start, __m512i u, __m512i x) {
#ifdef __AVX512VNNI__
  return _mm512_dpbusd_epi32(start, u, x);
#else
  (void)start;
  const __m512i q = _mm512_xor_si512(u, _mm512_set1_epi8(static_cast<char>(0x80)));
  return dot_u8s8(_mm512_abs_epi8(q), signed_by(x, signs(q)));
#endif
}

// Pairs ahead of an interleaved product's reads that it asks for: the prefetcher alone, which follows the one
// stream, fell well behind a plain read, and 16 on read faster than 4 (benchmarks/block_read.cpp; docs/serving.md)
constexpr int64_t kPairsAhead = 16;

#ifndef __AVX512F__
// qgemv_x4 below at one input row, in AVX2 itself: through SIMDe's 512-bit values its accumulators went through
// the stack every pair (docs/serving.md has the figures). Each row's sums are two registers
// that hold what the AVX-512 lanes 0-7 and 8-15 hold, summed the same way: Q8_0x4's sums are bitwise
// qgemv_i8's on the Q8_0 it interleaves, as there.
template <typename W, typename B, typename Emit>
inline void qgemv_x4_avx2(const Acts& x, const W& w, const B* bias, int64_t I, int64_t o0, Emit&& emit) {
  constexpr bool kMin = W::kMin;
  const int64_t pairs = I / 64, nb = I / 32;
  const uint8_t* p = w.pair(o0, 0);
  constexpr int64_t ahead = kPairsAhead * W::kPair;
  const char* asked = reinterpret_cast<const char*>(reinterpret_cast<uintptr_t>(p + ahead) & ~uintptr_t{63});
  const __m256i ones = _mm256_set1_epi16(1), low4 = _mm256_set1_epi8(0x0F);
  const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80));
  __m256 acc[4][2], off = _mm256_setzero_ps();
  for (int r = 0; r < 4; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  alignas(32) float sc[8];
  for (int64_t k = 0; k < pairs; ++k, p += W::kPair) {
    for (const char* until = reinterpret_cast<const char*>(p + ahead + W::kPair); asked < until; asked += 64)
      _mm_prefetch(asked, _MM_HINT_T0);
    const float* xd = x.d + 2 * k;
    const __m256 dx = _mm256_insertf128_ps(_mm256_set1_ps(xd[0]), _mm_set1_ps(xd[1]), 1);
    // [rows 0-3 of block b, rows 0-3 of b + 1], each times its block's d_x
    _mm256_store_ps(sc, _mm256_mul_ps(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), dx));
    const __m256i x0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.q + k * 64));
    const __m256i x1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.q + k * 64 + 32));
    if constexpr (kMin) {
      const __m256 m8 = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16)));
      const float* xs = x.sums + 2 * k;
      off = _mm256_fmadd_ps(m8, _mm256_insertf128_ps(_mm256_set1_ps(xs[0]), _mm_set1_ps(xs[1]), 1), off);
      // the nibbles' x: [b 0-15 | b + 1 0-15] for the low ones, [b 16-31 | b + 1 16-31] for the high
      const __m256i xl = _mm256_permute2x128_si256(x0, x1, 0x20), xh = _mm256_permute2x128_si256(x0, x1, 0x31);
      for (int r = 0; r < 4; ++r) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32 + r * 32));
        const __m256i lo = _mm256_and_si256(v, low4), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
        const __m256i dl = _mm256_madd_epi16(_mm256_maddubs_epi16(lo, xl), ones);  // lanes 0-3 b's, 4-7 b + 1's
        const __m256i dh = _mm256_madd_epi16(_mm256_maddubs_epi16(hi, xh), ones);
        const __m256 s = _mm256_setr_ps(sc[r], sc[r], sc[r], sc[r], sc[4 + r], sc[4 + r], sc[4 + r], sc[4 + r]);
        acc[r][0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_add_epi32(dl, dh)), s, acc[r][0]);
      }
    } else {
      for (int r = 0; r < 4; ++r) {
        const __m256i q0 = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 16 + r * 64)), flip);
        const __m256i q1 =
            _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 16 + r * 64 + 32)), flip);
        const __m256i d0 = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_abs_epi8(q0), _mm256_sign_epi8(x0, q0)), ones);
        const __m256i d1 = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_abs_epi8(q1), _mm256_sign_epi8(x1, q1)), ones);
        acc[r][0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d0), _mm256_broadcast_ss(sc + r), acc[r][0]);
        acc[r][1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d1), _mm256_broadcast_ss(sc + 4 + r), acc[r][1]);
      }
    }
  }
  alignas(32) float o[8];
  _mm256_store_ps(o, off);
  for (int r = 0; r < 4; ++r) {
    const float b = bias ? static_cast<float>(bias[o0 + r]) : 0.f;
    emit(0, o0 + r, gw_sum8(_mm256_add_ps(acc[r][0], acc[r][1])) + (kMin ? o[r] + o[4 + r] : 0.f) + b);
  }
}
#endif

// qgemv_i8 for an interleaved format (Q8_0x4, Q4_1x4): the group of 4 weight rows at o0 (a multiple of 4), two
// blocks a step, the 4 rows' scales one load, times MM input rows. On Q8_0x4 the same sums in the same order as
// qgemv_i8's on the Q8_0 it interleaves; Q4_1's offset m comes in as m times the block's sum of x, 4 rows at once.
template <int MM, typename W, typename B, typename Emit>
inline void qgemv_x4(const Acts& x, const W& w, const B* bias, int64_t I, int64_t o0, Emit&& emit) {
#ifndef __AVX512F__
  if constexpr (MM == 1) return qgemv_x4_avx2(x, w, bias, I, o0, emit);
#endif
  constexpr bool kMin = W::kMin;
  const int64_t pairs = I / 64, nb = I / 32;
  const uint8_t* p = w.pair(o0, 0);
  // each line from kPairsAhead pairs on asked for once (the lines before: by the group before)
  constexpr int64_t ahead = kPairsAhead * W::kPair;
  const char* asked = reinterpret_cast<const char*>(reinterpret_cast<uintptr_t>(p + ahead) & ~uintptr_t{63});
  // row r's scales out of the 8 loaded, for the 16 lanes a product's 64 bytes sum into: Q8_0x4's lanes 0-7 are
  // block b's, 8-15 b + 1's; Q4_1x4's go b, b + 1, b, b + 1 four at a time (the low nibbles, then the high)
  __m512i pick[4];
  for (int r = 0; r < 4; ++r) {
    const int b0 = r, b1 = 4 + r;
    pick[r] = kMin ? _mm512_set_epi32(b1, b1, b1, b1, b0, b0, b0, b0, b1, b1, b1, b1, b0, b0, b0, b0)
                   : _mm512_set_epi32(b1, b1, b1, b1, b1, b1, b1, b1, b0, b0, b0, b0, b0, b0, b0, b0);
  }
  __m512 acc[4][MM];
  __m256 off[MM];  // Q4_1: [rows 0-3 of block b's m s, rows 0-3 of b + 1's] summed over the pairs
  for (int m = 0; m < MM; ++m) {
    off[m] = _mm256_setzero_ps();
    for (int r = 0; r < 4; ++r) acc[r][m] = _mm512_setzero_ps();
  }
  for (int64_t k = 0; k < pairs; ++k, p += W::kPair) {
    for (const char* until = reinterpret_cast<const char*>(p + ahead + W::kPair); asked < until; asked += 64)
      _mm_prefetch(asked, _MM_HINT_T0);
    const __m256 s8 = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    __m256 m8 = _mm256_setzero_ps();
    if constexpr (kMin) m8 = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16)));
    __m512i q[4];
    for (int r = 0; r < 4; ++r) q[r] = W::quants(p, r);
    for (int m = 0; m < MM; ++m) {
      const __m512i xv = W::x_order(_mm512_loadu_si512(x.q + m * I + k * 64));
      const float* xd = x.d + m * nb + 2 * k;
      const __m256 dx = _mm256_insertf128_ps(_mm256_set1_ps(xd[0]), _mm_set1_ps(xd[1]), 1);
      const __m512 sc = _mm512_castps256_ps512(_mm256_mul_ps(s8, dx));
      __m512i start = _mm512_setzero_si512();
      if constexpr (kMin) {
        const float* xs = x.sums + m * nb + 2 * k;
        const __m256 sums = _mm256_insertf128_ps(_mm256_set1_ps(xs[0]), _mm_set1_ps(xs[1]), 1);
        off[m] = _mm256_add_ps(_mm256_mul_ps(m8, sums), off[m]);
      } else {
        start = _mm512_loadu_si512(x.c + m * (I / 4) + k * 16);
      }
      for (int r = 0; r < 4; ++r) {
        const __m512i dot = kMin ? dot_u8s8(q[r], xv) : dot_biased(start, q[r], xv);
        acc[r][m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_permutexvar_ps(pick[r], sc), acc[r][m]);
      }
    }
  }
  for (int m = 0; m < MM; ++m) {
    alignas(32) float o[8];
    _mm256_store_ps(o, off[m]);
    for (int r = 0; r < 4; ++r) {
      const float b = bias ? static_cast<float>(bias[o0 + r]) : 0.f;
      emit(m, o0 + r, _mm512_reduce_add_ps(acc[r][m]) + (kMin ? o[r] + o[4 + r] : 0.f) + b);
    }
  }
}

#ifndef __AVX512F__
// gemv_block below at one input row with its sums in AVX2's registers (why: qgemv_x4_avx2), the weight read as
// there; the same sums in the same order.
template <typename W, typename B, typename Emit>
inline void gemv_block_avx2(const float* xf, const W& w, const B* bias, int64_t I, int64_t o0, int64_t rows,
                            Emit&& emit) {
  constexpr int64_t R = kBlock;
  const int64_t full = I / 16 * 16, tail = I - full;
  __m256 acc[R][2];
  for (int64_t r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  for (int64_t i = 0; i < full; i += 16) {
    if (i % W::kEvery == 0)
      for (int64_t r = 0; r < R; ++r)
        _mm_prefetch(static_cast<const char*>(w.at(o0 + kAhead + r, i)), _MM_HINT_T0);
    const __m256 x0 = _mm256_loadu_ps(xf + i), x1 = _mm256_loadu_ps(xf + i + 8);
    for (int64_t r = 0; r < R; ++r)
      if (r < rows) {
        const __m512 v = w.load(o0 + r, i);
        acc[r][0] = _mm256_fmadd_ps(gw_lo(v), x0, acc[r][0]);
        acc[r][1] = _mm256_fmadd_ps(gw_hi(v), x1, acc[r][1]);
      }
  }
  if (tail) {
    const __m512 xv = load_tail(xf + full, tail);
    for (int64_t r = 0; r < rows; ++r) {
      const __m512 v = w.tail(o0 + r, full, tail);
      acc[r][0] = _mm256_fmadd_ps(gw_lo(v), gw_lo(xv), acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(gw_hi(v), gw_hi(xv), acc[r][1]);
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    const float b = bias ? static_cast<float>(bias[o0 + r]) : 0.f;
    emit(0, o0 + r, gw_sum8(_mm256_add_ps(acc[r][0], acc[r][1])) + b);
  }
}
#endif

// Output rows m0 .. m0 + MM of output columns o0 .. o0 + rows (rows <= kBlock), each weight row read once a
// pass: emit(m, o, the fp32 sum plus the bias) for each, m counted from m0.
template <int MM, typename W, typename B, typename Emit>
inline void gemv_block(const float* xf, const W& w, const B* bias, int64_t I, int64_t o0, int64_t rows, Emit&& emit) {
#ifndef __AVX512F__
  if constexpr (MM == 1) return gemv_block_avx2(xf, w, bias, I, o0, rows, emit);
#endif
  constexpr int64_t R = kBlock;
  const int64_t full = I / 16 * 16, tail = I - full;
  __m512 acc[R][MM];
  for (int64_t r = 0; r < R; ++r)
    for (int m = 0; m < MM; ++m) acc[r][m] = _mm512_setzero_ps();
  // the weight rows kAhead on, asked for a block ahead: this pass reads R rows at once, more streams than the
  // hardware's prefetcher follows well (a 1-row product read the weight 1.3-1.5x faster with it)
  for (int64_t i = 0; i < full; i += 16) {
    if (i % W::kEvery == 0)
      for (int64_t r = 0; r < R; ++r)
        _mm_prefetch(static_cast<const char*>(w.at(o0 + kAhead + r, i)), _MM_HINT_T0);
    __m512 wv[R];
    for (int64_t r = 0; r < R; ++r) wv[r] = r < rows ? w.load(o0 + r, i) : _mm512_setzero_ps();
    for (int m = 0; m < MM; ++m) {
      const __m512 xv = _mm512_loadu_ps(xf + m * I + i);
      for (int64_t r = 0; r < R; ++r) acc[r][m] = _mm512_fmadd_ps(wv[r], xv, acc[r][m]);
    }
  }
  if (tail) {
    __m512 wv[R];
    for (int64_t r = 0; r < R; ++r) wv[r] = r < rows ? w.tail(o0 + r, full, tail) : _mm512_setzero_ps();
    for (int m = 0; m < MM; ++m) {
      const __m512 xv = load_tail(xf + m * I + full, tail);
      for (int64_t r = 0; r < R; ++r) acc[r][m] = _mm512_fmadd_ps(wv[r], xv, acc[r][m]);
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    const float b = bias ? static_cast<float>(bias[o0 + r]) : 0.f;
    for (int m = 0; m < MM; ++m) emit(m, o0 + r, _mm512_reduce_add_ps(acc[r][m]) + b);
  }
}

// Output columns o0 .. o0 + rows (rows <= kBlock) for all M input rows xf [M, I] in fp32: emit(m, o, v). xa: what
// a block format's product reads besides (ActBuffers::prepare), else unread.
template <typename W, typename B, typename Emit>
void gemv_cols(const float* xf, const Acts& xa, const W& w, const B* bias, int64_t M, int64_t I, int64_t o0,
               int64_t rows, Emit&& emit) {
  for (int64_t m0 = 0; m0 < M; m0 += kRowsAtOnce) {  // more rows: the block's weights again, from L1
    const float* xm = xf + m0 * I;
    auto at = [&](int m, int64_t o, float v) { emit(m0 + m, o, v); };
    if constexpr (W::kBlocks) {
      const Acts xm_a = xa.from(m0, I);
      const float* sums = xm_a.sums;
      if constexpr (kInterleaved<W>) {
        if (xm_a.q) {
          switch (std::min(kRowsAtOnce, M - m0)) {
            case 1: qgemv_x4<1>(xm_a, w, bias, I, o0, at); break;
            case 2: qgemv_x4<2>(xm_a, w, bias, I, o0, at); break;
            case 3: qgemv_x4<3>(xm_a, w, bias, I, o0, at); break;
            default: qgemv_x4<4>(xm_a, w, bias, I, o0, at); break;
          }
          continue;
        }
      } else if (xm_a.q) {
        switch (std::min(kRowsAtOnce, M - m0)) {
          case 1: qgemv_i8<1>(xm_a, w, bias, I, o0, rows, at); break;
          case 2: qgemv_i8<2>(xm_a, w, bias, I, o0, rows, at); break;
          case 3: qgemv_i8<3>(xm_a, w, bias, I, o0, rows, at); break;
          default: qgemv_i8<4>(xm_a, w, bias, I, o0, rows, at); break;
        }
        continue;
      }
      switch (std::min(kRowsAtOnce, M - m0)) {
        case 1: qgemv_block<1>(xm, sums, w, bias, I, o0, rows, at); break;
        case 2: qgemv_block<2>(xm, sums, w, bias, I, o0, rows, at); break;
        case 3: qgemv_block<3>(xm, sums, w, bias, I, o0, rows, at); break;
        default: qgemv_block<4>(xm, sums, w, bias, I, o0, rows, at); break;
      }
    } else {
      switch (std::min(kRowsAtOnce, M - m0)) {
        case 1: gemv_block<1>(xm, w, bias, I, o0, rows, at); break;
        case 2: gemv_block<2>(xm, w, bias, I, o0, rows, at); break;
        case 3: gemv_block<3>(xm, w, bias, I, o0, rows, at); break;
        default: gemv_block<4>(xm, w, bias, I, o0, rows, at); break;
      }
    }
  }
}

// Weight blocks begin .. end (kBlock output columns each, of O): emit(m, o, v).
template <typename W, typename B, typename Emit>
void gemv_blocks(const float* xf, const Acts& xa, const W& w, const B* bias, int64_t M, int64_t O, int64_t I,
                 int64_t begin, int64_t end, Emit&& emit) {
  for (int64_t block = begin; block < end; ++block)
    gemv_cols(xf, xa, w, bias, M, I, block * kBlock, std::min(kBlock, O - block * kBlock), emit);
}

// A product of any number of rows by a weight in a block format (prefill, many streams): each thread takes
// kWide weight rows at a time, dequantizes them once into fp32 in its own buffer (kWide x I: L1 or L2), and
// multiplies every input row by them, four input rows by four weight rows a pass, so that both stay in cache.
constexpr int64_t kWide = 16;

template <typename T, typename W>
void wide_blocks(const float* xf, const W& w, const T* bias, T* out, int64_t M, int64_t O, int64_t I, int64_t begin,
                 int64_t end) {
  std::vector<float> buf(kWide * I);
  const Plain<float> plain{buf.data(), I};
  for (int64_t block = begin; block < end; ++block) {
    const int64_t o0 = block * kWide, rows = std::min(kWide, O - o0);
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t i = 0; i < I; i += 16) _mm512_storeu_ps(buf.data() + r * I + i, w.load(o0 + r, i));
    const T* b = bias ? bias + o0 : nullptr;
    for (int64_t m0 = 0; m0 < M; m0 += kRowsAtOnce) {
      const float* xm = xf + m0 * I;
      auto emit = [&](int m, int64_t o, float v) { out[(m0 + m) * O + o0 + o] = static_cast<T>(v); };
      for (int64_t r0 = 0; r0 < rows; r0 += kBlock) {
        const int64_t n = std::min(kBlock, rows - r0);
        switch (std::min(kRowsAtOnce, M - m0)) {
          case 1: gemv_block<1>(xm, plain, b, I, r0, n, emit); break;
          case 2: gemv_block<2>(xm, plain, b, I, r0, n, emit); break;
          case 3: gemv_block<3>(xm, plain, b, I, r0, n, emit); break;
          default: gemv_block<4>(xm, plain, b, I, r0, n, emit); break;
        }
      }
    }
  }
}

// 16 values stored as T: fp32 as they are; bf16 rounded to nearest even, as c10::BFloat16 rounds a finite float
inline void store16(float* o, __m512 v) { _mm512_storeu_ps(o, v); }

inline void store16(c10::BFloat16* o, __m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF)));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(o), _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16)));
}

#ifdef GPUWISE_AMX
// Products of many rows (a prompt's, many streams') by a weight in a block format, in bf16, on AMX's tiles: each
// task dequantizes 32 weight rows (rounded to bf16 as `dequantize` rounds them: the library's product on
// dequantized chunks, without the library's copy of them into its own layout) into AMX's B layout, then multiplies
// every group of 16 input rows by them, 32 values of a row a tile product (tdpbf16ps, fp32 sums). The input rows
// are the A operand as they are stored.
constexpr int64_t kAmxRows = kMaxRows + 1;  // from here on ahead of the int8 products (docs/serving.md)
constexpr int64_t kAmxCols = 32;  // weight rows a task: two tiles of 16

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

inline bool amx_usable() {
  // Linux gives a process AMX's tile state only once asked (arch_prctl ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)
  static const bool ok = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  return ok;
}

// r[0..15] (16 x 16 32-bit lanes) transposed in place: r[i] lane j becomes r[j] lane i
inline void transpose16(__m512i r[16]) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int i = 0; i < 16; i += 8)
    for (int j = 0; j < 4; ++j) {
      t[i + j] = _mm512_shuffle_i32x4(r[i + j], r[i + j + 4], 0x88);
      t[i + j + 4] = _mm512_shuffle_i32x4(r[i + j], r[i + j + 4], 0xdd);
    }
  for (int j = 0; j < 8; ++j) {
    r[j] = _mm512_shuffle_i32x4(t[j], t[j + 8], 0x88);
    r[j + 8] = _mm512_shuffle_i32x4(t[j], t[j + 8], 0xdd);
  }
}

// x [M, I] as AMX's B operand, once a product: per block of 32 values and group of 16 rows a 16 x 16 tile of pairs
// of values, t[r][m] = (x[m][2r], x[m][2r + 1]); rows past M are zeros. A group's block is its 16 rows' 64 bytes
// seen as 16 x 16 pairs, transposed in registers.
inline void x_tiles(const c10::BFloat16* x, int64_t M, int64_t I, uint32_t* t) {
  const int64_t groups = (M + 15) / 16, nb = I / 32;
  at::parallel_for(0, groups, 1, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g) {
      const int64_t n = std::min<int64_t>(16, M - g * 16);
      for (int64_t kb = 0; kb < nb; ++kb) {
        __m512i r[16];
        for (int64_t m = 0; m < 16; ++m)
          r[m] = m < n ? _mm512_loadu_si512(x + (g * 16 + m) * I + kb * 32) : _mm512_setzero_si512();
        transpose16(r);
        uint32_t* tile = t + (kb * groups + g) * 256;
        for (int64_t k = 0; k < 16; ++k) _mm512_storeu_si512(tile + k * 16, r[k]);
      }
    }
  });
}

// One task's products: every group of 16 input rows by its 32 weight rows, whose A tiles `a(kb, half)` gives
// (16 rows of a block's 32 bf16 values, and their stride in bytes), the results transposed into rows of out.
template <typename A>
inline void amx_task(const uint32_t* xt, const A& a, const c10::BFloat16* bias, c10::BFloat16* out, int64_t M,
                     int64_t O, int64_t nb, int64_t o0, int64_t cols) {
  const int64_t groups = (M + 15) / 16;
  alignas(64) float c[256];
  for (int64_t g = 0; g < groups; g += 2) {  // two groups of 16 input rows a pass: four result tiles
    const bool two = g + 1 < groups;
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t kb = 0; kb < nb; ++kb) {
      const auto [w0, s0] = a(kb, 0);
      const auto [w1, s1] = a(kb, 1);
      _tile_loadd(4, w0, s0);  // weight rows 0-15
      _tile_loadd(5, w1, s1);  // weight rows 16-31
      _tile_loadd(6, xt + (kb * groups + g) * 256, 64);
      _tile_dpbf16ps(0, 4, 6);
      _tile_dpbf16ps(1, 5, 6);
      if (two) {
        _tile_loadd(7, xt + (kb * groups + g + 1) * 256, 64);
        _tile_dpbf16ps(2, 4, 7);
        _tile_dpbf16ps(3, 5, 7);
      }
    }
    for (int t = 0; t < (two ? 4 : 2); ++t) {  // result t: weight rows (t % 2) * 16 ..., input group g + t / 2
      const int64_t half = t % 2, first = (g + t / 2) * 16, n = std::min<int64_t>(16, M - first);
      if (half * 16 >= cols) continue;
      switch (t) {  // the tile's number is part of the instruction
        case 0: _tile_stored(0, c, 64); break;
        case 1: _tile_stored(1, c, 64); break;
        case 2: _tile_stored(2, c, 64); break;
        default: _tile_stored(3, c, 64); break;
      }
      __m512i r[16];  // c[weight row][input row] turned to [input row][weight row]: a row of the output
      for (int k = 0; k < 16; ++k) r[k] = _mm512_load_si512(c + k * 16);
      transpose16(r);
      const int64_t count = std::min<int64_t>(16, cols - half * 16);
      const __mmask16 keep = static_cast<__mmask16>((1u << count) - 1);
      const __m512 bv = bias ? load_tail(bias + o0 + half * 16, count) : _mm512_setzero_ps();
      for (int64_t j = 0; j < n; ++j) {
        alignas(64) c10::BFloat16 row[16];
        store16(row, _mm512_add_ps(_mm512_castsi512_ps(r[j]), bv));
        _mm256_mask_storeu_epi16(out + (first + j) * O + o0 + half * 16, keep,
                                 _mm256_load_si256(reinterpret_cast<const __m256i*>(row)));
      }
    }
  }
}

using TileRef = std::pair<const void*, int64_t>;

inline void amx_config() {
  TileConfig config;
  for (int t = 0; t < 8; ++t) config.rows[t] = 16, config.colsb[t] = 64;
  _tile_loadconfig(&config);
}

template <typename W>
void amx_blocks(const uint32_t* xt, const W& w, const c10::BFloat16* bias, c10::BFloat16* out, int64_t M, int64_t O,
                int64_t I, int64_t begin, int64_t end) {
  const int64_t nb = I / 32;
  // the A operand: per block of 32 values and tile of 16 weight rows, the rows' 32 values (1 KB, contiguous),
  // each rounded to bf16 as store16 rounds (AVX512-BF16's conversion: to nearest even)
  std::vector<c10::BFloat16> a(nb * 2 * 16 * 32);
  amx_config();
  for (int64_t task = begin; task < end; ++task) {
    const int64_t o0 = task * kAmxCols, cols = std::min(kAmxCols, O - o0);
    if (task + 1 < end) {  // the next task's rows (contiguous) asked for now, for the same reason as kAhead
      const char* next = static_cast<const char*>(w.at(o0 + kAmxCols, 0));
      const int64_t bytes = std::min(kAmxCols, O - o0 - kAmxCols) * w.so;
      for (int64_t line = 0; line < bytes; line += 64) _mm_prefetch(next + line, _MM_HINT_T1);
    }
    for (int64_t row = 0; row < kAmxCols; ++row)  // a row at a time: its blocks in the order they are stored
      for (int64_t kb = 0; kb < nb; ++kb) {
        __m512i v = _mm512_setzero_si512();
        if (row < cols) {  // the block's values as `load` gives them: q d (+ m), one fp32 rounding
          __m512 lo, hi;
          float d, m;
          w.decode(o0 + row, kb, lo, hi, d, m);
          const __m512 dv = _mm512_set1_ps(d), mv = _mm512_set1_ps(m);
          v = reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(_mm512_fmadd_ps(hi, dv, mv), _mm512_fmadd_ps(lo, dv, mv)));
        }
        _mm512_storeu_si512(a.data() + ((kb * 2 + row / 16) * 16 + row % 16) * 32, v);
      }
    amx_task(xt, [&](int64_t kb, int64_t half) { return TileRef(a.data() + (kb * 2 + half) * 512, 64); }, bias, out,
             M, O, nb, o0, cols);
  }
  _tile_release();
}

// The same for a plain bf16 weight, with no copy: its rows are the A operand as they are stored (a tile load takes
// 16 rows of 64 bytes at the row stride), but for a last task of fewer than 32 rows, copied beside zeros. That
// lets a bf16 model's products of many rows go without a library's packed copy of its weights.
void amx_plain(const uint32_t* xt, const c10::BFloat16* w, int64_t so, const c10::BFloat16* bias,
               c10::BFloat16* out, int64_t M, int64_t O, int64_t I, int64_t begin, int64_t end) {
  const int64_t nb = I / 32;
  std::vector<c10::BFloat16> a;
  amx_config();
  for (int64_t task = begin; task < end; ++task) {
    const int64_t o0 = task * kAmxCols, cols = std::min(kAmxCols, O - o0);
    if (task + 1 < end) {  // the next task's 32 rows, into L2 while this one multiplies
      for (int64_t row = o0 + kAmxCols; row < std::min(O, o0 + 2 * kAmxCols); ++row)
        for (int64_t i = 0; i < I; i += 32) _mm_prefetch(reinterpret_cast<const char*>(w + row * so + i), _MM_HINT_T1);
    }
    if (cols == kAmxCols) {
      amx_task(xt, [&](int64_t kb, int64_t half) { return TileRef(w + (o0 + half * 16) * so + kb * 32, so * 2); },
               bias, out, M, O, nb, o0, cols);
      continue;
    }
    a.assign(nb * 2 * 16 * 32, c10::BFloat16(0.0f));
    for (int64_t row = 0; row < cols; ++row)
      for (int64_t kb = 0; kb < nb; ++kb)
        std::memcpy(a.data() + ((kb * 2 + row / 16) * 16 + row % 16) * 32, w + (o0 + row) * so + kb * 32, 64);
    amx_task(xt, [&](int64_t kb, int64_t half) { return TileRef(a.data() + (kb * 2 + half) * 512, 64); }, bias, out,
             M, O, nb, o0, cols);
  }
  _tile_release();
}

// the product on AMX where it takes it (bf16, kAmxRows rows or more, rows of whole blocks, the tiles granted):
// whether it did
template <typename T>
bool amx_gemv(int fmt, const T* x, const void* w, const T* bias, T* out, int64_t M, int64_t O, int64_t I,
              int64_t w_so) {
  if constexpr (!std::is_same<T, c10::BFloat16>::value) {
    return false;
  } else {
    if (M < kAmxRows || I % 32 || fmt == kPlainX4 || !amx_usable()) return false;
    std::vector<uint32_t> xt((I / 32) * ((M + 15) / 16) * 256);
    x_tiles(x, M, I, xt.data());
    const int64_t tasks = (O + kAmxCols - 1) / kAmxCols;
    if (fmt == kPlain) {
      at::parallel_for(0, tasks, 1, [&](int64_t begin, int64_t end) {
        amx_plain(xt.data(), static_cast<const T*>(w), w_so, bias, out, M, O, I, begin, end);
      });
      return true;
    }
    with_weight<T>(fmt, w, I, I, [&](auto wv) {
      using W = decltype(wv);
      if constexpr (W::kBlocks) {
        at::parallel_for(0, tasks, 1, [&](int64_t begin, int64_t end) {
          amx_blocks(xt.data(), wv, bias, out, M, O, I, begin, end);
        });
      }
    });
    return true;
  }
}
#else
template <typename T>
bool amx_gemv(int, const T*, const void*, const T*, T*, int64_t, int64_t, int64_t, int64_t) {
  return false;
}
inline bool amx_usable() { return false; }
#endif

template <typename T>
void gemv(int fmt, const T* x, const void* w, const T* bias, T* out, int64_t M, int64_t O, int64_t I, int64_t w_so) {
  if (amx_gemv(fmt, x, w, bias, out, M, O, I, w_so)) return;
  std::vector<float> xf(M * I);
  for (int64_t j = 0; j < M * I; ++j) xf[j] = static_cast<float>(x[j]);
  ActBuffers buffers;
  const Acts xa = buffers.prepare(fmt, xf.data(), M, I, kInt8Acts<T>);
  with_weight<T>(fmt, w, I, w_so, [&](auto wv) {
    using W = decltype(wv);
    if (M > kMaxRows && !std::is_same<W, Plain<T>>::value && !xa.q) {
      at::parallel_for(0, (O + kWide - 1) / kWide, 4, [&](int64_t begin, int64_t end) {
        wide_blocks(xf.data(), wv, bias, out, M, O, I, begin, end);
      });
      return;
    }
    at::parallel_for(0, (O + kBlock - 1) / kBlock, 16, [&](int64_t begin, int64_t end) {
      gemv_blocks(xf.data(), xa, wv, bias, M, O, I, begin, end,
                  [&](int64_t m, int64_t o, float v) { out[m * O + o] = static_cast<T>(v); });
    });
  });
}

// 3. A whole decode step of a Llama-family decoder (serve/engines/gpuwise/decoder.py's fused forward, one token for each of
// M <= kMaxRows rows, no LoRA): every layer's norm, products, rotary embedding, cache write and attention in
// one call, so that the ~25 tensor ops a layer do not each pay Python's and ATen's dispatch. It rounds to T
// where serve/engines/gpuwise/decoder.py's PyTorch ops do (each op's output), so its logits are that forward's within the
// order of a sum. x: [M, E] the embedded tokens (updated in place); cos, sin: [M, D]; pos: [M] each row's
// position, row m's block table table[m * tb ...] (blocks of bs positions); per layer l, ptrs[l * 12 + ...]: input
// norm, qkv weight and bias, o weight and bias, post-attention norm, gate_up weight and bias, down weight and bias
// (a null bias: none), and the layer's keys and values ([blocks, bs, K, D]: strides c_sb, c_sl, c_sh); eps[l * 2 +
// 0/1] the norms'.
// Then the final norm and the output layer into logits [M, V].
//
// The threads stay in one parallel region for the whole step and meet at a spinning barrier between its
// phases (six a layer). A parallel region per product and attention (151 a step) woke the pool's threads
// each time, and under OMP_WAIT_POLICY=PASSIVE (what `gpuwise serve` sets, so that idle threads leave the
// cores to the server) a wake costs tens of microseconds: docs/serving.md, "One stream".

// A barrier for the threads of one region: spins (a phase is tens of microseconds), then yields the core,
// so that a thread the OS took off a core is not kept off by the one waiting for it.
class SpinBarrier {
 public:
  explicit SpinBarrier(int threads) : threads_(threads) {}
  void wait() {
    if (threads_ == 1) return;
    const int phase = phase_.load(std::memory_order_acquire);
    if (arrived_.fetch_add(1, std::memory_order_acq_rel) == threads_ - 1) {
      arrived_.store(0, std::memory_order_relaxed);
      phase_.store(phase + 1, std::memory_order_release);
      return;
    }
    for (int spins = 0; phase_.load(std::memory_order_acquire) == phase; ++spins) {
      if (spins < kSpins) {
        _mm_pause();
      } else {
        sched_yield();
      }
    }
  }

 private:
  static constexpr int kSpins = 1 << 12;
  const int threads_;
  alignas(64) std::atomic<int> arrived_{0};
  alignas(64) std::atomic<int> phase_{0};
};

// this thread's share [begin, end) of n items among `threads`
inline std::pair<int64_t, int64_t> share(int64_t n, int tid, int threads) {
  return {n * tid / threads, n * (tid + 1) / threads};
}

// Work handed out a chunk at a time from a counter, to whichever thread comes for it: a thread that runs slower
// (its core shared, the OS's work, a wake-up of the front end) takes fewer chunks instead of holding the others at
// the next barrier. Each phase of a step has its own counter. A chunk is an eighth of a thread's even share.
class Dealer {
 public:
  explicit Dealer(int64_t phases) : next_(phases) {
    for (auto& n : next_) n.store(0, std::memory_order_relaxed);
  }
  template <typename F>
  void deal(int64_t phase, int64_t n, int threads, F&& f) {  // f(begin, end) for the chunks this thread takes
    std::atomic<int64_t>& next = next_[phase];
    const int64_t chunk = std::max<int64_t>(1, n / (threads * 8));
    for (int64_t b = next.fetch_add(chunk, std::memory_order_relaxed); b < n;
         b = next.fetch_add(chunk, std::memory_order_relaxed))
      f(b, std::min(n, b + chunk));
  }

 private:
  std::vector<std::atomic<int64_t>> next_;
};

// x [M, E] normalized (RMSNorm, rounded to T as serve/engines/gpuwise/decoder.py's ops round) into xf in fp32, the products' input
template <typename T>
void rms_into(const T* x, const T* weight, float eps, float* xf, int64_t M, int64_t E) {
  for (int64_t m = 0; m < M; ++m) {
    const T* row = x + m * E;
    float sum = 0.f;
    for (int64_t e = 0; e < E; ++e) sum += static_cast<float>(row[e]) * static_cast<float>(row[e]);
    const float inv = 1.f / std::sqrt(sum / static_cast<float>(E) + eps);
    for (int64_t e = 0; e < E; ++e) {
      const T normed = static_cast<T>(static_cast<float>(row[e]) * inv);
      xf[m * E + e] = static_cast<float>(static_cast<T>(static_cast<float>(weight[e]) * static_cast<float>(normed)));
    }
  }
}

template <typename T>
void to_float(const T* x, float* xf, int64_t n) {
  for (int64_t j = 0; j < n; ++j) xf[j] = static_cast<float>(x[j]);
}

template <typename T>
void decode_step(int fmt, int head_fmt, T* x, const T* cos, const T* sin, const int64_t* pos, const int64_t* table,
                 int64_t tb, int64_t bs, const int64_t* ptrs, const float* eps, int64_t layers, const T* final_norm, float final_eps,
                 const void* head, T* logits,
                 int64_t M, int64_t E, int64_t H, int64_t K, int64_t D, int64_t F, int64_t V, int64_t c_sb,
                 int64_t c_sl, int64_t c_sh, int threads_asked) {
  const int64_t QKV = (H + 2 * K) * D, half = D / 2;
  const float scale = 1.f / std::sqrt(static_cast<float>(D));
  std::vector<T> qkv(M * QKV), att(M * H * D), act(M * F);
  std::vector<int64_t> lens(M);
  for (int64_t m = 0; m < M; ++m) lens[m] = pos[m] + 1;
  const int requested = threads_asked > 0 ? threads_asked : at::get_num_threads();
  SpinBarrier* barrier = nullptr;
  alignas(SpinBarrier) unsigned char barrier_space[sizeof(SpinBarrier)];
  Dealer dealer(layers * 4 + 1);  // the products' phases: four a layer, then the output layer
#pragma omp parallel num_threads(requested)
  {
    const int tid = omp_get_thread_num(), threads = omp_get_num_threads();
#pragma omp single
    barrier = new (barrier_space) SpinBarrier(threads);  // the team's size is known only inside the region
    // (omp single ends with OpenMP's own barrier: every thread sees the barrier from here on)
    std::vector<float> xf(M * std::max({E, H * D, F}));
    ActBuffers buffers;
    Acts xs;
    // what a block format's product reads besides xf, of what xf holds now (I values a row)
    auto sums = [&](int f, int64_t I) { xs = buffers.prepare(f, xf.data(), M, I, kInt8Acts<T>); };
    auto add_to_x = [&](int64_t m, int64_t o, float v) {  // the residual: x + the product rounded to T, rounded
      x[m * E + o] = static_cast<T>(static_cast<float>(x[m * E + o]) + static_cast<float>(static_cast<T>(v)));
    };
    for (int64_t l = 0; l < layers; ++l) {
      const int64_t* p = ptrs + l * 12;
      auto w = [&](int i) { return reinterpret_cast<const T*>(p[i]); };
      auto weight = [&](int i) { return reinterpret_cast<const void*>(p[i]); };
      T* kc = reinterpret_cast<T*>(p[10]);
      T* vc = reinterpret_cast<T*>(p[11]);
      // the norm (every thread its own copy: it is small), then this thread's share of the qkv product
      rms_into(x, w(0), eps[l * 2], xf.data(), M, E);
      sums(fmt, E);
      with_weight<T>(fmt, weight(1), E, E, [&](auto wv) {
        dealer.deal(l * 4, (QKV + kBlock - 1) / kBlock, threads, [&](int64_t b, int64_t e) {
          gemv_blocks(xf.data(), xs, wv, w(2), M, QKV, E, b, e,
                      [&](int64_t m, int64_t o, float v) { qkv[m * QKV + o] = static_cast<T>(v); });
        });
      });
      barrier->wait();
      // rotary embedding of the q and k heads: x * cos + rotate_half(x) * sin, rounded per op; a k head's
      // item also writes that head's key and value to the cache
      {
        auto [b, e] = share(M * (H + K), tid, threads);
        for (int64_t item = b; item < e; ++item) {
          const int64_t m = item / (H + K), h = item % (H + K);
          T* row = qkv.data() + m * QKV;
          const T* c = cos + m * D;
          const T* s = sin + m * D;
          T* v = row + h * D;
          T rotated[512];
          for (int64_t d = 0; d < half; ++d) {
            rotated[d] = static_cast<T>(-static_cast<float>(v[d + half]));
            rotated[d + half] = v[d];
          }
          for (int64_t d = 0; d < D; ++d) {
            const T a = static_cast<T>(static_cast<float>(v[d]) * static_cast<float>(c[d]));
            const T r = static_cast<T>(static_cast<float>(rotated[d]) * static_cast<float>(s[d]));
            v[d] = static_cast<T>(static_cast<float>(a) + static_cast<float>(r));
          }
          if (h >= H) {
            const int64_t kh = h - H;
            const int64_t at = table[m * tb + pos[m] / bs] * c_sb + pos[m] % bs * c_sl + kh * c_sh;
            T* krow = kc + at;
            T* vrow = vc + at;
            for (int64_t d = 0; d < D; ++d) {
              krow[d] = v[d];
              vrow[d] = row[(H + K + kh) * D + d];
            }
          }
        }
      }
      barrier->wait();
      {
        const int64_t split = attend_split(M, K, threads);
        auto [b, e] = share(M * split, tid, threads);
        attend_items(qkv.data(), kc, vc, table, tb, bs, lens.data(), att.data(), H, K, D, QKV, D, c_sb, c_sl, c_sh,
                     H * D, D, scale, split, b, e);
      }
      barrier->wait();
      // the output projection, added to x column by column (no other thread reads x until the barrier)
      to_float(att.data(), xf.data(), M * H * D);
      sums(fmt, H * D);
      with_weight<T>(fmt, weight(3), H * D, H * D, [&](auto wv) {
        dealer.deal(l * 4 + 1, (E + kBlock - 1) / kBlock, threads,
                    [&](int64_t b, int64_t e) { gemv_blocks(xf.data(), xs, wv, w(4), M, E, H * D, b, e, add_to_x); });
      });
      barrier->wait();
      // the MLP's gate and up products for the same columns, then silu(gate) * up for them
      rms_into(x, w(5), eps[l * 2 + 1], xf.data(), M, E);
      sums(fmt, E);
      with_weight<T>(fmt, weight(6), E, E, [&](auto wv) {
        dealer.deal(l * 4 + 2, (F + kBlock - 1) / kBlock, threads, [&](int64_t b, int64_t e) {
        for (int64_t block = b; block < e; ++block) {
          T gate[kBlock * kMaxRows], up[kBlock * kMaxRows];
          const int64_t f0 = block * kBlock, rows = std::min(kBlock, F - f0);
          gemv_cols(xf.data(), xs, wv, w(7), M, E, f0, rows,
                    [&](int64_t m, int64_t o, float v) { gate[(o - f0) * M + m] = static_cast<T>(v); });
          gemv_cols(xf.data(), xs, wv, w(7), M, E, F + f0, rows,
                    [&](int64_t m, int64_t o, float v) { up[(o - F - f0) * M + m] = static_cast<T>(v); });
          for (int64_t f = f0; f < f0 + rows; ++f)
            for (int64_t m = 0; m < M; ++m) {
              const float g = static_cast<float>(gate[(f - f0) * M + m]);
              const T silu = static_cast<T>(g / (1.f + std::exp(-g)));
              act[m * F + f] = static_cast<T>(static_cast<float>(silu) * static_cast<float>(up[(f - f0) * M + m]));
            }
        }
        });
      });
      barrier->wait();
      to_float(act.data(), xf.data(), M * F);
      sums(fmt, F);
      with_weight<T>(fmt, weight(8), F, F, [&](auto wv) {
        dealer.deal(l * 4 + 3, (E + kBlock - 1) / kBlock, threads,
                    [&](int64_t b, int64_t e) { gemv_blocks(xf.data(), xs, wv, w(9), M, E, F, b, e, add_to_x); });
      });
      barrier->wait();
    }
    rms_into(x, final_norm, final_eps, xf.data(), M, E);
    sums(head_fmt, E);
    with_weight<T>(head_fmt, head, E, E, [&](auto wv) {
      dealer.deal(layers * 4, (V + kBlock - 1) / kBlock, threads, [&](int64_t b, int64_t e) {
        gemv_blocks(xf.data(), xs, wv, static_cast<const T*>(nullptr), M, V, E, b, e,
                    [&](int64_t m, int64_t o, float v) { logits[m * V + o] = static_cast<T>(v); });
      });
    });
  }
}

}  // namespace

extern "C" {

// dtype: 0 float32, 1 bfloat16. Returns 0, or 1 when the shapes are not ones this kernel takes.
int gpuwise_decode_attention(int dtype, const void* q, const void* k, const void* v, const int64_t* table, int64_t tb,
                             int64_t bs, const int64_t* lens, void* out, int64_t n, int64_t H, int64_t K, int64_t D,
                             int64_t q_sn, int64_t q_sh, int64_t c_sb, int64_t c_sl, int64_t c_sh, int64_t o_sn,
                             int64_t o_sh, float scale) {
  if (D % 16 != 0 || D / 16 > kMaxChunks || K <= 0 || H % K != 0 || bs < 1 || tb < 1) return 1;
  if (dtype == 0) {
    attend(static_cast<const float*>(q), static_cast<const float*>(k), static_cast<const float*>(v), table, tb, bs,
           lens, static_cast<float*>(out), n, H, K, D, q_sn, q_sh, c_sb, c_sl, c_sh, o_sn, o_sh, scale);
  } else if (dtype == 1) {
    attend(static_cast<const c10::BFloat16*>(q), static_cast<const c10::BFloat16*>(k),
           static_cast<const c10::BFloat16*>(v), table, tb, bs, lens, static_cast<c10::BFloat16*>(out), n, H, K, D,
           q_sn, q_sh, c_sb, c_sl, c_sh, o_sn, o_sh, scale);
  } else {
    return 1;
  }
  return 0;
}

// What this build does on this CPU: 1 int8 dot products in one instruction (AVX512-VNNI), 2 AMX's bf16 tiles
// (granted by Linux), 4 AMX compiled in.
int gpuwise_caps() {
#ifdef __AVX512VNNI__
  const int vnni = 1;
#else
  const int vnni = 0;
#endif
#ifdef GPUWISE_AMX
  const int built = 4;
#else
  const int built = 0;
#endif
  return vnni | (amx_usable() ? 2 : 0) | built;
}

// dtype: 0 float32, 1 bfloat16 (x, bias, out); fmt: the weight's format (kPlain: dtype's, row stride w_so; or
// kQ8_0, kQ4_0, kQ4_1, I a multiple of 32); bias may be null. M up to kMaxRows for a plain weight (any M in bf16
// where AMX takes it, I a multiple of 32), any M for a block format. Returns 0, or 1 when the shapes are not ones
// it takes.
int gpuwise_gemv(int dtype, int fmt, const void* x, const void* w, const void* bias, void* out, int64_t M, int64_t O,
                 int64_t I, int64_t w_so) {
  if (M < 1 || O < 1 || I < 1 || !known_format(fmt)) return 1;
  // a plain weight: up to kMaxRows rows, or more in bf16 on AMX's tiles (rows of whole blocks)
  const bool plain_amx = dtype == 1 && I % 32 == 0 && amx_usable();
  if (fmt == kPlain ? ((M > kMaxRows && !plain_amx) || w_so < I) : !takes_shape(fmt, O, I)) return 1;
  if (fmt == kPlainX4 && M > kMaxRows) return 1;
  if (dtype == 0) {
    gemv(fmt, static_cast<const float*>(x), w, static_cast<const float*>(bias), static_cast<float*>(out), M, O, I,
         w_so);
  } else if (dtype == 1) {
    using B = c10::BFloat16;
    gemv(fmt, static_cast<const B*>(x), w, static_cast<const B*>(bias), static_cast<B*>(out), M, O, I, w_so);
  } else {
    return 1;
  }
  return 0;
}

// Rows r0 .. r0 + n of a weight in a block format (fmt), dequantized into out [n, I] in dtype (0 float32, 1
// bfloat16): a few rows at a time for a library's product of many rows. Returns 0, or 1 when it does not take them.
int gpuwise_dequantize(int dtype, int fmt, const void* w, void* out, int64_t r0, int64_t n, int64_t I) {
  // (any rows of an interleaved weight: its whole groups are the caller's)
  if (fmt == kPlain || !known_format(fmt) || !takes_shape(fmt, 4, I) || n < 0 || r0 < 0) return 1;
  auto run = [&](auto* o) {
    using T = std::remove_pointer_t<decltype(o)>;
    with_weight<T>(fmt, w, I, I, [&](auto wv) {
      at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
        for (int64_t r = begin; r < end; ++r)
          for (int64_t i = 0; i < I; i += 16) store16(o + r * I + i, wv.load(r0 + r, i));
      });
    });
  };
  if (dtype == 0) {
    run(static_cast<float*>(out));
  } else if (dtype == 1) {
    run(static_cast<c10::BFloat16*>(out));
  } else {
    return 1;
  }
  return 0;
}

// dtype: 0 float32, 1 bfloat16; fmt: the layers' weights' format, head_fmt the output layer's (kPlain: dtype's;
// a block format: E, H * D and F multiples of 32); threads: the step's threads (0: PyTorch's). Returns 0, or 1 when
// the shapes are not ones it takes.
int gpuwise_decode_step(int dtype, int fmt, int head_fmt, void* x, const void* cos, const void* sin,
                        const int64_t* pos, const int64_t* table, int64_t tb, int64_t bs, const int64_t* ptrs,
                        const float* eps, int64_t layers, const void* final_norm, float final_eps, const void* head,
                        void* logits, int64_t M, int64_t E, int64_t H, int64_t K, int64_t D, int64_t F, int64_t V,
                        int64_t c_sb, int64_t c_sl, int64_t c_sh, int threads) {
  if (M < 1 || M > kMaxRows || D % 16 != 0 || D / 16 > kMaxChunks || K <= 0 || H % K != 0) return 1;
  if (bs < 1 || tb < 1) return 1;
  if (!known_format(fmt) || !known_format(head_fmt)) return 1;
  const int64_t QKV = (H + 2 * K) * D;  // gate_up: F gate rows, then F up rows, read a group of each at a time
  if (!takes_shape(fmt, QKV, E) || !takes_shape(fmt, E, H * D) || !takes_shape(fmt, F, E) || !takes_shape(fmt, E, F))
    return 1;
  if (!takes_shape(head_fmt, V, E)) return 1;
  if (dtype == 0) {
    decode_step(fmt, head_fmt, static_cast<float*>(x), static_cast<const float*>(cos),
                static_cast<const float*>(sin), pos, table, tb, bs, ptrs, eps, layers,
                static_cast<const float*>(final_norm), final_eps, head, static_cast<float*>(logits), M, E, H, K, D,
                F, V, c_sb, c_sl, c_sh, threads);
  } else if (dtype == 1) {
    using B = c10::BFloat16;
    decode_step(fmt, head_fmt, static_cast<B*>(x), static_cast<const B*>(cos), static_cast<const B*>(sin), pos,
                table, tb, bs, ptrs, eps, layers, static_cast<const B*>(final_norm), final_eps, head,
                static_cast<B*>(logits), M, E, H, K, D, F, V, c_sb, c_sl, c_sh, threads);
  } else {
    return 1;
  }
  return 0;
}
}
