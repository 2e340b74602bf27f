"""Flash attention's backward on the CPU as one native call.

``aten._scaled_dot_product_flash_attention_for_cpu_backward`` is about 70% of an SDPA's
forward + backward time at the zoo's attention shape (B=4, H=4, S=128, D=16: ~620 us of
thread CPU time), twice per transformer training step, and Inductor calls the same ATen
kernel. :func:`flash_attention_backward` has that op's signature and results (values,
shapes and strides) and computes them in hand-written C++ (:data:`SOURCE`):

per (batch, head), in OpenMP's static schedule over batch x heads (each thread writes
only its heads' gradients: no races, no atomics), and per block of keys, for each block
of queries: S = scale Q K^T, P = exp(S + mask - lse) (the forward's logsumexp: no
softmax recomputed), dV += P^T dO, dS = P (dO V^T - rowsum(dO * O)), dK += dS^T Q,
dQ += dS K; dQ and dK are scaled once at the end. Everything is computed in float32 on
staged float32 copies of the head's rows (bfloat16/float16 converted once, the head dim
padded with zeros to 16/32/64/128, a compile-time constant of the matmul tiles), so
the reduced types round once at the store (ATen rounds P and dS to the input type
before its matmuls, and dQ/dK/dV per block of 512 keys). The matmuls are register
tiles of GCC vector types (16 floats: one AVX-512 register), contracted to FMAs; with
AVX-512 the exp is 13 instructions (vscalefps) and K/V and dK/dV are transposed in 16 x 16
blocks of shuffles. The matmuls after the exp stop, per block of queries, at the last key
with a nonzero P: a causal or padding mask given as a tensor (GPT-2, LLaMA) skips its
masked blocks as ``is_causal`` does. Without AVX-512 the same code builds (plain loops for
the exp and the transposes; the tests pass with ``-mno-avx512f``).

At the zoo shape, one thread: ~600 -> ~285 us (2.1x); the zoo's BERT/GPT-2/LLaMA
training step 1.07-1.12x with the pypto backend (the branch's report, k17b).

Masks as ATen's CPU kernel takes them: none, ``is_causal`` (key j <= query i, top-left,
also when Lq != Lk), an additive mask of the query's dtype or float32 of 2 or 4 dims
broadcast to [B, H, Lq, Lk]; a fully masked row has a logsumexp of 0 and gets zero
gradients, as in ATen. What it does not take (:func:`eligible` says why) goes to ATen:
dropout, bool/float64 masks (ATen's backward adds those as numbers), head dims above
128, inner strides other than 1 (a broadcast grad_out is copied first, as ATen does),
empty tensors.
"""
from __future__ import annotations

import ctypes
import math

import torch

from . import alloc, attention, compiler, native_call
from .prelude import PRELUDE

NATIVE_BACKWARD = True  # False: flash_attention_backward calls ATen's op (the A/B switch)

ATEN_BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default
DTYPES = {torch.float32: 0, torch.bfloat16: 2, torch.float16: 3}
MAX_HEAD_DIM = 128

