"""Column reductions on the native CPU target: reductions over a tensor's leading or
middle dims (bias and norm-weight gradients, pooling over a sequence) against eager, on
the native kernel (cpp_emit_columns)."""
from __future__ import annotations

import copy

import pytest
import torch

from pypto_inductor import models
from pypto_inductor.report import collect
from test_cpp_target import DTYPES, built, check, check_sizes, isolated_cpp_cache, rand  # noqa: F401

COLUMN_REDUCTIONS = {
    "sum": lambda x: x.sum(0), "sum01_keepdim": lambda x: x.sum((0, 1), keepdim=True),
    "mean": lambda x: x.mean(0), "amax": lambda x: x.amax((0, 1)),
    "amin": lambda x: x.amin(0, keepdim=True), "var": lambda x: x.var(0),
    "std0": lambda x: x.std((0, 1), correction=0), "argmax": lambda x: x.argmax(0),
    "argmin": lambda x: x.argmin(0),
}


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", list(COLUMN_REDUCTIONS))
def test_column_reductions(name, dtype, built, tol):
    x = rand(7, 33, 130, dtype=dtype) * 3.0
    check(COLUMN_REDUCTIONS[name], x, built=built, **tol(dtype))


def test_integer_and_bool_column_sums(built):
    def fn(i, b):
        return i.sum(0), i.amax(0), b.sum((0, 1))
    check(fn, torch.randint(-50, 50, (40, 3, 70), dtype=torch.int32),
          torch.rand(5, 9, 70) > 0.5, built=built)


def test_column_reduction_with_prologue_and_per_element_outputs(built, tol):
    def fn(x, w, b):
        y = x * w + b  # written in the pass that sums it
        centred = x - x.mean(0)  # needs the sums: one more pass
        return y, y.sum((0, 1)), centred, (centred * centred).amax(0)
    check(fn, rand(6, 50, 96), rand(96), rand(50, 96), built=built, **tol(torch.float32))


