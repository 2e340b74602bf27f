"""A precompiled header of the prelude's standard includes.

Parsing ``<cmath>``, ``<algorithm>`` and ``<immintrin.h>`` (with ``-march=native``) is
0.3-0.4 s of g++'s CPU per library (a GPT-2 training step compiles 11 of them with two
compile jobs). With the headers precompiled once per compiler and flag set, that part is
~0.05 s, and the library is the same: g++ uses a ``.gch`` only where it was built with
the same code-generation flags and falls back to the text otherwise, and the kernel's own
``#include`` lines after ``-include`` are no-ops under the headers' include guards
(objdump of every kernel of 20 fuzz cases and of a GPT-2 training step's libraries
identical with and without it, docs/fuzz.md, docs/benchmarks.md).

Building the header costs ~1.2 s CPU and 40 MB once per cache directory, compiler and
flags, and saves ~0.3 s per library after: with the default, lasting cache directory that
is once per machine. So ``PYPTO_INDUCTOR_PCH`` unset (``AUTO``): a process uses the header
where its cache directory has it and builds it at its first library with the prelude
into that directory once it has compiled ``AUTO_AFTER`` (0) of them there
(the thread building it waits; a compile running meanwhile goes without); ``=1`` always
(the fuzzer), ``=0`` never. GCC only (clang's
PCH is another format).
"""
from __future__ import annotations

import hashlib
import os
import subprocess
import threading
from pathlib import Path

from filelock import FileLock, Timeout

from .prelude import PRELUDE

# the prelude's include block, verbatim: a source that starts with it can take the header
HEADER = PRELUDE[:PRELUDE.index("#define PI_INLINE")].lstrip("\n")
# PYPTO_INDUCTOR_PCH unset: build the header once a process has compiled AUTO_AFTER
# libraries with the prelude into a cache directory (False: the old opt-in only; the
# benchmark's "before")
AUTO = True
AUTO_AFTER = 0
_BUILDING = "building"
headers: dict[str, str | None] = {}  # its directory -> header path, None: build failed,
#   _BUILDING: a thread of this process builds it
prelude_compiles: dict[str, int] = {}  # cache directory -> prelude libraries this process sent
_lock = threading.Lock()


def mode() -> str:
    """"on", "off" or "auto" (``PYPTO_INDUCTOR_PCH`` 1 / 0 / unset)."""
    env = os.environ.get("PYPTO_INDUCTOR_PCH", "")
    if env == "":
        return "auto" if AUTO else "off"
    return "off" if env == "0" else "on"


def enabled() -> bool:
    return mode() != "off"


def flags(compiler, extra_flags, source: str, root: Path) -> list[str]:
    """``["-include", header]`` when ``source`` starts with the prelude's includes and the
    precompiled header for this compiler and these flags exists or is built now (see the
    module doc for when); else ``[]`` (the kernel then compiles as it would without it)."""
    path, version, base = compiler
    how = mode()
    if how == "off" or "clang" in version.lower() or not source.lstrip("\n").startswith(HEADER):
        return []
    cflags = [f for f in (*base, *extra_flags) if f != "-shared"]
    key = hashlib.sha256("\0".join([path, version, *cflags, HEADER]).encode()).hexdigest()[:24]
    where = root / "pch" / key
    with _lock:
        earlier = prelude_compiles.get(str(root), 0)
        prelude_compiles[str(root)] = earlier + 1
        ready = (where / "pi_std.h.gch").exists() and (where / "pi_std.h").exists()
        if str(where) in headers and (ready or headers[str(where)] in (None, _BUILDING)):
            header = headers[str(where)]
            return [] if header in (None, _BUILDING) else ["-include", header]
        # (a header built here and removed since, with its cache: decided again)
        if not (how == "on" or ready or earlier >= AUTO_AFTER):
            return []
        headers[str(where)] = _BUILDING  # this thread builds it; others go without meanwhile
    header = _build(path, cflags, where, wait=how == "on")
    with _lock:
        if header is _BUILDING:  # another process is building it: ask again next time
            del headers[str(where)]
            return []
        headers[str(where)] = header
    return ["-include", header] if header else []


def _build(path: str, cflags: list[str], where: Path, wait: bool) -> str | None:
    where.mkdir(parents=True, exist_ok=True)
    header, gch = where / "pi_std.h", where / "pi_std.h.gch"
    try:
        with FileLock(str(where / "build.lock"), timeout=-1 if wait else 0):
            if gch.exists() and header.exists():
                return str(header)
            for stale in where.glob("pi_std.h.gch.*.tmp"):  # a killed build's (we hold the lock)
                stale.unlink(missing_ok=True)
            header.write_text(HEADER)
            tmp = where / f"pi_std.h.gch.{os.getpid()}.tmp"
            try:
                out = subprocess.run([path, *cflags, "-x", "c++-header", str(header), "-o",
                                      str(tmp)], capture_output=True, timeout=300)
                if out.returncode != 0:
                    return None
                os.replace(tmp, gch)
            except (OSError, subprocess.SubprocessError):
                return None
            finally:
                if tmp.exists():
                    tmp.unlink()
    except Timeout:  # another process builds it: this compile goes without
        return _BUILDING
    return str(header)