SOURCE = PRELUDE + r"""
#include <omp.h>

// 16 floats: one AVX-512 register (two AVX2 ones elsewhere); unaligned access through pa_vu
PA_INSTANCE
// PA_DT >= 0: the library runs that dtype only, PA_DV > 0: that head-dim block only
// (native_kernel); else every instance, chosen per call
#if PA_DT >= 0
#define PA_BY_DT(...) { constexpr int DT = PA_DT; __VA_ARGS__; }
#else
#define PA_BY_DT(...) switch (J.dt) { \
    case 0: { constexpr int DT = 0; __VA_ARGS__; break; } \
    case 2: { constexpr int DT = 2; __VA_ARGS__; break; } \
    default: { constexpr int DT = 3; __VA_ARGS__; } }
#endif

typedef float pa_v __attribute__((vector_size(64)));
typedef float pa_vu __attribute__((vector_size(64), aligned(4)));
PI_INLINE pa_v pa_ld(const float* p) { return *(const pa_vu*)p; }
PI_INLINE void pa_st(float* p, pa_v v) { *(pa_vu*)p = v; }
// (not z + s: 0 + s is an add, -0.0 + 0.0 being +0.0)
PI_INLINE pa_v pa_splat(float s) { return (pa_v){s, s, s, s, s, s, s, s, s, s, s, s, s, s, s, s}; }

static const int64_t PA_BM = 32;   // queries per block (rows are padded to 4)
static const int64_t PA_BN = 256;  // keys per block at most; the P and dS blocks' row stride
// (a constant: pa_dq's 16 rows are offsets of one pointer, not 16 registers)

PI_INLINE int64_t pa_up16(int64_t n) { return (n + 15) & ~(int64_t)15; }

template <int DT> PI_INLINE float pa_ldx(const void* p, int64_t i) {
  if constexpr (DT == 0) return ((const float*)p)[i];
  else if constexpr (DT == 2) return ld_bf16(((const uint16_t*)p)[i]);
  else return ld_f16(((const uint16_t*)p)[i]);
}
template <int DT> PI_INLINE void pa_stx(void* p, int64_t i, float f) {
  if constexpr (DT == 0) ((float*)p)[i] = f;
  else if constexpr (DT == 2) ((uint16_t*)p)[i] = st_bf16(f);
  else ((uint16_t*)p)[i] = st_f16(f);
}

// ---- matmul tiles on the staged float32 blocks ----------------------------------------
// C[4 rows][NV vectors] = alpha * A[4][DP] Bt[DP][NV*16] (DS: C = P * (that - Di[row]))
template <int DV, int NV, bool DS>
PI_INLINE void pa_rows_tile(const float* A, const float* Bt, int64_t ldb, float* C,
                            int64_t ldc, float alpha, const float* P, const float* Di) {
  constexpr int DP = DV * 16;
  pa_v acc[4][NV];
#pragma GCC unroll 4
  for (int r = 0; r < 4; ++r)
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) acc[r][v] = pa_splat(0.0f);
#pragma GCC unroll 4
  for (int d = 0; d < DP; ++d) {
    pa_v b[NV];
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) b[v] = pa_ld(Bt + d * ldb + 16 * v);
#pragma GCC unroll 4
    for (int r = 0; r < 4; ++r) {
      const pa_v a = pa_splat(A[r * DP + d]);
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) acc[r][v] += a * b[v];
    }
  }
#pragma GCC unroll 4
  for (int r = 0; r < 4; ++r)
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) {
      if constexpr (DS)
        pa_st(C + r * ldc + 16 * v, pa_ld(P + r * ldc + 16 * v) * (acc[r][v] - Di[r]));
      else
        pa_st(C + r * ldc + 16 * v, acc[r][v] * alpha);
    }
}

// C[rows][nc] for rows a multiple of 4, nc of 16
template <int DV, bool DS>
static __attribute__((noinline)) void pa_rows(const float* A, const float* Bt, int64_t ldb,
                                              float* C, int64_t nc, int64_t rows, float alpha,
                                              const float* P, const float* Di) {
  constexpr int DP = DV * 16;
  for (int64_t r = 0; r < rows; r += 4) {
    const float* a = A + r * DP;
    float* c = C + r * PA_BN;
    const float* p = DS ? P + r * PA_BN : nullptr;
    const float* di = DS ? Di + r : nullptr;
    int64_t j = 0;
    for (; j + 64 <= nc; j += 64) pa_rows_tile<DV, 4, DS>(a, Bt + j, ldb, c + j, PA_BN, alpha, DS ? p + j : p, di);
    switch ((nc - j) / 16) {
      case 3: pa_rows_tile<DV, 3, DS>(a, Bt + j, ldb, c + j, PA_BN, alpha, DS ? p + j : p, di); break;
      case 2: pa_rows_tile<DV, 2, DS>(a, Bt + j, ldb, c + j, PA_BN, alpha, DS ? p + j : p, di); break;
      case 1: pa_rows_tile<DV, 1, DS>(a, Bt + j, ldb, c + j, PA_BN, alpha, DS ? p + j : p, di); break;
      default: break;
    }
  }
}

// Ct[4][NV*16] (ld ldc) += A[rows][4]^T P[rows][NV*16]  (A: ld DP, P: ld ldp)
template <int NV>
PI_INLINE void pa_acc_tile(float* Ct, int64_t ldc, const float* A, int64_t DP, const float* P,
                           int64_t ldp, int64_t rows) {
  pa_v acc[4][NV];
#pragma GCC unroll 4
  for (int d = 0; d < 4; ++d)
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) acc[d][v] = pa_ld(Ct + d * ldc + 16 * v);
  for (int64_t i = 0; i < rows; ++i) {
    pa_v p[NV];
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) {
      p[v] = pa_ld(P + i * ldp + 16 * v);
#if defined(__AVX512F__)  // (a 64-byte vector is one register only there)
      __asm__("" : "+v"(p[v]));  // in a register: not folded into each of the 4 FMAs
#endif
    }
#pragma GCC unroll 4
    for (int d = 0; d < 4; ++d) {
      const pa_v a = pa_splat(A[i * DP + d]);
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) acc[d][v] += a * p[v];
    }
  }
#pragma GCC unroll 4
  for (int d = 0; d < 4; ++d)
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) pa_st(Ct + d * ldc + 16 * v, acc[d][v]);
}

// Ct[DP][nc] (ld ldc) += A[rows][DP]^T P[rows][nc]
static __attribute__((noinline)) void pa_acc(float* Ct, int64_t ldc, const float* A, int64_t DP,
                                             const float* P, int64_t nc, int64_t rows) {
  for (int64_t d = 0; d < DP; d += 4) {
    int64_t j = 0;
    for (; j + 64 <= nc; j += 64) pa_acc_tile<4>(Ct + d * ldc + j, ldc, A + d, DP, P + j, PA_BN, rows);
    switch ((nc - j) / 16) {
      case 3: pa_acc_tile<3>(Ct + d * ldc + j, ldc, A + d, DP, P + j, PA_BN, rows); break;
      case 2: pa_acc_tile<2>(Ct + d * ldc + j, ldc, A + d, DP, P + j, PA_BN, rows); break;
      case 1: pa_acc_tile<1>(Ct + d * ldc + j, ldc, A + d, DP, P + j, PA_BN, rows); break;
      default: break;
    }
  }
}

// dQ[R][DP] += dS[R][nj] (ld lds) Kf[nj][DP]
template <int DV, int R>
PI_INLINE void pa_dq_tile(float* dQ, const float* dS, int64_t lds, const float* Kf, int64_t nj) {
  constexpr int DP = DV * 16;
  pa_v acc[R][DV];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int v = 0; v < DV; ++v) acc[r][v] = pa_ld(dQ + r * DP + 16 * v);
  for (int64_t j = 0; j < nj; ++j) {
    pa_v k[DV];
#pragma GCC unroll 8
    for (int v = 0; v < DV; ++v) k[v] = pa_ld(Kf + j * DP + 16 * v);
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const pa_v s = pa_splat(dS[r * lds + j]);
#pragma GCC unroll 8
      for (int v = 0; v < DV; ++v) acc[r][v] += s * k[v];
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int v = 0; v < DV; ++v) pa_st(dQ + r * DP + 16 * v, acc[r][v]);
}

// rows: a multiple of 4 (tiles of R rows, then of 4)
template <int DV>
static __attribute__((noinline)) void pa_dq(float* dQ, const float* dS, int64_t nc,
                                            const float* Kf, int64_t rows) {
  constexpr int R = DV == 1 ? 16 : DV == 2 ? 8 : DV == 4 ? 4 : 2;
  int64_t r = 0;
  for (; r + R <= rows; r += R)
    pa_dq_tile<DV, R>(dQ + r * DV * 16, dS + r * PA_BN, PA_BN, Kf, nc);
  for (; r < rows; r += 4)
    pa_dq_tile<DV, 4>(dQ + r * DV * 16, dS + r * PA_BN, PA_BN, Kf, nc);
}

// ---- staging -----------------------------------------------------------------------------
// dst[i][0:DP] = src rows (row stride rs) as float, zero past D and past rows
template <int DT>
static void pa_stage_rows(float* dst, int64_t DP, const void* src, int64_t rs, int64_t rows,
                          int64_t rows_pad, int64_t D) {
  for (int64_t i = 0; i < rows; ++i) {
    float* d = dst + i * DP;
    for (int64_t c = 0; c < D; ++c) d[c] = pa_ldx<DT>(src, i * rs + c);
    for (int64_t c = D; c < DP; ++c) d[c] = 0.0f;
  }
  if (rows_pad > rows) memset(dst + rows * DP, 0, (size_t)((rows_pad - rows) * DP) * 4);
}
#if defined(__AVX512F__)
// d[c * ds + j] = scale * s[j * ss + c] for j, c < 16: three rounds of shuffles
static inline void pa_tr16(const float* s, int64_t ss, float* d, int64_t ds, float scale) {
  __m512 r[16], t[16];
  for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_ps(s + i * ss);
  for (int i = 0; i < 8; ++i) {  // lane L: rows 2i, 2i+1 of columns 4L.. interleaved
    t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int g = 0; g < 4; ++g) {  // r[4g + k], lane L: column 4L + k of rows 4g..4g+3
    const __m512d a = _mm512_castps_pd(t[4 * g]), b = _mm512_castps_pd(t[4 * g + 2]);
    const __m512d c = _mm512_castps_pd(t[4 * g + 1]), e = _mm512_castps_pd(t[4 * g + 3]);
    r[4 * g] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, b));
    r[4 * g + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, b));
    r[4 * g + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(c, e));
    r[4 * g + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(c, e));
  }
  const __m512 f = _mm512_set1_ps(scale);
  for (int k = 0; k < 4; ++k) {  // the 128-bit lanes of the four groups, transposed
    const __m512 a = _mm512_shuffle_f32x4(r[k], r[4 + k], 0x44);
    const __m512 b = _mm512_shuffle_f32x4(r[k], r[4 + k], 0xEE);
    const __m512 c = _mm512_shuffle_f32x4(r[8 + k], r[12 + k], 0x44);
    const __m512 e = _mm512_shuffle_f32x4(r[8 + k], r[12 + k], 0xEE);
    _mm512_storeu_ps(d + k * ds, _mm512_mul_ps(f, _mm512_shuffle_f32x4(a, c, 0x88)));
    _mm512_storeu_ps(d + (4 + k) * ds, _mm512_mul_ps(f, _mm512_shuffle_f32x4(a, c, 0xDD)));
    _mm512_storeu_ps(d + (8 + k) * ds, _mm512_mul_ps(f, _mm512_shuffle_f32x4(b, e, 0x88)));
    _mm512_storeu_ps(d + (12 + k) * ds, _mm512_mul_ps(f, _mm512_shuffle_f32x4(b, e, 0xDD)));
  }
}
#endif
// dst[c][j] (ld) = src[j][c] for j < cols, c < D; zero elsewhere in [DP][ld]
template <int DT>
static void pa_stage_t(float* dst, int64_t ld, int64_t DP, const void* src, int64_t rs,
                       int64_t cols, int64_t D) {
  int64_t j0 = 0, c0 = 0;
#if defined(__AVX512F__)
  if constexpr (DT == 0) {  // whole 16 x 16 blocks
    for (c0 = 0; c0 + 16 <= D; c0 += 16)
      for (j0 = 0; j0 + 16 <= cols; j0 += 16)
        pa_tr16((const float*)src + j0 * rs + c0, rs, dst + c0 * ld + j0, ld, 1.0f);
    j0 = cols & ~(int64_t)15;
  }
#endif
  for (int64_t c = 0; c < D; ++c) {  // the rest: columns j0.. of rows < c0, all of rows c0..
    for (int64_t j = c < c0 ? j0 : 0; j < cols; ++j) dst[c * ld + j] = pa_ldx<DT>(src, j * rs + c);
    for (int64_t j = cols; j < ld; ++j) dst[c * ld + j] = 0.0f;
  }
  if (DP > D) memset(dst + D * ld, 0, (size_t)((DP - D) * ld) * 4);
}
// Di[i] = rowsum(dO * O) of the staged rows (zero-padded to DP: padded rows give 0)
static void pa_rowsum(float* Di, const float* dOf, const float* Of, int64_t DP, int64_t rows) {
  for (int64_t i = 0; i < rows; ++i) {
    pa_v acc = pa_ld(dOf + i * DP) * pa_ld(Of + i * DP);
    for (int64_t c = 16; c < DP; c += 16) acc += pa_ld(dOf + i * DP + c) * pa_ld(Of + i * DP + c);
    float sum = 0.0f;
    for (int v = 0; v < 16; ++v) sum += acc[v];
    Di[i] = sum;
  }
}
// out rows (row stride rs) = scale * src (transposed: src[c][j], ld; else src[j][c], ld)
template <int DT>
static void pa_store(void* out, int64_t rs, const float* src, int64_t ld, bool transposed,
                     int64_t rows, int64_t D, float scale) {
  int64_t j0 = 0, c0 = 0;
#if defined(__AVX512F__)
  if (DT == 0 && transposed) {  // whole 16 x 16 blocks
    for (c0 = 0; c0 + 16 <= D; c0 += 16)
      for (j0 = 0; j0 + 16 <= rows; j0 += 16)
        pa_tr16(src + c0 * ld + j0, ld, (float*)out + j0 * rs + c0, rs, scale);
    j0 = rows & ~(int64_t)15;
  }
#endif
  if (!transposed) {  // (a loop of its own: it vectorises)
    for (int64_t j = 0; j < rows; ++j)
      for (int64_t c = 0; c < D; ++c) pa_stx<DT>(out, j * rs + c, scale * src[j * ld + c]);
    return;
  }
  for (int64_t j = 0; j < rows; ++j)
    for (int64_t c = j < j0 ? c0 : 0; c < D; ++c)
      pa_stx<DT>(out, j * rs + c, scale * src[c * ld + j]);
}
static void pa_mask_row(float* dst, const void* m, int64_t sn, int64_t n, int mdt) {
  if (mdt == 0) {
    const float* f = (const float*)m;
    if (sn == 1) { memcpy(dst, f, (size_t)n * 4); return; }
    for (int64_t j = 0; j < n; ++j) dst[j] = f[j * sn];
  } else {
    const uint16_t* h = (const uint16_t*)m;
    if (mdt == 2) for (int64_t j = 0; j < n; ++j) dst[j] = ld_bf16(h[j * sn]);
    else for (int64_t j = 0; j < n; ++j) dst[j] = ld_f16(h[j * sn]);
  }
}

// row[j] = exp(row[j] (+ mask[j]) - l) for j < n
#if defined(__AVX512F__)
// pi_exp's reduction and polynomial, 2^n applied by vscalefps (denormals and 0 below
// -87 as exp gives them; -inf gives 0, NaN stays NaN): 13 instructions where GCC's
// vectorised pi_exp takes ~25 (the exp pass was ~20% of the zoo shape's time)
PI_INLINE __m512 pa_exp512(__m512 x) {
  x = _mm512_min_ps(_mm512_set1_ps(89.0f), _mm512_max_ps(_mm512_set1_ps(-104.0f), x));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fmadd_ps(n, _mm512_set1_ps(2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_add_ps(_mm512_fmadd_ps(p, _mm512_mul_ps(r, r), r), _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}
#endif
// returns a bound past the row's last nonzero (a multiple of 16, or n): the columns
// after it are 0 in P and so in dS, and the matmuls after the exp can stop there (a causal
// or padding mask given as a tensor then skips its masked blocks as is_causal does)
template <bool MASK>
static int64_t pa_exp_row(float* row, const float* mask, float l, int64_t n) {
  int64_t last = 0;
#if defined(__AVX512F__)
  const __m512 vl = _mm512_set1_ps(l);
  for (int64_t j = 0; j < n; j += 16) {
    const __mmask16 k = n - j >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (n - j)) - 1u);
    __m512 x = _mm512_maskz_loadu_ps(k, row + j);
    if (MASK) x = _mm512_add_ps(x, _mm512_maskz_loadu_ps(k, mask + j));
    const __m512 e = pa_exp512(_mm512_sub_ps(x, vl));
    _mm512_mask_storeu_ps(row + j, k, e);
    if (_mm512_mask_cmp_ps_mask(k, e, _mm512_setzero_ps(), _CMP_NEQ_UQ)) last = j + 16;
  }
  return last < n ? last : n;
#else
#pragma omp simd
  for (int64_t j = 0; j < n; ++j) row[j] = pi_exp((MASK ? row[j] + mask[j] : row[j]) - l);
  for (last = n; last > 0 && row[last - 1] == 0.0f; --last) {}
  return last;
#endif
}

// ---- one (batch, head) -----------------------------------------------------------------
struct PaJob {
  void* const* p;  // grad_out, q, k, v, out, lse, mask, grad_q, grad_k, grad_v
  const int64_t* s;  // native_call's numbers (see pa_flash_backward_call)
  int64_t B, H, M, N, D, Mp, BN;
  float scale;
  bool causal;
  int dt, mdt;
};

static size_t pa_workspace_floats(int64_t Mp, int64_t DP, int64_t BN) {
  return (size_t)(3 * Mp * DP + 2 * Mp + 5 * DP * BN + 2 * PA_BM * PA_BN + BN + 64);
}

template <int DT>
static void pa_stage_head(const PaJob& J, int64_t DP, int64_t b, int64_t h, float* Qf,
                          float* dOf, float* Of, float* lse, float* Di) {
  const int64_t* s = J.s;
  const int es = DT == 0 ? 4 : 2;
  const char* go = (const char*)J.p[0] + (b * s[5] + h * s[6]) * es;
  const char* q = (const char*)J.p[1] + (b * s[8] + h * s[9]) * es;
  const char* o = (const char*)J.p[4] + (b * s[17] + h * s[18]) * es;
  pa_stage_rows<DT>(Qf, DP, q, s[10], J.M, J.Mp, J.D);
  pa_stage_rows<DT>(dOf, DP, go, s[7], J.M, J.Mp, J.D);
  pa_stage_rows<DT>(Of, DP, o, s[19], J.M, J.Mp, J.D);
  pa_rowsum(Di, dOf, Of, DP, J.Mp);
  const float* l = (const float*)J.p[5] + b * s[20] + h * s[21];
  for (int64_t i = 0; i < J.M; ++i) lse[i] = l[i * s[22]];
  for (int64_t i = J.M; i < J.Mp; ++i) lse[i] = 0.0f;
}

template <int DT>
static void pa_stage_keys(const PaJob& J, int64_t DP, int64_t b, int64_t h, int64_t n0,
                          int64_t nk, int64_t ld, float* Kt, float* Vt, float* Kf) {
  const int64_t* s = J.s;
  const int es = DT == 0 ? 4 : 2;
  const char* k = (const char*)J.p[2] + (b * s[11] + h * s[12] + n0 * s[13]) * es;
  const char* v = (const char*)J.p[3] + (b * s[14] + h * s[15] + n0 * s[16]) * es;
  pa_stage_t<DT>(Kt, ld, DP, k, s[13], nk, J.D);
  pa_stage_t<DT>(Vt, ld, DP, v, s[16], nk, J.D);
  pa_stage_rows<DT>(Kf, DP, k, s[13], nk, ld, J.D);
}

template <int DT>
static void pa_store_keys(const PaJob& J, int64_t b, int64_t h, int64_t n0, int64_t nk,
                          int64_t ld, const float* dKt, const float* dVt) {
  const int64_t* s = J.s;
  const int es = DT == 0 ? 4 : 2;
  char* gk = (char*)J.p[8] + (b * s[30] + h * s[31] + n0 * s[32]) * es;
  char* gv = (char*)J.p[9] + (b * s[33] + h * s[34] + n0 * s[35]) * es;
  pa_store<DT>(gk, s[32], dKt, ld, true, nk, J.D, J.scale);
  pa_store<DT>(gv, s[35], dVt, ld, true, nk, J.D, 1.0f);
}

template <int DV>
static void pa_head(const PaJob& J, int64_t b, int64_t h, float* ws) {
  constexpr int64_t DP = DV * 16;
  const int64_t M = J.M, N = J.N, Mp = J.Mp, BN = J.BN;
  const int64_t* s = J.s;
  float* Qf = ws;
  float* dOf = Qf + Mp * DP;
  float* dQ = dOf + Mp * DP;
  float* lse = dQ + Mp * DP;
  float* Di = lse + Mp;
  float* Kt = Di + Mp;
  float* Vt = Kt + DP * BN;
  float* Kf = Vt + DP * BN;
  float* dKt = Kf + BN * DP;
  float* dVt = dKt + DP * BN;
  float* Pb = dVt + DP * BN;
  float* dSb = Pb + PA_BM * PA_BN;
  float* mrow = dSb + PA_BM * PA_BN;
  PA_BY_DT(pa_stage_head<DT>(J, DP, b, h, Qf, dOf, dQ, lse, Di));
  memset(dQ, 0, (size_t)(Mp * DP) * 4);
  const int mes = J.mdt == 0 ? 4 : 2;
  const char* mbase = J.mdt < 0 ? nullptr : (const char*)J.p[6] + (b * s[23] + h * s[24]) * mes;
  for (int64_t n0 = 0; n0 < N; n0 += BN) {
    const int64_t nk = std::min(BN, N - n0), ld = pa_up16(nk);
    PA_BY_DT(pa_stage_keys<DT>(J, DP, b, h, n0, nk, ld, Kt, Vt, Kf));
    memset(dKt, 0, (size_t)(DP * ld) * 4);
    memset(dVt, 0, (size_t)(DP * ld) * 4);
    // causal: queries before n0 see no key of this block
    const int64_t m_start = J.causal ? (n0 / PA_BM) * PA_BM : 0;
    for (int64_t m0 = m_start; m0 < Mp; m0 += PA_BM) {
      const int64_t mr = std::min(PA_BM, Mp - m0);
      const int64_t lim = J.causal ? std::min(nk, m0 + mr - n0) : nk;  // keys any row sees
      if (lim <= 0) continue;
      int64_t nc = pa_up16(lim);
      // S = scale Q K^T, then P = exp(S + mask - lse) in place
      pa_rows<DV, false>(Qf + m0 * DP, Kt, ld, Pb, nc, mr, J.scale, nullptr, nullptr);
      int64_t used = 0;  // columns with a nonzero P in some row
      for (int64_t r = 0; r < mr; ++r) {
        const int64_t i = m0 + r;
        float* row = Pb + r * PA_BN;
        int64_t rl = i >= M ? 0 : J.causal ? std::min(lim, i - n0 + 1) : lim;
        rl = rl < 0 ? 0 : rl;
        const float l = lse[i];
        if (mbase != nullptr && rl > 0) {
          pa_mask_row(mrow, mbase + (i * s[25] + n0 * s[26]) * mes, s[26], rl, J.mdt);
          used = std::max(used, pa_exp_row<true>(row, mrow, l, rl));
        } else if (rl > 0) {
          used = std::max(used, pa_exp_row<false>(row, nullptr, l, rl));
        }
        for (int64_t j = rl; j < nc; ++j) row[j] = 0.0f;
      }
      if (used == 0) continue;  // every row masked out: no gradient from this block
      nc = pa_up16(used);
      // dS = P (dO V^T - Di)
      pa_rows<DV, true>(dOf + m0 * DP, Vt, ld, dSb, nc, mr, 1.0f, Pb, Di + m0);
      pa_acc(dVt, ld, dOf + m0 * DP, DP, Pb, nc, mr);
      pa_acc(dKt, ld, Qf + m0 * DP, DP, dSb, nc, mr);
      pa_dq<DV>(dQ + m0 * DP, dSb, nc, Kf, mr);
    }
    PA_BY_DT(pa_store_keys<DT>(J, b, h, n0, nk, ld, dKt, dVt));
  }
  const int es = J.dt == 0 ? 4 : 2;
  char* gq = (char*)J.p[7] + (b * s[27] + h * s[28]) * es;
  PA_BY_DT(pa_store<DT>(gq, s[29], dQ, DP, false, M, J.D, J.scale));
}

static void pa_one_head(const PaJob& J, int64_t z, float* ws) {
  const int64_t b = z / J.H, h = z % J.H;
#if PA_DV > 0
  pa_head<PA_DV>(J, b, h, ws);
#else
  if (J.D <= 16) pa_head<1>(J, b, h, ws);
  else if (J.D <= 32) pa_head<2>(J, b, h, ws);
  else if (J.D <= 64) pa_head<4>(J, b, h, ws);
  else pa_head<8>(J, b, h, ws);
#endif
}

// native_call's convention: p = grad_out, q, k, v, out, lse, mask (q when none), grad_q,
// grad_k, grad_v, status; s = B, H, M, N, D, then (batch, head, row) element strides of grad_out,
// q, k, v, out, lse (s[5..22]), the mask's (batch, head, row, col) (s[23..26]), grad_q,
// grad_k, grad_v's (s[27..35]), causal, dtype (0 f32, 2 bf16, 3 f16), mask dtype (-1 none),
// the scale's float32 bits.
extern "C" void pa_flash_backward_call(void* const* p, const int64_t*, const int64_t* s, int nt) {
  PaJob J;
  J.p = p;
  J.s = s;
  J.B = s[0]; J.H = s[1]; J.M = s[2]; J.N = s[3]; J.D = s[4];
  J.causal = s[36] != 0;
  J.dt = (int)s[37];
  J.mdt = (int)s[38];
  J.scale = pi_f((uint32_t)s[39]);
  J.Mp = (J.M + 3) & ~(int64_t)3;  // the row tiles' multiple: 65 rows cost 68, not 80
  J.BN = std::min(pa_up16(J.N), PA_BN);
  const int64_t DP = J.D <= 16 ? 16 : J.D <= 32 ? 32 : J.D <= 64 ? 64 : 128;
  const size_t bytes = (pa_workspace_floats(J.Mp, DP, J.BN) * 4 + 63) & ~(size_t)63;
  const int64_t BH = J.B * J.H;
  const int threads = (int)std::max<int64_t>(1, std::min<int64_t>(nt, BH));
  int64_t* status = (int64_t*)p[10];  // call_status's: 1 when a workspace is not allocated
  if (threads == 1) {
    float* ws = (float*)aligned_alloc(64, bytes);
    if (ws == nullptr) { *status = 1; return; }
    for (int64_t z = 0; z < BH; ++z) pa_one_head(J, z, ws);
    free(ws);
    return;
  }
#pragma omp parallel num_threads(threads)
  {
    float* ws = (float*)aligned_alloc(64, bytes);
    if (ws == nullptr) {
#pragma omp atomic write
      *status = 1;
    }
#pragma omp for schedule(static)
    for (int64_t z = 0; z < BH; ++z)
      if (ws != nullptr) pa_one_head(J, z, ws);
    free(ws);
  }
}
"""

