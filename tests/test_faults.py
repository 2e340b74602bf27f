"""Faults a user's machine throws at the backend, and what must keep holding under them.

Threads sharing one compiled model, processes racing to fill one fresh kernel
cache, corrupt / read-only / deleted caches, no compiler, a build killed with
SIGKILL. Cross-process cases run a child script (``CHILD``) that compiles a zoo
model, checks it against eager (forward and, with ``backward``, the input's
gradient) and prints the kernel-cache counters and pypto's warnings as JSON.
tests/test_cpp_target.py covers the single-process forms (a corrupt entry at the
``cpp_build.load`` level, two processes on one graph, no compiler in-process).
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch

from pypto_inductor import models
from pypto_inductor.codegen.cpp import compiler as cpp_build

CHILD = textwrap.dedent("""
    import copy, json, sys, warnings
    import torch
    from pypto_inductor import models
    from pypto_inductor.codegen.cpp import compiler as cpp_build
    from pypto_inductor.report import collect

    name, backward = sys.argv[1], sys.argv[2] == "1"
    model, (x,) = models.build(name)
    x = torch.randn(x.shape, generator=torch.Generator().manual_seed(7))
    compiled = torch.compile(copy.deepcopy(model), backend="pypto")
    with warnings.catch_warnings(record=True) as caught, collect() as graphs:
        warnings.simplefilter("always")
        xc, xe = x.clone().requires_grad_(backward), x.clone().requires_grad_(backward)
        with torch.set_grad_enabled(backward):
            out, ref = compiled(xc), model(xe)
        torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
        if backward:
            out.square().mean().backward()
            ref.square().mean().backward()
            torch.testing.assert_close(xc.grad, xe.grad, rtol=1e-4, atol=1e-4)
    kernels = [v for g in graphs for v in g.compiled.kernel_native.values()]
    print("RESULT " + json.dumps({
        "stats": cpp_build.stats, "native": sum(k["native"] for k in kernels),
        "tiles": len(kernels), "reasons": [k["reason"] for k in kernels if not k["native"]],
        "warnings": [str(w.message) for w in caught if "pypto_inductor" in str(w.message)]}))
""")


def child(cache: Path, model: str = "ln_gelu_residual", backward: bool = False, env=None,
          prefix=(), timeout: float = 600) -> dict:
    """Run CHILD in a new process with kernel cache ``cache``; its JSON result."""
    full_env = {**os.environ, "PYPTO_INDUCTOR_CACHE_DIR": str(cache),
                "PYPTO_INDUCTOR_NO_CALIBRATE": "1", **(env or {})}
    proc = subprocess.run([*prefix, sys.executable, "-c", CHILD, model, "1" if backward else "0"],
                          env=full_env, capture_output=True, text=True, timeout=timeout)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, f"exit {proc.returncode}\n{proc.stderr[-3000:]}"
    return json.loads(lines[-1][len("RESULT "):])


def libraries(cache: Path) -> list[Path]:
    return sorted((cache / "cpp").glob("*.so"))


@pytest.fixture(scope="module")
def filled_cache(tmp_path_factory) -> Path:
    """A kernel cache a first process filled with CHILD's default model."""
    cache = tmp_path_factory.mktemp("filled") / "cache"
    child(cache)
    assert libraries(cache)
    return cache


@pytest.fixture
def cache_copy(filled_cache, tmp_path) -> Path:
    """This test's own copy of ``filled_cache``."""
    return Path(shutil.copytree(filled_cache, tmp_path / "cache"))


