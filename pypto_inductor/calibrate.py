"""Calibrated host numbers for the ROI model: copy bandwidth, per-call cost, compute rate.

Measured once per machine on first use of :func:`hardware.host` (well under a
second) and cached on disk as JSON under ``$PYPTO_INDUCTOR_CACHE_DIR`` (default
``~/.cache/pypto_inductor``)``/host_calibration.json``, keyed by the CPU model
and core count; written atomically under a file lock. Never on a kernel's call
path. ``PYPTO_INDUCTOR_NO_CALIBRATE=1`` keeps the built-in defaults (the test
suite sets it so planner tests do not depend on the machine's timing).

- bandwidth: a large ``torch`` copy (read + write bytes over time), the fastest
  of 7, with the current torch thread count;
- per-call cost: a trivial native kernel (one element) called through the cpu
  target's wrapper (output allocation, stride key, the call), the
  fastest batch's per-call average;
- compute: a native ``exp`` over a cache-resident buffer with every thread,
  counted at the ROI model's weight of ``exp`` in flops per element, so the
  roofline's compute term is what this CPU really sustains on the transcendental
  math our kernels are made of (not a theoretical FMA peak).

Each is the best of its repeats: on a shared machine other jobs only ever slow
a measurement down, and a model calibrated while another job ran (12 GB/s on a
30 GB/s machine) called compute-heavy softmax tiles memory-bound.

``python -m pypto_inductor.calibrate`` measures afresh and prints the numbers.
"""
from __future__ import annotations

import json
import os
import platform
import statistics
import tempfile
import time
import warnings
from pathlib import Path

ENV_OFF = "PYPTO_INDUCTOR_NO_CALIBRATE"
# bumped when what is measured changes (3: the straight-line wrapper; 4: best of repeats)
VERSION = 4
_TRIVIAL = ('#include <cstdint>\nextern "C" void pi_kernel(void* const* ptrs, const int64_t* meta, '
            'const int64_t* syms, int nt) '
            '{ ((float*)ptrs[1])[0] = ((const float*)ptrs[0])[0] + 1.0f; }\n')


def disabled() -> bool:
    return os.environ.get(ENV_OFF, "").strip().lower() not in ("", "0", "false", "no")


def cache_file() -> Path:
    from .config import cache_dir

    return cache_dir("host_calibration.json")


def _cores() -> int:
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("model name", "Model")):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_key() -> str:
    return f"v{VERSION}|{cpu_model()}|{_cores()} cores"


def measure_bandwidth(nbytes: int | None = None, repeats: int = 7, stat=min) -> float:
    """Bytes per second of a large torch copy (bytes read + bytes written), from ``stat`` of
    the times of ``repeats`` copies. The model takes the fastest: other jobs on a shared
    machine only ever slow a copy down, so it is the one closest to what the machine can
    do (a median taken while the test suite ran beside it once gave 12 GB/s on a 30 GB/s
    machine). Benchmarks comparing with median kernel times take the median."""
    import torch

    from .hardware import MiB, _sysfs_cache_bytes

    if nbytes is None:
        nbytes = min(max(64 * MiB, 2 * _sysfs_cache_bytes(3, 32 * MiB)), 256 * MiB)
    src = torch.ones(nbytes // 4, dtype=torch.float32)
    dst = torch.empty_like(src)
    dst.copy_(src)  # first touch
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - start)
    return 2 * src.numel() * 4 / stat(times)


def measure_call_us(calls: int = 500, batches: int = 7, warmup: int = 2000) -> float | None:
    """Microseconds per call of a trivial native kernel through the cpu target's wrapper."""
    import torch

    from .codegen import cpp, cpp_build
    from .ir import TensorSpec

    if cpp_build.find_compiler() is None:
        return None
    fn = cpp_build.load(_TRIVIAL, cpp.SYMBOL)
    spec = TensorSpec((1,), (1,), torch.float32)
    program = cpp.Program(shape=(1,), m=1, reduction=False, nodes=[], accesses=[],
                          input_specs=[spec], outputs=[(None, spec)], fast=[], symbols=[])
    kernel = cpp._native_kernel(fn, program)
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


