"""2-D max pooling on the cpu target: native kernels in ATen's contract.

``aten.max_pool2d_with_indices`` and its backward are extern ops of the training graph
(the conv nets' stem pool; lowering/conv_layout.py gives them channels-last inputs). ATen
ran them; Inductor generates its own kernels. At the zoo ResNet's pool (in [4, 16, 64, 64]
channels-last, 3x3 stride 2 padding 1, one thread, thread time) ATen's forward took
~170 us and its backward ~55 us (a zero fill of the 1 MiB input grad, then a scatter).
These are the same ops natively:

- forward: per output element the window's max and the flat position ``h * W + w`` of it
  in its plane, ATen's rule exactly: the scan starts at -inf with the window's first
  in-bounds position, and a value replaces the max when it is greater or NaN (so the
  first max wins on ties, the last NaN wins). Values are copies: bit-exact. Channels-last:
  OpenMP over batch x output rows, GCC vectors of 16 channels, and under 64 channels four
  outputs of whole windows at once (independent compare-select chains): ~63 us. Contiguous
  NCHW: OpenMP over batch x channels x output rows, 16 outputs of a row as one vector (a
  scalar compare-select mispredicts on random data; ATen's NCHW kernel ~1.6 ms, this ~0.3).
- backward (channels-last only: on NCHW planes the same scatter is no faster than ATen's):
  ATen's zero fill + scatter in ATen's order (per image: output rows, then columns, then
  channels), each input row zeroed just before the first window reaching it scatters, so
  the zeroing hits cache and there is no separate pass; the same additions in the same
  order: bit-exact (~48 us). The indices are trusted to come from the forward (positions
  inside their windows); positions outside the plane are skipped, not checked.

Outputs are allocated as ATen's (the input's memory format). float32 only, 4-d, static
shapes and strides; anything else is ATen's (the binders say why). The graph's call
compares the input's strides with the graph's (anything else: ATen) and does nothing more.
"""
from __future__ import annotations

import ctypes

import torch

from ...sizes import is_symbolic
from . import compiler, native_call
from .prelude import PRELUDE

NATIVE_POOLING = True  # the benchmarks' switch (read at bind time): False keeps ATen's kernels
_aten = torch.ops.aten
ATEN_FORWARD = _aten.max_pool2d_with_indices.default
ATEN_BACKWARD = _aten.max_pool2d_with_indices_backward.default

