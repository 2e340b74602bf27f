"""SDPA's forward on the cpu target: a native flash-attention kernel in ATen's contract.

Every transformers model reaches the graph with ``aten._scaled_dot_product_flash_attention_for_cpu``
(lowering/attention.py rewrites written-out attention into it), an extern op: ATen's own
flash kernel ran it, ~350 us per call at the zoo's shape (B=4, H=4, S=128, D=16; 44% of
BERT's compiled forward), and Inductor calls the same kernel. This module is a native
forward with the same contract (``(query, key, value, dropout_p, is_causal, *, attn_mask,
scale) -> (output, logsumexp)``), so ATen's own backward takes its ``(out, lse)``:

- output allocated as ``torch.empty_like(query)`` (ATen's strides, which the graph code's
  views were planned from), logsumexp float32 ``[B, H, Lq]`` over strides ``(Lq*H, 1, H)``
  (ATen's: physically ``[B, Lq, H]``); a fully masked row gives 0 and logsumexp ATen's value;
- fp32 math for every dtype (bf16 / fp16 loads and stores convert), scale ``1/sqrt(D)``
  by default, causal top-left (key j seen by query i when ``j <= i``, ATen CPU's rule),
  additive float masks of the query's dtype broadcast by stride 0 (ATen refuses others);
- inputs read through their strides (views, GQA's expanded K/V): nothing copied; K/V with
  fewer heads than the query (LLaMA's decode steps) as ATen: query head h reads K/V head
  h // (H / Hkv).

The kernel: one work item per (batch, head, block of 64 queries) under ``omp parallel
for``; per block of 128 keys, K^T and V are packed as fp32 (zero-padded to a multiple of 16
in the head dim), scores come from a register tile of RT rows x 16/RT vectors of 16 keys
(the last keys one vector at a time: 65 keys cost 80, not 96),
the online softmax rescales the running output (exp: the prelude's vectorised ``pi_exp``),
and P V is a register tile of RT rows x D/16 vectors. Head dims up to 128 are templates
on D/16, each (dtype, D/16) instance its own library, built when a graph first binds it
(the whole set cost ~6 s of CPU in a cold cache, one instance ~0.5 s); larger ones, dropout and other dtypes keep ATen (:func:`bind_forward` says
why, and the fusion report lists it per SDPA call).
"""
from __future__ import annotations

import ctypes
import math
import struct

import torch

from ...sizes import is_symbolic
from . import compiler, native_call
from .prelude import PRELUDE

NATIVE_ATTENTION = True  # the benchmarks' switch: False keeps ATen's flash kernel
DTYPES = {torch.float32: 0, torch.bfloat16: 2, torch.float16: 3}
MAX_HEAD_DIM = 128  # D/16 vectors up to 8 (templates below)
_aten = torch.ops.aten
ATEN_FORWARD = _aten._scaled_dot_product_flash_attention_for_cpu.default

