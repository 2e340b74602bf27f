"""``index_put(accumulate=True)`` along dim 0 as a native loop (embedding's backward).

The embedding backward reaches the graph as ``full`` zeros + ``index_put(accumulate=True)``
of the gradient rows at the token ids (core's decomposition of ``embedding_dense_backward``).
The reference executor ran it through ``aten.index_put``: a TensorIterator per element, and
about 145 us for T5's relative-position bias (16384 ids into 32 rows of 4).

Here it is one C function for every graph: copy ``x``, check every index (before any
write, so an out-of-range index raises eager's IndexError and never writes out of
bounds), then add the value rows in index order. That is the order of eager's serial
loops (``index_put_`` accumulate, ``embedding_dense_backward_cpu`` per row), so float
results are the same bits; half types round after each add, as ``c10::BFloat16 +=`` does.
The loop is serial: eager's multi-threaded float path adds atomically in no fixed order.
Only a single integer index on dim 0 with a tensor of values is handled; the rest
(bool masks, several index tensors, a scalar value, assignment) keeps the reference.

With ``ONE_CALL`` (contiguous operands of eager's shapes), the copy of ``x`` is in the same
native call, made through the extension every other native kernel goes through
(:mod:`.native_call`), into a buffer from :func:`.alloc.empty`: no ATen ``clone`` /
``reshape`` and no ctypes call. In BERT's training step the first of these kernels took
~60-80 us of thread CPU time for 128 rows (~5 us when repeated at once): each code path
it used for the first time in the step (ATen's dispatcher, the copy kernel, ctypes) cost
~30 us cold; the paths every other kernel uses are warm.
"""
from __future__ import annotations

import ctypes
import math

import sympy
import torch

from ...ir import FusionTile, TileGraph
from ...sizes import contiguous_strides
from .. import Kernel
from . import alloc, compiler, native_call
from .prelude import PRELUDE

DTYPES = {torch.float32: 0, torch.float64: 1, torch.bfloat16: 2, torch.float16: 3}
INDEX_DTYPES = {torch.int64: 0, torch.int32: 1}
NATIVE = True  # the benchmarks' switch: False runs these tiles on the reference executor
ONE_CALL = True  # copy + adds in one extension call (module docstring); False: clone + ctypes