SOURCE = PRELUDE + r"""
#include <limits>

struct MpArgs {
  int64_t N, C, H, W, OH, OW, kH, kW, sH, sW, pH, pW, dH, dW;
};

static inline void mp_args(MpArgs& a, const int64_t* s) {
  a.N = s[0]; a.C = s[1]; a.H = s[2]; a.W = s[3]; a.OH = s[4]; a.OW = s[5];
  a.kH = s[6]; a.kW = s[7]; a.sH = s[8]; a.sW = s[9]; a.pH = s[10]; a.pW = s[11];
  a.dH = s[12]; a.dW = s[13];
}

// ATen's window: [i0, i1) step d, i0 moved past the padding by whole dilations
static inline void mp_window(int64_t o, int64_t st, int64_t pad, int64_t k, int64_t d,
                             int64_t n, int64_t& i0, int64_t& i1) {
  i0 = o * st - pad;
  i1 = std::min<int64_t>(i0 + (k - 1) * d + 1, n);
  while (i0 < 0) i0 += d;
}

// GCC vectors of 16 lanes (one AVX-512 register; split in two or four without it),
// unaligned loads and stores through the aligned(4) / aligned(8) types
typedef float mp_f16 __attribute__((vector_size(64)));
typedef float mp_f16u __attribute__((vector_size(64), aligned(4)));
typedef int32_t mp_i16 __attribute__((vector_size(64)));
typedef int64_t mp_l16 __attribute__((vector_size(128)));
typedef int64_t mp_l16u __attribute__((vector_size(128), aligned(8)));

// V vectors of channels of U outputs of a row (U > 1: whole windows, the next output's
// sW input columns on): each window's max and its flat position (int32 in registers: a
// plane of < 2^31 elements, checked by the binder); U * V independent dependency chains
template <int V, int U>
static inline __attribute__((always_inline)) void mp_fwd_block(
    const float* x, const int64_t* xs, const MpArgs& a, int64_t ih0, int64_t ih1,
    int64_t iw0, int64_t iw1, float* o, int64_t* id, int64_t ostep) {
  mp_f16 mv[U][V];
  mp_i16 mi[U][V];
  const float ninf = -std::numeric_limits<float>::infinity();
#pragma GCC unroll 4
  for (int u = 0; u < U; ++u)
#pragma GCC unroll 4
    for (int v = 0; v < V; ++v) {
      mv[u][v] = mp_f16{} + ninf;
      mi[u][v] = mp_i16{} + (int32_t)(ih0 * a.W + iw0 + u * a.sW);
    }
  for (int64_t ih = ih0; ih < ih1; ih += a.dH)
    for (int64_t iw = iw0; iw < iw1; iw += a.dW) {
      const float* xp = x + ih * xs[2] + iw * xs[3];
#pragma GCC unroll 4
      for (int u = 0; u < U; ++u) {
        const mp_i16 idx = mp_i16{} + (int32_t)(ih * a.W + iw + u * a.sW);
#pragma GCC unroll 4
        for (int v = 0; v < V; ++v) {
          const mp_f16 val = *(const mp_f16u*)(xp + u * a.sW * xs[3] + 16 * v);
          const mp_i16 take = (val > mv[u][v]) | (val != val);
          mv[u][v] = take ? val : mv[u][v];
          mi[u][v] = take ? idx : mi[u][v];
        }
      }
    }
#pragma GCC unroll 4
  for (int u = 0; u < U; ++u)
#pragma GCC unroll 4
    for (int v = 0; v < V; ++v) {
      *(mp_f16u*)(o + u * ostep + 16 * v) = mv[u][v];
      *(mp_l16u*)(id + u * ostep + 16 * v) = __builtin_convertvector(mi[u][v], mp_l16);
    }
}

// channels [c0, C) of one output element, one at a time (past the last whole vector)
static inline void mp_fwd_scalar(const float* x, const int64_t* xs, const MpArgs& a,
                                 int64_t ih0, int64_t ih1, int64_t iw0, int64_t iw1, float* o,
                                 int64_t* id, int64_t c0) {
  for (int64_t c = c0; c < a.C; ++c) {
    float mv = -std::numeric_limits<float>::infinity();
    int64_t mi = ih0 * a.W + iw0;
    for (int64_t ih = ih0; ih < ih1; ih += a.dH)
      for (int64_t iw = iw0; iw < iw1; iw += a.dW) {
        const float v = x[ih * xs[2] + iw * xs[3] + c];
        const bool take = (v > mv) | (v != v);
        mv = take ? v : mv;
        mi = take ? ih * a.W + iw : mi;
      }
    o[c] = mv;
    id[c] = mi;
  }
}

// 16 outputs of a plane's row with whole windows, sW input columns apart, as GCC vectors
// (lane u: output u; the loads gather), branch-free: a scalar compare-select mispredicts
// on random data (ATen's NCHW kernel: ~1.6 ms at the zoo ResNet's pool)
static inline void mp_fwd_plane16(const float* x, const int64_t* xs, const MpArgs& a,
                                  int64_t ih0, int64_t ih1, int64_t iw0, int64_t iw1,
                                  float* o, int64_t* id, int64_t ostep) {
  const int64_t step = a.sW * xs[3];
  mp_i16 lane;
  for (int u = 0; u < 16; ++u) lane[u] = (int32_t)(u * a.sW);
  mp_f16 mv = mp_f16{} - std::numeric_limits<float>::infinity();
  mp_i16 mi = lane + (int32_t)(ih0 * a.W + iw0);
  for (int64_t ih = ih0; ih < ih1; ih += a.dH)
    for (int64_t iw = iw0; iw < iw1; iw += a.dW) {
      const float* xr = x + ih * xs[2] + iw * xs[3];
      mp_f16 val;
#pragma GCC unroll 16
      for (int u = 0; u < 16; ++u) val[u] = xr[u * step];
      const mp_i16 take = (val > mv) | (val != val);
      mv = take ? val : mv;
      mi = take ? lane + (int32_t)(ih * a.W + iw) : mi;
    }
  for (int u = 0; u < 16; ++u) { o[u * ostep] = mv[u]; id[u * ostep] = mi[u]; }
}

// p = x, out, indices; s = N C H W OH OW kH kW sH sW pH pW dH dW, strides of x (n c h w),
// of out and indices (n c h w, the same), then 1 for the channels-last loops
extern "C" void mp_forward(void* const* p, const int64_t*, const int64_t* s, int nt) {
  MpArgs a;
  mp_args(a, s);
  const int64_t* xs = s + 14;
  const int64_t* os = s + 18;
  const float* x = (const float*)p[0];
  float* out = (float*)p[1];
  int64_t* ind = (int64_t*)p[2];
  const float ninf = -std::numeric_limits<float>::infinity();
  if (s[22]) {
    const int64_t items = a.N * a.OH;
#pragma omp parallel for num_threads(nt) schedule(static) if (nt > 1 && items > 1)
    for (int64_t t = 0; t < items; ++t) {
      const int64_t n = t / a.OH, oh = t % a.OH;
      int64_t ih0, ih1;
      mp_window(oh, a.sH, a.pH, a.kH, a.dH, a.H, ih0, ih1);
      const float* xn = x + n * xs[0];
      for (int64_t ow = 0; ow < a.OW;) {
        int64_t iw0, iw1;
        mp_window(ow, a.sW, a.pW, a.kW, a.dW, a.W, iw0, iw1);
        float* o = out + n * os[0] + oh * os[2] + ow * os[3];
        int64_t* id = ind + n * os[0] + oh * os[2] + ow * os[3];
        int64_t c0 = 0;
        // under 64 channels, 4 outputs at once when their windows are whole (same shape)
        if (a.C < 64 && ow + 4 <= a.OW && iw0 == ow * a.sW - a.pW &&
            (ow + 3) * a.sW - a.pW + (a.kW - 1) * a.dW + 1 <= a.W) {
          for (; c0 + 16 <= a.C; c0 += 16)
            mp_fwd_block<1, 4>(xn + c0, xs, a, ih0, ih1, iw0, iw1, o + c0, id + c0, os[3]);
          for (int u = 0; u < 4 && c0 < a.C; ++u)
            mp_fwd_scalar(xn, xs, a, ih0, ih1, iw0 + u * a.sW, iw1 + u * a.sW, o + u * os[3],
                          id + u * os[3], c0);
          ow += 4;
          continue;
        }
        for (; c0 + 64 <= a.C; c0 += 64)
          mp_fwd_block<4, 1>(xn + c0, xs, a, ih0, ih1, iw0, iw1, o + c0, id + c0, 0);
        for (; c0 + 16 <= a.C; c0 += 16)
          mp_fwd_block<1, 1>(xn + c0, xs, a, ih0, ih1, iw0, iw1, o + c0, id + c0, 0);
        mp_fwd_scalar(xn, xs, a, ih0, ih1, iw0, iw1, o, id, c0);
        ++ow;
      }
    }
    return;
  }
  const int64_t items = a.N * a.C * a.OH;
#pragma omp parallel for num_threads(nt) schedule(static) if (nt > 1 && items > 1)
  for (int64_t t = 0; t < items; ++t) {
    const int64_t oh = t % a.OH, nc = t / a.OH, c = nc % a.C, n = nc / a.C;
    int64_t ih0, ih1;
    mp_window(oh, a.sH, a.pH, a.kH, a.dH, a.H, ih0, ih1);
    const float* xp = x + n * xs[0] + c * xs[1];
    float* o = out + n * os[0] + c * os[1] + oh * os[2];
    int64_t* id = ind + n * os[0] + c * os[1] + oh * os[2];
    for (int64_t ow = 0; ow < a.OW;) {
      int64_t iw0, iw1;
      mp_window(ow, a.sW, a.pW, a.kW, a.dW, a.W, iw0, iw1);
      // 16 outputs with whole windows: from ow, or the row's last 16 (recomputing some:
      // the same values) when fewer than 16 are left
      const int64_t v0 = ow + 16 <= a.OW ? ow : a.OW - 16;
      if (v0 >= 0 && v0 * a.sW - a.pW >= 0 && iw0 == ow * a.sW - a.pW &&
          (v0 + 15) * a.sW - a.pW + (a.kW - 1) * a.dW + 1 <= a.W) {
        mp_fwd_plane16(xp, xs, a, ih0, ih1, v0 * a.sW - a.pW, v0 * a.sW - a.pW + (a.kW - 1) * a.dW + 1,
                       o + v0 * os[3], id + v0 * os[3], os[3]);
        ow = v0 + 16;
        continue;
      }
      float mv = ninf;
      int64_t mi = ih0 * a.W + iw0;
      for (int64_t ih = ih0; ih < ih1; ih += a.dH)
        for (int64_t iw = iw0; iw < iw1; iw += a.dW) {
          const float v = xp[ih * xs[2] + iw * xs[3]];
          const bool take = (v > mv) | (v != v);
          mv = take ? v : mv;
          mi = take ? ih * a.W + iw : mi;
        }
      o[ow * os[3]] = mv;
      id[ow * os[3]] = mi;
      ++ow;
    }
  }
}

// zero grad_in rows [from, to) of channels [c0, c1) of one channels-last image (a row: W * C
// floats; whole_rows: all channels, one memset)
static inline void mp_zero_rows(float* g, const int64_t* is, int64_t W, int64_t from,
                                int64_t to, int64_t c0, int64_t c1, bool whole_rows) {
  for (int64_t ih = from; ih < to; ++ih) {
    float* r = g + ih * is[2];
    if (whole_rows) {
      memset(r, 0, sizeof(float) * W * is[3]);
    } else {
      for (int64_t iw = 0; iw < W; ++iw) memset(r + iw * is[3] + c0, 0, sizeof(float) * (c1 - c0));
    }
  }
}

// p = grad_out, indices, grad_in, all channels-last; s = N C H W OH OW kH kW sH sW pH pW
// dH dW, strides of grad_out and indices (n c h w, the same), of grad_in.
// ATen's zero fill + scatter, in its order (per image and channel: output rows, then
// columns), each input row zeroed just before the first window reaching it scatters
// (so in cache, and no separate pass); the indices come from the forward (positions in
// their windows: the rows below a window are never zeroed after it scattered into them).
extern "C" void mp_backward(void* const* p, const int64_t*, const int64_t* s, int nt) {
  MpArgs a;
  mp_args(a, s);
  const int64_t* gs = s + 14;
  const int64_t* is = s + 18;
  const float* go = (const float*)p[0];
  const int64_t* ind = (const int64_t*)p[1];
  float* gi = (float*)p[2];
  // work items: (image, block of channels): whole images unless that leaves threads
  // idle, then blocks of 16 channels
  const int64_t cb = (a.N >= nt || a.C < 32) ? a.C : 16;
  const int64_t blocks = (a.C + cb - 1) / cb, items = a.N * blocks;
  const int64_t plane = a.H * a.W;
#pragma omp parallel for num_threads(nt) schedule(static) if (nt > 1 && items > 1)
  for (int64_t t = 0; t < items; ++t) {
    const int64_t n = t / blocks, c0 = (t % blocks) * cb, c1 = std::min<int64_t>(a.C, c0 + cb);
    const bool whole = c1 - c0 == a.C;
    float* g = gi + n * is[0];
    const float* gn = go + n * gs[0];
    const int64_t* in = ind + n * gs[0];
    int64_t zeroed = 0;  // rows [0, zeroed) of this item are zero or hold sums
    for (int64_t oh = 0; oh < a.OH; ++oh) {
      const int64_t reach = std::min<int64_t>(a.H, oh * a.sH - a.pH + (a.kH - 1) * a.dH + 1);
      if (reach > zeroed) {
        mp_zero_rows(g, is, a.W, zeroed, reach, c0, c1, whole);
        zeroed = reach;
      }
      for (int64_t ow = 0; ow < a.OW; ++ow) {
        const int64_t off = oh * gs[2] + ow * gs[3];
        const float* gp = gn + off;
        const int64_t* ip = in + off;
        for (int64_t c = c0; c < c1; ++c) {  // position q of channel c at q * C + c
          const int64_t q = ip[c];
          if ((uint64_t)q < (uint64_t)plane) g[q * a.C + c] += gp[c];
        }
      }
    }
    if (zeroed < a.H) mp_zero_rows(g, is, a.W, zeroed, a.H, c0, c1, whole);  // rows no window reaches
  }
}
"""

