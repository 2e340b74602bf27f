"""Column reductions whose reduced dims merge into one stride (emit_columns.
MERGED_REDUCED_DIMS): BatchNorm's training statistics over an NHWC activation's N, H, W.
The offset of reduced element c is then c times one stride, checked at run time; the
kernel reads the same elements in the same order, so its results are the bits of the
decomposed index's, and match eager."""
from __future__ import annotations

import pytest
import torch

from pypto_inductor.codegen import cpp
from pypto_inductor.codegen.cpp import emit_columns
from test_cpp_target import built, isolated_cpp_cache, rand  # noqa: F401

OPTS = {"fallback": "error"}


def stats(x, b):
    v, m = torch.var_mean(x, [0, 1, 2], correction=0)
    y = (x - m) * b  # per-element outputs after both passes
    return v, m, x.sum((0, 1, 2)), x.amax((0, 1, 2)), y, y.sum((0, 1, 2))


def run(fn, args, merged: bool, built, monkeypatch):
    monkeypatch.setattr(emit_columns, "MERGED_REDUCED_DIMS", merged)
    built.clear()
    torch._dynamo.reset()
    compiled = torch.compile(fn, backend="pypto", options=OPTS, dynamic=False)
    with torch.no_grad():
        out = compiled(*args)
    assert built and all(k.native for _, k in built), [(t.name, k.reason) for t, k in built]
    sources = [cpp.generate_source(k.program) for _, k in built]
    return out, any("if (merged)" in s for s in sources)


def views(n, h, w, c, dtype):
    """The NHWC activation contiguous (merged), an NCHW tensor's permute (merged, the kept
    dim strided) and every other W (not merged: decomposed at run time)."""
    return {"nhwc": rand(n, h, w, c, dtype=dtype),
            "nchw_permuted": rand(n, c, h, w, dtype=dtype).permute(0, 2, 3, 1),
            "w_sliced": rand(n, h, 2 * w + 1, c, dtype=dtype)[:, :, ::2]}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", [(4, 6, 6, 16), (1, 13, 11, 5), (3, 9, 17, 24),
                                   (2, 5, 7, 130), (1, 1, 1, 3)])
def test_merged_reduced_dims_bit_exact_and_match_eager(shape, dtype, built, monkeypatch):
    b = rand(shape[-1], dtype=dtype)
    # y.sum cancels (its terms sum to about 0): an absolute tolerance
    tol = {"rtol": 1e-5, "atol": 1e-4} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 5e-2}
    for name, x in views(*shape, dtype).items():
        ref = stats(x, b)
        on, emitted = run(stats, (x, b), True, built, monkeypatch)
        off, emitted_off = run(stats, (x, b), False, built, monkeypatch)
        assert emitted and not emitted_off, name
        torch.testing.assert_close(on, ref, **tol)
        torch.testing.assert_close(on, off, rtol=0, atol=0)  # the same bits


def outer_sums(x, b):
    """Sums over the outer dims keeping the inner ones (a bias broadcast over the batch: its
    gradient), a max, and a per-element output beside them."""
    y = x * b
    return x.sum(0, keepdim=True), x.amax((0, 1)), y, y.sum(0)


def kept_views(dtype):
    """Kept dims that merge (contiguous; one of size 1 with any stride) and that do not (a
    permuted input, a sliced kept dim, a last kept dim of size 1: not even emitted)."""
    return {"contiguous": rand(4, 4, 16, 24, dtype=dtype),
            "size1_kept": rand(3, 1, 8, 40, dtype=dtype),
            "permuted": rand(4, 16, 4, 24, dtype=dtype).permute(0, 2, 1, 3),
            "sliced": rand(4, 4, 16, 50, dtype=dtype)[..., :24],
            "last_size1": rand(5, 6, 7, 1, dtype=dtype)}


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_merged_kept_dims_bit_exact_and_match_eager(dtype, threads, built, monkeypatch):
    """emit_columns.MERGED_KEPT_DIMS: blocks along all the kept elements when the kept dims
    merge; the same elements summed in the same order, so the bits of the unmerged kernel's."""
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for name, x in kept_views(dtype).items():
            b = rand(x.shape[-1], dtype=dtype)
            ref = outer_sums(x, b)
            outs = []
            for merged in (True, False):
                monkeypatch.setattr(emit_columns, "MERGED_KEPT_DIMS", merged)
                out, _ = run(outer_sums, (x, b), True, built, monkeypatch)
                sources = [cpp.generate_source(k.program) for _, k in built]
                # a last kept dim of size 1 is a narrow case the kernel compiles alone
                emits = merged and name != "last_size1"
                assert any("kept_merged" in s for s in sources) == emits, name
                outs.append(out)
            torch.testing.assert_close(outs[0], ref, **tol, msg=lambda m: f"{name}: {m}")
            torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=0)
    finally:
        torch.set_num_threads(before)