SOURCE = PRELUDE + r"""
#include <limits>
typedef float pa_v16 __attribute__((vector_size(64)));
static const int PA_BQ = 64;   // queries per work item
static const int PA_BK = 128;  // keys per packed block

template <int DT> struct PaT;
template <> struct PaT<0> {
  typedef float T;
  static inline __attribute__((always_inline)) float ld(float x) { return x; }
  static inline __attribute__((always_inline)) float st(float x) { return x; }
};
template <> struct PaT<2> {
  typedef uint16_t T;
  static inline __attribute__((always_inline)) float ld(uint16_t x) { return ld_bf16(x); }
  static inline __attribute__((always_inline)) uint16_t st(float x) { return st_bf16(x); }
};
template <> struct PaT<3> {
  typedef uint16_t T;
  static inline __attribute__((always_inline)) float ld(uint16_t x) { return ld_f16(x); }
  static inline __attribute__((always_inline)) uint16_t st(float x) { return st_f16(x); }
};

struct PaArgs {
  int64_t B, H, Lq, Lk, D, causal, has_mask, group;  // group: query heads per K/V head
  float scale;
  const int64_t *qs, *ks, *vs, *ms, *os, *ls;  // element strides (b, h, row, d)
};

// exp(x) for x <= 0 (a score minus its row's max): pi_exp's reduction and polynomial, 2^n
// one factor (x >= -87.3: n >= -126, no denormal scaling), 0 below -87.3 (-inf: masked)
static inline __attribute__((always_inline)) float pa_exp(float x) {
  const float xc = x < -87.3f ? -87.3f : x;
  const float n = PI_FMA(xc, 1.44269504088896341f, 12582912.0f) - 12582912.0f;
  const float r = PI_FMA(n, 2.12194440e-4f, PI_FMA(-n, 0.693359375f, xc));
  const float e = pi_exp_poly(r) * pi_f((uint32_t)((int32_t)n + 127) << 23);
  return x < -87.3f ? 0.0f : e;
}

typedef int pa_i16 __attribute__((vector_size(64)));
static inline __attribute__((always_inline)) float pa_hsum(pa_v16 v) {
  v += __builtin_shuffle(v, pa_i16{8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7});
  v += __builtin_shuffle(v, pa_i16{4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11});
  v += __builtin_shuffle(v, pa_i16{2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13});
  v += __builtin_shuffle(v, pa_i16{1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14});
  return v[0];
}
static inline __attribute__((always_inline)) pa_v16 pa_vmax(pa_v16 a, pa_v16 b) {
  return a > b ? a : b;
}
static inline __attribute__((always_inline)) float pa_hmax(pa_v16 v) {
  v = pa_vmax(v, __builtin_shuffle(v, pa_i16{8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7}));
  v = pa_vmax(v, __builtin_shuffle(v, pa_i16{4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11}));
  v = pa_vmax(v, __builtin_shuffle(v, pa_i16{2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13}));
  v = pa_vmax(v, __builtin_shuffle(v, pa_i16{1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14}));
  return v[0];
}

// K^T and V of keys [0, nk) of one head as fp32: Kt block-major ([block][DP][PA_BK]), Vp
// [key][DP], zero-padded to whole register tiles and to DP
template <int DT, int NV>
static void pa_pack_kv(const typename PaT<DT>::T* k, const typename PaT<DT>::T* v,
                       const PaArgs& a, int64_t nk, int64_t nkp, float* Kt, float* Vp) {
  typedef typename PaT<DT>::T T;
  constexpr int DP = NV * 16;
  const int64_t D = a.D, ks2 = a.ks[2], ks3 = a.ks[3], vs2 = a.vs[2], vs3 = a.vs[3];
  for (int64_t j = 0; j < nkp; ++j) {
    float* kt = Kt + (j / PA_BK) * DP * PA_BK + (j % PA_BK);
    float* vp = Vp + j * DP;
    if (j >= nk) {
      for (int d = 0; d < DP; ++d) { kt[d * PA_BK] = 0.0f; vp[d] = 0.0f; }
      continue;
    }
    const T* kr = k + j * ks2;
    const T* vr = v + j * vs2;
    float row[DP];
    if (ks3 == 1) {
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) row[d] = PaT<DT>::ld(kr[d]);
    } else {
      for (int64_t d = 0; d < D; ++d) row[d] = PaT<DT>::ld(kr[d * ks3]);
    }
    for (int64_t d = D; d < DP; ++d) row[d] = 0.0f;
#pragma GCC unroll 16
    for (int d = 0; d < DP; ++d) kt[d * PA_BK] = row[d];
    if (vs3 == 1) {
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) vp[d] = PaT<DT>::ld(vr[d]);
    } else {
      for (int64_t d = 0; d < D; ++d) vp[d] = PaT<DT>::ld(vr[d * vs3]);
    }
    for (int64_t d = D; d < DP; ++d) vp[d] = 0.0f;
  }
}

// S[r][0, 16 C) = Q[r] . K^T[:, 0, 16 C) for RT rows: a register tile of RT x C vectors
template <int NV, int RT, int C>
static inline __attribute__((always_inline)) void pa_scores(const float* Qs, const float* kt,
                                                            float* S) {
  constexpr int DP = NV * 16;
  pa_v16 acc[RT][C];
#pragma GCC unroll 16
  for (int r = 0; r < RT; ++r)
#pragma GCC unroll 16
    for (int c = 0; c < C; ++c) acc[r][c] = pa_v16{};
  for (int d = 0; d < DP; ++d) {
    pa_v16 kv[C];
#pragma GCC unroll 16
    for (int c = 0; c < C; ++c) kv[c] = *(const pa_v16*)&kt[d * PA_BK + c * 16];
#pragma GCC unroll 16
    for (int r = 0; r < RT; ++r) {
      const float qv = Qs[r * DP + d];
#pragma GCC unroll 16
      for (int c = 0; c < C; ++c) acc[r][c] += qv * kv[c];
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < RT; ++r)
#pragma GCC unroll 16
    for (int c = 0; c < C; ++c) *(pa_v16*)&S[r * PA_BK + c * 16] = acc[r][c];
}

// one block of queries [i0, i0 + nq) of head (b, h) against the packed keys [0, kend)
template <int DT, int NV, int RT>
static void pa_block(void* const* p, const PaArgs& a, int64_t b, int64_t h, int64_t i0,
                     const float* Kt, const float* Vp) {
  typedef typename PaT<DT>::T T;
  constexpr int DP = NV * 16, CV = 16 / RT, TK = CV * 16;
  const T* q = (const T*)p[0] + b * a.qs[0] + h * a.qs[1];
  const T* mk = a.has_mask ? (const T*)p[3] + b * a.ms[0] + h * a.ms[1] : nullptr;
  T* o = (T*)p[4] + b * a.os[0] + h * a.os[1];
  float* lse = (float*)p[5] + b * a.ls[0] + h * a.ls[1];
  const int64_t D = a.D, nq = std::min<int64_t>(PA_BQ, a.Lq - i0);
  alignas(64) float Qs[PA_BQ * DP];
  alignas(64) float O[PA_BQ * DP];
  alignas(64) float S[RT * PA_BK];
  float m[PA_BQ], l[PA_BQ], alpha[RT];
  const float ninf = -std::numeric_limits<float>::infinity();
  const float scale = a.scale;
  const int64_t nqr = (nq + RT - 1) / RT * RT;  // the rows the register tiles read
  for (int64_t r = 0; r < nqr; ++r) {
    m[r] = ninf;
    l[r] = 0.0f;
    float* qs = Qs + r * DP;
    const T* qr = q + (i0 + r) * a.qs[2];
    if (r >= nq) {
      for (int d = 0; d < DP; ++d) qs[d] = 0.0f;
    } else if (a.qs[3] == 1) {
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) qs[d] = PaT<DT>::ld(qr[d]) * scale;
    } else {
      for (int64_t d = 0; d < D; ++d) qs[d] = PaT<DT>::ld(qr[d * a.qs[3]]) * scale;
    }
    for (int64_t d = r < nq ? D : DP; d < DP; ++d) qs[d] = 0.0f;
    for (int d = 0; d < DP; ++d) O[r * DP + d] = 0.0f;
  }
  // top-left causal: row i sees keys j <= i
  const int64_t kend = a.causal ? std::min<int64_t>(a.Lk, i0 + nq) : a.Lk;
  for (int64_t j0 = 0; j0 < kend; j0 += PA_BK) {
    const int64_t nk = std::min<int64_t>(PA_BK, kend - j0);
    const float* kt = Kt + (j0 / PA_BK) * DP * PA_BK;
    const float* vp = Vp + j0 * DP;
    for (int64_t r0 = 0; r0 < nq; r0 += RT) {
      // causal: the tile's rows see keys up to i0 + r0 + RT - 1 (none of this block: skip)
      const int64_t nkt = a.causal ? std::min<int64_t>(nk, i0 + r0 + RT - j0) : nk;
      if (nkt <= 0) continue;
      // scores: RT rows x the tile's keys (whole vectors), register tiles of RT x CV
      // vectors, then of RT x 1 for the last keys (65 keys: 80 computed, not 96)
      const int64_t nkpt = (nkt + 15) / 16 * 16, nkm = nkpt / TK * TK;
      for (int64_t jv = 0; jv < nkm; jv += TK)
        pa_scores<NV, RT, CV>(Qs + r0 * DP, kt + jv, S + jv);
      for (int64_t jv = nkm; jv < nkpt; jv += 16)
        pa_scores<NV, RT, 1>(Qs + r0 * DP, kt + jv, S + jv);
      // online softmax per row: mask and max, then exp and sum; S becomes P
      for (int r = 0; r < RT; ++r) {
        float* __restrict s = S + r * PA_BK;
        const int64_t i = i0 + r0 + r;
        const int64_t valid = r0 + r >= nq ? 0
            : a.causal ? std::max<int64_t>(0, std::min<int64_t>(nk, i - j0 + 1)) : nk;
        if (mk != nullptr && valid > 0) {
          const T* mr = mk + i * a.ms[2] + j0 * a.ms[3];
          const int64_t st = a.ms[3];
          if (st == 1) {
#pragma omp simd
            for (int64_t j = 0; j < valid; ++j) s[j] += PaT<DT>::ld(mr[j]);
          } else {
            for (int64_t j = 0; j < valid; ++j) s[j] += PaT<DT>::ld(mr[j * st]);
          }
        }
        // whole vectors (the tile's width is a multiple of 16): -inf past the row's keys,
        // so the max ignores them and their exp is 0; reductions as vector trees
        const int64_t v16 = (valid + 15) / 16 * 16;
        for (int64_t j = valid; j < v16; ++j) s[j] = ninf;
        pa_v16 vm = pa_v16{} + ninf;
        for (int64_t j = 0; j < v16; j += 16) {
          const pa_v16 x = *(const pa_v16*)&s[j];
          vm = x > vm ? x : vm;
        }
        const float mx = pa_hmax(vm);
        const float mold = r0 + r < nq ? m[r0 + r] : ninf;
        const float mnew = mx > mold ? mx : mold;
        if (mnew == ninf) {  // every key so far masked (or a padding row): nothing adds up
          alpha[r] = 1.0f;
          for (int64_t j = 0; j < nkt; ++j) s[j] = 0.0f;
          continue;
        }
#pragma omp simd
        for (int64_t j = 0; j < v16; ++j) s[j] = pa_exp(s[j] - mnew);
        pa_v16 vs = pa_v16{};
        for (int64_t j = 0; j < v16; j += 16) vs += *(const pa_v16*)&s[j];
        const float sum = pa_hsum(vs);
        for (int64_t j = v16; j < nkt; ++j) s[j] = 0.0f;
        alpha[r] = pa_exp(mold - mnew);
        l[r0 + r] = l[r0 + r] * alpha[r] + sum;
        m[r0 + r] = mnew;
      }
      // O = O * alpha + P V: a register tile of RT rows x NV vectors
      pa_v16 acc[RT][NV];
#pragma GCC unroll 16
      for (int r = 0; r < RT; ++r)
#pragma GCC unroll 16
        for (int c = 0; c < NV; ++c) acc[r][c] = *(const pa_v16*)&O[(r0 + r) * DP + c * 16] * alpha[r];
      for (int64_t j = 0; j < nkt; ++j) {
        pa_v16 vv[NV];
#pragma GCC unroll 16
        for (int c = 0; c < NV; ++c) vv[c] = *(const pa_v16*)&vp[j * DP + c * 16];
#pragma GCC unroll 16
        for (int r = 0; r < RT; ++r) {
          const float pv = S[r * PA_BK + j];
#pragma GCC unroll 16
          for (int c = 0; c < NV; ++c) acc[r][c] += pv * vv[c];
        }
      }
#pragma GCC unroll 16
      for (int r = 0; r < RT; ++r)
#pragma GCC unroll 16
        for (int c = 0; c < NV; ++c) *(pa_v16*)&O[(r0 + r) * DP + c * 16] = acc[r][c];
    }
  }
  for (int64_t r = 0; r < nq; ++r) {
    const int64_t i = i0 + r;
    const float inv = l[r] > 0.0f ? 1.0f / l[r] : 0.0f;  // a fully masked row: 0
    T* orow = o + i * a.os[2];
    if (a.os[3] == 1) {
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) orow[d] = PaT<DT>::st(O[r * DP + d] * inv);
    } else {
      for (int64_t d = 0; d < D; ++d) orow[d * a.os[3]] = PaT<DT>::st(O[r * DP + d] * inv);
    }
    lse[i * a.ls[2]] = l[r] > 0.0f ? m[r] + std::log(l[r]) : PA_EMPTY_LSE;
  }
}

// per thread: the packed K/V of the item it runs (grown, never shrunk)
static thread_local float* pa_scratch = nullptr;
static thread_local size_t pa_scratch_n = 0;

static float* pa_buffer(size_t n) {
  if (n > pa_scratch_n) {
    free(pa_scratch);
    pa_scratch = (float*)aligned_alloc(64, (n * sizeof(float) + 63) / 64 * 64);
    pa_scratch_n = n;
  }
  return pa_scratch;
}

// work items: (batch, head, a run of query blocks); each packs the keys its queries see once
template <int DT, int NV>
static void pa_run(void* const* p, const PaArgs& a, int nt) {
  typedef typename PaT<DT>::T T;
  constexpr int RT = NV == 1 ? 8 : NV == 2 ? 8 : NV <= 4 ? 4 : 2;
  constexpr int DP = NV * 16;
  const int64_t nqb = (a.Lq + PA_BQ - 1) / PA_BQ, heads = a.B * a.H;
  // query blocks per item: all of a head's, unless that leaves threads idle
  int64_t per = nqb;
  if (nt > 1 && heads < 4 * nt) per = std::max<int64_t>(1, nqb * heads / (4 * nt));
  const int64_t runs = (nqb + per - 1) / per, items = heads * runs;
#pragma omp parallel for num_threads(nt) schedule(static) if (nt > 1 && items > 1)
  for (int64_t t = 0; t < items; ++t) {
    const int64_t run = t % runs, bh = t / runs, b = bh / a.H, h = bh % a.H;
    const int64_t q0 = run * per * PA_BQ, q1 = std::min<int64_t>(a.Lq, q0 + per * PA_BQ);
    const int64_t nk = a.causal ? std::min<int64_t>(a.Lk, q1) : a.Lk;
    const int64_t nkb = (nk + PA_BK - 1) / PA_BK * PA_BK;  // Kt's whole blocks
    const int64_t nkp = (nk + 15) / 16 * 16;  // the keys the score tiles read
    float* Kt = pa_buffer((size_t)(2 * nkb * DP));
    float* Vp = Kt + nkb * DP;
    const int64_t hk = h / a.group;  // GQA: K/V heads shared by `group` query heads
    pa_pack_kv<DT, NV>((const T*)p[1] + b * a.ks[0] + hk * a.ks[1],
                       (const T*)p[2] + b * a.vs[0] + hk * a.vs[1], a, nk, nkp, Kt, Vp);
    for (int64_t i0 = q0; i0 < q1; i0 += PA_BQ) pa_block<DT, NV, RT>(p, a, b, h, i0, Kt, Vp);
  }
}

// native_call's convention: p = q, k, v, mask (q when none), out, lse;
// s = dt, B, H, Lq, Lk, D, causal, has_mask, scale (float bits), then the strides:
// q, k, v, mask, out (4 each), lse (3), then query heads per K/V head
extern "C" void pa_flash_forward(void* const* p, const int64_t*, const int64_t* s, int nt) {
  PaArgs a;
  a.B = s[1]; a.H = s[2]; a.Lq = s[3]; a.Lk = s[4]; a.D = s[5];
  a.causal = s[6]; a.has_mask = s[7];
  const uint32_t bits = (uint32_t)s[8];
  memcpy(&a.scale, &bits, 4);
  a.qs = s + 9; a.ks = s + 13; a.vs = s + 17; a.ms = s + 21; a.os = s + 25; a.ls = s + 29;
  a.group = s[32];
  if (a.B * a.H * a.Lq == 0) return;
  pa_run<PA_DT, PA_NV>(p, a, nt);  // one dtype and D/16 per library (_kernel)
}
"""
# g++ fuses the tiles' multiply-adds (the kernels' default -ffp-contract=off keeps eager's
# roundings elementwise; ATen's flash kernel is a GEMM with FMAs)
_FLAGS = ("-ffp-contract=fast",)
EMPTY_LSE = "0.0f"  # ATen's logsumexp of a fully masked row (tests/test_native_attention.py)

