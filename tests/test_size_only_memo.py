"""Kernels of the size symbols alone, launched once per sizes (codegen/graph/memo.py).

T5's relative-position buckets are the model case: aranges, a log per element, an integer
bucket, then a gather from a weight. Every case is compared with eager on fresh inputs,
over repeated calls (the kept values must stay right) and changing sizes (dynamic)."""
from __future__ import annotations

import math

import pytest
import torch

from pypto_inductor.codegen.graph import memo
from pypto_inductor.report import collect


def buckets(q: int, k: int, n: int = 32, exact: int = 8) -> torch.Tensor:
    rel = torch.arange(k)[None, :] - torch.arange(q)[:, None]
    big = exact + (torch.log(rel.abs().float().clamp(min=1) / exact)
                   / math.log(128 / exact) * (n - exact)).to(torch.long)
    return torch.where(rel.abs() < exact, rel.abs(), big.clamp(max=n - 1)) + (rel > 0) * n


def position_bias(x, weight):
    # [batch, heads, q, k] scores plus a bias gathered at the buckets (T5's compute_bias)
    q, k = x.shape[-2], x.shape[-1]
    return x + weight[buckets(q, k)].permute(2, 0, 1)


def _compile(fn, dynamic=False):
    torch._dynamo.reset()
    return torch.compile(fn, backend="pypto", dynamic=dynamic)


def _sources(fn, *args):
    with collect() as reports:
        out = fn(*args)
    return out, "\n".join(r.compiled.source for r in reports if r.compiled is not None)


def test_bucket_kernel_runs_once_and_stays_right():
    weight = torch.randn(64, 4)
    f = _compile(position_bias)
    x = torch.randn(2, 4, 24, 40)
    out, source = _sources(f, x, weight)
    torch.testing.assert_close(out, position_bias(x, weight))
    assert "kept = memo" in source, source
    for _ in range(3):  # kept buckets, fresh scores and weights
        x, weight = torch.randn(2, 4, 24, 40), torch.randn(64, 4)
        torch.testing.assert_close(f(x, weight), position_bias(x, weight))


def test_kept_values_follow_dynamic_sizes():
    weight = torch.randn(64, 4)
    f = _compile(position_bias, dynamic=True)
    for q, k in ((24, 40), (9, 17), (24, 40), (30, 30), (9, 17)):
        x = torch.randn(2, 4, q, k)
        torch.testing.assert_close(f(x, weight), position_bias(x, weight))


def test_more_sizes_than_kept_entries(monkeypatch):
    monkeypatch.setattr(memo, "MEMO_ENTRIES", 2)
    weight = torch.randn(64, 4)
    f = _compile(position_bias, dynamic=True)
    for q in (5, 6, 7, 8, 5, 9, 6):
        x = torch.randn(1, 4, q, q + 3)
        torch.testing.assert_close(f(x, weight), position_bias(x, weight))


def returns_arange(x):
    return torch.arange(x.shape[0]) * 3, x @ x


def test_returned_values_are_not_kept():
    # the caller owns a returned tensor and may write into it: computed on every call
    f = _compile(returns_arange)
    x = torch.randn(6, 6)
    (r, y), source = _sources(f, x)
    assert "kept = memo" not in source, source
    r.fill_(-1)
    for got, want in zip(f(x), returns_arange(x)):
        torch.testing.assert_close(got, want)


def bucket_in_place(x):
    b = buckets(x.shape[0], x.shape[1])
    b.add_(1)  # functionalised: a new value, the kept one untouched
    return x * b


@pytest.mark.parametrize("on", [False, True])
def test_switch_and_in_place_writes(monkeypatch, on):
    monkeypatch.setattr(memo, "MEMO_SIZE_ONLY", on)
    f = _compile(bucket_in_place)
    for _ in range(3):
        x = torch.randn(12, 20)
        torch.testing.assert_close(f(x), bucket_in_place(x))
