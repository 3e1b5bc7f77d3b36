// How fast a one-row product reads a Q8_0 weight laid out as a GGUF ships it and laid out four rows at a time
// (serve/engines/gpuwise/quant.py: interleave; kernels/decode_attention.cpp: Q8_0x4, qgemv_x4), beside one plain
// stream a thread summed over the same bytes: why the engine lays its Q8_0 and Q4_1 weights out again at load.
// One weight of 143 MB (SmolLM2-135M's bytes a token in Q8_0) as [O, 576]; int8 activations with a scale a block
// of 32, as the kernel's; every variant in one run, rounds alternating, median of each. The two layouts' sums are
// checked equal (the same integer sums, scaled and added in the same order).
//
// Build and run (AVX-512 VNNI):
//   g++ -O3 -march=native -fopenmp benchmarks/block_read.cpp -o /tmp/block_read && OMP_NUM_THREADS=2 /tmp/block_read
#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

namespace {
constexpr int64_t I = 576, NB = I / 32, O = 143'000'000 / (I / 32 * 34) / 4 * 4;
constexpr int64_t kPair = 272;  // a group's two blocks: 8 fp16 scales, then 4 rows x 64 quants

uint8_t* shipped;     // [O][NB][34]: fp16 d, 32 int8 q
uint8_t* interleaved;  // [O / 4][NB / 2][272]
std::vector<int8_t> xq(I);
std::vector<float> xd(NB);
std::vector<int32_t> xc(I / 4);  // -128 x each four x's sum
std::vector<float> out_shipped(O), out_interleaved(O);

// as the kernel's qgemv_i8 reads Q8_0 as it ships: 4 rows a pass, two blocks a step, signs moved onto x
void as_shipped() {
#pragma omp parallel
  {
    const int tid = omp_get_thread_num(), th = omp_get_num_threads();
    const int64_t groups = O / 4, g0 = groups * tid / th, g1 = groups * (tid + 1) / th;
    const __m512i pick = _mm512_set_epi32(2, 2, 2, 2, 2, 2, 2, 2, 0, 0, 0, 0, 0, 0, 0, 0);
    for (int64_t g = g0; g < g1; ++g) {
      __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
      for (int64_t b = 0; b < NB; b += 2) {
        for (int64_t k = b; k < b + 2; ++k)  // the rows 4 on, as the kernel's kAhead
          if (k * 34 % 64 < 34)
            for (int r = 0; r < 4; ++r) _mm_prefetch(reinterpret_cast<const char*>(shipped + ((g * 4 + 4 + r) * NB + k) * 34), _MM_HINT_T0);
        const __m512i xv = _mm512_loadu_si512(&xq[b * 32]);
        const __m512 dx = _mm512_insertf32x8(_mm512_set1_ps(xd[b]), _mm256_set1_ps(xd[b + 1]), 1);
        for (int r = 0; r < 4; ++r) {
          const uint8_t* p = shipped + ((g * 4 + r) * NB + b) * 34;
          const __m512i q = _mm512_inserti64x4(
              _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 2))),
              _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 36)), 1);
          uint32_t lo, hi;
          std::memcpy(&lo, p, 4), std::memcpy(&hi, p + 34, 4);
          const uint64_t h = (static_cast<uint64_t>(lo) | static_cast<uint64_t>(hi) << 32) & 0x0000FFFF0000FFFFull;
          const __m512 dw = _mm512_permutexvar_ps(pick, _mm512_castps128_ps512(_mm_cvtph_ps(_mm_cvtsi64_si128(static_cast<int64_t>(h)))));
          const __m512i x = _mm512_mask_sub_epi8(xv, _mm512_movepi8_mask(q), _mm512_setzero_si512(), xv);
          const __m512i d = _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_abs_epi8(q), x);
          acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), _mm512_mul_ps(dw, dx), acc[r]);
        }
      }
      for (int r = 0; r < 4; ++r) out_shipped[g * 4 + r] = _mm512_reduce_add_ps(acc[r]);
    }
  }
}

// as the kernel's qgemv_x4 reads Q8_0x4: one stream a thread, each line asked for `ahead` pairs on
template <int64_t Ahead>
void four_rows() {
#pragma omp parallel
  {
    const int tid = omp_get_thread_num(), th = omp_get_num_threads();
    const int64_t groups = O / 4, g0 = groups * tid / th, g1 = groups * (tid + 1) / th;
    __m512i pick[4];
    for (int r = 0; r < 4; ++r) pick[r] = _mm512_set_epi32(4 + r, 4 + r, 4 + r, 4 + r, 4 + r, 4 + r, 4 + r, 4 + r, r, r, r, r, r, r, r, r);
    for (int64_t g = g0; g < g1; ++g) {
      __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
      const uint8_t* p = interleaved + g * (NB / 2) * kPair;
      const char* asked = reinterpret_cast<const char*>(reinterpret_cast<uintptr_t>(p + Ahead * kPair) & ~uintptr_t{63});
      for (int64_t b = 0; b < NB; b += 2, p += kPair) {
        if (Ahead)
          for (const char* until = reinterpret_cast<const char*>(p + (Ahead + 1) * kPair); asked < until; asked += 64)
            _mm_prefetch(asked, _MM_HINT_T0);
        const __m512i xv = _mm512_loadu_si512(&xq[b * 32]);
        const __m512i start = _mm512_loadu_si512(&xc[b * 8]);
        const __m256 dx = _mm256_insertf128_ps(_mm256_set1_ps(xd[b]), _mm_set1_ps(xd[b + 1]), 1);
        const __m512 sc = _mm512_castps256_ps512(_mm256_mul_ps(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), dx));
        for (int r = 0; r < 4; ++r) {
          const __m512i d = _mm512_dpbusd_epi32(start, _mm512_loadu_si512(p + 16 + r * 64), xv);
          acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), _mm512_permutexvar_ps(pick[r], sc), acc[r]);
        }
      }
      for (int r = 0; r < 4; ++r) out_interleaved[g * 4 + r] = _mm512_reduce_add_ps(acc[r]);
    }
  }
}