_libraries: dict = {}  # (dtype code, D/16) -> (call, address), or False: no extension


def _kernel(dtype_code: int = 0, vectors: int = 1):
    """(the extension's call, pa_flash_forward's address) for one dtype and head dim of
    ``vectors`` * 16 (each its own small library: the whole template set took ~6 s of CPU to
    compile cold, one instance ~0.5 s), or None without the extension."""
    entry = _libraries.get((dtype_code, vectors))
    if entry is None:
        call = native_call.extension_call()
        entry = False
        if call is not None:
            source = (SOURCE.replace("PA_EMPTY_LSE", EMPTY_LSE)
                      .replace("PA_DT", str(dtype_code)).replace("PA_NV", str(vectors)))
            lib = compiler.load_library(source, ("pa_flash_forward",), flags=_FLAGS)
            entry = (call, ctypes.cast(lib.pa_flash_forward, ctypes.c_void_p).value)
        _libraries[(dtype_code, vectors)] = entry
    return entry or None


def _vectors(head_dim: int) -> int:
    """D/16 rounded up, 1 to 8: the template instance a head dim runs."""
    return min(max((head_dim + 15) // 16, 1), MAX_HEAD_DIM // 16)


_scale_bits: dict = {}


def float32_bits(scale: float) -> int:
    """A float's bits as the kernel reads them (fp32, as ATen's kernel computes)."""
    b = _scale_bits.get(scale)
    if b is None:
        b = _scale_bits[scale] = struct.unpack("<I", struct.pack("<f", scale))[0]
    return b


def unsupported(query, key, value, dropout_p=0.0, attn_mask=None) -> str | None:
    """Why the native kernel cannot run these operands (None: it can); from tensors or
    fake tensors (compile time)."""
    if not NATIVE_ATTENTION:
        return "NATIVE_ATTENTION is off"
    if dropout_p:
        return "dropout: ATen's kernel draws what eager draws"
    if query.dtype not in DTYPES:
        return f"dtype {query.dtype}"
    if key.dtype != query.dtype or value.dtype != query.dtype:
        return "mixed dtypes"
    if query.dim() != 4 or key.dim() != 4 or value.dim() != 4:
        return "not 4-d"
    if query.device.type != "cpu":
        return f"device {query.device.type}"
    d = query.shape[-1]
    if not isinstance(d, int) or d > MAX_HEAD_DIM or value.shape[-1] != d:
        return f"head dim {d} (native: up to {MAX_HEAD_DIM}, static, equal for q/k/v)"
    if _heads_mismatch(query, key, value):
        return "query heads not a multiple of K/V heads"
    if attn_mask is not None and (attn_mask.dtype != query.dtype or attn_mask.dim() not in (2, 4)):
        return f"mask of dtype {attn_mask.dtype} / {attn_mask.dim()} dims"
    if _kernel(DTYPES[query.dtype], _vectors(d)) is None:
        return "no native call extension (C++ compiler / Python headers)"
    return None


def flash_forward(query, key, value, dropout_p=0.0, is_causal=False, *, attn_mask=None,
                  scale=None):
    """``aten._scaled_dot_product_flash_attention_for_cpu`` natively where the kernel can
    run it (else ATen's)."""
    if unsupported(query, key, value, dropout_p, attn_mask) is not None:
        return ATEN_FORWARD(query, key, value, dropout_p, is_causal, attn_mask=attn_mask, scale=scale)
    return run_kernel(query, key, value, is_causal, attn_mask, scale)


def flash_forward_bound(query, key, value, dropout_p=0.0, is_causal=False, *, attn_mask=None,
                        scale=None):
    """The graph's call (:func:`bind_forward` checked dtypes, dropout and mask from the fake
    tensors): only the head dim, symbolic under ``dynamic=True``, is checked per call."""
    d = query.shape[-1]
    if d > MAX_HEAD_DIM or value.shape[-1] != d or _heads_mismatch(query, key, value):
        return ATEN_FORWARD(query, key, value, dropout_p, is_causal, attn_mask=attn_mask, scale=scale)
    return run_kernel(query, key, value, is_causal, attn_mask, scale)


# the graph code reads an extern's schema (fresh results, no input written: buffer reuse,
# codegen/graph/buffers.py); this kernel's contract is the ATen op's
flash_forward._schema = flash_forward_bound._schema = ATEN_FORWARD._schema


def _heads_mismatch(query, key, value) -> bool:
    """Whether K/V's heads differ or do not divide the query's (GQA: ATen's kernel maps
    query head h to K/V head h // (H / Hkv); anything else is ATen's to reject)."""
    hk = key.shape[1]
    return value.shape[1] != hk or hk == 0 or query.shape[1] % hk != 0 \
        or key.shape[0] != query.shape[0] or value.shape[0] != query.shape[0]


def mask_strides(mask, shape) -> tuple:
    """The mask's strides broadcast to ``[B, H, Lq, Lk]`` (0 along size-1 / missing dims)."""
    n = mask.dim()
    sizes, strides = mask.shape, mask.stride()
    out = [0, 0, 0, 0]
    for i in range(n):
        if sizes[i] != 1:
            if sizes[i] != shape[4 - n + i]:
                raise RuntimeError(f"attn_mask of shape {tuple(sizes)} does not broadcast to "
                                   f"{tuple(shape)}")
            out[4 - n + i] = strides[i]
    return tuple(out)


def run_kernel(query, key, value, is_causal, attn_mask, scale):
    """The native kernel on operands :func:`unsupported` accepted: (output, logsumexp)."""
    B, H, Lq, D = query.shape
    call, address = _kernel(DTYPES[query.dtype], _vectors(D))
    Lk = key.shape[2]
    out = torch.empty_like(query)
    lse = torch.empty_strided((B, H, Lq), (Lq * H, 1, H), dtype=torch.float32)
    if scale is None:
        scale = 1.0 / math.sqrt(D)
    if attn_mask is None:
        mask, ms = query, (0, 0, 0, 0)
    else:
        mask, ms = attn_mask, mask_strides(attn_mask, (B, H, Lq, Lk))
    call(address, (query, key, value, mask, out, lse), 0,
         (DTYPES[query.dtype], B, H, Lq, Lk, D, int(bool(is_causal)), int(attn_mask is not None),
          float32_bits(scale), *query.stride(), *key.stride(), *value.stride(), *ms, *out.stride(),
          *lse.stride(), H // key.shape[1]),
         torch.get_num_threads())
    return out, lse


def bind_forward(step, specs) -> tuple:
    """(the callable the graph runs for this SDPA extern step, why): the native kernel when
    its operands qualify (fake-tensor specs: dtype, head dim, dropout, mask dtype), else
    ATen's kernel with the reason."""
    args = list(step.args) + [None] * (5 - len(step.args))
    kwargs = step.kwargs
    names = [getattr(a, "name", None) for a in args[:3]]
    if any(n is None or n not in specs for n in names):
        return None, "operands not tensors of the graph"
    q, k, v = (specs[n] for n in names)
    dropout = kwargs.get("dropout_p", args[3] if len(step.args) > 3 else 0.0)
    mask = kwargs.get("attn_mask")
    mspec = specs.get(getattr(mask, "name", None)) if mask is not None else None
    if not isinstance(dropout, (int, float)):
        return None, "symbolic dropout_p"
    why = _unsupported_specs(q, k, v, dropout, mspec, mask is not None) or aten_faster(
        q.dtype, q.shape[-1], kwargs.get("is_causal", args[4] if len(step.args) > 4 else False), backward=False)
    if why is not None:
        return None, why
    return flash_forward_bound, (f"native flash-attention forward (codegen/cpp/attention.py, "
                                 f"D={q.shape[-1]}, {q.dtype}): fp32 online softmax, "
                           "~2x ATen's flash kernel at the zoo's shape (docs/ARCHITECTURE.md)")


def aten_faster(dtype, head_dim, is_causal, backward: bool) -> str | None:
    """Why ATen's flash kernel runs an SDPA the native kernels could run: where it measured
    faster (one thread, 15 interleaved rounds; docs/benchmarks.md "Session 23"). In float32
    without a causal mask ATen's blocks are BLAS GEMMs, which beat our register tiles in
    the forward from head dim 48 ([4, 12, 128, 64]: 3.4 against 4.1 ms) and in the backward
    where our kernel pads the head dim by a fifth or more (80, 96 -> 128). Causal masks
    (our kernels skip masked tiles), half types (ATen rounds P and dS) and the zoo's head
    dims 16 and 32 are ours."""
    if dtype != torch.float32 or is_causal is not False or is_symbolic(head_dim):
        return None
    d = int(head_dim)
    if not backward and d > 32:
        return (f"float32, no causal mask, head dim {d} > 32: ATen's flash kernel (BLAS "
                "blocks) measured faster than the native forward")
    if backward and 64 < d < 128:
        return (f"float32, no causal mask, head dim {d} padded to 128 in the native backward: "
                "ATen's measured faster")
    return None


def _unsupported_specs(q, k, v, dropout, mspec, has_mask) -> str | None:
    if not NATIVE_ATTENTION:
        return "NATIVE_ATTENTION is off"
    if dropout:
        return "dropout: ATen's kernel draws what eager draws"
    if q.dtype not in DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        return f"dtype {q.dtype} (native: float32, bfloat16, float16)"
    if len(q.shape) != 4 or len(k.shape) != 4 or len(v.shape) != 4:
        return "not 4-d"
    d = q.shape[-1]
    if not is_symbolic(d) and int(d) > MAX_HEAD_DIM:  # symbolic: checked per call
        return f"head dim {d} (native: up to {MAX_HEAD_DIM})"
    if has_mask and (mspec is None or mspec.dtype != q.dtype or len(mspec.shape) not in (2, 4)):
        return "mask not a tensor of the query's dtype"
    # built now for a static head dim (a symbolic one: on its first call's size)
    if (native_call.extension_call() if is_symbolic(d)
            else _kernel(DTYPES[q.dtype], _vectors(int(d)))) is None:
        return "no native call extension (C++ compiler / Python headers)"
    return None
