"""The C++ helpers every native kernel includes: dtype conversions and math.

Everything is branch-free and inlined so loops over columns vectorise without
-ffast-math: exp is a Cephes-style polynomial, tanh/sigmoid/silu/gelu(tanh) are
built on it, erf is a polynomial below 1 and 1 - exp(-x^2) R(x) above (exact gelu's
negative tail erfc-based); fp16 and bf16 are converted with integer bit manipulation
(round to nearest even, as c10 does), so loads and stores vectorise too; fp16 blocks
convert with F16C/AVX-512 instructions where the compiler targets them.
"""

PRELUDE = r"""
#include <cstdint>
#include <cstring>
#include <cmath>
#include <algorithm>
#include <cstdlib>
#include <type_traits>
#if defined(__AVX512F__) || defined(__F16C__)
#include <immintrin.h>
#endif
#define PI_INLINE static inline __attribute__((always_inline))

namespace c10 {  // what torch's CppPrinter emits for FloorDiv
PI_INLINE int64_t div_floor_integer(int64_t a, int64_t b) {
  int64_t q = a / b, r = a % b;
  return (r != 0 && ((r < 0) != (b < 0))) ? q - 1 : q;
}
}

// eager's integer pow: exact, wrapping like its repeated products; a negative exponent
// gives 1 / b truncated (0 unless |b| == 1, 0 for b == 0 too)
PI_INLINE int64_t pi_ipow(int64_t b, int64_t e) {
  if (e < 0) return b == 1 ? 1 : b == -1 ? ((e & 1) ? -1 : 1) : 0;
  uint64_t r = 1, x = (uint64_t)b;
  for (; e; e >>= 1, x *= x) if (e & 1) r *= x;
  return (int64_t)r;
}

PI_INLINE float pi_f(uint32_t u) { float f; std::memcpy(&f, &u, 4); return f; }
PI_INLINE uint32_t pi_u(float f) { uint32_t u; std::memcpy(&u, &f, 4); return u; }
// a's magnitude with b's sign bit, NaN signs included: pi_copysign(a, x * x) is folded by
// GCC to fabs(a) (x * x "is not negative"), while x86 gives -NaN * -NaN the negative NaN
// eager keeps (float16 x * x + 1, tanh(x * x), erf(x * x) of a -NaN)
PI_INLINE float pi_copysign(float a, float b) {
  return pi_f((pi_u(a) & 0x7fffffffu) | (pi_u(b) & 0x80000000u));
}

// bfloat16 <-> float
PI_INLINE float ld_bf16(uint16_t h) { return pi_f((uint32_t)h << 16); }
// Stores differing only in the bits a NaN gets (ops.bf16_store picks one per output, as
// eager's kernel for that value would store it): st_bf16 as ATen's vectorized conversion
// (cvtfp32_bf16: every NaN is 0xffff), st_bf16_scalar as c10::BFloat16's
// round_to_nearest_even (every NaN is 0x7fc0), st_bf16_nan<bits> another constant,
// st_bf16_bits a NaN's top 16 bits (a bfloat16 NaN loaded and copied, negated, made
// absolute or selected keeps its bits, as in eager's bit-level kernels for those).
PI_INLINE uint16_t pi_bf16_rne(uint32_t u) {
  return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
template <uint16_t NAN_BITS>
PI_INLINE uint16_t st_bf16_nan(float f) {
  return (f != f) ? NAN_BITS : pi_bf16_rne(pi_u(f));
}
PI_INLINE uint16_t st_bf16(float f) { return st_bf16_nan<0xffff>(f); }
PI_INLINE uint16_t st_bf16_scalar(float f) { return st_bf16_nan<0x7fc0>(f); }
PI_INLINE uint16_t st_bf16_bits(float f) {
  return (f != f) ? (uint16_t)(pi_u(f) >> 16) : pi_bf16_rne(pi_u(f));
}
// f rounded to the nearest bfloat16 (as ld_bf16(st_bf16(f)) on every float but NaN, checked
// on all 2^32) without the narrowing and widening shifts; a NaN stays itself (not the
// canonical 0x7fc0 NaN: a select of the NaN constant made GCC spill, 25% more instructions).
// The 4096x1024 bf16 x * w + b -> silu kernel: 4013 -> 3430 us with pi_exp's mask selects.
PI_INLINE float rnd_bf16(float f) {
  const uint32_t u = pi_u(f);
  const float r = pi_f((u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u);
  return f != f ? f : r;
}

// IEEE half <-> float
PI_INLINE float ld_f16(uint16_t h) {
  const uint32_t w = (uint32_t)h << 16;
  const uint32_t sign = w & 0x80000000u;
  const uint32_t two_w = w + w;
  const float normalized = pi_f((two_w >> 4) + (0xE0u << 23)) * 0x1.0p-112f;
  const float denormalized = pi_f((two_w >> 17) | (126u << 23)) - 0.5f;
  const uint32_t bits = two_w < (1u << 27) ? pi_u(denormalized) : pi_u(normalized);
  return pi_f(sign | bits);
}
PI_INLINE uint16_t st_f16(float f) {
  float base = (std::fabs(f) * 0x1.0p+112f) * 0x1.0p-110f;
  const uint32_t w = pi_u(f);
  const uint32_t shl1_w = w + w;
  const uint32_t sign = w & 0x80000000u;
  uint32_t bias = shl1_w & 0xFF000000u;
  bias = bias < 0x71000000u ? 0x71000000u : bias;
  base = pi_f((bias >> 1) + 0x07800000u) + base;
  const uint32_t bits = pi_u(base);
  const uint32_t nonsign = ((bits >> 13) & 0x00007C00u) + (bits & 0x00000FFFu);
  return (uint16_t)((sign >> 16) | (shl1_w > 0xFF000000u ? 0x7E00u : nonsign));
}
// f rounded to the nearest half (as ld_f16(st_f16(f)) on every float but NaN, checked on all
// 2^32; a NaN stays NaN) in 9 vectorisable ops: adding and taking m = 2^(e + 13) (e: |f|'s
// exponent) leaves 11 significant bits, rounded to nearest even by the float add itself;
// m is at least 0.5 (a multiple of 2^-24, the subnormal halves); 65520 and up is infinity
// (from 2^115, infinity and NaN the exponent add wraps: m is then 0.5 and the select or the
// NaN decides). 16 ops before (integer round-to-even, a subnormal path, NaN select).
PI_INLINE float rnd_f16(float f) {
  const float a = std::fabs(f);
  const float e = pi_f((pi_u(a) & 0x7f800000u) + (13u << 23));
  const float m = e > 0.5f ? e : 0.5f;
  const float r = (a + m) - m;
  return pi_copysign(a >= 65520.0f ? INFINITY : r, f);
}

// n consecutive halves <-> floats, for a block of a row staged before the loop over it
// (emit_rows.RowEmitter.staging): GCC does not vectorise fp16 conversions, while one
// vcvtph2ps / vcvtps2ph converts 16 lanes (round to nearest even, as st_f16; NaN stays
// NaN, subnormals exact). Without F16C/AVX-512 the scalar helpers convert.
PI_INLINE void pi_ld_f16_n(const uint16_t* __restrict__ s, float* __restrict__ d, int64_t n) {
  int64_t i = 0;
#if defined(__AVX512F__)
  for (; i + 16 <= n; i += 16)
    _mm512_storeu_ps(d + i, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(s + i))));
#if defined(__AVX512BW__) && defined(__AVX512VL__)
  if (i < n) {
    const __mmask16 m = (__mmask16)((1u << (n - i)) - 1u);
    _mm512_mask_storeu_ps(d + i, m, _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, s + i)));
    return;
  }
#endif
#elif defined(__F16C__) && defined(__AVX__)
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(d + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(s + i))));
#endif
  for (; i < n; ++i) d[i] = ld_f16(s[i]);
}
PI_INLINE void pi_st_f16_n(const float* __restrict__ s, uint16_t* __restrict__ d, int64_t n) {
  int64_t i = 0;
#if defined(__AVX512F__)
  for (; i + 16 <= n; i += 16)
    _mm256_storeu_si256((__m256i*)(d + i), _mm512_cvtps_ph(_mm512_loadu_ps(s + i),
                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#if defined(__AVX512BW__) && defined(__AVX512VL__)
  if (i < n) {
    const __mmask16 m = (__mmask16)((1u << (n - i)) - 1u);
    _mm256_mask_storeu_epi16(d + i, m, _mm512_cvtps_ph(_mm512_maskz_loadu_ps(m, s + i),
                             _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    return;
  }
#endif
#elif defined(__F16C__) && defined(__AVX__)
  for (; i + 8 <= n; i += 8)
    _mm_storeu_si128((__m128i*)(d + i), _mm256_cvtps_ph(_mm256_loadu_ps(s + i),
                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#endif
  for (; i < n; ++i) d[i] = st_f16(s[i]);
}

// n floats rounded to the nearest half in place, as rnd_f16 (NaN stays NaN): one vcvtps2ph
// and one vcvtph2ps per 16 lanes where rnd_f16 is a 9-op dependency chain (a fp16 loop that
// rounds intermediates before a math call: emit_rows.RowEmitter.split_roundings)
PI_INLINE void pi_rnd_f16_n(float* __restrict__ p, int64_t n) {
  int64_t i = 0;
#if defined(__AVX512F__)
  for (; i + 16 <= n; i += 16)
    _mm512_storeu_ps(p + i, _mm512_cvtph_ps(_mm512_cvtps_ph(
        _mm512_loadu_ps(p + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)));
#elif defined(__F16C__) && defined(__AVX__)
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(p + i, _mm256_cvtph_ps(_mm256_cvtps_ph(
        _mm256_loadu_ps(p + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)));
#endif
  for (; i < n; ++i) p[i] = rnd_f16(p[i]);
}

// a * b + c rounded once where the target has FMA (-march=native), else twice. Kernels
// build with -ffp-contract=off (compiler.py): g++ fuses nothing by itself, so every fma
// eager's own kernels make is written out, here and in ops.py.
#if defined(__FMA__) || defined(__aarch64__)
#define PI_FMA(a, b, c) std::fma(a, b, c)
#else
#define PI_FMA(a, b, c) ((a) * (b) + (c))
#endif
// math
// exp(r) for the reduced argument r in [-ln2/2, ln2/2]: pi_exp_core's and pi_erfc_core's
PI_INLINE float pi_exp_poly(float r) {
  float p = 1.9875691500e-4f;
  p = PI_FMA(p, r, 1.3981999507e-3f);
  p = PI_FMA(p, r, 8.3334519073e-3f);
  p = PI_FMA(p, r, 4.1665795894e-2f);
  p = PI_FMA(p, r, 1.6666665459e-1f);
  p = PI_FMA(p, r, 5.0000001201e-1f);
  return PI_FMA(p, r * r, r) + 1.0f;
}
// exp as 2^n * P(r), 2^n applied as two factors so n reaches the denormals: x below
// ln(FLT_MIN) (-87.34) gives a denormal as eager does (only those lanes pay for denormal
// arithmetic). Below -104 the result is 0 and the lane computes exp(0) instead: masked
// softmax feeds exp(-inf) to half its lanes.
PI_INLINE float pi_exp_core(float x) {
  float xc = x < -104.0f ? 0.0f : x;
  xc = xc > 88.7228394f ? 88.7228394f : xc;
  const float n = PI_FMA(xc, 1.44269504088896341f, 12582912.0f) - 12582912.0f;
  const float r = PI_FMA(n, 2.12194440e-4f, PI_FMA(-n, 0.693359375f, xc));
  const float p = pi_exp_poly(r);
  const int32_t ni = (int32_t)n, n1 = ni >> 1, n2 = ni - n1;
  return p * pi_f((uint32_t)(n1 + 127) << 23) * pi_f((uint32_t)(n2 + 127) << 23);
}
PI_INLINE float pi_exp(float x) {
  const float res = pi_exp_core(x);
  return x > 88.7228394f ? INFINITY : (x < -104.0f ? 0.0f : res);
}
// pi_exp for a divisor (silu, sigmoid: x / (1 + exp(-x))), the same bits with the selects
// as bit masks: with ?: GCC distributes the division over them (four masked vdivps a vector
// pair, not two; the bf16 silu kernel 1.04x). Plain exp keeps ?: (softmax fp16 0.82x with
// the masks).
PI_INLINE float pi_exp_d(float x) {
  const float res = pi_exp_core(x);
  const uint32_t keep = -(uint32_t)!(x < -104.0f), big = -(uint32_t)(x > 88.7228394f);
  return pi_f((pi_u(res) & keep & ~big) | (0x7f800000u & big));
}
PI_INLINE float pi_tanh(float x) {
  const float a = std::fabs(x), s = x * x;
  float p = PI_FMA(-5.70498872745e-3f, s, 2.06390887954e-2f);
  p = PI_FMA(p, s, -5.37397155531e-2f);
  p = PI_FMA(p, s, 1.33314422036e-1f);
  p = PI_FMA(p, s, -3.33332819422e-1f);
  p = PI_FMA(p * s, a, a);
  const float q = 1.0f - 2.0f / (pi_exp(a + a) + 1.0f);
  return pi_copysign(a < 0.625f ? p : q, x);  // odd: tanh(-0.0) is -0.0
}
// sigmoid of a NaN is the NaN of the other sign, as eager's 1 / (1 + exp(-x)) gives on x86
// (the NaN operand propagates with its sign through each op); GCC folds our -x into the
// exponent's constants, so the sign is set explicitly (copysign and signbit read it)
PI_INLINE float pi_sigmoid(float x) {
  const float r = 1.0f / (1.0f + pi_exp_d(-x));
  return x != x ? -x : r;
}
// erfc in double, rounded once: within about half an ulp (glibc's float erfcf is up to
// 1.6 ulps off, eager's Sleef 0.7; a matmul that cancels amplifies the difference: 82806)
PI_INLINE float pi_erfc(float x) { return (float)std::erfc((double)x); }
PI_INLINE double pi_erfc(double x) { return std::erfc(x); }
// the rounding error of h = a * a (a * a = h + l exactly): exp(-a^2) for a up to 4 is a
// few ulps only from the exact square (h alone is up to 1e-6 off: 16 ulps)
PI_INLINE float pi_sq_lo(float a, float h) {
#if defined(__FMA__) || defined(__aarch64__)
  return std::fma(a, a, -h);
#else  // Dekker: a split into 12-bit halves, whose products are exact
  const float ah = pi_f(pi_u(a) & 0xfffff000u), al = a - ah;
  return ((ah * ah - h) + 2.0f * ah * al) + al * al;
#endif
}
// erf for |a| < 1 as a + a y(a^2), y = erf(a) / a - 1 a degree-6 polynomial (our float64
// least-squares fit, relative 1.2e-9): ~1 ulp, a denormal a rounds once
PI_INLINE float pi_erf_small(float a) {
  const float z = a * a;
  float y = 7.854219439e-05f;
  y = PI_FMA(y, z, -8.010310703e-04f);
  y = PI_FMA(y, z, 5.188342649e-03f);
  y = PI_FMA(y, z, -2.685382031e-02f);
  y = PI_FMA(y, z, 1.128358543e-01f);
  y = PI_FMA(y, z, -3.761262596e-01f);
  y = PI_FMA(y, z, 1.283791661e-01f);
  return PI_FMA(a, y, a);
}
// erfc(a) for a in [0, 4] (past 4 it is below the 2^-25 that 1 - erfc rounds away) as
// exp(-a^2) R(a), R = erfc(a) exp(a^2) fitted as t P(t), t = 1 / (1 + a / 2), P of degree
// 8 (our float64 least-squares fit, relative 1.2e-8; evaluated in float 3.4e-7); h + l = a^2
// exactly (pi_sq_lo), and exp(-h - l) = exp(-h) (1 - l) as |l| < 1e-6
PI_INLINE float pi_erfc_uv(float a, float h, float l, float* v) {
  const float t = 1.0f / PI_FMA(0.5f, a, 1.0f);
  float p = -4.261611402e-02f;
  p = PI_FMA(p, t, 1.989218146e-01f);
  p = PI_FMA(p, t, -2.960256934e-01f);
  p = PI_FMA(p, t, 3.941052407e-02f);
  p = PI_FMA(p, t, 1.554371864e-01f);
  p = PI_FMA(p, t, 1.158571988e-01f);
  p = PI_FMA(p, t, 2.683685720e-01f);
  p = PI_FMA(p, t, 2.782761455e-01f);
  p = PI_FMA(p, t, 2.823703885e-01f);
  // exp(-h) for h in [0, 16]: pi_exp_core's reduction and polynomial, 2^n one factor
  const float n = PI_FMA(h, -1.44269504088896341f, 12582912.0f) - 12582912.0f;
  const float r = PI_FMA(n, 2.12194440e-4f, PI_FMA(-n, 0.693359375f, -h));
  *v = t * p;
  return pi_exp_poly(r) * pi_f((uint32_t)((int32_t)n + 127) << 23) * (1.0f - l);
}
// erfc(a) = u v (pi_erfc_uv); erf's 1 - u v is one fma
PI_INLINE float pi_erfc_core(float a, float h, float l) {
  float v;
  const float u = pi_erfc_uv(a, h, l, &v);
  return u * v;
}
// erf to ~1 ulp (eager's Sleef erf 0.6): below 1 a polynomial, above 1 - erfc(|x|), which
// rounds to exactly 1 past 3.92 as eager's does. Both halves run and one is selected, so
// the loop vectorises.
PI_INLINE float pi_erf(float x) {
  const float a = std::fabs(x);
  const float c = a > 4.0f ? 4.0f : a;  // NaN passes and stays NaN
  const float h = c * c;
  float v;
  const float u = pi_erfc_uv(c, h, pi_sq_lo(c, h), &v);
  const float big = PI_FMA(-u, v, 1.0f);
  const float e = a < 1.0f ? pi_erf_small(a) : big;
  return pi_copysign(e, x);  // odd: erf(-0.0) is -0.0
}
// 1 + erf(x / sqrt 2) (twice the normal CDF, GELU's factor) as erfc(|x| / sqrt 2) or 2 minus
// it, not as 1 + erf, which cancels for negative x (eager's GELU is 100% off at x = -5.5
// and 2% at -4: 1 + erf has erf's absolute error); the square is taken from x, as
// x / sqrt 2 rounded is ~1e-7 off (2 ulps of exp(-x^2 / 2) per unit of x^2). Where eager's
// 1 + erf is exactly 0 (erfc below 2^-25, x below -5.54), so is ours: GELU's tail is -0.0.
PI_INLINE float pi_cdf2(float x) {
  const float ax = std::fabs(x);
  const float xc = ax > 5.65685425f ? 5.65685425f : ax;  // |x| / sqrt 2 <= 4; NaN stays
  const float h = xc * xc;
  float c = pi_erfc_core(xc * 0.70710678118654752f, 0.5f * h, 0.5f * pi_sq_lo(xc, h));
  c = c <= 0x1p-25f ? 0.0f : c;
  return x > 0.0f ? 2.0f - c : c;
}
// GELU as eager computes it: x * (1 + erf(x / sqrt 2)) * 0.5 (so x above FLT_MAX / 2
// overflows to inf and the far negative tail is -0.0). For float32 and bfloat16 eager runs
// oneDNN's GELU on contiguous tensors, which gives NaN at +inf (`inf_nan`); float16 does not.
// onednn: eager's oneDNN GELU (float32/bfloat16, more than one element): NaN at +inf, and
// x (1 + erf) overflows before the halving near the float max; else ATen's, halved first
PI_INLINE float pi_gelu(float x, bool onednn) {
  const float e = pi_cdf2(x);
  return onednn ? (x == INFINITY ? NAN : x * e * 0.5f) : (x * 0.5f) * e;
}
// tanh GELU as eager computes it, 0.5 x (1 + tanh(inner)), where 1 + tanh(inner) is
// 2 sigmoid(2 inner) rounded through tanh's value ((s - 1) + 1): one exp and one division,
// and the tail where tanh rounds to -1 is exactly -0.0 as in eager.
PI_INLINE float pi_gelu_tanh(float x) {
  const float inner = 0.7978845608028654f * PI_FMA(0.044715f * x * x, x, x);
  const float s = 2.0f / (1.0f + pi_exp(-2.0f * inner));
  return (0.5f * x) * ((s - 1.0f) + 1.0f);
}
// maximum/minimum propagate NaN; of 0.0 and -0.0 they return the second, as eager's float32
// kernel does
template <typename T> PI_INLINE T pi_max(T a, T b) { return (a > b || a != a) ? a : b; }
template <typename T> PI_INLINE T pi_min(T a, T b) { return (a < b || a != a) ? a : b; }
template <typename T> PI_INLINE T pi_abs(T a) { return a < 0 ? -a : a; }
// sqrt/log/log2 of a negative number: eager's float32/float64 NaN is positive, the
// vectorized libm's negative (eager's float16/bfloat16 too: ops.py); copysign and signbit
// read the sign
template <typename T> PI_INLINE T pi_sqrt(T x) { return x < 0 ? (T)NAN : std::sqrt(x); }
template <typename T> PI_INLINE T pi_log(T x) { return x < 0 ? (T)NAN : std::log(x); }
template <typename T> PI_INLINE T pi_log2(T x) { return x < 0 ? (T)NAN : std::log2(x); }
// pow of a finite negative base and a finite non-integer exponent: eager's vectorized
// float32/float64 NaN is positive (its scalar tail's negative), std::pow's negative
template <typename T> PI_INLINE T pi_pow(T x, T y) {
  return (x < 0 && x > -INFINITY && std::isfinite(y) && y != std::trunc(y)) ? (T)NAN : std::pow(x, y);
}
// sign(NaN) is 0, as eager's (0 < a) - (a < 0)
template <typename T> PI_INLINE T pi_sign(T a) { return (T)((a > 0) - (a < 0)); }
// float -> integer as eager converts on x86 (cvttss2si): NaN and values out of the 32- or
// 64-bit range give that range's minimum; narrower integers wrap from the 32-bit result.
// A plain C++ cast is undefined there. GCC (-fno-trapping-math) also folds (float)(int)x
// into truncf(x), which is -0.0 for x in (-1, 0) where the integer 0 converts to +0.0
// (-1 / x.long() gave +inf, eager -inf), and it drops a "+ 0.0f" after the conversion as
// a no-op: those x give the integer 0 explicitly, so a folded trunc never meets them.
template <typename T> PI_INLINE int64_t pi_i64(T x) {
  if constexpr (std::is_floating_point<T>::value)
    return (x >= -0x1p63f && x < 0x1p63f) ? (std::fabs(x) < 1 ? 0 : (int64_t)x) : INT64_MIN;
  else
    return (int64_t)x;
}
template <typename T> PI_INLINE int32_t pi_i32(T x) {
  if constexpr (std::is_floating_point<T>::value)
    return (x >= -0x1p31f && x < 0x1p31f) ? (std::fabs(x) < 1 ? 0 : (int32_t)x) : INT32_MIN;
  else
    return (int32_t)x;
}
"""

# Index scans (codegen/cpp_indexing.py): whether any index of an input with `nd` dims
# (sizes then strides at `meta`) lies outside [0, bound), or [-bound, bound) when `wrap`.
PRELUDE += r"""
template <typename T>
static bool pi_index_bad(const T* p, const int64_t* meta, int nd, int64_t bound, bool wrap) {
  int64_t n = 1, off = 0, pos[16] = {0};
  for (int d = 0; d < nd; ++d) n *= meta[d];
  const int64_t lo = wrap ? -bound : 0;
  for (int64_t e = 0; e < n; ++e) {
    const int64_t v = (int64_t)p[off];
    if (v < lo || v >= bound) return true;
    for (int d = nd - 1; d >= 0; --d) {
      if (++pos[d] < meta[d]) { off += meta[nd + d]; break; }
      off -= (meta[d] - 1) * meta[nd + d];
      pos[d] = 0;
    }
  }
  return false;
}
"""