@pytest.mark.parametrize("shape", [(5000, 24), (3, 2100), (2, 40)])
def test_column_parts_split_between_threads(shape, built, two_threads):
    """Few kept elements, many reduced ones: the threads split the columns and combine
    partial sums, maxima and NaN flags."""
    x = rand(*shape)
    x[shape[0] // 2, 1] = float("nan")
    check(lambda x: (x.sum(0), x.amax(0), x.amin(0), x.mean(0)), x, built=built,
          rtol=1e-4, atol=1e-4)


def _channel_stats(x):
    """BatchNorm's training statistics of an NHWC activation: per channel over N, H, W."""
    return torch.var_mean(x, dim=(0, 2, 3), correction=0)


@pytest.mark.parametrize("shape", [(4, 16, 64, 64), (3, 5, 33, 17), (2, 24, 40, 40)])
@pytest.mark.parametrize("overflow", [False, True], ids=["finite", "overflow"])
def test_several_passes_split_between_threads(shape, overflow, sources, two_threads):
    """A var_mean over too few channels for the threads (one block of kept elements) splits
    its reduced elements pass by pass (emit_columns.SPLIT_PASSES), its conditional passes
    included: a channel near the float max overflows the float sums, so the double passes
    run in some parts only."""
    x = (rand(*shape) * 3 + 1).contiguous(memory_format=torch.channels_last)
    if overflow:
        x[:, 1] = 3e37 + 1e36 * rand(shape[0], *shape[2:])
    check(_channel_stats, x, rtol=1e-5, atol=1e-5)
    want = torch.var_mean(x.double(), dim=(0, 2, 3), correction=0)
    torch.testing.assert_close(torch.compile(_channel_stats, backend="pypto")(x),
                               [w.float() for w in want], rtol=1e-5, atol=1e-5)
    assert any("kept" in src and "S > 1" in src for src in sources), "no pass was split"


def test_split_passes_leave_one_thread_calls_bit_identical(threads):
    """At one thread the kernel takes its unsplit loop: the same bits as without the switch."""
    from pypto_inductor.codegen.cpp import emit_columns
    threads(1)
    x = (rand(4, 16, 32, 32) * 3 + 1).contiguous(memory_format=torch.channels_last)
    got = {}
    for on in (False, True):
        torch._dynamo.reset()
        old, emit_columns.SPLIT_PASSES = emit_columns.SPLIT_PASSES, on
        try:
            got[on] = torch.compile(_channel_stats, backend="pypto")(x)
        finally:
            emit_columns.SPLIT_PASSES = old
    torch.testing.assert_close(got[True], got[False], rtol=0, atol=0)
    torch.testing.assert_close(got[True], _channel_stats(x))


def test_column_reduction_of_strided_input(built):
    check(lambda x: (x.sum(0), x.amax(0)), rand(300, 64).t(), built=built,
          rtol=1e-4, atol=1e-4)


@pytest.mark.filterwarnings("ignore::UserWarning")  # eager var() on empty input warns
@pytest.mark.parametrize("shape", [(0, 5), (3, 0)])
def test_column_reductions_of_empty_tensors(shape, built):
    check(lambda x: (x.sum(0), x.mean(0), x.var(0)), rand(*shape), built=built)


def test_column_reductions_dynamic_sizes_one_compile():
    """K across one and two blocks of ROWS_PER_BLOCK, split and unsplit columns (sums of
    up to 4000 products, in another order than eager's: 1e-4)."""
    sizes = [(9, 70), (300, 3), (2, 1100), (4000, 17), (2, 2)]  # 1s would specialise
    check_sizes(lambda x, w: ((x * w).sum(0), x.amax(0)),
                [(rand(r, c), rand(c)) for r, c in sizes], rtol=1e-4, atol=1e-4)


UNIT_DIM_REDUCTIONS = [
    (lambda x: x.amax(-1, keepdim=True) * 2.0, (5, 1)),  # a row reduction
    (lambda x: x.sum(0) + 1.0, (1, 7)),
    (lambda x: (x.amax(0, keepdim=True), x.mean((0, 1))), (1, 1, 6)),
    (lambda x: x - x.mean(-1, keepdim=True), (3, 1)),
    (lambda x: x.var(0, keepdim=True), (1, 5)),
]


@pytest.mark.filterwarnings("ignore::UserWarning")  # eager var() of one element warns
@pytest.mark.parametrize("case", range(len(UNIT_DIM_REDUCTIONS)))
def test_reductions_over_dims_of_size_one(case, built):
    """The reduced dims are all 1s, so a keepdim result has the tile's shape: native."""
    fn, shape = UNIT_DIM_REDUCTIONS[case]
    check(fn, rand(*shape), built=built)


MIDDLE_REDUCTIONS = {
    "sum": (lambda x: x.sum(1), (4, 33, 70)),
    "mean_keepdim": (lambda x: x.mean(1, keepdim=True) * 2.0, (4, 33, 70)),
    "amax_bias": (lambda x, w: (x * w).amax(1) + w, (4, 33, 70), (70,)),
    "sum_plus_kept_input": (lambda x, y: x.sum(1) + y, (4, 33, 70), (4, 70)),
    "sum_times_kept_column": (lambda x, y: x.sum(1) * y, (4, 33, 70), (4, 1)),
    "var": (lambda x: x.var(1), (4, 33, 70)),
    "argmax": (lambda x: x.argmax(1), (4, 33, 70)),
    "two_middle_dims": (lambda x: x.sum((1, 2)), (3, 5, 6, 40)),
    "first_and_third": (lambda x: x.amin((0, 2)), (3, 5, 6, 40)),
    "static_equal_sizes": (lambda x: x.sum(1), (4, 4, 70)),  # the result alone: native
}


@pytest.mark.parametrize("name", list(MIDDLE_REDUCTIONS))
def test_middle_dim_reductions(name, built):
    """Reductions over dims that are neither the innermost nor only the leading ones (the
    last dim kept): the same kernel, its blocks along the last dim, the rows' outer
    dims decomposed."""
    fn, *shapes = MIDDLE_REDUCTIONS[name]
    check(fn, *[rand(*s) for s in shapes], built=built, rtol=1e-4, atol=1e-4)


def test_middle_reduction_dynamic_sizes_one_compile():
    check_sizes(lambda x, w: (x * w).sum(1) + w,
                [(rand(b, s, h), rand(h)) for b, s, h in ((3, 9, 70), (5, 40, 17), (2, 3, 1100))],
                rtol=1e-4, atol=1e-4)


def test_ambiguous_or_unsupported_reductions_are_not_native(built):
    # [4, 70] may be x's reduction over dim 1 or broadcast over its dims 1, 2 (4 == 4)
    check(lambda x, y: x.sum(1) + y, rand(4, 4, 70), rand(4, 70), built=built, native=False)
    assert built and all("ambiguous" in k.reason for _, k in built)
    built.clear()
    # kept dims not one block (a reduced dim between them): a mixed reduction emit_mixed
    # does not take ([0, 2] of 3 dims is native: tests/test_mixed_reductions.py)
    check(lambda x: x.sum((1, 3)), rand(4, 5, 6, 3), built=built, native=False)
    assert built and all("takes the last dim" in k.reason for _, k in built)


def test_transformer_backward_runs_every_tile_natively():
    torch.manual_seed(0)
    model, x = models.TransformerBlock(64, 4, 128), rand(2, 16, 64)
    ref = copy.deepcopy(model)
    with collect() as graphs:
        torch.compile(model, backend="pypto", options={"target": "cpu"})(x).square().sum() \
            .backward()
    ref(x).square().sum().backward()
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-4)
    natives = [v for g in graphs for v in g.compiled.kernel_native.values()]
    assert natives and all(v["native"] for v in natives), natives


