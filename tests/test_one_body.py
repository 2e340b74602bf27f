"""Row and column kernels written smaller for g++ (emit_rows.ONE_BODY: the loop over work items
once, for the parallel and the serial branch; row_loop.COMPACT_FALLBACK: the generic path
beside a fast one in scalar loops). Each kernel of a LayerNorm / RMSNorm training step, a
softmax and a middle-dim sum (emit_columns) is built with the switch off and on and called
directly on contiguous inputs (the fast path) and on strided ones (the generic path: the
kernels were traced contiguous), at one and two threads: the on source is smaller, the fast
path gives the same bits, ONE_BODY's generic path too, COMPACT_FALLBACK's the fast path's
values on the same numbers (its sums add in another order) and emit_columns' the same bits."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pypto_inductor.codegen import cpp
from pypto_inductor.codegen.cpp import emit_rows, row_loop
from same_bits import same_bits

ROWS, COLS = 96, 400  # 38400 elements: over PARALLEL_MIN, so a kernel has both branches


def _residual_ln(x, y, w, b):
    return F.layer_norm(x + y, x.shape[-1:], w, b, 1e-5)


def _rms_norm(x, y, w, b):
    h = x + y
    return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) * w


def _softmax(x, y, w, b):
    return torch.softmax(x * 0.125 + y, -1) * w


def _middle_sum(x, y, w, b):
    return (x.view(ROWS, 40, 10) * y.view(ROWS, 40, 10)).sum(1) + b[:10]


CASES = {f.__name__.lstrip("_"): f for f in (_residual_ln, _rms_norm, _softmax, _middle_sum)}


def _build(fn, dtype, built, train: bool) -> list:
    """(kernel, source) of each native kernel of ``fn``'s forward (and backward)."""
    g = torch.Generator().manual_seed(5)
    args = [torch.randn(*s, generator=g).to(dtype).requires_grad_(train)
            for s in ((ROWS, COLS), (ROWS, COLS), (COLS,), (COLS,))]
    torch._dynamo.reset()
    start = len(built)
    out = torch.compile(fn, backend="pypto")(*args)
    if train:
        out.backward(torch.randn(out.shape, generator=g).to(dtype))
    return [(k, cpp.generate_source(k.program)) for _, k in built[start:] if k.native]


def _inputs(program, seed: int, strided: bool) -> list | None:
    """Random inputs of the kernel's input specs (None: a non-float input); ``strided``:
    each input a view of every other element of a wider tensor, else a contiguous copy of
    the same values (the same ``seed``)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for spec in program.input_specs:
        if not spec.dtype.is_floating_point:
            return None
        shape = [int(d) for d in spec.shape]
        t = torch.randn(*shape[:-1], 2 * shape[-1], generator=g)[..., ::2] if shape \
            else torch.randn((), generator=g)
        out.append(t.to(spec.dtype) if strided else t.to(spec.dtype).contiguous())
    return out


def _call(kernel, inputs, threads: int) -> list:
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return [t.clone() for t in kernel.fn(inputs, ())]
    finally:
        torch.set_num_threads(old)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("switch", ["ONE_BODY", "COMPACT_FALLBACK"])
def test_smaller_source_same_bits(switch, case, dtype, built, monkeypatch):
    fn = CASES[case]
    train = case != "middle_sum"
    module = emit_rows if switch == "ONE_BODY" else row_loop  # where the switch is read
    monkeypatch.setattr(module, switch, False)
    off = _build(fn, dtype, built, train)
    monkeypatch.setattr(module, switch, True)
    on = _build(fn, dtype, built, train)
    assert len(on) == len(off) > 0
    assert sum(len(s) for _, s in on) < sum(len(s) for _, s in off)
    if switch == "ONE_BODY":
        assert any("pi_items" in s for _, s in on) and not any("pi_items" in s for _, s in off)
    checked = 0
    for j, ((k_off, s_off), (k_on, s_on)) in enumerate(zip(off, on)):
        fast = _inputs(k_on.program, j, strided=False)
        if fast is None:
            continue
        slow = _inputs(k_on.program, j, strided=True)
        columns = k_on.program.transposed and not k_on.program.mixed  # emit_columns
        for threads in (1, 2):
            what = f"{case} kernel {j}, {threads} threads"
            ref = _call(k_off, fast, threads)
            for a, b in zip(_call(k_on, fast, threads), ref):
                same_bits(a, b, f"{what}, contiguous: {switch} on vs off")
            slow_on, slow_off = _call(k_on, slow, threads), _call(k_off, slow, threads)
            for a, b, c in zip(slow_on, slow_off, ref):
                if switch == "ONE_BODY" or columns or a.numel() == 0:
                    same_bits(a, b, f"{what}, strided: {switch} on vs off")
                # the generic path: the fast path's values on the same numbers
                tol = {torch.float32: 2e-5}.get(dtype, 2e-2)
                torch.testing.assert_close(a, c, rtol=tol, atol=tol, equal_nan=True)
        checked += 1
    assert checked