library: list = []  # [(call, forward address, backward address)] or [None]: no extension


def kernels():
    """(the extension's call, mp_forward's address, mp_backward's address), built on first
    use, or None without the extension (no compiler / Python headers)."""
    if not library:
        call = native_call.extension_call()
        entry = None
        if call is not None:
            lib = compiler.load_library(SOURCE, ("mp_forward", "mp_backward"))
            entry = (call, ctypes.cast(lib.mp_forward, ctypes.c_void_p).value,
                     ctypes.cast(lib.mp_backward, ctypes.c_void_p).value)
        library.append(entry)
    return library[0]


# --- parameters as ATen reads them ------------------------------------------------------
def _pair(v, default=None):
    if v is None or (isinstance(v, (list, tuple)) and len(v) == 0):
        return default
    if isinstance(v, int):
        return (v, v)
    v = tuple(v)
    if len(v) == 1:
        return (v[0], v[0])
    return v if len(v) == 2 else None


def _output_size(size, k, s, p, d, ceil_mode) -> int:
    """ATen's pooling_output_shape."""
    num = size + 2 * p - d * (k - 1) - 1 + (s - 1 if ceil_mode else 0)
    out = num // s + 1  # floor division as ATen's div_rtn
    if ceil_mode and (out - 1) * s >= size + p:
        out -= 1
    return out