def test_random_column_reductions_match_eager():
    """Random shapes (2-4 dims, sizes 1-70), any dims but the last reduced (keepdim or
    not), a pointwise prologue and epilogue, every reduction kind, fp32 and bf16.
    Static sizes can make a result's shape ambiguous (see align): those fall back."""
    import os

    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    reductions = {"sum": torch.sum, "mean": torch.mean, "amax": torch.amax,
                  "amin": torch.amin}

    @settings(max_examples=int(os.environ.get("PYPTO_TEST_EXAMPLES", 12)), deadline=None,
              database=None, derandomize=not os.environ.get("PYPTO_TEST_EXAMPLES"),
              suppress_health_check=list(HealthCheck))
    @given(shape=st.lists(st.integers(1, 70), min_size=2, max_size=4),
           picks=st.lists(st.booleans(), min_size=3, max_size=3),
           name=st.sampled_from(sorted(reductions)), keepdim=st.booleans(),
           bf16=st.booleans())
    def check(shape, picks, name, keepdim, bf16):
        dims = tuple(d for d in range(len(shape) - 1) if picks[d]) or (0,)
        dtype = torch.bfloat16 if bf16 else torch.float32

        def fn(x, w):
            return reductions[name](x * w + 1.0, dims, keepdim=keepdim) * 0.5

        torch._dynamo.reset()
        x, w = rand(*shape, dtype=dtype), rand(shape[-1], dtype=dtype)
        compiled = torch.compile(fn, backend="pypto", options={"target": "cpu",
                                                                "fallback": "error"})
        with torch.no_grad(), collect() as graphs:
            tol = {"rtol": 2e-2, "atol": 2e-2} if bf16 else {"rtol": 1e-4, "atol": 1e-4}
            torch.testing.assert_close(compiled(x, w), fn(x, w), **tol)
        natives = [v for g in graphs for v in g.compiled.kernel_native.values()]
        assert natives and all(v["native"] or "ambiguous" in v["reason"] for v in natives), \
            natives

    check()


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("kept", [1, 3, 7])
def test_narrow_blocks_of_few_kept_elements(kept, threads, built):
    """Fewer than NARROW_ROWS kept elements: a vector loop over the reduced elements per
    kept element (sums, NaN-flagged maxima and minima, per-element outputs written in the
    pass, a reduction over two dims, bf16), with and without split columns."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        x = rand(5, 700, kept) * 3.0
        x[2, 100, 0] = float("nan")

        def fn(x, b):
            y = x * 2.0 + b  # stored by the pass that sums it
            return y, y.sum(0), x.amax(0), x.amin((0, 1)), x.mean((0, 1)), (x - x.mean(0)).var(0)
        check(fn, x, rand(700, kept), built=built, rtol=1e-4, atol=1e-4)
        check(lambda x: x.sum(0), rand(3000, kept, dtype=torch.bfloat16), built=built,
              rtol=2e-2, atol=0.5)
    finally:
        torch.set_num_threads(before)
