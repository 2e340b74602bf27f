"""A one-thread call of a row kernel runs a serial copy of its loop over work items, outside
the OpenMP region (emit_rows.SERIAL_COPY): the same bits as the ``omp parallel for`` loop at
one and two threads, eager's values (RMSNorm forward and backward, a residual add + LayerNorm,
a strided input), and no OpenMP region at all in a tile too small to run in parallel.
The loops are checked as two copies (emit_rows.ONE_BODY off; test_one_body: on)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pypto_inductor.codegen.cpp import emit_rows

PRAGMA = "#pragma omp parallel for"


def _rms_norm(x, y, w):
    h = x + y
    return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) * w


def _residual_ln(x, y, w):
    return F.layer_norm(x + y, x.shape[-1:], w, None, 1e-5)


def _run(fn, args, grad_out, threads):
    torch._dynamo.reset()
    leaves = [a.detach().clone().requires_grad_() for a in args]
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = torch.compile(fn, backend="pypto")(*leaves)
        out.backward(grad_out)
    finally:
        torch.set_num_threads(old)
    return [out.detach()] + [a.grad for a in leaves]


def _bits(t):
    return t.view(torch.int32)


@pytest.mark.parametrize("transposed", [False, True], ids=["contiguous", "transposed"])
@pytest.mark.parametrize("fn", [_rms_norm, _residual_ln], ids=["rms_norm", "residual_ln"])
def test_serial_copy_same_bits_and_eager_values(fn, transposed, sources, monkeypatch):
    g = torch.Generator().manual_seed(16)
    rows, cols = 4 * 130, 64  # 33280 elements: over PARALLEL_MIN, so both loops exist
    assert rows * cols >= emit_rows.PARALLEL_MIN
    x = torch.randn(cols, rows, generator=g).t() if transposed else \
        torch.randn(rows, cols, generator=g)
    args = (x * 2 + 0.5, torch.randn(rows, cols, generator=g), torch.randn(cols, generator=g))
    grad_out = torch.randn(rows, cols, generator=g)
    monkeypatch.setattr(emit_rows, "ONE_BODY", False)
    monkeypatch.setattr(emit_rows, "SERIAL_COPY", False)
    off = {nt: _run(fn, args, grad_out, nt) for nt in (1, 2)}
    assert not any("} else {\n  for (int64_t wi" in s for s in sources)
    sources.clear()
    monkeypatch.setattr(emit_rows, "SERIAL_COPY", True)
    on = {nt: _run(fn, args, grad_out, nt) for nt in (1, 2)}
    # the row kernels have both loops: the parallel one and its serial copy
    rows_kernels = [s for s in sources if "for (int64_t wi = 0; wi < W; ++wi)" in s]
    assert rows_kernels and all(s.count("for (int64_t wi = 0; wi < W; ++wi)") == 2
                                and s.count(PRAGMA) == 1 for s in rows_kernels)
    for nt in (1, 2):
        for k, (a, b) in enumerate(zip(on[nt], off[nt])):
            assert torch.equal(_bits(a), _bits(b)), f"{nt} threads, result {k}"
    leaves = [a.detach().clone().requires_grad_() for a in args]
    out = fn(*leaves)
    out.backward(grad_out)
    for a, b in zip(on[1], [out.detach()] + [a.grad for a in leaves]):
        torch.testing.assert_close(a, b, atol=2e-5, rtol=2e-5)


def test_small_constant_tile_has_no_openmp_region(sources):
    g = torch.Generator().manual_seed(3)
    x, y, w = (torch.randn(*s, generator=g) for s in ((12, 64), (12, 64), (64,)))
    torch._dynamo.reset()
    with torch.no_grad():
        out = torch.compile(_rms_norm, backend="pypto")(x, y, w)
    torch.testing.assert_close(out, _rms_norm(x, y, w), atol=2e-6, rtol=2e-6)
    rows_kernels = [s for s in sources if "for (int64_t wi = 0; wi < W; ++wi)" in s]
    assert rows_kernels and not any(PRAGMA in s for s in rows_kernels)


@pytest.mark.parametrize("shape", [(4, 2, 2, 128, 16), (3, 5, 70, 33)], ids=["gqa", "odd"])
def test_column_reduction_serial_copy(shape, sources, monkeypatch):
    """Column reductions (emit_columns) too: GQA's sum over the repeats, a float sum over a
    middle dim; the same bits on and off at 1 and 2 threads, eager's values."""
    g = torch.Generator().manual_seed(len(shape))
    x = torch.randn(*shape, generator=g) * 3 + 1

    def f(x):
        return x.sum(2) * 0.5, x.amax(2)

    def run(nt):
        torch._dynamo.reset()
        old = torch.get_num_threads()
        torch.set_num_threads(nt)
        try:
            with torch.no_grad():
                return torch.compile(f, backend="pypto")(x)
        finally:
            torch.set_num_threads(old)
    monkeypatch.setattr(emit_rows, "ONE_BODY", False)
    monkeypatch.setattr(emit_rows, "SERIAL_COPY", False)
    off = {nt: run(nt) for nt in (1, 2)}
    sources.clear()
    monkeypatch.setattr(emit_rows, "SERIAL_COPY", True)
    on = {nt: run(nt) for nt in (1, 2)}
    assert sources and all(s.count("for (int64_t wi = 0;") == 2 * s.count(PRAGMA) > 0
                           for s in sources)
    for nt in (1, 2):
        for k, (a, b) in enumerate(zip(on[nt], off[nt])):
            assert torch.equal(_bits(a), _bits(b)), f"{nt} threads, result {k}"
    torch.testing.assert_close(on[1], f(x), atol=2e-5, rtol=2e-5)