_FLAGS = ("-ffp-contract=fast",)  # the matmul tiles' a * b + c are FMAs (ATen's gemms' too)
_SYMBOL = "pa_flash_backward_call"
# One library per (dtype, head-dim block) a graph binds, as the forward's (attention._kernel):
# the whole template set took 1.45 s of CPU to compile cold. Switch: the benchmark's "before"
# (one library with every instance, dispatching per call). Read per call (the instance is
# looked up by each call's dtype and D): the same template code runs either way, bit for bit.
SPLIT_INSTANCES = True
libraries: dict = {}  # (dtype code, D/16 block) -> (call, kernel address), or False


def head_block(head_dim: int) -> int:
    """The head dim's block of 16 floats the kernel pads it to: 1, 2, 4 or 8."""
    return 1 if head_dim <= 16 else 2 if head_dim <= 32 else 4 if head_dim <= 64 else 8


def native_kernel(dtype_code: int = 0, block: int = 1):
    """(native_call's ``call_status``, the kernel's address) for one dtype code
    (:data:`DTYPES`) and head-dim block (:func:`head_block`), built on first use; None
    without a C++ compiler or the extension."""
    key = (dtype_code, block) if SPLIT_INSTANCES else (-1, 0)
    entry = libraries.get(key)
    if entry is None:
        entry = False
        try:
            call = native_call.extension_call_status()
            if call is not None:
                source = SOURCE.replace("PA_INSTANCE", f"#define PA_DT {key[0]}\n"
                                        f"#define PA_DV {key[1]}")
                lib = compiler.load_library(source, (_SYMBOL,), flags=_FLAGS)
                entry = (call, ctypes.cast(getattr(lib, _SYMBOL), ctypes.c_void_p).value)
        except (compiler.CompilerNotFound, compiler.CompileError):
            entry = False
        libraries[key] = entry
    return entry or None


