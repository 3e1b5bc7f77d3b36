// How fast a one-row product reads its bf16 weight on this CPU, read as gpuwise's decode kernel reads it
// (src/gpuwise/serve/engines/gpuwise/kernels/decode_attention.cpp: gemv_block, 4 weight rows a pass), with and without asking
// for the rows ahead (_mm_prefetch), beside one plain stream a thread summed: the bound the kernel is held to.
// One weight of 270 MB (SmolLM2-135M's bytes a token in bf16), or of the MB given, as [O, 576]; every variant in
// one run, rounds alternating, median of each. A size matters where the CPU's last-level cache holds a good part
// of it (the 2-core Xeon's is 300 MB, shared with the host's other tenants): a server is held to a read of its
// own step's bytes (benchmarks/llm_serve_load.py).
//
// Build and run (AVX-512, or AVX2 and FMA):
//   g++ -O3 -march=native -fopenmp benchmarks/weight_read.cpp -o /tmp/weight_read && OMP_NUM_THREADS=2 /tmp/weight_read [MB]
#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <string>
#include <vector>

namespace {
constexpr int64_t I = 576;
int64_t O = 270'000'000 / 2 / I;  // rows: the MB asked for

// 16 floats a step: one zmm where the CPU has AVX-512, two ymm where it has AVX2 alone (a Zen 3), so that
// the bound is read on every host llm_serve_load.py and engine_step.py run on
#ifdef __AVX512F__
using V16 = __m512;
inline V16 zero() { return _mm512_setzero_ps(); }
inline V16 loadf(const float* p) { return _mm512_loadu_ps(p); }
inline V16 load16(const uint16_t* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
inline V16 fmadd(V16 a, V16 b, V16 c) { return _mm512_fmadd_ps(a, b, c); }
inline V16 add(V16 a, V16 b) { return _mm512_add_ps(a, b); }
inline float sum(V16 a) { return _mm512_reduce_add_ps(a); }
#else
struct V16 {
  __m256 lo, hi;
};
inline V16 zero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline V16 loadf(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
inline __m256 widen(__m128i h) { return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16)); }
inline V16 load16(const uint16_t* p) {
  return {widen(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))),
          widen(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8)))};
}
inline V16 fmadd(V16 a, V16 b, V16 c) { return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)}; }
inline V16 add(V16 a, V16 b) { return {_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; }
inline float sum(V16 a) {
  const __m256 s = _mm256_add_ps(a.lo, a.hi);
  __m128 t = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
  t = _mm_add_ps(t, _mm_movehl_ps(t, t));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
}
#endif

// this thread's product rows, 4 a pass; ahead > 0: each pass asks for the rows `ahead` on
void product(const uint16_t* w, const float* x, float* out, int64_t ahead) {
  const int tid = omp_get_thread_num(), threads = omp_get_num_threads();
  const int64_t blocks = O / 4, b = blocks * tid / threads, e = blocks * (tid + 1) / threads;
  for (int64_t block = b; block < e; ++block) {
    V16 acc[4] = {zero(), zero(), zero(), zero()};
    const uint16_t* rows = w + block * 4 * I;
    for (int64_t i = 0; i < I; i += 16) {
      if (ahead && i % 32 == 0)
        for (int r = 0; r < 4; ++r) _mm_prefetch(reinterpret_cast<const char*>(rows + (ahead + r) * I + i), _MM_HINT_T0);
      const V16 xv = loadf(x + i);
      for (int r = 0; r < 4; ++r) acc[r] = fmadd(load16(rows + r * I + i), xv, acc[r]);
    }
    for (int r = 0; r < 4; ++r) out[block * 4 + r] = sum(acc[r]);
  }
}
// the same product on the weight laid out four rows at a time: per pass, each row's 32 values (a 64-byte line) in
// turn, so that a pass reads one stream (as the kernel's Q8_0x4 and Q4_1x4 blocks are laid out)
void product_x4(const uint16_t* w, const float* x, float* out) {
  const int tid = omp_get_thread_num(), threads = omp_get_num_threads();
  const int64_t blocks = O / 4, b = blocks * tid / threads, e = blocks * (tid + 1) / threads;
  for (int64_t block = b; block < e; ++block) {
    V16 acc[4] = {zero(), zero(), zero(), zero()};
    const uint16_t* rows = w + block * 4 * I;
    for (int64_t i = 0; i < I; i += 32) {
      const V16 x0 = loadf(x + i), x1 = loadf(x + i + 16);
      for (int r = 0; r < 4; ++r) {
        const uint16_t* line = rows + i * 4 + r * 32;
        acc[r] = fmadd(load16(line), x0, acc[r]);
        acc[r] = fmadd(load16(line + 16), x1, acc[r]);
      }
    }
    for (int r = 0; r < 4; ++r) out[block * 4 + r] = sum(acc[r]);
  }
}
}  // namespace

int main(int argc, char** argv) {
  if (argc > 1) O = static_cast<int64_t>(std::atof(argv[1]) * 1e6 / 2 / I) / 4 * 4;
  // room past the end: the last rows' prefetches ask for addresses beyond the weight
  std::vector<uint16_t> w((O + 64) * I, 0x3f80);
  std::vector<float> x(I, 1.f), out(O), sums(256);
  std::vector<std::pair<std::string, std::function<void()>>> variants = {
      {"one stream a thread, summed", [&] {
#pragma omp parallel
         {
           const int tid = omp_get_thread_num(), threads = omp_get_num_threads();
           const int64_t n = O * I / 32, b = n * tid / threads * 32, e = n * (tid + 1) / threads * 32;
           V16 a = zero(), c = zero();
           for (int64_t i = b; i < e; i += 32) {
             a = add(a, load16(&w[i]));
             c = add(c, load16(&w[i + 16]));
           }
           sums[tid] = sum(add(a, c));
         }
       }},
  };
  for (int64_t ahead : {0, 4, 8, 16, 32}) {
    std::string name = ahead ? "4 rows a pass, prefetch " + std::to_string(ahead) + " rows on" : "4 rows a pass";
    variants.emplace_back(name, [&, ahead] {
#pragma omp parallel
      product(w.data(), x.data(), out.data(), ahead);
    });
  }
  variants.emplace_back("4 rows a pass, laid four rows at a time", [&] {
#pragma omp parallel
    product_x4(w.data(), x.data(), out.data());
  });
  std::vector<std::vector<double>> ms(variants.size());
  for (int round = 0; round < 12; ++round) {
    for (size_t k = 0; k < variants.size(); ++k) {
      const size_t v = round % 2 ? variants.size() - 1 - k : k;
      const auto t = std::chrono::steady_clock::now();
      variants[v].second();
      ms[v].push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t).count());
    }
  }
  std::printf("a one-row product of a %.0f MB bf16 weight, %d threads, median of 12 rounds\n", O * I * 2 / 1e6,
              omp_get_max_threads());
  double plain = 0;
  for (size_t v = 0; v < variants.size(); ++v) {
    std::sort(ms[v].begin(), ms[v].end());
    const double m = ms[v][ms[v].size() / 2];
    if (variants[v].first == "4 rows a pass") plain = m;
    std::printf("%-36s %7.2f ms  %5.1f GB/s\n", variants[v].first.c_str(), m, O * I * 2 / m / 1e6);
  }
  std::printf("prefetch 4 rows on / none: %.2fx\n", plain / ms[2][ms[2].size() / 2]);
}