# --- threads --------------------------------------------------------------------------------
def _hammer(call, inputs_of, expected_of, threads: int, calls: int) -> list:
    """``threads`` threads, each calling ``call`` ``calls`` times on its own inputs; the
    exceptions and wrong results they met."""
    errors = []
    start = threading.Barrier(threads)

    def worker(i):
        try:
            start.wait()
            for j in range(calls):
                x = inputs_of(i, j)
                torch.testing.assert_close(call(x), expected_of(i, j), rtol=1e-4, atol=1e-4)
        except Exception as e:  # noqa: BLE001 - reported by the test
            errors.append(f"thread {i}: {type(e).__name__}: {e}")

    pool = [threading.Thread(target=worker, args=(i,)) for i in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join(timeout=600)
    assert not any(t.is_alive() for t in pool), "a thread hung"
    return errors


def test_sixteen_threads_call_one_compiled_block():
    """The transformer block (several native kernels, a buffer pool) from 16 threads at
    once, 6 calls each, each thread on its own inputs."""
    model, (x,) = models.build("transformer")
    inputs = [[torch.randn(x.shape, generator=torch.Generator().manual_seed(100 * i + j))
               for j in range(6)] for i in range(16)]
    with torch.no_grad():
        expected = [[model(t) for t in row] for row in inputs]
        # attention as the block writes it, not rewritten into an SDPA call (an extern op,
        # which fallback='error' refuses): every step a kernel of ours
        compiled = torch.compile(model, backend="pypto",
                                 options={"fallback": "error", "fuse_attention": False})
        compiled(x)
        errors = _hammer(compiled, lambda i, j: inputs[i][j], lambda i, j: expected[i][j],
                         threads=16, calls=6)
    assert not errors, errors[:3]


def test_threads_at_different_sizes_share_one_dynamic_graph():
    """dynamic=True, eight threads at eight batch sizes interleaved: the buffer pool is
    emptied whenever the sizes change, while other threads hold buffers from it."""
    model, _ = models.build("ln_gelu_residual")
    sizes = [3, 5, 8, 11, 16, 21, 27, 32]
    inputs = [[torch.randn(b, 32, 256, generator=torch.Generator().manual_seed(10 * b + j))
               for j in range(6)] for b in sizes]
    with torch.no_grad():
        expected = [[model(t) for t in row] for row in inputs]
        compiled = torch.compile(model, backend="pypto", dynamic=True,
                                 options={"fallback": "error"})
        compiled(inputs[0][0])
        errors = _hammer(compiled, lambda i, j: inputs[i][j], lambda i, j: expected[i][j],
                         threads=len(sizes), calls=6)
    assert not errors, errors[:3]


# --- processes and the on-disk cache ---------------------------------------------------------
def test_three_processes_build_one_model_into_a_fresh_cache(tmp_path):
    """The transformer block (several libraries, built concurrently within each process
    too) from three processes started together on an empty cache; a fourth process
    afterwards compiles nothing."""
    cache = tmp_path / "cache"
    env = {**os.environ, "PYPTO_INDUCTOR_CACHE_DIR": str(cache),
           "PYPTO_INDUCTOR_NO_CALIBRATE": "1"}
    procs = [subprocess.Popen([sys.executable, "-c", CHILD, "transformer", "0"], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(3)]
    for p in procs:
        out, err = p.communicate(timeout=900)
        assert p.returncode == 0 and "RESULT" in out, err[-3000:]
    assert libraries(cache) and not list((cache / "cpp").glob("*.tmp"))
    later = child(cache, "transformer")
    assert later["stats"]["compiles"] == 0 and later["stats"]["disk_hits"] >= 1
    assert later["native"] == later["tiles"] > 0


@pytest.mark.parametrize("damage", ["truncated", "random", "zero_length", "random_rechecksummed"])
def test_corrupt_cached_libraries_are_rebuilt_by_a_new_process(cache_copy, damage):
    """Every cached library damaged after a first process built them: the next process
    rebuilds them (the checksum side file catches the first three; a checksum rewritten
    to match random bytes is caught when the library does not load) and runs natively."""
    cache = cache_copy
    libs = libraries(cache)
    assert libs
    for so in libs:
        data = so.read_bytes()
        so.write_bytes({"truncated": data[: len(data) // 3], "zero_length": b""}.get(
            damage, os.urandom(len(data))))
        if damage == "random_rechecksummed":
            so.with_suffix(".sha256").write_text(cpp_build.checksum(so))
    again = child(cache)
    assert again["stats"]["rebuilt"] == len(libs) and again["native"] == again["tiles"] > 0
    assert all(so.stat().st_size > 1000 for so in libraries(cache))


def _read_only(path: Path):
    """A command prefix running a child with ``path`` read-only, or None if this machine
    cannot make one (root ignores file modes: a read-only bind mount in a private mount
    namespace does it)."""
    if os.geteuid() != 0:
        path.chmod(0o555)
        for p in path.rglob("*"):
            p.chmod(0o555 if p.is_dir() else 0o444)
        return ()
    if shutil.which("unshare") is None:
        return None
    script = (f'mount --bind "{path}" "{path}" && mount -o remount,bind,ro "{path}" '
              f'&& touch "{path}/probe" 2>/dev/null; test ! -e "{path}/probe"')
    if subprocess.run(["unshare", "-m", "sh", "-c", script], capture_output=True).returncode:
        return None
    return ("unshare", "-m", "sh", "-c",
            f'mount --bind "{path}" "{path}" && mount -o remount,bind,ro "{path}" '
            '&& exec "$@"', "sh")


@pytest.mark.parametrize("populated", [True, False], ids=["populated", "empty"])
def test_read_only_cache(filled_cache, tmp_path, populated):
    """A cache the process cannot write: right answers either way; a populated one still
    serves its libraries."""
    cache = tmp_path / "cache"
    if populated:
        shutil.copytree(filled_cache, cache)
    else:
        cache.mkdir()
    prefix = _read_only(cache)
    if prefix is None:
        pytest.skip("this machine cannot make a read-only directory (root without unshare)")
    result = child(cache, prefix=prefix)
    if populated:
        assert result["stats"]["compiles"] == 0 and result["native"] == result["tiles"] > 0


def test_cache_deleted_between_processes_and_within_one(cache_copy):
    cache = cache_copy
    shutil.rmtree(cache)
    again = child(cache)  # a new process, the cache gone: rebuilt from scratch
    assert again["stats"]["compiles"] >= 1 and again["native"] == again["tiles"] > 0
    script = textwrap.dedent(f"""
        import shutil, torch
        x = torch.randn(64, 48)
        f = torch.compile(lambda x: torch.softmax(x * 3.0, -1), backend="pypto",
                          options={{"fallback": "error"}})
        torch.testing.assert_close(f(x), torch.softmax(x * 3.0, -1))
        shutil.rmtree({str(cache)!r})  # deleted under the running process
        g = torch.compile(lambda x: torch.tanh(x).sum(-1), backend="pypto",
                          options={{"fallback": "error"}})
        torch.testing.assert_close(g(x), torch.tanh(x).sum(-1))
        torch.testing.assert_close(f(x * 2), torch.softmax(x * 6.0, -1))
        print("OK")
    """)
    env = {**os.environ, "PYPTO_INDUCTOR_CACHE_DIR": str(cache),
           "PYPTO_INDUCTOR_NO_CALIBRATE": "1"}
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stderr[-3000:]


@pytest.mark.parametrize("cxx", [None, "/nonexistent/bin/c++"], ids=["no_cxx", "cxx_nowhere"])
def test_no_compiler_runs_reference_after_one_warning(tmp_path, cxx):
    """No compiler on PATH (and CXX unset, or pointing nowhere): a training step of the
    transformer block (forward and backward graphs) runs every tile that needs C++ on the
    reference executor (GEMM-only tiles stay on BLAS), right, after exactly one warning."""
    env = {"PATH": str(tmp_path / "empty_bin")}
    if cxx:
        env["CXX"] = cxx
    else:
        env["CXX"] = ""
    result = child(tmp_path / "cache", "transformer", backward=True, env=env)
    compiler_warnings = [w for w in result["warnings"] if "compiler" in w]
    assert len(compiler_warnings) == 1, result["warnings"]
    assert result["stats"]["compiles"] == 0
    assert result["reasons"] and all(r == "no C++ compiler" for r in result["reasons"])
    assert result["native"] < result["tiles"]


def test_build_killed_mid_compile_then_a_new_process_works(tmp_path):
    """SIGKILL to a process (and its compiler) while it builds a model's kernels: a new
    process on the same cache builds and runs them natively, and sweeps the temporaries
    the killed build left."""
    cache = tmp_path / "cache"
    env = {**os.environ, "PYPTO_INDUCTOR_CACHE_DIR": str(cache),
           "PYPTO_INDUCTOR_NO_CALIBRATE": "1"}
    proc = subprocess.Popen([sys.executable, "-c", CHILD, "transformer", "0"], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    deadline = time.monotonic() + 300
    building = False
    while time.monotonic() < deadline and proc.poll() is None:
        if list(cache.glob("cpp/*.tmp")):  # a compiler is writing a library
            building = True
            break
        time.sleep(0.01)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=60)
    assert building, "the first process never started a build"
    after = child(cache, "transformer")
    assert after["native"] == after["tiles"] > 0
    assert not list(cache.glob("cpp/*.tmp*")), list(cache.glob("cpp/*"))