_EXP_KERNEL = r"""
extern "C" void pi_kernel(void* const* ptrs, const int64_t* meta, const int64_t* syms, int nt) {
  const float* __restrict__ in = (const float*)ptrs[0];
  float* __restrict__ out = (float*)ptrs[1];
  const int64_t n = meta[0];
  #pragma omp parallel for simd num_threads(nt) schedule(static)
  for (int64_t i = 0; i < n; ++i) out[i] = pi_exp(in[i]);
}
"""


def measure_flops(elems: int = 1 << 17, repeats: int = 31) -> float | None:
    """Flops per second of the native ``exp`` (at the ROI model's flops per exp)."""
    import ctypes

    import torch

    from .codegen import cpp_build
    from .codegen.cpp_prelude import PRELUDE
    from .fusion.roi import transcendental_flops

    if cpp_build.find_compiler() is None:
        return None
    fn = cpp_build.load(PRELUDE + _EXP_KERNEL, "pi_kernel")
    x, y = torch.randn(elems), torch.empty(elems)
    ptrs = (ctypes.c_void_p * 2)(x.data_ptr(), y.data_ptr())
    meta, syms = (ctypes.c_int64 * 1)(elems), (ctypes.c_int64 * 1)(0)
    threads = torch.get_num_threads()
    fn(ptrs, meta, syms, threads)
    torch.testing.assert_close(y, x.exp())
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn(ptrs, meta, syms, threads)
        times.append(time.perf_counter() - start)
    return elems * transcendental_flops("exp") / min(times)


def measure() -> dict:
    """Both numbers, on real tensors even when called while the backend traces (fake mode)."""
    import torch
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.utils._python_dispatch import _disable_current_modes

    start = time.perf_counter()
    with unset_fake_temporarily(), _disable_current_modes(), torch.no_grad():
        bw = measure_bandwidth()
        call = measure_call_us()
        flops = measure_flops()
    return {"gm_bandwidth_bytes_per_s": bw, "launch_us": call, "vector_flops_per_s": flops,
            "threads": torch.get_num_threads(), "cpu_model": cpu_model(), "cores": _cores(),
            "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "seconds": round(time.perf_counter() - start, 3)}


def _read(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def _write(path: Path, data: dict) -> None:
    fd, tmp = tempfile.mkstemp(suffix=".json.tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=1, sort_keys=True)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def host_numbers() -> dict | None:
    """The cached (or freshly measured) numbers for this machine; None when disabled/failed."""
    if disabled():
        return None
    path = cache_file()
    key = machine_key()
    entry = _read(path).get(key)
    if entry:
        return entry
    try:
        from filelock import FileLock

        path.parent.mkdir(parents=True, exist_ok=True)
        with FileLock(str(path) + ".lock"):
            data = _read(path)  # another process may have measured meanwhile
            if key not in data:
                data[key] = measure()
                _write(path, data)
            return data[key]
    except Exception as e:  # noqa: BLE001 - calibration must never break compilation
        warnings.warn(f"pypto_inductor: host calibration failed ({e}); using defaults",
                      stacklevel=2)
        return None


def breakdown(number: int = 20000, repeat: int = 7) -> dict:
    """Median microseconds of the pieces of one native call, and of whole compiled calls."""
    import ctypes
    import timeit

    import torch

    from .codegen import cpp, cpp_build, host_alloc, native_call
    from .ir import TensorSpec

    fn = cpp_build.load(_TRIVIAL, cpp.SYMBOL)
    call = native_call.extension_call()
    spec = TensorSpec((1,), (1,), torch.float32)
    program = cpp.Program(shape=(1,), m=1, reduction=False, nodes=[], accesses=[],
                          input_specs=[spec], outputs=[(None, spec)], fast=[], symbols=[])
    kernel = cpp._native_kernel(fn, program)
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
        "  output allocation (host_alloc.empty)": lambda: host_alloc.empty((1,), torch.float32),
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


if __name__ == "__main__":
    import torch

    torch.set_num_threads(int(os.environ.get("THREADS", "2")))
    numbers = measure()
    print(json.dumps(numbers, indent=1))
    for label, us in breakdown().items():
        print(f"{label:<58} {us:8.2f} us")