SOURCE = PRELUDE + r"""
// the first index outside [-rows, rows) plus one, else 0 (nothing written then)
template <typename I>
static int64_t pi_check(const I* idx, int64_t n, int64_t rows) {
  for (int64_t i = 0; i < n; ++i)
    if ((int64_t)idx[i] < -rows || (int64_t)idx[i] >= rows) return i + 1;
  return 0;
}

// W > 0: rows of a width known here (T5's relative-position bias: 16384 rows of 4, where
// the generic loop's per-row vectoriser checks cost more than the adds)
template <int W, typename T, typename I>
static void pi_add_rows_w(T* out, const T* v, const I* idx, int64_t n, int64_t rows,
                          int64_t w) {
  const int64_t width = W > 0 ? W : w;
  for (int64_t i = 0; i < n; ++i) {
    int64_t k = (int64_t)idx[i];
    k += k < 0 ? rows : 0;
    T* __restrict o = out + k * width;
    const T* __restrict s = v + i * width;
    for (int64_t j = 0; j < width; ++j) o[j] += s[j];
  }
}

template <typename T, typename I>
static void pi_add_rows(T* out, const T* v, const I* idx, int64_t n, int64_t rows, int64_t w) {
  switch (w) {
    case 1: pi_add_rows_w<1>(out, v, idx, n, rows, w); break;
    case 2: pi_add_rows_w<2>(out, v, idx, n, rows, w); break;
    case 4: pi_add_rows_w<4>(out, v, idx, n, rows, w); break;
    case 8: pi_add_rows_w<8>(out, v, idx, n, rows, w); break;
    case 16: pi_add_rows_w<16>(out, v, idx, n, rows, w); break;
    default: pi_add_rows_w<0>(out, v, idx, n, rows, w);
  }
}

template <uint16_t (*ST)(float), float (*LD)(uint16_t), typename I>
static void pi_add_rows16(uint16_t* out, const uint16_t* v, const I* idx, int64_t n,
                          int64_t rows, int64_t w) {
  for (int64_t i = 0; i < n; ++i) {
    int64_t k = (int64_t)idx[i];
    k += k < 0 ? rows : 0;
    uint16_t* __restrict o = out + k * w;
    const uint16_t* __restrict s = v + i * w;
    for (int64_t j = 0; j < w; ++j) o[j] = ST(LD(o[j]) + LD(s[j]));
  }
}

template <typename I>
static int64_t pi_run(void* out, const void* v, const I* idx, int64_t dt, int64_t n,
                      int64_t rows, int64_t w) {
  int64_t bad = pi_check(idx, n, rows);
  if (bad) return bad;
  switch (dt) {
    case 0: pi_add_rows((float*)out, (const float*)v, idx, n, rows, w); break;
    case 1: pi_add_rows((double*)out, (const double*)v, idx, n, rows, w); break;
    case 2:  // eager's scalar accumulate: c10::BFloat16's NaN (0x7fc0)
      pi_add_rows16<st_bf16_scalar, ld_bf16>((uint16_t*)out, (const uint16_t*)v, idx, n, rows,
                                             w);
      break;
    default: pi_add_rows16<st_f16, ld_f16>((uint16_t*)out, (const uint16_t*)v, idx, n, rows, w);
  }
  return 0;
}

static int64_t pi_dispatch(void* out, const void* v, const void* idx, int64_t it, int64_t dt,
                           int64_t n, int64_t rows, int64_t w) {
  return it ? pi_run(out, v, (const int32_t*)idx, dt, n, rows, w)
            : pi_run(out, v, (const int64_t*)idx, dt, n, rows, w);
}

// native_call's convention: p = x, values, index, out, status; s = it, dt, n, rows, w.
// out is a fresh buffer: on a bad index (checked before any add) the caller drops it.
extern "C" void pi_index_put_call(void* const* p, const int64_t*, const int64_t* s, int) {
  const int64_t size = s[1] == 1 ? 8 : s[1] == 0 ? 4 : 2;
  if (s[3] * s[4]) memcpy(p[3], p[0], (size_t)(s[3] * s[4] * size));
  *(int64_t*)p[4] = pi_dispatch(p[3], p[1], p[2], s[0], s[1], s[2], s[3], s[4]);
}

extern "C" int64_t pi_index_put_add(void* out, const void* v, const void* idx, int64_t it,
                                    int64_t dt, int64_t n, int64_t rows, int64_t w) {
  return pi_dispatch(out, v, idx, it, dt, n, rows, w);
}
"""
_function = None


def _load():
    global _function
    if _function is None:
        fn = compiler.load(SOURCE, "pi_index_put_add")
        fn.restype = ctypes.c_int64
        fn.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 5
        _function = fn
    return _function


def eligible(tile: FusionTile, graph: TileGraph) -> bool:
    """One ``index_put(accumulate=True)`` with one integer index on dim 0, tensor values,
    a float result declared contiguous, and a C++ compiler to build the loop with."""
    if not NATIVE or len(tile.ops) != 1 or tile.ops[0].op != "index_put":
        return False
    op = tile.ops[0]
    attrs = dict(op.attrs)
    if not attrs.get("accumulate") or tuple(attrs.get("positions", ())) != (0,) \
            or len(op.args) != 3 or not all(isinstance(a, str) for a in op.args):
        return False
    x, values, index = (graph.specs.get(a) for a in op.args)
    out = graph.specs.get(tile.outputs[0]) if len(tile.outputs) == 1 else None
    if out is None or x is None or values is None or index is None or not x.shape:
        return False
    if x.dtype not in DTYPES or values.dtype != x.dtype or index.dtype not in INDEX_DTYPES:
        return False
    if any(sympy.simplify(a - b) != 0 for a, b, n in
           zip(out.stride, contiguous_strides(out.shape), out.shape) if n != 1):
        return False
    return compiler.find_compiler() is not None