def _static(seq) -> tuple | None:
    if any(is_symbolic(v) for v in seq):
        return None
    return tuple(int(v) for v in seq)


def _channels_last_strides(shape) -> tuple:
    n, c, h, w = shape
    return (h * w * c, 1, w * c, c)


def _contiguous_strides(shape) -> tuple:
    n, c, h, w = shape
    return (c * h * w, h * w, w, 1)


def _layout(shape, stride) -> str | None:
    """'cl' / 'nchw' when the strides are unambiguously that memory format (ATen's
    suggest_memory_format picks the outputs' from them), else None."""
    cl, nchw = _channels_last_strides(shape), _contiguous_strides(shape)
    if stride == cl and stride != nchw:
        return "cl"
    if stride == nchw and stride != cl:
        return "nchw"
    return None


def _window_params(args, first: int) -> tuple | str:
    """(kernel, stride, padding, dilation, ceil_mode) from the op's arguments after its
    tensors, or why not."""
    k = _pair(args[first] if len(args) > first else None)
    s = _pair(args[first + 1] if len(args) > first + 1 else None, k)
    p = _pair(args[first + 2] if len(args) > first + 2 else 0, (0, 0))
    d = _pair(args[first + 3] if len(args) > first + 3 else 1, (1, 1))
    ceil = args[first + 4] if len(args) > first + 4 else False
    params = (k, s, p, d)
    if any(v is None or not all(isinstance(x, int) for x in v) for v in params) \
            or not isinstance(ceil, bool):
        return "kernel size / stride / padding / dilation not static pairs"
    if min(k) < 1 or min(s) < 1 or min(d) < 1 or min(p) < 0 \
            or p[0] * 2 > k[0] or p[1] * 2 > k[1]:
        return "window parameters ATen rejects"
    return (*params, ceil)


