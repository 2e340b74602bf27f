"""Calibrated host numbers for the ROI model: copy bandwidth, per-call cost, compute rate.

Measured once per machine on first use (well under a second) and cached on disk
as JSON under ``$PYPTO_INDUCTOR_CACHE_DIR`` (default ``~/.cache/pypto_inductor``)
``/host_calibration.json``, keyed by the CPU model and core count; written
atomically under a file lock. Never on a kernel's call path. The backend asks
:func:`hardware_model`, which hands the numbers to :func:`hardware.host` (the
hardware model itself measures nothing). ``PYPTO_INDUCTOR_NO_CALIBRATE=1`` keeps
the built-in defaults (the test suite sets it so planner tests do not depend on
the machine's timing).

- bandwidth: a large ``torch`` copy (read + write bytes over time), the fastest
  of 7, with the current torch thread count;
- per-call cost and compute rate: native kernels of the cpu target, timed by
  :mod:`.codegen.cpp.calibrate`.

Each is the best of its repeats: on a shared machine other jobs only ever slow
a measurement down, and a model calibrated while another job ran called
compute-heavy softmax tiles memory-bound.

``python -m pypto_inductor.calibrate`` measures afresh and prints the numbers.
"""
from __future__ import annotations

import functools
import json
import os
import platform
import tempfile
import time
import warnings
from pathlib import Path

import torch
from filelock import FileLock
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.utils._python_dispatch import _disable_current_modes

from .codegen.cpp import calibrate as native
from .config import cache_dir
from .hardware import MiB, HardwareModel, cache_bytes, get_hardware, host, usable_cpus

ENV_OFF = "PYPTO_INDUCTOR_NO_CALIBRATE"
# bumped when what is measured changes (3: the straight-line wrapper; 4: best of repeats;
# 5: exp on one thread by its CPU time, times the threads)
VERSION = 5


def disabled() -> bool:
    return os.environ.get(ENV_OFF, "").strip().lower() not in ("", "0", "false", "no")


def cache_file() -> Path:
    return cache_dir("host_calibration.json")


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
    return f"v{VERSION}|{cpu_model()}|{usable_cpus()} cores"


def measure_bandwidth(nbytes: int | None = None, repeats: int = 7, stat=min) -> float:
    """Bytes per second of a large torch copy (bytes read + bytes written), from ``stat`` of
    the times of ``repeats`` copies. The model takes the fastest: other jobs on a shared
    machine only ever slow a copy down, so it is the one closest to what the machine can
    do (a median taken while the test suite ran beside it is far below it). Benchmarks
    comparing with median kernel times take the median."""
    if nbytes is None:
        nbytes = min(max(64 * MiB, 2 * cache_bytes(3, 32 * MiB)), 256 * MiB)
    src = torch.ones(nbytes // 4, dtype=torch.float32)
    dst = torch.empty_like(src)
    dst.copy_(src)  # first touch
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - start)
    return 2 * src.numel() * 4 / stat(times)


def measure() -> dict:
    """Every number, on real tensors even when called while the backend traces (fake mode)."""
    start = time.perf_counter()
    with unset_fake_temporarily(), _disable_current_modes(), torch.no_grad():
        bw = measure_bandwidth()
        call = native.measure_call_us()
        flops = native.measure_flops()
    return {"gm_bandwidth_bytes_per_s": bw, "launch_us": call, "vector_flops_per_s": flops,
            "threads": torch.get_num_threads(), "cpu_model": cpu_model(), "cores": usable_cpus(),
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


@functools.lru_cache(maxsize=None)
def host_model() -> HardwareModel:
    """The host's hardware model with this machine's numbers (measured once, then cached)."""
    return host(host_numbers())


def hardware_model(name: str, capacity_bytes: int | None = None) -> HardwareModel:
    """The hardware model named ``name``: the host's calibrated (see :func:`host_model`)."""
    if name == "host":
        return host_model().with_capacity(capacity_bytes)
    return get_hardware(name, capacity_bytes)


if __name__ == "__main__":
    torch.set_num_threads(int(os.environ.get("THREADS", "2")))
    numbers = measure()
    print(json.dumps(numbers, indent=1))
    for label, us in native.breakdown().items():
        print(f"{label:<58} {us:8.2f} us")
