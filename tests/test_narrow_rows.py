"""Pointwise kernels whose rows are a few (constant) columns run blocks of rows per work item
(narrow_rows.NARROW_ROWS): T5's masked position bias where(mask[B,1,S,S], bias[S,S,H] viewed
[1,H,S,S], min) is computed heads-last, [B,S,S,H] rows of H = 4 (206 -> 77 us a call, one
thread; docs/benchmarks.md). The new loop is taken (the switch off: it is not) and gives
eager's values: bit for bit for selects and exact pointwise ops, at one and two threads;
the masked-bias attention's training step (where, softmax, the bias gradient's sum over the
batch) within the float32 tolerances."""
from __future__ import annotations

import pytest
import torch

from pypto_inductor.codegen.cpp import narrow_rows

NARROW_LOOP = "NJB"  # the narrow kernel's count of row blocks per outer index


def _masked_bias(mask, emb):
    return torch.where(mask, emb.permute(2, 0, 1).unsqueeze(0), torch.finfo(emb.dtype).min)


def _add_broadcast(x, y):  # rows of 3: a full input plus one broadcast over the rows
    return x + y


def _int_where(mask, a):  # int64 rows of 5, a row-broadcast mask
    return torch.where(mask, a, -a)


def _inputs(fn, g):
    if fn is _masked_bias:
        return torch.rand(4, 1, 64, 64, generator=g) > 0.2, torch.randn(64, 64, 4, generator=g)
    if fn is _add_broadcast:
        return torch.randn(5, 70, 33, 3, generator=g), torch.randn(70, 1, 3, generator=g)
    return torch.rand(6, 40, 37, 1, generator=g) > 0.5, \
        torch.randint(-1000, 1000, (6, 40, 37, 5), generator=g)


def _compiled(fn, args, threads):
    torch._dynamo.reset()
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return torch.compile(fn, backend="pypto")(*args)
    finally:
        torch.set_num_threads(old)


def _loop_taken_and_bit_exact(switch, fn, args, sources, monkeypatch):
    """narrow_rows.<switch> off: no narrow loop; on: the narrow loop, at one and two threads;
    each gives eager's values bit for bit, in eager's layout."""
    want = fn(*args)
    monkeypatch.setattr(narrow_rows, switch, False)
    off = _compiled(fn, args, 1)
    assert sources and not any(NARROW_LOOP in s for s in sources)
    sources.clear()
    monkeypatch.setattr(narrow_rows, switch, True)
    on = {nt: _compiled(fn, args, nt) for nt in (1, 2)}
    assert any(NARROW_LOOP in s for s in sources)
    torch.testing.assert_close(off, want, rtol=0, atol=0)
    for nt, out in on.items():
        assert out.stride() == want.stride(), nt
        torch.testing.assert_close(out, want, rtol=0, atol=0, msg=f"{nt} threads")


@pytest.mark.parametrize("fn", [_masked_bias, _add_broadcast, _int_where],
                         ids=["masked_bias", "add_broadcast", "int_where"])
def test_narrow_rows_taken_and_bit_exact(fn, sources, monkeypatch):
    args = _inputs(fn, torch.Generator().manual_seed(18))
    _loop_taken_and_bit_exact("NARROW_ROWS", fn, args, sources, monkeypatch)


def test_narrow_rows_not_taken_for_a_strided_column_read(sources, monkeypatch):
    """An input read with a column stride (a sliced last dim) keeps the blocked loop over
    rows x columns (the strided reads share cache lines), with eager's values."""
    g = torch.Generator().manual_seed(19)
    x = torch.randn(3, 50, 20, 8, generator=g)[..., ::2]  # column stride 2
    y = torch.randn(50, 1, 4, generator=g)
    monkeypatch.setattr(narrow_rows, "NARROW_ROWS", True)
    out = _compiled(_add_broadcast, (x, y), 1)
    assert sources and not any(NARROW_LOOP in s for s in sources)
    torch.testing.assert_close(out, x + y, rtol=0, atol=0)


def _attention(q, k, v, mask, emb):
    p = torch.softmax(q @ k.transpose(-1, -2) + _masked_bias(mask, emb), -1)
    return p @ v


@pytest.mark.parametrize("threads", [1, 2])
def test_masked_bias_attention_training_matches_eager(threads, sources, monkeypatch):
    """T5's self-attention with its position bias: forward, and the gradients (the bias's is
    where(mask, dscores, 0) summed over the batch) against eager at float32 tolerances."""
    g = torch.Generator().manual_seed(20)
    B, H, S, d = 2, 4, 48, 8
    qkv = [torch.randn(B, H, S, d, generator=g) for _ in range(3)]
    mask = torch.rand(B, 1, S, S, generator=g) > 0.2
    emb = torch.randn(S, S, H, generator=g)
    monkeypatch.setattr(narrow_rows, "NARROW_ROWS", True)
    torch._dynamo.reset()
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        results = []
        for f in (_attention, torch.compile(_attention, backend="pypto")):
            leaves = [t.clone().requires_grad_() for t in (*qkv, emb)]
            out = f(*leaves[:3], mask, leaves[3])
            (out * torch.linspace(-1, 1, d)).sum().backward()
            results.append([out.detach()] + [t.grad for t in leaves])
    finally:
        torch.set_num_threads(old)
    assert any(NARROW_LOOP in s for s in sources)
    for k, (want, got) in enumerate(zip(*results)):
        torch.testing.assert_close(got, want, msg=f"result {k}")


def _bn_relu(x, m, s, w, b):  # BatchNorm's apply + ReLU on channels-last rows of C
    return torch.relu((x - m[:, None, None]) * s[:, None, None] * w[:, None, None]
                      + b[:, None, None])


def _bn_input_grad(x, m, s, g, a, w):  # BatchNorm backward's input gradient, as in the ResNet
    return ((g - (x - m[:, None, None]) * s[:, None, None]) - a[:, None, None]) * w[:, None, None]


@pytest.mark.parametrize("channels", [16, 32])
@pytest.mark.parametrize("fn", [_bn_relu, _bn_input_grad], ids=["bn_relu", "bn_input_grad"])
def test_wide_narrow_rows_for_channels_last_batchnorm(fn, channels, sources, monkeypatch):
    """Rows of 16 and 32 channels (NARROW_WIDE_ROWS): the narrow loop is taken only with the
    switch on, and both give eager's values bit for bit at one and two threads."""
    g = torch.Generator().manual_seed(21)
    x = torch.randn(4, channels, 24, 20, generator=g).contiguous(
        memory_format=torch.channels_last)
    per_channel = [torch.randn(channels, generator=g) for _ in range(5)]
    if fn is _bn_relu:
        args = (x, *per_channel[:4])
    else:
        grad = torch.randn(x.shape, generator=g).contiguous(memory_format=torch.channels_last)
        args = (x, *per_channel[:2], grad, *per_channel[2:4])
    _loop_taken_and_bit_exact("NARROW_WIDE_ROWS", fn, args, sources, monkeypatch)