def _operand(specs, arg, what) -> tuple | str:
    """(shape, stride, layout) of a float32 4-d static tensor operand, or why not."""
    spec = specs.get(getattr(arg, "name", None))
    if spec is None:
        return f"{what} not a tensor of the graph"
    if spec.dtype != torch.float32:
        return f"dtype {spec.dtype} (native: float32)"
    if len(spec.shape) != 4:
        return f"{what} of {len(spec.shape)} dims (native: 4)"
    shape, stride = _static(spec.shape), _static(spec.stride)
    if shape is None or stride is None:
        return "symbolic sizes"
    if min(shape) == 0:
        return "empty tensor"
    layout = _layout(shape, stride)
    if layout is None:
        return f"{what} strides {stride} neither channels-last nor contiguous"
    return shape, stride, layout


def _eligible(specs, x_arg, window) -> tuple | str:
    if not NATIVE_POOLING:
        return "NATIVE_POOLING is off"
    x = _operand(specs, x_arg, "input")
    if isinstance(x, str):
        return x
    if isinstance(window, str):
        return window
    (kh, kw), (sh, sw), (ph, pw), (dh, dw), ceil = window
    n, c, h, w = x[0]
    oh, ow = _output_size(h, kh, sh, ph, dh, ceil), _output_size(w, kw, sw, pw, dw, ceil)
    if oh <= 0 or ow <= 0:
        return "empty output (ATen raises)"
    if h * w >= 2 ** 31:
        return "planes of 2^31 elements or more (the forward's positions are int32)"
    if kernels() is None:
        return "no native call extension (C++ compiler / Python headers)"
    window_syms = (n, c, h, w, oh, ow, kh, kw, sh, sw, ph, pw, dh, dw)
    return x, (n, c, oh, ow), window_syms