def eligible(grad_out, query, key, value, out, logsumexp, dropout_p, is_causal,
             attn_mask=None, scale=None) -> str | None:
    """None when :func:`flash_attention_backward` computes these natively, else why not
    (then it calls ATen's op). On every call's path: attribute reads only (no generators,
    no torch.device objects): ~9 -> ~3 us."""
    if dropout_p:
        return "dropout"
    dtype = query.dtype
    if dtype not in DTYPES:
        return f"dtype {dtype}"
    if grad_out.dtype != dtype or key.dtype != dtype or value.dtype != dtype \
            or out.dtype != dtype or logsumexp.dtype != torch.float32:
        return "mixed dtypes"
    if not (query.is_cpu and key.is_cpu and value.is_cpu and out.is_cpu and grad_out.is_cpu
            and logsumexp.is_cpu):
        return "not on the CPU"
    shape, kshape = query.shape, key.shape
    if len(shape) != 4 or len(kshape) != 4:
        return "not [B, H, L, D]"
    b, h, m, d = shape
    n = kshape[2]
    if kshape[0] != b or kshape[1] != h or kshape[3] != d or value.shape != kshape \
            or grad_out.shape != shape or out.shape != shape or logsumexp.shape != shape[:3]:
        return "shapes"
    if not (b and h and m and n and d):
        return "empty"
    if d > MAX_HEAD_DIM:
        return f"head dim {d} > {MAX_HEAD_DIM}"
    # grad_out's inner stride may be anything: it is copied then (as ATen does)
    if d > 1 and (query.stride(3) != 1 or key.stride(3) != 1 or value.stride(3) != 1
                  or out.stride(3) != 1):
        return "head dim not contiguous"
    if attn_mask is not None:
        if attn_mask.dtype != dtype and attn_mask.dtype != torch.float32:
            return f"mask dtype {attn_mask.dtype}"  # ATen's backward adds bool/double as numbers
        if not attn_mask.is_cpu:
            return "mask not on the CPU"
        mshape = attn_mask.shape
        if len(mshape) not in (2, 4) or mshape[-2] not in (1, m) or mshape[-1] not in (1, n) \
                or (len(mshape) == 4 and (mshape[0] not in (1, b) or mshape[1] not in (1, h))):
            return f"mask shape {tuple(mshape)}"
    if native_kernel(DTYPES[dtype], head_block(d)) is None:
        return "no C++ compiler or native call extension"
    return None


