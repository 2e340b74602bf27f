"""Pointwise producers of cat parts fused into the cat's kernel (fusion/capacity.cat_part_ops):
rotate_half's neg over half the columns, RoPE of k inside the KV cache's cat along the
sequence dim, against eager PyTorch, static and dynamic=True, with the fused tile count."""
from __future__ import annotations

import pytest
import torch

from pypto_inductor import models

DTYPES = [torch.float32, torch.bfloat16]
DYNAMIC = [False, True]


def _tiles(run) -> list[dict]:
    return [t for g in run.report.to_dict()["graphs"] for t in g["fusion_tiles"]]


def _check_tiles(run, count: int, must: set[str]) -> None:
    tiles = _tiles(run)
    assert len(tiles) == count, [t["ops"] for t in tiles]
    assert any(must <= {op.rstrip("_0123456789") for op in t["ops"]} for t in tiles), \
        [t["ops"] for t in tiles]
    assert all(t["native"]["native"] for t in tiles), [t["native"] for t in tiles]


def _rope(x, cos, sin):
    return x * cos + models.rotate_half(x) * sin


def _rand(*shape, dtype):
    return torch.randn(*shape).to(dtype)


@pytest.mark.parametrize("dynamic", DYNAMIC)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("b,h,s,d", [(1, 4, 1, 16), (2, 3, 5, 10)])
def test_rotate_half_rope_is_one_kernel(run_both, dtype, dynamic, b, h, s, d):
    """q * cos + rotate_half(q) * sin: the neg of half the columns is computed in the cat's
    part, one kernel (was two: 'iteration domains differ')."""
    run = run_both(_rope, _rand(b, h, s, d, dtype=dtype), _rand(b, 1, s, d, dtype=dtype),
                   _rand(b, 1, s, d, dtype=dtype), dynamic=dynamic)
    _check_tiles(run, 1, {"neg", "cat", "mul", "add"})


@pytest.mark.parametrize("dynamic", DYNAMIC)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("new_first", [False, True])
def test_rope_into_kv_cache_cat_is_one_kernel(run_both, dtype, dynamic, new_first):
    """The decode step's cat([cache, rope(k)], seq dim): RoPE (a column cat) computed inside
    the row cat's part, at its rows; q's RoPE beside it."""
    def f(q, k, cache, cos, sin):
        kr = _rope(k, cos, sin)
        return _rope(q, cos, sin), torch.cat([kr, cache] if new_first else [cache, kr], 2)

    run = run_both(f, _rand(1, 4, 1, 16, dtype=dtype), _rand(1, 2, 1, 16, dtype=dtype),
                   _rand(1, 2, 7, 16, dtype=dtype), _rand(1, 1, 1, 16, dtype=dtype),
                   _rand(1, 1, 1, 16, dtype=dtype), dynamic=dynamic)
    tiles = _tiles(run)
    assert len(tiles) == 2, [t["ops"] for t in tiles]
    assert all(t["native"]["native"] for t in tiles), [t["native"] for t in tiles]
    assert sorted(sum(op.startswith("cat") for op in t["ops"]) for t in tiles) == [1, 2]


@pytest.mark.parametrize("dynamic", DYNAMIC)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_cat_of_pointwise_parts(run_both, dtype, dynamic):
    """Parts computed by pointwise chains of their own shapes, along the columns and along
    a row dim, with an op after the cat: one kernel each."""
    def cols(a, b, w):
        return torch.cat([torch.exp(a) * 0.5, torch.sigmoid(b) - 1.0], -1) * w

    def rows(a, b):
        return torch.tanh(torch.cat([a * 2.0, -b], 1)) + 1.0

    run = run_both(cols, _rand(3, 5, 7, dtype=dtype), _rand(3, 5, 4, dtype=dtype),
                   _rand(11, dtype=dtype), dynamic=dynamic)
    _check_tiles(run, 1, {"exp", "sigmoid", "cat"})
    run = run_both(rows, _rand(2, 3, 6, dtype=dtype), _rand(2, 4, 6, dtype=dtype),
                   dynamic=dynamic)
    _check_tiles(run, 1, {"neg", "cat", "tanh"})


def test_part_reading_a_whole_domain_value_stays_apart(run_both):
    """A part computed from a value the kernel also needs over its whole domain is not
    computed per part (codegen reads parts at their own elements only): still correct."""
    def f(x):
        y = torch.exp(x)
        return torch.cat([y * 2.0, y + 1.0], -1) + torch.cat([y, y], -1)

    run = run_both(f, torch.randn(3, 8))
    assert all(t["native"]["native"] for t in _tiles(run))
