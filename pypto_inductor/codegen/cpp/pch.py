"""A precompiled header of the prelude's standard includes, opt-in (``PYPTO_INDUCTOR_PCH=1``).

Parsing ``<cmath>``, ``<algorithm>`` and ``<immintrin.h>`` (with ``-march=native``) is
about 3/4 of g++'s time on a fuzz kernel (0.4 of 0.55 s user). With the headers
precompiled once per compiler and flag set, a kernel builds in ~0.14 s user, and the
library is the same: g++ uses a ``.gch`` only where it was built with the same
code-generation flags and falls back to the text otherwise, and the kernel's own
``#include`` lines after ``-include`` are no-ops under the headers' include guards
(objdump of every kernel of 20 fuzz cases identical with and without it, docs/fuzz.md).

Opt-in because building the header takes ~5 s and 40 MB once per cache directory: a
win for a process compiling many kernels (the fuzzer sets it), a loss for one that
compiles a few into a fresh cache (most tests). GCC only (clang's PCH is another format).
"""
from __future__ import annotations

import hashlib
import os
import subprocess
import threading
from pathlib import Path

from filelock import FileLock

from .prelude import PRELUDE

# the prelude's include block, verbatim: a source that starts with it can take the header
HEADER = PRELUDE[:PRELUDE.index("#define PI_INLINE")].lstrip("\n")
_built: dict[str, str | None] = {}  # its directory -> header path, None: build failed
_lock = threading.Lock()


def enabled() -> bool:
    return os.environ.get("PYPTO_INDUCTOR_PCH", "0") not in ("0", "")


def flags(compiler, extra_flags, source: str, root: Path) -> list[str]:
    """``["-include", header]`` when ``source`` starts with the prelude's includes and the
    precompiled header for this compiler and these flags exists or builds; else ``[]``
    (the kernel then compiles as it would without it)."""
    path, version, base = compiler
    if not enabled() or "clang" in version.lower() or not source.lstrip("\n").startswith(HEADER):
        return []
    cflags = [f for f in (*base, *extra_flags) if f != "-shared"]
    key = hashlib.sha256("\0".join([path, version, *cflags, HEADER]).encode()).hexdigest()[:24]
    where = root / "pch" / key
    with _lock:
        if str(where) not in _built:
            _built[str(where)] = _build(path, cflags, where)
        header = _built[str(where)]
    return ["-include", header] if header else []


def _build(path: str, cflags: list[str], where: Path) -> str | None:
    where.mkdir(parents=True, exist_ok=True)
    header, gch = where / "pi_std.h", where / "pi_std.h.gch"
    with FileLock(str(where / "build.lock")):
        if gch.exists() and header.exists():
            return str(header)
        for stale in where.glob("pi_std.h.gch.*.tmp"):  # a killed build's (we hold the lock)
            stale.unlink(missing_ok=True)
        header.write_text(HEADER)
        tmp = where / f"pi_std.h.gch.{os.getpid()}.tmp"
        try:
            out = subprocess.run([path, *cflags, "-x", "c++-header", str(header), "-o", str(tmp)],
                                 capture_output=True, timeout=300)
            if out.returncode != 0:
                return None
            os.replace(tmp, gch)
        except (OSError, subprocess.SubprocessError):
            return None
        finally:
            if tmp.exists():
                tmp.unlink()
    return str(header)
