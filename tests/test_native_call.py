"""How kernels are called: the CPython extension (codegen/native_call.py) and the ctypes
path used without it give the same results as eager."""
from __future__ import annotations

import sysconfig
from pathlib import Path

import pytest
import torch

from pypto_inductor.codegen.cpp import native_call


def _fn(x, w):
    return torch.softmax(x * 2.0, -1) @ w + w.sum(0), (x - x.mean(-1, keepdim=True)).relu()


def test_extension_builds_where_python_headers_exist():
    headers = Path(sysconfig.get_paths()["include"]) / "Python.h"
    call = native_call.extension_call()
    assert (call is not None) == headers.exists()


@pytest.mark.parametrize("path", ["extension", "ctypes"])
def test_kernels_match_eager_through_either_call(path, monkeypatch):
    if path == "ctypes":
        monkeypatch.setitem(native_call.state, "call", None)
    elif native_call.extension_call() is None:
        pytest.fail("the extension did not build on this machine")
    x, w = torch.randn(33, 40), torch.randn(40, 7)
    compiled = torch.compile(_fn, backend="pypto", options={"target": "cpu",
                                                            "fallback": "error"})
    for scale in (1.0, -3.0):  # a second call reuses the cached layout
        with torch.no_grad():
            torch.testing.assert_close(compiled(x * scale, w), _fn(x * scale, w))


def test_extension_rejects_bad_arguments():
    call = native_call.extension_call()
    if call is None:
        pytest.fail("the extension did not build on this machine")
    with pytest.raises(TypeError):
        call(0, [torch.zeros(1)], 0, 0, 1)  # tensors must be a tuple


def _embed_norm(ids, w, g):  # a causal LM's first kernel: embedding + RMSNorm
    x = torch.nn.functional.embedding(ids, w)
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * g


def _eager_error(fn, *args) -> str:
    with pytest.raises(IndexError) as e:
        fn(*args)
    return str(e.value)


@pytest.mark.parametrize("path", ["returned", "tensor", "ctypes"])
def test_index_check_raises_like_eager_through_each_status_path(path, monkeypatch):
    """An index scan's status comes back as the extension call's value (launcher.STATUS_RETURN),
    else in a status tensor: in range, eager's values; out of range (past the end, or below
    -size), eager's IndexError, on every call, from the graph code and from the kernel's own
    wrapper alike."""
    from pypto_inductor.codegen.cpp import launcher
    from pypto_inductor.report import collect

    torch._dynamo.reset()
    monkeypatch.setattr(launcher, "STATUS_RETURN", path == "returned")
    if path == "ctypes":
        monkeypatch.setitem(native_call.state, "call", None)
    elif native_call.extension_call() is None:
        pytest.fail("the extension did not build on this machine")
    gen = torch.Generator().manual_seed(5)
    w, g = torch.randn(11, 16, generator=gen), torch.randn(16, generator=gen)
    compiled = torch.compile(_embed_norm, backend="pypto", options={"target": "cpu",
                                                                    "fallback": "error"})
    with collect() as reports:
        ids = torch.randint(0, 11, (2, 5), generator=gen)
        torch.testing.assert_close(compiled(ids, w, g), _embed_norm(ids, w, g))
    source = "\n".join(r.compiled.source for r in reports if r.compiled is not None)
    assert (".item()" in source) == (path == "tensor"), source
    kernels = [k for r in reports for k in r.compiled.kernels.values()
               if k.program is not None and k.program.checks]
    assert len(kernels) == 1, kernels
    by_spec = {((11, 16), torch.float32): w, ((16,), torch.float32): g}
    for bad in (11, -12, 100):
        ids = torch.randint(0, 11, (2, 5), generator=gen)
        torch.testing.assert_close(compiled(ids, w, g), _embed_norm(ids, w, g))
        ids[1, 3] = bad
        message = _eager_error(_embed_norm, ids, w, g)
        for _ in range(2):
            with pytest.raises(IndexError, match=message):
                compiled(ids, w, g)
        # the kernel's own wrapper (launcher.wrapper_source), its inputs in its order
        inputs = [by_spec.get((tuple(s.shape), s.dtype), ids) for s in kernels[0].program.input_specs]
        with pytest.raises(IndexError, match=message):
            kernels[0].fn(list(inputs), ())
        ids[1, 3] = 3
        out = kernels[0].fn(list(inputs), ())[0]
        torch.testing.assert_close(out, _embed_norm(ids, w, g))


def test_threads_checking_indices_at_once_get_their_own_status():
    """Two threads call one compiled graph with index checks at once (the kernel runs with
    the GIL released): the one with a bad index always raises, the other never does."""
    import threading

    torch._dynamo.reset()
    gen = torch.Generator().manual_seed(6)
    w, g = torch.randn(50, 64, generator=gen), torch.randn(64, generator=gen)
    compiled = torch.compile(_embed_norm, backend="pypto")
    good = torch.randint(0, 50, (4, 256), generator=gen)
    bad = good.clone()
    bad[3, 255] = 50
    torch.testing.assert_close(compiled(good, w, g), _embed_norm(good, w, g))
    errors, outcomes = [], []

    def worker(ids):
        name = "bad" if ids is bad else "good"
        try:
            for _ in range(200):
                try:
                    out = compiled(ids, w, g)
                except IndexError:
                    outcomes.append((name, "raised"))
                    continue
                outcomes.append((name, "ran"))
                torch.testing.assert_close(out, _embed_norm(ids, w, g))
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(ids,)) for ids in (good, bad)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert sorted(outcomes) == [("bad", "raised")] * 200 + [("good", "ran")] * 200
