// The decode step's kernels for CPUs with AVX-512, built and loaded by serve/attention.py, which says why they
// exist; docs/serving.md has their speed.
//
// 1. Attention of one new token per sequence over its cached keys and values.
// q:   [n, H, D] (strided: row q_sn, head q_sh; D contiguous), in T (float or bfloat16)
// k, v: one layer of the slot cache, row i's position l of key/value head h at i*c_sn + l*c_sl + h*c_sh
// lens: [n] how many positions row i attends to (0 .. lens[i]-1)
// out: [n, H, D] (row o_sn, head o_sh)
// Query head j reads key/value head j / (H / K) (grouped-query attention). Scores, softmax and the weighted
// sum run in fp32 whatever T is; the output is rounded to T once.
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
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

template <typename T>
void attend(const T* q, const T* k, const T* v, const int64_t* lens, T* out, int64_t n, int64_t H, int64_t K,
            int64_t D, int64_t q_sn, int64_t q_sh, int64_t c_sn, int64_t c_sl, int64_t c_sh, int64_t o_sn,
            int64_t o_sh, float scale) {
  const int64_t G = H / K, V = D / 16;
  // A work item is a row, all its heads: the keys and values of one position (every head) are contiguous in the
  // cache, read in one pass. With fewer rows than two per thread, a (row, key/value head) pair instead.
  const int64_t split = n >= 2 * at::get_num_threads() ? 1 : K, per = K / split;
  at::parallel_for(0, n * split, 1, [&](int64_t begin, int64_t end) {
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
      const T* keys = k + i * c_sn;
      for (int64_t l = 0; l < L; ++l) {
        for (int64_t h = h0; h < h1; ++h) {
          __m512 key[kMaxChunks];
          for (int64_t j = 0; j < V; ++j) key[j] = load16(keys + l * c_sl + h * c_sh + j * 16);
          for (int64_t g = 0; g < G; ++g) {
            const int64_t hg = h * G + g;
            __m512 dot = _mm512_mul_ps(query[hg * V], key[0]);
            for (int64_t j = 1; j < V; ++j) dot = _mm512_fmadd_ps(query[hg * V + j], key[j], dot);
            scores[hg * padded + l] = _mm512_reduce_add_ps(dot);
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
      const T* values = v + i * c_sn;
      for (int64_t l = 0; l < L; ++l) {
        for (int64_t h = h0; h < h1; ++h) {
          __m512 value[kMaxChunks];
          for (int64_t j = 0; j < V; ++j) value[j] = load16(values + l * c_sl + h * c_sh + j * 16);
          for (int64_t g = 0; g < G; ++g) {
            const int64_t hg = h * G + g;
            const __m512 p = _mm512_set1_ps(scores[hg * padded + l]);
            for (int64_t j = 0; j < V; ++j) acc[hg * V + j] = _mm512_fmadd_ps(p, value[j], acc[hg * V + j]);
          }
        }
      }
      for (int64_t hg = h0 * G; hg < h1 * G; ++hg) {
        for (int64_t j = 0; j < V; ++j) _mm512_store_ps(lane + j * 16, acc[hg * V + j]);
        T* o = out + i * o_sn + hg * o_sh;
        for (int64_t d = 0; d < D; ++d) o[d] = static_cast<T>(lane[d]);
      }
    }
  });
}

// 2. A product of a few rows by a weight: out[m, o] = sum_i x[m, i] w[o, i] (+ bias[o]), m < M <= kMaxRows.
// At a decode step's few rows a product is bound by reading the weight once (oneDNN and MKL reorder or pad
// for blocks of rows and reach a third of the memory's speed there: docs/serving.md). Each thread takes a
// share of the output columns, four weight rows at a time, each read once for every input row; the sums run
// in fp32 and the output is rounded to T once. w: [O, I] with row stride w_so, x: [M, I] and out: [M, O]
// contiguous.
constexpr int64_t kMaxRows = 8;
constexpr int64_t kRowsAtOnce = 4;  // input rows a pass: R x 4 fp32 accumulators stay in registers

// out rows m0 .. m0 + MM of output columns o0 .. o0 + rows (rows <= R): each weight row read once a pass
template <typename T, int MM>
inline void gemv_block(const float* xf, const T* w, const T* bias, T* out, int64_t O, int64_t I, int64_t w_so,
                       int64_t o0, int64_t rows) {
  constexpr int64_t R = 4;
  const int64_t full = I / 16 * 16, tail = I - full;
  __m512 acc[R][MM];
  for (int64_t r = 0; r < R; ++r)
    for (int m = 0; m < MM; ++m) acc[r][m] = _mm512_setzero_ps();
  for (int64_t i = 0; i < full; i += 16) {
    __m512 wv[R];
    for (int64_t r = 0; r < R; ++r) wv[r] = r < rows ? load16(w + (o0 + r) * w_so + i) : _mm512_setzero_ps();
    for (int m = 0; m < MM; ++m) {
      const __m512 xv = _mm512_loadu_ps(xf + m * I + i);
      for (int64_t r = 0; r < R; ++r) acc[r][m] = _mm512_fmadd_ps(wv[r], xv, acc[r][m]);
    }
  }
  if (tail) {
    __m512 wv[R];
    for (int64_t r = 0; r < R; ++r) wv[r] = r < rows ? load_tail(w + (o0 + r) * w_so + full, tail) : _mm512_setzero_ps();
    for (int m = 0; m < MM; ++m) {
      const __m512 xv = load_tail(xf + m * I + full, tail);
      for (int64_t r = 0; r < R; ++r) acc[r][m] = _mm512_fmadd_ps(wv[r], xv, acc[r][m]);
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    const float b = bias ? static_cast<float>(bias[o0 + r]) : 0.f;
    for (int m = 0; m < MM; ++m) out[m * O + o0 + r] = static_cast<T>(_mm512_reduce_add_ps(acc[r][m]) + b);
  }
}

template <typename T>
void gemv(const T* x, const T* w, const T* bias, T* out, int64_t M, int64_t O, int64_t I, int64_t w_so) {
  std::vector<float> xf(M * I);
  for (int64_t j = 0; j < M * I; ++j) xf[j] = static_cast<float>(x[j]);
  constexpr int64_t R = 4;
  at::parallel_for(0, (O + R - 1) / R, 16, [&](int64_t begin, int64_t end) {
    for (int64_t block = begin; block < end; ++block) {
      const int64_t o0 = block * R, rows = std::min(R, O - o0);
      for (int64_t m0 = 0; m0 < M; m0 += kRowsAtOnce) {  // more rows: the block's weights again, from L1
        const float* xm = xf.data() + m0 * I;
        T* om = out + m0 * O;
        switch (std::min(kRowsAtOnce, M - m0)) {
          case 1: gemv_block<T, 1>(xm, w, bias, om, O, I, w_so, o0, rows); break;
          case 2: gemv_block<T, 2>(xm, w, bias, om, O, I, w_so, o0, rows); break;
          case 3: gemv_block<T, 3>(xm, w, bias, om, O, I, w_so, o0, rows); break;
          default: gemv_block<T, 4>(xm, w, bias, om, O, I, w_so, o0, rows); break;
        }
      }
    }
  });
}

// 3. A whole decode step of a Llama-family decoder (serve/decoder.py's fused forward, one token for each of
// M <= kMaxRows rows, no LoRA): every layer's norm, products, rotary embedding, cache write and attention in
// one call, so that the ~25 tensor ops a layer do not each pay Python's and ATen's dispatch. It rounds to T
// where serve/decoder.py's PyTorch ops do (each op's output), so its logits are that forward's within the
// order of a sum. x: [M, E] the embedded tokens (updated in place); cos, sin: [M, D]; pos: [M] each row's
// position, its cache row first + m; per layer l, ptrs[l * 12 + ...]: input norm, qkv weight and bias, o weight
// and bias, post-attention norm, gate_up weight and bias, down weight and bias (a null bias: none), and the
// layer's keys and values ([slots, capacity, K, D]: strides c_sn, c_sl, c_sh); eps[l * 2 + 0/1] the norms'.
// Then the final norm and the output layer into logits [M, V].
template <typename T>
void rms(const T* x, const T* weight, float eps, T* out, int64_t M, int64_t E) {
  for (int64_t m = 0; m < M; ++m) {
    const T* row = x + m * E;
    float sum = 0.f;
    for (int64_t e = 0; e < E; ++e) sum += static_cast<float>(row[e]) * static_cast<float>(row[e]);
    const float inv = 1.f / std::sqrt(sum / static_cast<float>(E) + eps);
    for (int64_t e = 0; e < E; ++e) {
      const T normed = static_cast<T>(static_cast<float>(row[e]) * inv);
      out[m * E + e] = static_cast<T>(static_cast<float>(weight[e]) * static_cast<float>(normed));
    }
  }
}

template <typename T>
void decode_step(T* x, const T* cos, const T* sin, const int64_t* pos, int64_t first, const int64_t* ptrs,
                 const float* eps, int64_t layers, const T* final_norm, float final_eps, const T* head, T* logits,
                 int64_t M, int64_t E, int64_t H, int64_t K, int64_t D, int64_t F, int64_t V, int64_t c_sn,
                 int64_t c_sl, int64_t c_sh) {
  const int64_t QKV = (H + 2 * K) * D, half = D / 2;
  std::vector<T> normed(M * E), qkv(M * QKV), att(M * H * D), proj(M * E), gu(M * 2 * F), act(M * F);
  std::vector<int64_t> lens(M);
  for (int64_t m = 0; m < M; ++m) lens[m] = pos[m] + 1;
  for (int64_t l = 0; l < layers; ++l) {
    const int64_t* p = ptrs + l * 12;
    auto w = [&](int i) { return reinterpret_cast<const T*>(p[i]); };
    T* kc = reinterpret_cast<T*>(p[10]);
    T* vc = reinterpret_cast<T*>(p[11]);
    rms(x, w(0), eps[l * 2], normed.data(), M, E);
    gemv(normed.data(), w(1), w(2), qkv.data(), M, QKV, E, E);
    for (int64_t m = 0; m < M; ++m) {
      T* row = qkv.data() + m * QKV;
      const T* c = cos + m * D;
      const T* s = sin + m * D;
      for (int64_t h = 0; h < H + K; ++h) {  // q and k heads: x * cos + rotate_half(x) * sin, rounded per op
        T* v = row + h * D;
        T rotated[512];
        for (int64_t d = 0; d < half; ++d) {
          rotated[d] = static_cast<T>(-static_cast<float>(v[d + half]));
          rotated[d + half] = v[d];
        }
        for (int64_t d = 0; d < D; ++d) {
          const T a = static_cast<T>(static_cast<float>(v[d]) * static_cast<float>(c[d]));
          const T b = static_cast<T>(static_cast<float>(rotated[d]) * static_cast<float>(s[d]));
          v[d] = static_cast<T>(static_cast<float>(a) + static_cast<float>(b));
        }
      }
      T* krow = kc + (first + m) * c_sn + pos[m] * c_sl;
      T* vrow = vc + (first + m) * c_sn + pos[m] * c_sl;
      for (int64_t h = 0; h < K; ++h)
        for (int64_t d = 0; d < D; ++d) {
          krow[h * c_sh + d] = row[(H + h) * D + d];
          vrow[h * c_sh + d] = row[(H + K + h) * D + d];
        }
    }
    attend(qkv.data(), kc + first * c_sn, vc + first * c_sn, lens.data(), att.data(), M, H, K, D, QKV, D, c_sn, c_sl,
           c_sh, H * D, D, 1.f / std::sqrt(static_cast<float>(D)));
    gemv(att.data(), w(3), w(4), proj.data(), M, E, H * D, H * D);
    for (int64_t j = 0; j < M * E; ++j) x[j] = static_cast<T>(static_cast<float>(x[j]) + static_cast<float>(proj[j]));
    rms(x, w(5), eps[l * 2 + 1], normed.data(), M, E);
    gemv(normed.data(), w(6), w(7), gu.data(), M, 2 * F, E, E);
    for (int64_t m = 0; m < M; ++m)
      for (int64_t f = 0; f < F; ++f) {
        const float g = static_cast<float>(gu[m * 2 * F + f]);
        const T silu = static_cast<T>(g / (1.f + std::exp(-g)));
        act[m * F + f] = static_cast<T>(static_cast<float>(silu) * static_cast<float>(gu[m * 2 * F + F + f]));
      }
    gemv(act.data(), w(8), w(9), proj.data(), M, E, F, F);
    for (int64_t j = 0; j < M * E; ++j) x[j] = static_cast<T>(static_cast<float>(x[j]) + static_cast<float>(proj[j]));
  }
  rms(x, final_norm, final_eps, normed.data(), M, E);
  gemv(normed.data(), head, static_cast<const T*>(nullptr), logits, M, V, E, E);
}

}  // namespace

extern "C" {

// dtype: 0 float32, 1 bfloat16. Returns 0, or 1 when the shapes are not ones this kernel takes.
int gpuwise_decode_attention(int dtype, const void* q, const void* k, const void* v, const int64_t* lens, void* out,
                             int64_t n, int64_t H, int64_t K, int64_t D, int64_t q_sn, int64_t q_sh, int64_t c_sn,
                             int64_t c_sl, int64_t c_sh, int64_t o_sn, int64_t o_sh, float scale) {
  if (D % 16 != 0 || D / 16 > kMaxChunks || K <= 0 || H % K != 0) return 1;
  if (dtype == 0) {
    attend(static_cast<const float*>(q), static_cast<const float*>(k), static_cast<const float*>(v), lens,
           static_cast<float*>(out), n, H, K, D, q_sn, q_sh, c_sn, c_sl, c_sh, o_sn, o_sh, scale);
  } else if (dtype == 1) {
    attend(static_cast<const c10::BFloat16*>(q), static_cast<const c10::BFloat16*>(k),
           static_cast<const c10::BFloat16*>(v), lens, static_cast<c10::BFloat16*>(out), n, H, K, D, q_sn, q_sh,
           c_sn, c_sl, c_sh, o_sn, o_sh, scale);
  } else {
    return 1;
  }
  return 0;
}

// dtype: 0 float32, 1 bfloat16; bias may be null. Returns 0, or 1 when the shapes are not ones it takes.
int gpuwise_gemv(int dtype, const void* x, const void* w, const void* bias, void* out, int64_t M, int64_t O,
                 int64_t I, int64_t w_so) {
  if (M < 1 || M > kMaxRows || O < 1 || I < 1 || w_so < I) return 1;
  if (dtype == 0) {
    gemv(static_cast<const float*>(x), static_cast<const float*>(w), static_cast<const float*>(bias),
         static_cast<float*>(out), M, O, I, w_so);
  } else if (dtype == 1) {
    gemv(static_cast<const c10::BFloat16*>(x), static_cast<const c10::BFloat16*>(w),
         static_cast<const c10::BFloat16*>(bias), static_cast<c10::BFloat16*>(out), M, O, I, w_so);
  } else {
    return 1;
  }
  return 0;
}

// dtype: 0 float32, 1 bfloat16. Returns 0, or 1 when the shapes are not ones it takes.
int gpuwise_decode_step(int dtype, void* x, const void* cos, const void* sin, const int64_t* pos, int64_t first,
                        const int64_t* ptrs, const float* eps, int64_t layers, const void* final_norm,
                        float final_eps, const void* head, void* logits, int64_t M, int64_t E, int64_t H, int64_t K,
                        int64_t D, int64_t F, int64_t V, int64_t c_sn, int64_t c_sl, int64_t c_sh) {
  if (M < 1 || M > kMaxRows || D % 16 != 0 || D / 16 > kMaxChunks || K <= 0 || H % K != 0) return 1;
  if (dtype == 0) {
    decode_step(static_cast<float*>(x), static_cast<const float*>(cos), static_cast<const float*>(sin), pos, first,
                ptrs, eps, layers, static_cast<const float*>(final_norm), final_eps, static_cast<const float*>(head),
                static_cast<float*>(logits), M, E, H, K, D, F, V, c_sn, c_sl, c_sh);
  } else if (dtype == 1) {
    using B = c10::BFloat16;
    decode_step(static_cast<B*>(x), static_cast<const B*>(cos), static_cast<const B*>(sin), pos, first, ptrs, eps,
                layers, static_cast<const B*>(final_norm), final_eps, static_cast<const B*>(head),
                static_cast<B*>(logits), M, E, H, K, D, F, V, c_sn, c_sl, c_sh);
  } else {
    return 1;
  }
  return 0;
}
}