int64_t sums[256];
void plain() {  // the same bytes, one stream a thread, summed
#pragma omp parallel
  {
    const int tid = omp_get_thread_num(), th = omp_get_num_threads();
    const int64_t n = O * NB * 34 / 128, b = n * tid / th * 128, e = n * (tid + 1) / th * 128;
    __m512i a = _mm512_setzero_si512(), c = _mm512_setzero_si512();
    for (int64_t i = b; i < e; i += 128) {
      a = _mm512_add_epi32(a, _mm512_loadu_si512(interleaved + i));
      c = _mm512_add_epi32(c, _mm512_loadu_si512(interleaved + i + 64));
    }
    sums[tid] = _mm512_reduce_add_epi32(_mm512_add_epi32(a, c));
  }
}
}  // namespace

int main() {
  const int64_t bytes = O * NB * 34, room = 1 << 20;  // room past the end: the last prefetches ask beyond it
  shipped = static_cast<uint8_t*>(std::aligned_alloc(64, bytes + room));
  interleaved = static_cast<uint8_t*>(std::aligned_alloc(64, bytes + room));
  std::srand(1);
  for (int64_t j = 0; j < O * NB; ++j) {
    uint8_t* p = shipped + j * 34;
    const _Float16 d = static_cast<_Float16>(0.001f * (1 + std::rand() % 100));
    std::memcpy(p, &d, 2);
    for (int k = 0; k < 32; ++k) p[2 + k] = static_cast<uint8_t>(std::rand() % 255 - 127);
  }
  for (int64_t o = 0; o < O; ++o)  // quant.py's interleave
    for (int64_t b = 0; b < NB; ++b) {
      const uint8_t* p = shipped + (o * NB + b) * 34;
      uint8_t* pair = interleaved + ((o / 4) * (NB / 2) + b / 2) * kPair;
      std::memcpy(pair + 2 * ((b % 2) * 4 + o % 4), p, 2);
      for (int k = 0; k < 32; ++k) pair[16 + (o % 4) * 64 + (b % 2) * 32 + k] = p[2 + k] ^ 0x80;
    }
  for (int64_t i = 0; i < I; ++i) xq[i] = static_cast<int8_t>(std::rand() % 255 - 127);
  for (int64_t b = 0; b < NB; ++b) xd[b] = 0.01f * (1 + b % 3);
  for (int64_t i = 0; i < I / 4; ++i) xc[i] = -128 * (xq[4 * i] + xq[4 * i + 1] + xq[4 * i + 2] + xq[4 * i + 3]);
  std::vector<std::pair<std::string, std::function<void()>>> variants = {
      {"one stream a thread, summed", plain},
      {"Q8_0 as shipped (4 rows on)", as_shipped},
      {"four rows at a time, no asks", four_rows<0>},
      {"four rows, asked 4 pairs on", four_rows<4>},
      {"four rows, asked 16 pairs on", four_rows<16>},
      {"four rows, asked 24 pairs on", four_rows<24>},
  };
  std::vector<std::vector<double>> ms(variants.size());
  for (int round = 0; round < 12; ++round)
    for (size_t k = 0; k < variants.size(); ++k) {
      const size_t v = round % 2 ? variants.size() - 1 - k : k;
      const auto t = std::chrono::steady_clock::now();
      variants[v].second();
      ms[v].push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t).count());
    }
  std::printf("a one-row product of a %.0f MB Q8_0 weight, %d threads, median of 12 rounds\n", bytes / 1e6,
              omp_get_max_threads());
  std::vector<double> median(variants.size());
  for (size_t v = 0; v < variants.size(); ++v) {
    std::sort(ms[v].begin(), ms[v].end());
    median[v] = ms[v][ms[v].size() / 2];
    std::printf("%-32s %7.2f ms  %5.1f GB/s  %4.2fx the plain read's time\n", variants[v].first.c_str(), median[v],
                bytes / median[v] / 1e6, median[v] / median[0]);
  }
  std::printf("four rows asked 16 on / as shipped: %.2fx\n", median[1] / median[4]);
  int64_t differ = 0;
  for (int64_t o = 0; o < O; ++o) differ += out_shipped[o] != out_interleaved[o];
  std::printf("outputs that differ between the layouts: %lld of %lld (the plain read's sum: %lld)\n",
              static_cast<long long>(differ), static_cast<long long>(O), static_cast<long long>(sums[0] + sums[1]));
  return differ != 0;
}
