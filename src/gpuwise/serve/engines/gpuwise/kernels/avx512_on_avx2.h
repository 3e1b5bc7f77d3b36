// The AVX-512 intrinsics decode_attention.cpp is written in, on a CPU that has AVX2, FMA and F16C alone (AMD
// Zen 2 and 3, Intel's client cores): SIMDe (github.com/simd-everywhere/simde; Debian's libsimde-dev) gives most
// of them as two 256-bit halves; what its 0.7.4 lacks, or gives through a scalar loop, is below in AVX2.
// Built by serve/engines/gpuwise/attention.py where the CPU has no AVX-512 (docs/serving.md has the speed).
#pragma once
#include <cstdint>
#define SIMDE_ENABLE_NATIVE_ALIASES  // the kernel names _mm512_*; SIMDe answers to them
#include <simde/x86/avx512.h>
inline simde__m512i gw_cvtepu16_epi32(simde__m256i a) {
  return simde_mm512_inserti64x4(simde_mm512_castsi256_si512(simde_mm256_cvtepu16_epi32(simde_mm256_castsi256_si128(a))),
                                 simde_mm256_cvtepu16_epi32(simde_mm256_extracti128_si256(a, 1)), 1);
}
#define _mm512_cvtepu16_epi32 gw_cvtepu16_epi32
inline simde__m512 gw_combine(__m256 a, __m256 b) { return simde_mm512_insertf32x8(simde_mm512_castps256_ps512(a), b, 1); }
inline simde__m512i gw_combinei(__m256i a, __m256i b) { return simde_mm512_inserti64x4(simde_mm512_castsi256_si512(a), b, 1); }
inline __m256i gw_lanes8(unsigned k) {  // mask bits 0-7 as 8 int32 lanes of all ones or zeros
  const __m256i bits = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
  return _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_set1_epi32(static_cast<int>(k & 0xff)), bits), bits);
}
inline simde__m512 gw_maskz_loadu_ps(uint16_t k, const void* p) {
  const float* f = static_cast<const float*>(p);
  return gw_combine(_mm256_maskload_ps(f, gw_lanes8(k)), _mm256_maskload_ps(f + 8, gw_lanes8(k >> 8)));
}
#define _mm512_maskz_loadu_ps gw_maskz_loadu_ps
inline __m256i gw_lo(simde__m512i a) { return simde_mm512_castsi512_si256(a); }
inline __m256i gw_hi(simde__m512i a) { return simde_mm512_extracti64x4_epi64(a, 1); }
inline __m256 gw_lo(simde__m512 a) { return simde_mm512_castps512_ps256(a); }
inline __m256 gw_hi(simde__m512 a) { return _mm256_castsi256_ps(gw_hi(simde_mm512_castps_si512(a))); }
inline simde__m512 gw_cvtepi32_ps(simde__m512i a) { return gw_combine(_mm256_cvtepi32_ps(gw_lo(a)), _mm256_cvtepi32_ps(gw_hi(a))); }
#define _mm512_cvtepi32_ps gw_cvtepi32_ps
inline simde__m512i gw_cvtepi8_epi32(__m128i a) {
  return gw_combinei(_mm256_cvtepi8_epi32(a), _mm256_cvtepi8_epi32(_mm_unpackhi_epi64(a, a)));
}
#define _mm512_cvtepi8_epi32 gw_cvtepi8_epi32
inline simde__m512i gw_cvtepu8_epi32(__m128i a) {
  return gw_combinei(_mm256_cvtepu8_epi32(a), _mm256_cvtepu8_epi32(_mm_unpackhi_epi64(a, a)));
}
#define _mm512_cvtepu8_epi32 gw_cvtepu8_epi32
#define _mm512_shuffle_i64x2(a, b, imm) simde_mm512_shuffle_i64x2(a, b, imm)
inline float gw_sum8(__m256 s) {
  __m128 t = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
  t = _mm_add_ps(t, _mm_movehl_ps(t, t));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
}
inline float gw_reduce_add_ps(simde__m512 a) { return gw_sum8(_mm256_add_ps(gw_lo(a), gw_hi(a))); }
#define _mm512_reduce_add_ps gw_reduce_add_ps
inline float gw_reduce_max_ps(simde__m512 a) {
  const __m256 s = _mm256_max_ps(gw_lo(a), gw_hi(a));
  __m128 t = _mm_max_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
  t = _mm_max_ps(t, _mm_movehl_ps(t, t));
  return _mm_cvtss_f32(_mm_max_ss(t, _mm_movehdup_ps(t)));
}
#define _mm512_reduce_max_ps gw_reduce_max_ps
inline __m128i gw_low16(__m256i a) {  // the low 16 bits of 8 int32
  const __m256i pick = _mm256_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, -1, -1, -1, -1, -1, -1, -1, -1,
                                        0, 1, 4, 5, 8, 9, 12, 13, -1, -1, -1, -1, -1, -1, -1, -1);
  return _mm256_castsi256_si128(_mm256_permute4x64_epi64(_mm256_shuffle_epi8(a, pick), 0x08));
}
inline __m256i gw_cvtepi32_epi16(simde__m512i a) { return _mm256_set_m128i(gw_low16(gw_hi(a)), gw_low16(gw_lo(a))); }
#define _mm512_cvtepi32_epi16 gw_cvtepi32_epi16
// masked 16- and 8-bit loads and stores: only at a row's tail, so a copy through a buffer
inline __m256i gw_maskz_loadu_epi16(uint16_t k, const void* p) {
  alignas(32) uint16_t b[16] = {};
  for (int i = 0; i < 16; ++i)
    if (k >> i & 1) b[i] = static_cast<const uint16_t*>(p)[i];
  return _mm256_load_si256(reinterpret_cast<const __m256i*>(b));
}
#define _mm256_maskz_loadu_epi16 gw_maskz_loadu_epi16
inline void gw_mask_storeu_epi16(void* p, uint16_t k, __m256i a) {
  alignas(32) uint16_t b[16];
  _mm256_store_si256(reinterpret_cast<__m256i*>(b), a);
  for (int i = 0; i < 16; ++i)
    if (k >> i & 1) static_cast<uint16_t*>(p)[i] = b[i];
}
#define _mm256_mask_storeu_epi16 gw_mask_storeu_epi16
inline simde__m512i gw_maskz_loadu_epi8(uint64_t k, const void* p) {
  alignas(64) uint8_t b[64] = {};
  for (int i = 0; i < 64; ++i)
    if (k >> i & 1) b[i] = static_cast<const uint8_t*>(p)[i];
  return simde_mm512_loadu_si512(b);
}
#define _mm512_maskz_loadu_epi8 gw_maskz_loadu_epi8
inline simde__m512 gw_roundscale_nearest(simde__m512 a) {
  return gw_combine(_mm256_round_ps(gw_lo(a), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC),
                    _mm256_round_ps(gw_hi(a), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
#define _mm512_roundscale_ps(a, imm) gw_roundscale_nearest(a)
// p 2^i for whole i in [-126, 127] (exp16's range): i put in the exponent's bits
inline __m256 gw_pow2(__m256 i) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(i), _mm256_set1_epi32(127)), 23));
}
inline simde__m512 gw_scalef_ps(simde__m512 p, simde__m512 i) {
  return gw_combine(_mm256_mul_ps(gw_lo(p), gw_pow2(gw_lo(i))), _mm256_mul_ps(gw_hi(p), gw_pow2(gw_hi(i))));
}
#define _mm512_scalef_ps gw_scalef_ps
inline simde__m512i gw_cvtps_epi32(simde__m512 a) { return gw_combinei(_mm256_cvtps_epi32(gw_lo(a)), _mm256_cvtps_epi32(gw_hi(a))); }
#define _mm512_cvtps_epi32 gw_cvtps_epi32
inline __m128i gw_cvtsepi32_epi8(simde__m512i a) {  // 16 int32 to int8, saturated
  const __m256i w = _mm256_packs_epi32(gw_lo(a), gw_hi(a));  // int16, 128-bit lanes interleaved: [lo0 hi0 lo1 hi1]
  const __m256i o = _mm256_permute4x64_epi64(w, 0xD8);        // [lo0 lo1 hi0 hi1]
  return _mm_packs_epi16(_mm256_castsi256_si128(o), _mm256_extracti128_si256(o, 1));
}
#define _mm512_cvtsepi32_epi8 gw_cvtsepi32_epi8
inline simde__m512i gw_sign_epi8(simde__m512i a, simde__m512i b) {  // AVX2's vpsignb on each half
  return gw_combinei(_mm256_sign_epi8(gw_lo(a), gw_lo(b)), _mm256_sign_epi8(gw_hi(a), gw_hi(b)));
}
#define _mm512_sign_epi8 gw_sign_epi8
// 0.7.4 aliases the masked form (4 arguments) under the plain name, and its own is a scalar loop on AVX2
#undef _mm512_madd_epi16
inline simde__m512i gw_madd_epi16(simde__m512i a, simde__m512i b) {
  return gw_combinei(_mm256_madd_epi16(gw_lo(a), gw_lo(b)), _mm256_madd_epi16(gw_hi(a), gw_hi(b)));
}
#define _mm512_madd_epi16 gw_madd_epi16
