"""Embedding backward's ``index_put(accumulate=True)`` in one extension call
(``codegen.cpp.index_put.ONE_CALL``): the copy of the zeros, the index check and the row
adds in one native call, with no ATen ``clone`` on the way; gradients as eager's."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pypto_inductor.backend import pypto_backend
from pypto_inductor.codegen.cpp import index_put
from pypto_inductor.codegen.cpp import native_call

pytestmark = pytest.mark.skipif(native_call.extension_call_status() is None,
                                reason="no CPython extension for native calls here")


class Embeddings(torch.nn.Module):
    """BERT's three embeddings: words (padding_idx 0), positions, token types."""

    def __init__(self, dtype):
        super().__init__()
        self.words = torch.nn.Embedding(50, 24, padding_idx=0, dtype=dtype)
        self.positions = torch.nn.Embedding(40, 24, dtype=dtype)
        self.types = torch.nn.Embedding(2, 24, dtype=dtype)

    def forward(self, ids, types):
        positions = torch.arange(ids.shape[1]).unsqueeze(0)
        h = self.words(ids) + self.positions(positions) + self.types(types)
        return (h.float() * torch.linspace(-1, 1, 24)).square().sum()


def _grads(model, backend, ids, types):
    model.zero_grad(set_to_none=True)
    f = torch.compile(model, backend=backend) if backend is not None else model
    f(ids, types).backward()
    return [p.grad.clone() for p in model.parameters()]


def _inputs(index_dtype):
    ids = torch.randint(0, 50, (4, 32), dtype=index_dtype)
    ids[:, :6] = 7  # repeated ids
    ids[1, 20:] = 0  # padding: no gradient
    return ids, torch.randint(0, 2, (4, 32), dtype=index_dtype)


@pytest.mark.parametrize("index_dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_embedding_gradients_match_eager_and_the_clone_path(monkeypatch, dtype, index_dtype):
    torch.manual_seed(3)
    model = Embeddings(dtype)
    ids, types = _inputs(index_dtype)
    eager = _grads(model, None, ids, types)
    got = {}
    for one_call in (True, False):  # a backend callable each: no frame shared (k16x)
        monkeypatch.setattr(index_put, "ONE_CALL", one_call)
        got[one_call] = _grads(model, lambda gm, ex: pypto_backend(gm, ex), ids, types)
    for a, b in zip(got[True], got[False]):
        torch.testing.assert_close(a, b, rtol=0, atol=0)  # the same loop: the same bits
    tol = {"atol": 0.5, "rtol": 0.03} if dtype == torch.bfloat16 else {}
    for a, e in zip(got[True], eager):
        torch.testing.assert_close(a, e, **tol)
    assert got[True][0][0].abs().max() == 0  # padding_idx's row


def test_one_call_runs_no_aten_clone(monkeypatch):
    """The point of the switch: the kernel's copy is native, not an ATen clone."""
    torch.manual_seed(4)
    model = Embeddings(torch.float32)
    ids, types = _inputs(torch.int64)
    counts = {}
    for one_call in (True, False):
        monkeypatch.setattr(index_put, "ONE_CALL", one_call)
        model.zero_grad(set_to_none=True)
        f = torch.compile(model, backend=lambda gm, ex: pypto_backend(gm, ex))
        f(ids, types).backward()  # compile outside the profile
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            f(ids, types).backward()
        counts[one_call] = sum(e.count for e in prof.key_averages() if e.key == "aten::clone")
    assert counts[True] == 0 and counts[False] >= 3, counts


def test_one_call_out_of_range_raises_and_falls_back_for_views(monkeypatch):
    monkeypatch.setattr(index_put, "ONE_CALL", True)
    f = torch.compile(lambda x, i, v: x.index_put((i,), v, accumulate=True) + 1,
                      backend=lambda gm, ex: pypto_backend(gm, ex))
    torch.manual_seed(5)
    x, values = torch.randn(7, 4), torch.randn(9, 4)
    index = torch.randint(0, 7, (9,))
    index[3] = -8
    with pytest.raises(IndexError, match="index -8 is out of bounds for dimension 0 with size 7"):
        f(x, index, values)
    index[3] = -7  # negative ids count from the end, as eager's
    torch.testing.assert_close(f(x, index, values),
                               x.index_put((index,), values, accumulate=True) + 1)
    xt = torch.randn(4, 7).t()  # a transposed x: the clone path
    torch.testing.assert_close(f(xt, index, values),
                               xt.index_put((index,), values, accumulate=True) + 1)


def test_one_call_dynamic_batch_reads_each_call_sizes(monkeypatch):
    """Two batch sizes, one compiled graph: the indices' strides are the same, so the
    cached call numbers must follow the size symbols (the count of ids differs)."""
    monkeypatch.setattr(index_put, "ONE_CALL", True)
    torch.manual_seed(6)
    model = Embeddings(torch.float32)
    f = torch.compile(model, backend=lambda gm, ex: pypto_backend(gm, ex), dynamic=True)
    for batch in (4, 3, 4, 2):
        ids, types = _inputs(torch.int64)
        ids, types = ids[:batch].contiguous(), types[:batch].contiguous()
        model.zero_grad(set_to_none=True)
        f(ids, types).backward()
        got = [p.grad.clone() for p in model.parameters()]
        eager = _grads(model, None, ids, types)
        for a, e in zip(got, eager):
            torch.testing.assert_close(a, e)
