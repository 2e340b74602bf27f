"""Kernels writing into an input (copy_ outputs, indexing.DirectWrite: BatchNorm's running
statistics, in-place ops on graph inputs) called inline by the graph code
(launcher.INLINE_WRITES): the written input is the kernel's output when contiguous, else
the output is copied into it after the call, as the kernel's Python wrapper does. The
results are the wrapper's bit for bit, and eager's."""
from __future__ import annotations

import copy
import re

import pytest
import torch

from conv_blocks import ConvBnPoolBlock, loss_and_grads
from pypto_inductor.codegen.cpp import launcher
from pypto_inductor.report import collect

WRAPPER_CALL = re.compile(r"kern\d+\(\[")  # a kernel called through its wrapper


def _train(on: bool, monkeypatch, steps: int = 4, threads: int = 1):
    monkeypatch.setattr(launcher, "INLINE_WRITES", on)
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = ConvBnPoolBlock(c=8).to(memory_format=torch.channels_last)
    ref = copy.deepcopy(model)
    compiled = torch.compile(model, backend="pypto")
    gen = torch.Generator().manual_seed(1)
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with collect() as reports:
            for _ in range(steps):
                x = torch.randn(2, 3, 12, 12, generator=gen).to(memory_format=torch.channels_last)
                loss, gx, grads = loss_and_grads(compiled, x)
                want, wgx, wgrads = loss_and_grads(ref, x)
                torch.testing.assert_close(loss, want, rtol=1e-4, atol=1e-4)
                torch.testing.assert_close(gx, wgx, rtol=1e-4, atol=1e-4)
                for g, w in zip(grads, wgrads):  # scaled: reordered fp32 sums, 2 layers
                    scale = w.abs().max().clamp_min(1e-6)
                    torch.testing.assert_close(g / scale, w / scale, rtol=1e-4, atol=1e-4)
                for p in (*model.parameters(), *ref.parameters()):
                    p.grad = None
    finally:
        torch.set_num_threads(old)
    source = "\n".join(r.compiled.source for r in reports if r.compiled is not None)
    return model, ref, source


@pytest.mark.parametrize("threads", [1, 2])
def test_batchnorm_running_stats_are_updated_inline(threads, monkeypatch):
    # the wrapper's results (off) and the inline launch's (on): the same bits, and eager's
    got = {on: _train(on, monkeypatch, threads=threads) for on in (False, True)}
    for on, (model, ref, source) in got.items():
        for bn, want in ((model.bn, ref.bn), (model.bn2, ref.bn2)):
            assert int(bn.num_batches_tracked) == int(want.num_batches_tracked) == 4
            torch.testing.assert_close(bn.running_mean, want.running_mean, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(bn.running_var, want.running_var, rtol=1e-5, atol=1e-6)
        if on:  # the running-stats kernels' writes are written out, no wrapper call
            assert not WRAPPER_CALL.search(source), source
            assert ".copy_(" in source and ".is_contiguous()" in source, source
        else:
            assert WRAPPER_CALL.search(source), source
    (off, _, _), (on, _, _) = got[False], got[True]
    for name, buf in on.named_buffers():
        torch.testing.assert_close(buf, dict(off.named_buffers())[name], rtol=0, atol=0)


def scale_in_place(a, x):
    a.mul_(2).add_(x)
    return x.sin()


def shift_in_place(a, x):  # a tile reading a at other elements than it writes
    a[1:].copy_(a[:-1] * 2 + x[1:])
    return x.cos()


@pytest.mark.parametrize("fn", [scale_in_place, shift_in_place])
@pytest.mark.parametrize("contiguous", [True, False])
def test_written_input_matches_eager(fn, contiguous, monkeypatch):
    # a contiguous input is the kernel's output; another (a transposed view) or a write
    # the kernel may not make in place gets a fresh output copied into it after the call
    monkeypatch.setattr(launcher, "INLINE_WRITES", True)
    torch._dynamo.reset()
    compiled = torch.compile(fn, backend="pypto")
    with collect() as reports:
        for _ in range(3):
            a = torch.randn(6, 8) if contiguous else torch.randn(8, 6).t()
            x = torch.randn(6, 8)
            want_a = a.clone()
            out = compiled(a, x)
            want = fn(want_a, x)
            torch.testing.assert_close(a, want_a, rtol=0, atol=0)  # mul, add: exact
            assert a.is_contiguous() == contiguous
            torch.testing.assert_close(out, want)
    source = "\n".join(r.compiled.source for r in reports if r.compiled is not None)
    assert ".copy_(" in source and not WRAPPER_CALL.search(source), source
    # the written input (a: arg0) is no read-only input (layouts.fix_inputs): a copy of it
    # in the traced layout would take the write
    assert "arg0 = relayout(" not in source, source
