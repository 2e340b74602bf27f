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
entry that fails its checksum, lacks a symbol or does not load is rebuilt.
Temporaries a killed build left behind are removed the first time a process
uses the cache (those whose entry's lock is free). The compiler is ``$CXX``
(a command, flags allowed: ``ccache g++``, ``g++ -O0``), else ``c++``, ``g++``,
``clang++``; each is probed once by compiling and loading a tiny library, and a
``$CXX`` that fails the probe gets a warning naming it.
"""
from __future__ import annotations

import ctypes
import hashlib
import itertools
import os
import platform
import re
import shlex
import shutil
import subprocess
import tempfile
import threading
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from filelock import FileLock, Timeout

from ... import config
from ...hardware import usable_cpus
from . import pch

# -O2 with O3's vectoriser cost model: the kernels' hot loops are `omp simd`, and against -O3
# it compiles faster at equal kernel time (docs/benchmarks.md). -fwrapv: signed integer
# overflow wraps, as eager's integer ops do (without it g++ folds `abs(x) > 0` to `x != 0`,
# wrong at INT64_MIN: fuzz seed 50171); the kernels keep the same vector loops (docs/fuzz.md).
# -ffp-contract=off: g++ fuses no multiply and add by itself; fmas are written out where
# eager's own kernels have them (docs/ARCHITECTURE.md, fuzz seed 31858).
BASE_FLAGS = ("-O2", "-fvect-cost-model=dynamic", "-fwrapv", "-fopenmp", "-shared", "-fPIC",
              "-std=c++17", "-fno-math-errno", "-fno-trapping-math", "-ffp-contract=off", "-w")
NATIVE_FLAGS = ("-march=native",)
# -fno-tree-sink: g++ 12 sinks a load that only a select reads into the select's branch
# (`where(mask, 0, g)` reads g only where the mask is false), and in an unrolled block it
# does not vectorise (two sums of one select: BatchNorm's backward) that is a branch per
# element on the mask, mispredicted on real data: 10x slower (1.3 ms vs 0.13 ms a
# 262k-element pass, docs/benchmarks.md). Switch (read when the compiler is probed, cached
# in ``compilers``): the benchmark's "before".
NO_TREE_SINK = True
COMPILE_TIMEOUT_S = 300

# Counters, for tests and reports: compiles run, disk hits, memory hits, rebuilt entries.
stats = {"compiles": 0, "disk_hits": 0, "memory_hits": 0, "rebuilt": 0}

loaded: dict[str, ctypes.CDLL] = {}  # cache key -> library loaded in this process
_lock = threading.Lock()  # guards stats and loaded across load_many's threads
compilers: dict[tuple, tuple | None] = {}  # (CXX, PATH) -> (path, version, flags) or None
_cxx_problems: dict[tuple, str] = {}  # (CXX, PATH) -> why $CXX is not a working compiler
swept: set[str] = set()  # cache directories whose stale temporaries this process removed
_opened: set[str] = set()  # library paths this process has dlopen'ed
_reloads = itertools.count()


class CompilerNotFound(RuntimeError):
    """No C++ compiler: set CXX or install g++/clang++."""


class CompileError(RuntimeError):
    """The C++ compiler rejected a generated kernel."""


def cache_dir() -> Path:
    path = config.cache_dir("cpp")
    path.mkdir(parents=True, exist_ok=True)
    return path


def _sweep_once(path: Path) -> None:
    """The first compile of a process into ``path`` sweeps it (:func:`sweep_temporaries`):
    listing a large cache costs 0.3-1.4 s, which a process that only loads cached
    libraries (a warm start) does not pay."""
    with _lock:
        if str(path) in swept:
            return
        swept.add(str(path))
    sweep_temporaries(path)


_KEYED_TMP = re.compile(r"([0-9a-f]{64})\..*\.so\.tmp(\.sha256)?$")
_RELOAD = re.compile(r"[0-9a-f]{64}\.reload\d+_\d+\.so$")  # see _open


def sweep_temporaries(root: Path) -> int:
    """Remove the ``*.so.tmp`` files builds killed mid-compile left in ``root``; returns how
    many. A temporary is named after its entry's key, and its build holds that entry's lock:
    it is stale when the lock is free. Unkeyed ones (older versions) go once older than two
    compile timeouts."""
    removed = 0
    try:  # one listing (two globs cost twice)
        names = [e.name for e in os.scandir(root) if ".so.tmp" in e.name or ".reload" in e.name]
    except OSError:
        return 0
    for tmp in (root / n for n in names):
        match = _KEYED_TMP.match(tmp.name)
        try:
            if match:
                lock = FileLock(str(root / f"{match.group(1)}.lock"), timeout=0)
                with lock:  # raises Timeout while a build of that entry runs
                    tmp.unlink(missing_ok=True)
            elif (_RELOAD.match(tmp.name) or tmp.name.endswith((".so.tmp", ".so.tmp.sha256"))) \
                    and time.time() - tmp.stat().st_mtime > 2 * COMPILE_TIMEOUT_S:
                tmp.unlink(missing_ok=True)
            else:
                continue
            removed += 1
        except (OSError, Timeout):
            continue
    return removed


_PROBE = 'extern "C" int pi_probe(void) { return 42; }\n'


def _probe(cmd: list[str], flags) -> str | None:
    """None when ``cmd`` compiles a tiny library with ``flags`` that loads and runs, else
    what went wrong."""
    with tempfile.TemporaryDirectory() as tmp:
        src, lib = Path(tmp) / "probe.cpp", Path(tmp) / "probe.so"
        src.write_text(_PROBE)
        try:
            out = subprocess.run([*cmd, *flags, str(src), "-o", str(lib)], capture_output=True,
                                 text=True, timeout=120)
        except (OSError, subprocess.SubprocessError) as e:
            return f"it does not run ({e})"
        if out.returncode != 0:
            err = " ".join((out.stderr or out.stdout).split())  # one line, for the warning
            return f"it failed on a test file: {err[:300]}"
        if not lib.exists():
            return "it wrote no library for a test file"
        try:
            if ctypes.CDLL(str(lib)).pi_probe() != 42:
                return "the library it wrote for a test file returns the wrong value"
        except (OSError, AttributeError) as e:
            return f"the library it wrote for a test file does not load ({e})"
    return None


def _command(name: str) -> list[str] | None:
    """``name`` as a command line: its program resolved on PATH, then its arguments."""
    words = shlex.split(name)
    path = shutil.which(words[0]) if words else None
    return [path, *words[1:]] if path else None


def find_compiler() -> tuple[str, str, tuple[str, ...]] | None:
    """(compiler path, version line, flags) for the first working compiler, or None.

    ``$CXX`` is a command line (its arguments go after our flags, so ``g++ -O0`` builds at
    -O0); candidates that do not compile a loadable test library are skipped. A ``$CXX``
    skipped for another compiler gets a warning naming it; with no compiler at all the
    caller's one warning says why (:func:`cxx_problem`)."""
    cxx = os.environ.get("CXX")
    key = (cxx, os.environ.get("PATH"))
    if key in compilers:
        return compilers[key]
    found = None
    cxx_problem = None
    try:
        shlex.split(cxx or "")
    except ValueError:  # unbalanced quotes
        cxx_problem = f"CXX={cxx!r} is not a command line"
        cxx = None
    for name in ([cxx] if cxx else []) + ["c++", "g++", "clang++"]:
        cmd = _command(name)
        problem = f"{(shlex.split(name) or [''])[0]!r} is not found" if cmd is None else None
        if cmd is not None:
            try:
                out = subprocess.run([*cmd, "--version"], capture_output=True, text=True,
                                     timeout=30)
                version = (out.stdout.strip().splitlines() or [cmd[0]])[0]
            except (OSError, subprocess.SubprocessError) as e:
                out, version, problem = None, "", f"it does not run ({e})"
            if out is not None and out.returncode != 0:
                problem = "`--version` fails"
        if problem is None:
            flags = (*NATIVE_FLAGS, *BASE_FLAGS)  # -march=native where the compiler takes it
            problem = _probe(cmd, (*flags, *cmd[1:]))
            if problem is not None:
                flags = BASE_FLAGS
                problem = _probe(cmd, (*flags, *cmd[1:]))
        if problem is None:
            sink = ("-fno-tree-sink",) if NO_TREE_SINK and "clang" not in version.lower() \
                else ()
            found = (cmd[0], version, (*flags, *sink, *cmd[1:]))
            break
        if name == cxx:
            cxx_problem = f"CXX={cxx!r} is not a working C++ compiler: {problem}"
    if cxx_problem:
        _cxx_problems[key] = cxx_problem
        if found is not None:
            warnings.warn(f"pypto_inductor: {cxx_problem}; using {found[0]}", stacklevel=2)
    compilers[key] = found
    return found


def cxx_problem() -> str | None:
    """Why ``$CXX`` was skipped by :func:`find_compiler` (for its caller's warning), or None."""
    return _cxx_problems.get((os.environ.get("CXX"), os.environ.get("PATH")))


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
    """The library if it exists, matches its checksum, names all ``symbols`` and loads.

    The names are looked for in the file before it is opened: a library once loaded in
    this process stays loaded under its path (dlopen returns it again), so a stale one
    opened here could not be replaced by its rebuild."""
    side = so.with_suffix(".sha256")
    try:
        if not so.exists() or not side.exists():
            return None
        data = so.read_bytes()
        if side.read_text().strip() != hashlib.sha256(data).hexdigest():
            return None
        if any(symbol.encode() + b"\0" not in data for symbol in symbols):
            return None
        lib = _open(so)
        for symbol in symbols:
            getattr(lib, symbol)
        return lib
    except (OSError, AttributeError):
        return None


def _open(so: Path) -> ctypes.CDLL:
    """dlopen ``so``. A path this process opened before goes through a fresh hard link:
    dlopen hands back the library already loaded under a name, even after a rebuild
    replaced the file. The link is removed once loaded (the mapping stays)."""
    with _lock:
        first = str(so) not in _opened
        _opened.add(str(so))
    if first:
        return ctypes.CDLL(str(so))
    fresh = so.with_name(f"{so.stem}.reload{os.getpid()}_{next(_reloads)}.so")
    try:
        os.link(so, fresh)
    except OSError:
        shutil.copyfile(so, fresh)
    try:
        return ctypes.CDLL(str(fresh))
    finally:
        fresh.unlink(missing_ok=True)


def _count(name: str) -> None:
    with _lock:
        stats[name] += 1


def compile_library(source: str, compiler, out: Path, extra_flags=()) -> None:
    """Build ``out``; the caller holds ``out``'s entry lock, so the entry's temporary, when
    there, is a killed build's: it has a fixed name and is overwritten (no listing of the
    cache per compile: 0.1-0.4 s in a cache of 50-100k files)."""
    _sweep_once(out.parent)
    path, _, flags = compiler
    flags = (*flags, *extra_flags)
    src = out.with_suffix(".cpp")
    src.write_text(source)
    tmp = str(out.with_name(f"{out.stem}.build.so.tmp"))
    cmd = [path, *flags, *pch.flags(compiler, extra_flags, source, out.parent), str(src),
           "-o", tmp]
    try:
        # there from the start (g++ writes -o only when it links): a build killed while
        # compiling leaves a temporary that the next process's sweep finds
        Path(tmp).touch()
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
        why = cxx_problem()
        raise CompilerNotFound("no C++ compiler found (tried $CXX, c++, g++, clang++"
                               + (f"; {why})" if why else ")"))
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