def _grad(shape, dtype):
    """A gradient of ``shape`` [B, H, L, D] laid out as ATen's: [B, L, H, D] transposed."""
    b, h, n, d = shape
    if alloc.empty_strided_cpu is not None:
        return alloc.empty_strided_cpu((b, h, n, d), (n * h * d, d, h * d, 1), dtype)
    return torch.empty_strided((b, h, n, d), (n * h * d, d, h * d, 1), dtype=dtype)


def flash_attention_backward(grad_out, query, key, value, out, logsumexp, dropout_p,
                             is_causal, attn_mask=None, scale=None):
    """``aten._scaled_dot_product_flash_attention_for_cpu_backward``: (grad_query, grad_key,
    grad_value), natively where :func:`eligible` and ``NATIVE_BACKWARD``, else ATen's op."""
    if not NATIVE_BACKWARD:
        return ATEN_BACKWARD(grad_out, query, key, value, out, logsumexp, dropout_p,
                             is_causal, attn_mask=attn_mask, scale=scale)
    return flash_attention_backward_bound(grad_out, query, key, value, out, logsumexp,
                                          dropout_p, is_causal, attn_mask, scale)


def flash_attention_backward_bound(grad_out, query, key, value, out, logsumexp, dropout_p,
                                   is_causal, attn_mask=None, scale=None):
    """What a compiled graph runs (:func:`bind` read the switch when it
    compiled): natively where :func:`eligible`, else ATen's op."""
    if eligible(grad_out, query, key, value, out, logsumexp, dropout_p, is_causal,
                attn_mask, scale) is not None:
        return ATEN_BACKWARD(grad_out, query, key, value, out, logsumexp, dropout_p,
                             is_causal, attn_mask=attn_mask, scale=scale)
    dtype = query.dtype
    b, h, m, d = query.shape
    call, address = native_kernel(DTYPES[dtype], head_block(d))
    if d > 1 and grad_out.stride(3) != 1:  # a broadcast gradient (ATen copies it too)
        grad_out = grad_out.contiguous()
    gq, gk, gv = _grad(query.shape, dtype), _grad(key.shape, dtype), _grad(value.shape, dtype)
    go_s, q_s, k_s = grad_out.stride(), query.stride(), key.stride()
    v_s, o_s, l_s = value.stride(), out.stride(), logsumexp.stride()
    n = key.shape[2]
    hd = h * d
    if attn_mask is None:
        mask, m_s, mdt = query, (0, 0, 0, 0), -1
    else:
        mask, m_s, mdt = attn_mask, attention.mask_strides(attn_mask, (b, h, m, n)), \
            DTYPES[attn_mask.dtype]
    syms = (b, h, m, n, d,
            go_s[0], go_s[1], go_s[2], q_s[0], q_s[1], q_s[2], k_s[0], k_s[1], k_s[2],
            v_s[0], v_s[1], v_s[2], o_s[0], o_s[1], o_s[2], l_s[0], l_s[1], l_s[2],
            m_s[0], m_s[1], m_s[2], m_s[3],
            m * hd, d, hd, n * hd, d, hd, n * hd, d, hd,
            1 if is_causal else 0, DTYPES[dtype], mdt,
            attention.float32_bits(1.0 / math.sqrt(d) if scale is None else scale))
    if call(address, (grad_out, query, key, value, out, logsumexp, mask, gq, gk, gv), 0, syms,
            torch.get_num_threads()):
        raise MemoryError("flash_attention_backward: no memory for the native kernel's "
                          "per-thread workspace")
    return gq, gk, gv



