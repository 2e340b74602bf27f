"""The native prelude's erf and GELU against an older revision's (docs/fuzz.md, k12g):
accuracy on dense grids against float64 (eager's alongside) and the time of a one-thread
loop over 4096x1024 float32, both preludes compiled into two libraries loaded in one
process, calls interleaved, medians of thread time.

    python -m benchmarks.erf_prelude [--base 52ba8bd] [--repeats 30]
"""
from __future__ import annotations

import argparse
import ctypes
import math
import os
import statistics
import subprocess
import tempfile
import time
import types

import torch
import torch.nn.functional as F

from pypto_inductor.codegen.cpp import compiler
from pypto_inductor.codegen.cpp import prelude as new

ap = argparse.ArgumentParser()
ap.add_argument("--base", default="52ba8bd", help="git revision of the old prelude")
ap.add_argument("--repeats", type=int, default=30)
args = ap.parse_args()
root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
old = types.ModuleType("old_prelude")
exec(subprocess.run(["git", "show", f"{args.base}:pypto_inductor/codegen/cpp/prelude.py"], cwd=root,
                    check=True, capture_output=True, text=True).stdout, old.__dict__)
tmp = tempfile.mkdtemp()
BODY = r'''
extern "C" void gelu(const float* x, float* y, long n) {
  #pragma omp simd
  for (long i = 0; i < n; ++i) y[i] = pi_gelu(x[i], true);
}
extern "C" void erf_(const float* x, float* y, long n) {
  #pragma omp simd
  for (long i = 0; i < n; ++i) y[i] = pi_erf(x[i]);
}
'''
libs = {}
for name, mod in (("old", old), ("new", new)):
    src, so = os.path.join(tmp, f"{name}.cpp"), os.path.join(tmp, f"{name}.so")
    with open(src, "w") as f:
        f.write(mod.PRELUDE + BODY)
    # the kernels' own flags, one thread (no OpenMP runtime needed for `omp simd`)
    subprocess.run(["g++", *compiler.NATIVE_FLAGS, *compiler.BASE_FLAGS, src, "-o", so], check=True)
    libs[name] = ctypes.CDLL(so)
def call(lib, fn, x):
    y = torch.empty_like(x)
    getattr(lib, fn)(ctypes.c_void_p(x.data_ptr()), ctypes.c_void_p(y.data_ptr()), ctypes.c_long(x.numel()))
    return y
def ulps(v, r):  # error in units of the float32 spacing at the float64 value
    sp = torch.nextafter(r.float().abs(), torch.tensor(math.inf)) - r.float().abs()
    return ((v.double() - r).abs() / sp.double())
x = torch.linspace(-6, 6, 2_000_001, dtype=torch.float32)
r = torch.erf(x.double())
print("erf max/mean ulps over [-6, 6]: eager %.3f/%.4f" % (ulps(torch.erf(x), r).max(), ulps(torch.erf(x), r).mean()),
      *("%s %.3f/%.4f" % (k, ulps(call(l, "erf_", x), r).max(), ulps(call(l, "erf_", x), r).mean()) for k, l in libs.items()))
x = torch.linspace(-10, 10, 4_000_001, dtype=torch.float32)
x64 = x.double(); g64 = x64 * 0.5 * torch.special.erfc(-x64 / math.sqrt(2))
outs = {"eager": F.gelu(x), **{k: call(l, "gelu", x) for k, l in libs.items()}}
print("gelu max relative error vs float64 per band (elements where float64 != 0):")
for lo, hi in [(-10, -5.5), (-5.5, -4.5), (-4.5, -3.5), (-3.5, -2.5), (-2.5, -1.0), (-1.0, 0.0), (0.0, 10.0)]:
    m = (x >= lo) & (x < hi) & (g64 != 0)
    print(f"  [{lo:5}, {hi:5}):", "  ".join(f"{k} {((v.double()[m] - g64[m]).abs() / g64[m].abs()).max():.3g}" for k, v in outs.items()))
xs = torch.tensor([-math.inf, math.inf, math.nan, -math.nan, -0.0, 0.0, -5.6, -30.0, -3e38, 3e38, 1e-45, -1e-45] * 2)
for k, l in libs.items():
    print(k, "specials gelu", call(l, "gelu", xs)[:12].tolist(), "signbit", torch.signbit(call(l, "gelu", xs))[:12].tolist())
print("eager specials gelu", F.gelu(xs)[:12].tolist(), "signbit", torch.signbit(F.gelu(xs))[:12].tolist())
big = torch.randn(4096, 1024) * 3; out = torch.empty_like(big)
for fn in ("gelu", "erf_"):
  times = {k: [] for k in libs}; ttimes = {k: [] for k in libs}
  for rep in range(args.repeats):
    for k, l in libs.items():
        t0, c0 = time.perf_counter(), time.thread_time()
        getattr(l, fn)(ctypes.c_void_p(big.data_ptr()), ctypes.c_void_p(out.data_ptr()), ctypes.c_long(big.numel()))
        ttimes[k].append((time.thread_time() - c0) * 1e6); times[k].append((time.perf_counter() - t0) * 1e6)
  print(f"{fn} 4096x1024 f32 one thread, median us: " + ", ".join(f"{k} wall {statistics.median(times[k]):.0f} thread {statistics.median(ttimes[k]):.0f}" for k in libs),
      "new/old thread %.2f" % (statistics.median(ttimes["new"]) / statistics.median(ttimes["old"])))
