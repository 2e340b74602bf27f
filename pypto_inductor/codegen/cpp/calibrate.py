"""The native kernels the host calibration times (:mod:`pypto_inductor.calibrate`).

- per-call cost: a trivial native kernel (one element) called through the cpu
  target's wrapper (output allocation, stride key, the call), the fastest
  batch's per-call average;
- compute: a native ``exp`` over a cache-resident buffer on one thread, timed by that
  thread's CPU time and scaled by torch's thread count (exp is compute-bound: it scales
  with threads; timing every thread by the wall clock read 8.8e7 flops/s instead of
  ~1e10 on a machine loaded 4x, a barrier waiting for a descheduled thread), counted at
  the ROI model's weight of ``exp`` in flops per element (:data:`ops.OPS`), so the
  roofline's compute term is what this CPU really sustains on the transcendental math
  our kernels are made of (not a theoretical FMA peak);
- :func:`breakdown`: the pieces of one native call, for docs/runtime_overhead.md.
"""
from __future__ import annotations

import ctypes
import statistics
import time
import timeit

import torch

from ...ir import TensorSpec
from ...ops import flop_weight
from . import alloc, compiler, launcher, native_call
from .prelude import PRELUDE
from .program import SYMBOL, Program

TRIVIAL = ('#include <cstdint>\nextern "C" void pi_kernel(void* const* ptrs, const int64_t* meta, '
           'const int64_t* syms, int nt) '
           '{ ((float*)ptrs[1])[0] = ((const float*)ptrs[0])[0] + 1.0f; }\n')

EXP_KERNEL = r"""
extern "C" void pi_kernel(void* const* ptrs, const int64_t* meta, const int64_t* syms, int nt) {
  const float* __restrict__ in = (const float*)ptrs[0];
  float* __restrict__ out = (float*)ptrs[1];
  const int64_t n = meta[0];
  #pragma omp parallel for simd num_threads(nt) schedule(static)
  for (int64_t i = 0; i < n; ++i) out[i] = pi_exp(in[i]);
}
"""


def trivial_kernel():
    """The one-element kernel (x + 1) through the cpu target's wrapper, and its C function."""
    fn = compiler.load(TRIVIAL, SYMBOL)
    spec = TensorSpec((1,), (1,), torch.float32)
    program = Program(shape=(1,), m=1, reduction=False, nodes=[], accesses=[],
                      input_specs=[spec], outputs=[(None, spec)], fast=[], symbols=[])
    return launcher.native_kernel(fn, program), fn


def measure_call_us(calls: int = 500, batches: int = 7, warmup: int = 2000) -> float | None:
    """Microseconds per call of a trivial native kernel through the cpu target's wrapper."""
    if compiler.find_compiler() is None:
        return None
    kernel = trivial_kernel()[0].fn  # what the runtime calls
    x = [torch.zeros(1)]
    for _ in range(warmup):  # the first calls run slower (caches, branch predictors)
        kernel(x, ())
    assert float(kernel(x, ())[0][0]) == 1.0
    per_call = []
    for _ in range(batches):
        start = time.perf_counter()
        for _ in range(calls):
            kernel(x, ())
        per_call.append((time.perf_counter() - start) / calls * 1e6)
    return min(per_call)  # the least disturbed batch, as for the bandwidth


def measure_flops(elems: int = 1 << 17, repeats: int = 31) -> float | None:
    """Flops per second of the native ``exp`` on torch's threads (at the ROI model's flops
    per exp)."""
    if compiler.find_compiler() is None:
        return None
    fn = compiler.load(PRELUDE + EXP_KERNEL, SYMBOL)
    x, y = torch.randn(elems), torch.empty(elems)
    ptrs = (ctypes.c_void_p * 2)(x.data_ptr(), y.data_ptr())
    meta, syms = (ctypes.c_int64 * 1)(elems), (ctypes.c_int64 * 1)(0)
    fn(ptrs, meta, syms, 1)
    torch.testing.assert_close(y, x.exp())
    times = []
    for _ in range(repeats):
        start = time.thread_time()
        fn(ptrs, meta, syms, 1)
        times.append(time.thread_time() - start)
    return elems * flop_weight("exp") / min(times) * torch.get_num_threads()


def breakdown(number: int = 20000, repeat: int = 7) -> dict:
    """Median microseconds of the pieces of one native call, and of whole compiled calls."""
    kernel, fn = trivial_kernel()
    kernel = kernel.fn
    call = native_call.extension_call()
    x, o = torch.zeros(1), torch.empty(1)
    ptrs = (ctypes.c_void_p * 2)(x.data_ptr(), o.data_ptr())
    meta, syms = (ctypes.c_int64 * 2)(1, 1), (ctypes.c_int64 * 1)(0)
    address = ctypes.cast(fn, ctypes.c_void_p).value
    meta_address, syms_address = ctypes.addressof(meta), ctypes.addressof(syms)

    def fill():
        ptrs[0] = x.data_ptr()
        ptrs[1] = o.data_ptr()

    def chain(x):
        return ((x + 1.0) * 2.0).exp()

    compiled = torch.compile(chain, backend="pypto", options={"target": "cpu"})
    with torch.no_grad():
        compiled(x)
    pieces = {
        "native kernel call through the wrapper (gc on)": lambda: kernel([x], ()),
        "  output allocation (alloc.empty)": lambda: alloc.empty((1,), torch.float32),
        "  stride key of the inputs": lambda: ((), x.stride()),
        **({"  extension call (data pointers, compiled function)":
            lambda: call(address, (x, o), meta_address, syms_address, 2)} if call else {}),
        "  ctypes instead: call of the compiled function": lambda: fn(ptrs, meta, syms, 2),
        "  ctypes instead: filling the pointer array": fill,
        "torch.empty(1), for comparison": lambda: torch.empty((1,), dtype=torch.float32),
        "eager ((x + 1) * 2).exp() on 1 element (3 ATen ops)": lambda: chain(x),
        "torch.compile(backend='pypto') same chain, 1 kernel": lambda: compiled(x),
    }
    out = {}
    with torch.no_grad():
        for label, f in pieces.items():
            n = number // 10 if "compile" in label or "eager" in label else number
            setup = "import gc; gc.enable()" if "gc on" in label else "pass"
            times = timeit.repeat(f, setup=setup, number=n, repeat=repeat)
            out[label] = statistics.median(times) / n * 1e6
    return out