def bind(step, specs) -> tuple:
    """(callable, why) for SDPA's flash backward extern step: the native backward
    (:mod:`.attention_backward`) when the dtypes and dropout qualify, else ATen's kernel.
    Shapes, strides and masks are checked per call (its ``eligible``: attribute reads), and
    a call that does not qualify runs ATen's op."""
    args = list(step.args)
    names = [getattr(a, "name", None) for a in args[:4]]
    if len(args) < 8 or any(n is None or n not in specs for n in names):
        return None, "operands not tensors of the graph"
    if not NATIVE_BACKWARD:
        return None, "NATIVE_BACKWARD is off"
    if not isinstance(args[6], (int, float)) or args[6]:
        return None, "dropout: ATen's backward replays what its forward drew"
    q = specs[names[1]]
    if q.dtype not in DTYPES or any(specs[n].dtype != q.dtype for n in names):
        return None, f"dtype {q.dtype} (native: float32, bfloat16, float16)"
    d = q.shape[-1]  # a constant head dim: its instance builds now, else on the first call
    d = int(d) if getattr(d, "is_Integer", False) else d
    why = attention.aten_faster(q.dtype, d, args[7], backward=True)
    if why is not None:
        return None, why
    if (native_kernel(DTYPES[q.dtype], head_block(int(d))) if isinstance(d, int)
            else native_call.extension_call_status()) is None:
        return None, "no native call extension (C++ compiler / Python headers)"
    return flash_attention_backward_bound, (
        f"native flash-attention backward (codegen/cpp/attention_backward.py, "
        f"D={q.shape[-1]}, {q.dtype}): P recomputed from the logsumexp, ~2x ATen's at the "
        "zoo's shape")


# the graph code reads the schema: the results are fresh buffers (codegen/graph/buffers.py)
flash_attention_backward._schema = flash_attention_backward_bound._schema = \
    ATEN_BACKWARD._schema
