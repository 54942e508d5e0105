// Vector helpers shared by the CPU kernels (paged attention, fused elementwise ops): GCC/Clang vector
// types of VL float lanes (16 with AVX-512, 8 otherwise), loads and stores, horizontal max and sum, a
// polynomial 2^x, and element conversions between float32 and float32 / bfloat16 / float16 storage.
// Compile-time knobs of these kernels are macros named KRN_* (tile sizes, paths); the CBP_* names belong to
// the runtime switches and options, which are declared once in kernels/envs.py and passed in as arguments.
#pragma once

#include <torch/extension.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

namespace cbp {

#if defined(__AVX512F__)
constexpr int VL = 16;
#else
constexpr int VL = 8;
#endif
typedef float vfloat __attribute__((vector_size(VL * sizeof(float))));
typedef int32_t vint __attribute__((vector_size(VL * sizeof(int32_t))));
typedef uint16_t vu16 __attribute__((vector_size(VL * sizeof(uint16_t))));

static inline vfloat vload(const float* p) {
  vfloat v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
static inline void vstore(float* p, vfloat v) { std::memcpy(p, &v, sizeof v); }
// A broadcast. Not `vfloat{} + x`: 0 + (-0) is +0, so without -ffast-math the compiler must keep that
// addition, a scalar add (on an FMA port) before every broadcast of the kernels' inner loops; x - 0 is x
// for every x, so `x - vfloat{}` folds to a plain broadcast (from memory: a load-port operation only).
static inline vfloat vset1(float x) { return x - vfloat{}; }
static inline vfloat vmax(vfloat a, vfloat b) { return a > b ? a : b; }
// a * b + c: one FMA instruction (one rounding) where the build has FMA; elsewhere a product and a sum
// (two roundings: code that needs the single rounding, as gemm_f32, is compiled only with FMA)
static inline vfloat vfma(vfloat a, vfloat b, vfloat c) {
#if defined(__AVX512F__)
  return (vfloat)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
#elif defined(__AVX2__) && defined(__FMA__)
  return (vfloat)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
#else
  return a * b + c;
#endif
}
// horizontal max / sum as a tree over vector halves
typedef float vhalf __attribute__((vector_size(VL * sizeof(float) / 2)));
static inline float hmax(vfloat v) {
#if defined(__AVX512F__)
  return _mm512_reduce_max_ps((__m512)v);
#else
  vhalf lo, hi;
  std::memcpy(&lo, &v, sizeof lo);
  std::memcpy(&hi, reinterpret_cast<const char*>(&v) + sizeof lo, sizeof hi);
  vhalf m = lo > hi ? lo : hi;
  float r = m[0];
  for (int i = 1; i < VL / 2; ++i) r = std::max(r, m[i]);
  return r;
#endif
}
static inline float hsum(vfloat v) {
#if defined(__AVX512F__)
  return _mm512_reduce_add_ps((__m512)v);
#else
  vhalf lo, hi;
  std::memcpy(&lo, &v, sizeof lo);
  std::memcpy(&hi, reinterpret_cast<const char*>(&v) + sizeof lo, sizeof hi);
  vhalf s = lo + hi;
  float r = 0.f;
  for (int i = 0; i < VL / 2; ++i) r += s[i];
  return r;
#endif
}
static inline vint iota() {
  vint v;
  for (int i = 0; i < VL; ++i) v[i] = i;
  return v;
}

// 2^x for x <= 0 (clamped at -126): round-to-nearest split x = n + f, f in [-0.5, 0.5], polynomial
// for e^(f ln2) (Taylor, degree DEG: relative error 5e-9 for 7, 2e-6 for 5), exponent bits for 2^n.
template <int DEG>
static inline vfloat vexp2(vfloat x) {
  x = vmax(x, vset1(-126.0f));
  const vfloat magic = vset1(12582912.0f);  // 1.5 * 2^23: adding it rounds to an integer
  vfloat t = x + magic;
  vfloat n = t - magic;
  vfloat f = (x - n) * 0.6931471805599453f;
  vint ni = (vint)t - (vint)magic;
  constexpr float c[8] = {1.0f, 1.0f, 0.5f, 1.0f / 6, 1.0f / 24, 1.0f / 120, 1.0f / 720, 1.0f / 5040};
  vfloat p = vset1(c[DEG]);
#pragma GCC unroll 8
  for (int k = DEG - 1; k >= 0; --k) p = p * f + c[k];
  vint e = (ni + 127) << 23;
  return p * (vfloat)e;
}

// ------------------------------------------------------------------------------------------------
// element conversions
// ------------------------------------------------------------------------------------------------
template <typename T>
struct Cvt;

template <>
struct Cvt<float> {
  static inline vfloat load(const float* p) { return vload(p); }
  static inline float one(float x) { return x; }
  static inline void store_row(float* dst, const float* src, int n) {
    for (int i = 0; i < n; ++i) dst[i] = src[i];
  }
};

template <>
struct Cvt<at::BFloat16> {
  static inline vfloat load(const at::BFloat16* p) {
#if defined(__AVX512F__)
    // one zero-extending move and a shift (the generic conversion below is split into 256-bit halves
    // by GCC's 256-bit preference on AVX-512 CPUs)
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return (vfloat)_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16);
#else
    vu16 u;
    std::memcpy(&u, p, sizeof u);
    vint w = __builtin_convertvector(u, vint) << 16;
    return (vfloat)w;
#endif
  }
  static inline float one(at::BFloat16 x) { return static_cast<float>(x); }
  static inline void store_row(at::BFloat16* dst, const float* src, int n) {
    for (int i = 0; i < n; ++i) dst[i] = at::BFloat16(src[i]);  // round to nearest even
  }
};

template <>
struct Cvt<at::Half> {
  static inline vfloat load(const at::Half* p) {
#if defined(__AVX512F__)
    __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return (vfloat)_mm512_cvtph_ps(h);
#elif defined(__F16C__) && defined(__AVX__)
    __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return (vfloat)_mm256_cvtph_ps(h);
#else
    vfloat v;
    for (int i = 0; i < VL; ++i) v[i] = static_cast<float>(p[i]);
    return v;
#endif
  }
  static inline float one(at::Half x) { return static_cast<float>(x); }
  static inline void store_row(at::Half* dst, const float* src, int n) {
    for (int i = 0; i < n; ++i) dst[i] = at::Half(src[i]);
  }
};

// store VL float lanes into storage type T (bfloat16: round to nearest even, NaN kept a NaN); round (one
// value) and rounded (a vector): rounded to T and widened back, the values a store then a load would give
template <typename T>
struct Store;

template <>
struct Store<float> {
  static inline void vec(float* p, vfloat v) { vstore(p, v); }
  static inline float round(float x) { return x; }
  static inline vfloat rounded(vfloat v) { return v; }
};

template <>
struct Store<at::BFloat16> {
  // the bfloat16 bits of each lane in its low 16 bits: nearest even, NaN as the quiet 0x7fc0 (the upper
  // bits are sign fill, dropped by the narrowing store or the shift back)
  static inline vint bits(vfloat v) {
    vint u = (vint)v;
    vint r = (u + 0x7fff + ((u >> 16) & 1)) >> 16;
    return v != v ? vint{} + 0x7fc0 : r;
  }
  static inline void vec(at::BFloat16* p, vfloat v) {
    const vint r = bits(v);
#if defined(__AVX512F__)
    // one truncating move (VPMOVDW); the generic narrowing below is split into 256-bit halves by GCC
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16((__m512i)r));
#else
    vu16 h = __builtin_convertvector(r & 0xffff, vu16);
    std::memcpy(p, &h, sizeof h);
#endif
  }
  static inline float round(float x) { return static_cast<float>(at::BFloat16(x)); }
  // in registers (a store and a reload through memory cost 1.3x in SiLU-and-mul)
  static inline vfloat rounded(vfloat v) { return (vfloat)(bits(v) << 16); }
};

template <>
struct Store<at::Half> {
  static inline void vec(at::Half* p, vfloat v) {
    for (int i = 0; i < VL; ++i) p[i] = at::Half(v[i]);
  }
  static inline float round(float x) { return static_cast<float>(at::Half(x)); }
  static inline vfloat rounded(vfloat v) {
    alignas(64) at::Half tmp[VL];
    vec(tmp, v);
    return Cvt<at::Half>::load(tmp);
  }
};

}  // namespace cbp
