"""Compiler driver and on-disk cache for the native CPU target.

``load(source, symbol)`` returns the ctypes function ``symbol`` of the shared
library compiled from ``source``; ``load_many`` loads several libraries, running
their compiles concurrently (one compiler process per library, at most
``jobs()`` at a time). Libraries live in the cache directory
(``PYPTO_INDUCTOR_CACHE_DIR``, default ``~/.cache/pypto_inductor``) under the
sha256 of source + compiler version + flags (+ the host CPU when the flags say
``-march=native``). A library is written to a temporary file and moved into
place with ``os.replace`` while holding a file lock, so concurrent processes
compiling the same kernel are safe; each entry has a checksum side file, and an
entry that fails its checksum or does not load is rebuilt.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from filelock import FileLock

from ... import config
from ...hardware import usable_cpus

# -O2 with O3's vectoriser cost model: the kernels' hot loops are `omp simd`, and against -O3
# it compiles faster at equal kernel time (docs/benchmarks.md).
BASE_FLAGS = ("-O2", "-fvect-cost-model=dynamic", "-fopenmp", "-shared", "-fPIC", "-std=c++17",
              "-fno-math-errno", "-fno-trapping-math", "-w")
NATIVE_FLAGS = ("-march=native",)
COMPILE_TIMEOUT_S = 300

# Counters, for tests and reports: compiles run, disk hits, memory hits, rebuilt entries.
stats = {"compiles": 0, "disk_hits": 0, "memory_hits": 0, "rebuilt": 0}

loaded: dict[str, ctypes.CDLL] = {}  # cache key -> library loaded in this process
_lock = threading.Lock()  # guards stats and loaded across load_many's threads
_compilers: dict[tuple, tuple | None] = {}  # (CXX, PATH) -> (path, version, flags) or None


class CompilerNotFound(RuntimeError):
    """No C++ compiler: set CXX or install g++/clang++."""


class CompileError(RuntimeError):
    """The C++ compiler rejected a generated kernel."""


def cache_dir() -> Path:
    path = config.cache_dir("cpp")
    path.mkdir(parents=True, exist_ok=True)
    return path


def _candidates() -> list[str]:
    names = []
    if os.environ.get("CXX"):
        names.append(os.environ["CXX"])
    return names + ["c++", "g++", "clang++"]


def find_compiler() -> tuple[str, str, tuple[str, ...]] | None:
    """(compiler path, version line, flags) for the first working compiler, or None."""
    key = (os.environ.get("CXX"), os.environ.get("PATH"))
    if key in _compilers:
        return _compilers[key]
    found = None
    for name in _candidates():
        path = shutil.which(name)
        if path is None:
            continue
        try:
            out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.SubprocessError):
            continue
        if out.returncode != 0:
            continue
        version = (out.stdout.strip().splitlines() or [path])[0]
        found = (path, version, _flags_for(path))
        break
    _compilers[key] = found
    return found


def _flags_for(cxx: str) -> tuple[str, ...]:
    """The base flags plus -march=native when the compiler accepts it here."""
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "probe.cpp"
        src.write_text("extern \"C\" int probe(void) { return 1; }\n")
        cmd = [cxx, *NATIVE_FLAGS, *BASE_FLAGS, str(src), "-o", str(Path(tmp) / "probe.so")]
        try:
            ok = subprocess.run(cmd, capture_output=True, timeout=60).returncode == 0
        except (OSError, subprocess.SubprocessError):
            ok = False
    return (*NATIVE_FLAGS, *BASE_FLAGS) if ok else BASE_FLAGS


def _host_id() -> str:
    """What -march=native depends on: the CPU model and feature flags."""
    text = ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("model name", "flags", "Features")):
                    text += line
                if line.strip() == "":
                    break
    except OSError:
        pass
    return platform.machine() + hashlib.sha256(text.encode()).hexdigest()[:16]


def cache_key(source: str, compiler, extra_flags=()) -> str:
    path, version, flags = compiler
    host = _host_id() if "-march=native" in flags else platform.machine()
    text = "\n".join([source, version, " ".join((*flags, *extra_flags)), host])
    return hashlib.sha256(text.encode()).hexdigest()


def checksum(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _try_load(so: Path, symbols) -> ctypes.CDLL | None:
    """The library if it exists, matches its checksum, loads and has all ``symbols``."""
    side = so.with_suffix(".sha256")
    try:
        if not so.exists() or not side.exists() or side.read_text().strip() != checksum(so):
            return None
        lib = ctypes.CDLL(str(so))
        for symbol in symbols:
            getattr(lib, symbol)
        return lib
    except (OSError, AttributeError):
        return None


def _count(name: str) -> None:
    with _lock:
        stats[name] += 1


def compile_library(source: str, compiler, out: Path, extra_flags=()) -> None:
    path, _, flags = compiler
    flags = (*flags, *extra_flags)
    src = out.with_suffix(".cpp")
    src.write_text(source)
    fd, tmp = tempfile.mkstemp(suffix=".so.tmp", dir=out.parent)
    os.close(fd)
    cmd = [path, *flags, str(src), "-o", tmp]
    try:
        result = subprocess.run(cmd, capture_output=True, text=True, timeout=COMPILE_TIMEOUT_S)
        if result.returncode != 0:
            err = (result.stderr or result.stdout).strip()
            raise CompileError(f"{Path(path).name} failed on {src}: {err[:2000]}")
        _count("compiles")
        side_tmp = tmp + ".sha256"
        Path(side_tmp).write_text(checksum(Path(tmp)))
        os.replace(tmp, out)
        os.replace(side_tmp, out.with_suffix(".sha256"))
    finally:
        for leftover in (tmp, tmp + ".sha256"):
            if os.path.exists(leftover):
                os.unlink(leftover)


def load(source: str, symbol: str):
    """The ctypes function ``symbol`` compiled from ``source`` (cached)."""
    return getattr(load_library(source, (symbol,)), symbol)


def load_library(source: str, symbols=(), flags=()) -> ctypes.CDLL:
    """The shared library compiled from ``source`` (cached), checked to export ``symbols``;
    ``flags`` are added to the compiler's (an include path, say)."""
    compiler = find_compiler()
    if compiler is None:
        raise CompilerNotFound("no C++ compiler found (tried $CXX, c++, g++, clang++)")
    key = cache_key(source, compiler, flags)
    lib = loaded.get(key)
    if lib is not None:
        _count("memory_hits")
        return lib
    root = cache_dir()
    so = root / f"{key}.so"
    lib = _try_load(so, symbols)
    if lib is None:
        with FileLock(str(root / f"{key}.lock")):
            lib = _try_load(so, symbols)  # another process may have built it meanwhile
            if lib is None:
                if so.exists():
                    _count("rebuilt")
                compile_library(source, compiler, so, flags)
                lib = _try_load(so, symbols)
                if lib is None:
                    raise CompileError(f"compiled {so} but it does not load")
            else:
                _count("disk_hits")
    else:
        _count("disk_hits")
    with _lock:
        loaded[key] = lib
    return lib


def jobs() -> int:
    """How many compiler processes run at once: ``$PYPTO_INDUCTOR_COMPILE_JOBS``, else the
    CPUs this process may use."""
    env = os.environ.get("PYPTO_INDUCTOR_COMPILE_JOBS", "")
    if env.strip().isdigit() and int(env) > 0:
        return int(env)
    return usable_cpus()


def load_many(libraries) -> list:
    """``load_library(source, symbols)`` for each ``(source, symbols)``, the compiles running
    concurrently; each result is the library or the exception its build raised."""
    libraries = list(libraries)

    def one(item):
        try:
            return load_library(*item)
        except Exception as e:  # noqa: BLE001 - reported per library
            return e

    workers = min(jobs(), len(libraries))
    if workers <= 1:
        return [one(item) for item in libraries]
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="pi_cxx") as pool:
        return list(pool.map(one, libraries))
