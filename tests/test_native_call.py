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