def _one_call():
    """(the extension's call_status, pi_index_put_call's address), or None without the
    extension (ctypes then)."""
    global _call
    if _call is None:
        call = native_call.extension_call_status()
        lib = compiler.load_library(SOURCE, ("pi_index_put_call",))
        address = ctypes.cast(lib.pi_index_put_call, ctypes.c_void_p).value
        _call = (call, address) if call is not None else False
    return _call or None


_call = None


def build(tile: FusionTile, graph: TileGraph) -> Kernel:
    """The tile's kernel: ``out = x.clone(); out[idx] += values`` in one native call."""
    fn = _load()
    one = _one_call() if ONE_CALL else None
    if one is not None:
        return _build_one_call(tile, graph, one, fn)
    return Kernel(_generic(tile, graph, fn), native=True)


def _generic(tile: FusionTile, graph: TileGraph, fn):
    """``out = x.clone(); out[idx] += values`` with the ctypes function ``fn``."""
    x_spec = graph.specs[tile.ops[0].args[0]]
    dt = DTYPES[x_spec.dtype]
    # the operands' slots in the tile's inputs (x, values, index)
    slots = [tile.inputs.index(a) for a in tile.ops[0].args]
    ix, iv, ii = slots

    def kernel(inputs: list, syms: tuple) -> list:
        x, values, index = inputs[ix], inputs[iv], inputs[ii]
        out = x.clone(memory_format=torch.contiguous_format)
        rows = x.shape[0]
        width = math.prod(x.shape[1:])
        shape = index.shape + x.shape[1:]
        if values.shape != shape or not values.is_contiguous():
            values = values.expand(shape).contiguous()  # eager's broadcast (errors alike)
        index = index.reshape(-1).contiguous()
        n = index.numel()
        bad = fn(out.data_ptr(), values.data_ptr(), index.data_ptr(),
                 INDEX_DTYPES[index.dtype], dt, n, rows, width)
        if bad:
            raise IndexError(f"index {int(index[bad - 1])} is out of bounds for dimension 0 "
                             f"with size {rows}")
        return [out]

    return kernel


def _build_one_call(tile: FusionTile, graph: TileGraph, one: tuple, fn) -> Kernel:
    """``ONE_CALL``'s kernel: contiguous operands of eager's shapes in one extension call
    (copy, check, adds); anything else through the ctypes kernel of :func:`build`."""
    call_status, address = one
    x_spec = graph.specs[tile.ops[0].args[0]]
    dt = DTYPES[x_spec.dtype]
    dtype = x_spec.dtype
    ix, iv, ii = [tile.inputs.index(a) for a in tile.ops[0].args]
    generic = _generic(tile, graph, fn)

    # (syms, strides) -> (out shape, the call's numbers) or None (the clone path): the
    # size symbols and the strides fix the shapes, and stride() is the call the graph code
    # makes for every kernel (a code path already warm, where shape checks were not)
    layouts: dict = {}

    def layout(x, values, index, key):
        shape = x.shape
        ok = bool(shape) and values.shape == index.shape + shape[1:] and x.is_contiguous() \
            and values.is_contiguous() and index.is_contiguous() and x.dtype == dtype \
            and values.dtype == dtype and index.dtype in INDEX_DTYPES
        entry = ((tuple(shape), (INDEX_DTYPES[index.dtype], dt, index.numel(), shape[0],
                                 math.prod(shape[1:]))) if ok else None)
        if len(layouts) >= 64:
            layouts.clear()
        layouts[key] = entry
        return entry

    def kernel(inputs: list, syms: tuple) -> list:
        x, values, index = inputs[ix], inputs[iv], inputs[ii]
        key = (syms, x.stride(), values.stride(), index.stride())
        entry = layouts.get(key, False)
        if entry is False:
            entry = layout(x, values, index, key)
        if entry is None:
            return generic(inputs, syms)
        out = alloc.empty(entry[0], dtype)
        bad = call_status(address, (x, values, index, out), 0, entry[1], 1)
        if bad:
            raise IndexError(f"index {int(index.reshape(-1)[bad - 1])} is out of bounds for "
                             f"dimension 0 with size {entry[0][0]}")
        return [out]

    return Kernel(kernel, native=True)
