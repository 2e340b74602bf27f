"""Compile-time cuts of the native CPU target: tiles with the same C++ compile once
(cpp.DEDUPE_KERNELS), and a column reduction writes only the narrow-sum cases its block
sizes can take (emit_columns.STATIC_NARROW_CASES). Same results as before, and as eager."""
from __future__ import annotations

import pytest
import torch

from pypto_inductor.codegen import cpp
from pypto_inductor.codegen.cpp import emit_columns
from pypto_inductor.codegen.cpp.column_order import ROWS_PER_BLOCK
from test_cpp_target import built, check, isolated_cpp_cache, rand  # noqa: F401


def _two_blocks(x, w1, w2):
    """Two blocks of one shape (a GEMM, then its epilogue and a row sum): the same
    kernels twice."""
    a = torch.relu(x @ w1).sum(1, keepdim=True) * x
    return torch.relu(a @ w2).sum(1, keepdim=True) * a


def _run(fn, *inputs):
    compiled = torch.compile(fn, backend="pypto", options={"fallback": "error"})
    with torch.no_grad():
        return compiled(*inputs)


@pytest.mark.parametrize("dedupe", [True, False])
def test_tiles_with_the_same_source_compile_once(dedupe, monkeypatch, built):
    monkeypatch.setattr(cpp, "DEDUPE_KERNELS", dedupe)
    monkeypatch.setattr(cpp, "stats", {"tiles": 0, "functions": 0})
    x, w1, w2 = rand(32, 32), rand(32, 32), rand(32, 32)
    out = _run(_two_blocks, x, w1, w2)
    torch.testing.assert_close(out, _two_blocks(x, w1, w2), rtol=1e-4, atol=1e-4)
    tiles, functions = cpp.stats["tiles"], cpp.stats["functions"]
    assert tiles == 2
    if dedupe:
        assert functions == 1, cpp.stats  # the second block's kernel is the first's
    else:
        assert functions == tiles, cpp.stats


def test_deduplicated_kernels_give_the_same_bits():
    x, w1, w2 = rand(32, 32), rand(32, 32), rand(32, 32)
    before = cpp.DEDUPE_KERNELS
    try:
        outs = []
        for dedupe in (False, True):
            cpp.DEDUPE_KERNELS = dedupe
            torch._dynamo.reset()
            outs.append(_run(_two_blocks, x, w1, w2))
    finally:
        cpp.DEDUPE_KERNELS = before
    torch.testing.assert_close(outs[1], outs[0], rtol=0, atol=0)


def _blocks(k: int, nt: int) -> set:
    """The block sizes nr the column kernel's work items see (emit_columns.source's C++)."""
    ro = 1
    nb = min(ROWS_PER_BLOCK, max(k, 1))
    if nt > 1 and ro * ((k + nb - 1) // nb) < nt:
        nb = max(16, ((k + nt - 1) // nt + 15) // 16 * 16)
    return {min(nb, k - k0) for k0 in range(0, k, nb)}


def test_narrow_counts_cover_every_block_size():
    for k in list(range(1, 200)) + [1000, 1024, 1025, 2048, 3000, 4104]:
        need = {nr for nt in range(1, 70) for nr in _blocks(k, nt)
                if nr < emit_columns.NARROW_ROWS}
        got = set(emit_columns.narrow_counts(k))
        assert need <= got, (k, need, got)
        if k % emit_columns.NARROW_ROWS == 0:
            assert not got, k
    assert list(emit_columns.narrow_counts(object())) == list(range(1, emit_columns.NARROW_ROWS))


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("kept", [3, 16, 24, 13])
def test_column_sums_without_unreachable_cases_match(kept, threads, built, monkeypatch):
    """Column sums over (reduced, kept): the source has only the cases the kept size can
    reach, and the results are bit for bit those of the kernel with all cases."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        x = rand(2000, kept) * 3.0

        def fn(x):
            return x.sum(0), x.mean(0)
        outs = []
        for static in (False, True):
            monkeypatch.setattr(emit_columns, "STATIC_NARROW_CASES", static)
            torch._dynamo.reset()
            built.clear()
            outs.append(check(fn, x, built=built, rtol=1e-5, atol=1e-5))
            source = "".join(cpp.generate_source(k.program) for _, k in built
                             if k.program is not None)
            assert "auto sums = " in source, source  # the eager-order narrow sums
            cases = source.count("sums(std::integral_constant")
            if static and kept % emit_columns.NARROW_ROWS == 0:
                assert cases == 0, source
        torch.testing.assert_close(outs[1], outs[0], rtol=0, atol=0)
    finally:
        torch.set_num_threads(before)
