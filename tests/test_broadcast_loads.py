"""The fast path of a row kernel reads a column-broadcast input (a LayerNorm's mean and rstd
per row, a softmax's row max) once before its column loop (row_loop.HOIST_BROADCAST_LOADS):
inside the loop GCC's PRE reloaded it in the latch and the loop stopped vectorising (the
one-thread serial copy of LayerNorm's backward, with its column sums: 65 -> 17 us a call at
512 x 64). Same bits with the switch on and off, at one and two threads (fp32 and bf16), and
eager's values and gradients (fp32)."""
from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F

from pypto_inductor.codegen.cpp import row_loop

# a fast-path load of a column-broadcast access, still inside a column loop
IN_LOOP_BROADCAST = re.compile(r"^ {8}const \w+ v\d+ = .*in\d+\[b\d+ \+ 0\]", re.M)


def _ln_residual(x, y, w, b):
    return F.layer_norm(x + y, x.shape[-1:], w, b, 1e-5)


def _cross_entropy(logits, labels):
    return F.cross_entropy(logits, labels)


def _inputs(fn, dtype, g):
    rows, cols = 4 * 130, 64  # over PARALLEL_MIN: the parallel loop and its serial copy
    if fn is _ln_residual:
        return (torch.randn(rows, cols, generator=g) * 2 + 0.5, torch.randn(rows, cols, generator=g),
                torch.randn(cols, generator=g), torch.randn(cols, generator=g)), dtype
    return (torch.randn(rows, 256, generator=g) * 3, torch.randint(0, 256, (rows,), generator=g)), \
        dtype


def _run(fn, args, threads, dtype, compiled=True):
    torch._dynamo.reset()
    leaves = [a.detach().clone().to(dtype).requires_grad_() if a.is_floating_point() else a
              for a in args]
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        f = torch.compile(fn, backend="pypto") if compiled else fn
        out = f(*leaves)
        out.float().sum().backward() if out.dim() else out.backward()
    finally:
        torch.set_num_threads(old)
    return [out.detach()] + [a.grad for a in leaves if a.is_floating_point()]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("fn", [_ln_residual, _cross_entropy], ids=["layer_norm", "cross_entropy"])
def test_hoisted_broadcast_loads_same_bits_and_eager_values(fn, dtype, sources, monkeypatch):
    args, dtype = _inputs(fn, dtype, torch.Generator().manual_seed(16))
    monkeypatch.setattr(row_loop, "HOIST_BROADCAST_LOADS", False)
    off = {nt: _run(fn, args, nt, dtype) for nt in (1, 2)}
    before = sum(len(IN_LOOP_BROADCAST.findall(s)) for s in sources)
    sources.clear()
    monkeypatch.setattr(row_loop, "HOIST_BROADCAST_LOADS", True)
    on = {nt: _run(fn, args, nt, dtype) for nt in (1, 2)}
    after = sum(len(IN_LOOP_BROADCAST.findall(s)) for s in sources)
    # LayerNorm: none left; cross-entropy: fewer (pointwise kernels' loops are not row loops)
    assert sources and after < before and (after == 0 or fn is _cross_entropy)
    for nt in (1, 2):
        for k, (a, b) in enumerate(zip(on[nt], off[nt])):
            assert torch.equal(a, b), f"{nt} threads, result {k}"
    if dtype == torch.float32:  # bf16: the same bits as before the switch (above)
        want = _run(fn, args, 1, dtype, compiled=False)
        for a, b in zip(on[1], want):
            torch.testing.assert_close(a, b, atol=2e-5, rtol=2e-5)