def _out_strides(shape, layout) -> tuple:
    return _channels_last_strides(shape) if layout == "cl" else _contiguous_strides(shape)


# --- binders ------------------------------------------------------------------------------
def bind_forward(step, specs) -> tuple:
    """(callable, why) for a ``max_pool2d_with_indices`` extern step: the native kernel for
    a float32 4-d static input, channels-last or contiguous, else (None, why not)."""
    args = list(step.args)
    checked = _eligible(specs, args[0] if args else None, _window_params(args, 1))
    if isinstance(checked, str):
        return None, checked
    (shape, stride, layout), out_shape, window_syms = checked
    ostride = _out_strides(out_shape, layout)
    syms = (*window_syms, *stride, *ostride, int(layout == "cl"))
    call, address, _ = kernels()
    nthreads = torch.get_num_threads
    empty = torch.empty_strided
    f32, i64 = torch.float32, torch.int64

    def max_pool2d_with_indices(x, *rest, **kw):
        if x.stride() != stride:  # the graph was planned for these strides; anything else
            return ATEN_FORWARD(x, *rest, **kw)  # is ATen's
        out = empty(out_shape, ostride, dtype=f32)
        ind = empty(out_shape, ostride, dtype=i64)
        call(address, (x, out, ind), 0, syms, nthreads())
        return out, ind

    max_pool2d_with_indices._schema = ATEN_FORWARD._schema  # fresh outputs (graph/buffers.py)
    return max_pool2d_with_indices, (
        f"native max pool forward (codegen/cpp/pooling.py, {layout}, kernel {window_syms[6:8]}, "
        f"stride {window_syms[8:10]}, padding {window_syms[10:12]})")


def bind_backward(step, specs) -> tuple:
    """(callable, why) for a ``max_pool2d_with_indices_backward`` extern step (grad_output,
    self, kernel_size, stride, padding, dilation, ceil_mode, indices): the native scatter
    where the input qualifies as for the forward and is channels-last, and grad_output /
    indices have the output's shape and memory format."""
    args = list(step.args)
    if len(args) != 8:
        return None, "arguments not as the schema's 8"
    checked = _eligible(specs, args[1], _window_params(args[:7], 2))
    if isinstance(checked, str):
        return None, checked
    (shape, stride, layout), out_shape, window_syms = checked
    if layout != "cl":  # the same scatter runs no faster than ATen's on NCHW planes
        return None, "contiguous NCHW (native backward: channels-last)"
    go = _operand(specs, args[0], "grad_output")
    if isinstance(go, str):
        return None, go
    ispec = specs.get(getattr(args[7], "name", None))
    if ispec is None or ispec.dtype != torch.int64:
        return None, "indices not an int64 tensor of the graph"
    ostride = _out_strides(out_shape, layout)
    if go[0] != out_shape or go[1] != ostride or _static(ispec.stride) != ostride \
            or _static(ispec.shape) != out_shape:
        return None, "grad_output / indices not in the output's shape and memory format"
    syms = (*window_syms, *ostride, *stride)
    call, _, address = kernels()
    nthreads = torch.get_num_threads
    empty = torch.empty_strided
    f32 = torch.float32

    def max_pool2d_with_indices_backward(grad_output, x, *rest):
        indices = rest[-1]
        if grad_output.stride() != ostride or indices.stride() != ostride:
            return ATEN_BACKWARD(grad_output, x, *rest)
        grad_input = empty(shape, stride, dtype=f32)
        call(address, (grad_output, indices, grad_input), 0, syms, nthreads())
        return grad_input

    max_pool2d_with_indices_backward._schema = ATEN_BACKWARD._schema
    return max_pool2d_with_indices_backward, (
        f"native max pool backward (codegen/cpp/pooling.py, {layout}): ATen's scatter in its "
        "order, each input row zeroed as the first window reaches it (no zero-fill pass)")
