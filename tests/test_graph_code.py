"""The graph's generated code (codegen/graph): view chains as one as_strided, GEMM tiles as the
torch call itself. Every case is checked against eager on fresh inputs."""
from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F

from pypto_inductor.codegen.graph import layouts
from pypto_inductor.lowering import matmul as matmul_lowering
from pypto_inductor.report import collect


def _compiled(fn, *inputs, dynamic=False):
    torch._dynamo.reset()
    with collect() as reports:
        out = torch.compile(fn, backend="pypto", dynamic=dynamic)(*inputs)
    return out, "\n".join(r.compiled.source for r in reports if r.compiled is not None)


def heads(x, w):
    # the q/k/v split of an attention block: reshape, narrow, reshape, permute per head group
    y = torch.exp(x @ w)
    b, s, _ = y.shape
    q, k, v = y.reshape(b, s, 3 * 8).split(8, dim=-1)
    q, k, v = (t.reshape(b, s, 2, 4).permute(0, 2, 1, 3) for t in (q, k, v))
    return torch.tanh(q) + torch.sigmoid(k) * v


def test_view_chains_are_one_as_strided():
    x, w = torch.randn(2, 5, 6), torch.randn(6, 24)
    out, source = _compiled(heads, x, w)
    torch.testing.assert_close(out, heads(x, w))
    # one call per chain: its layout found at compile time (a base of known layout:
    # reinterpret with it written out, or no call at all where only native kernels read
    # it: their base and a byte offset) or cached per base layout
    assert "reinterpret(" in source or ".as_strided(" in source \
        or re.search(r"nthreads, offs\d+\)", source), source
    assert ".permute(" not in source and ".narrow(" not in source, source
    # called again: the chain's layout is taken from its cache, the same result
    x2 = torch.randn(2, 5, 6)
    torch.testing.assert_close(torch.compile(heads, backend="pypto")(x2, w), heads(x2, w))


def test_view_chains_with_dynamic_sizes():
    fn = torch.compile(heads, backend="pypto", dynamic=True)
    torch._dynamo.reset()
    w = torch.randn(6, 24)
    for b, s in ((2, 5), (3, 7), (2, 5), (1, 9)):
        x = torch.randn(b, s, 6)
        torch.testing.assert_close(fn(x, w), heads(x, w))


def strided_input(x):
    # a chain from a graph input whose strides the caller chooses (a transposed tensor:
    # its first reshape copies, so that chain keeps running through its views)
    return torch.sin(x.reshape(-1).narrow(0, 2, 12).reshape(3, 4).t()) * 2


@pytest.mark.parametrize("transposed", [False, True], ids=["contiguous", "transposed"])
def test_view_chain_of_an_input_with_any_strides(transposed):
    fn = torch.compile(strided_input, backend="pypto")
    torch._dynamo.reset()
    for _ in range(2):
        x = torch.randn(4, 5)
        x = x.t().contiguous().t() if transposed else x
        torch.testing.assert_close(fn(x), strided_input(x))


def linear_chain(x, w1, b1, w2):
    return F.linear(F.linear(x, w1, b1), w2) + 1


def test_gemm_tiles_are_the_torch_call_in_the_graph_code():
    x, w1, b1, w2 = torch.randn(3, 7, 16), torch.randn(32, 16), torch.randn(32), torch.randn(8, 32)
    out, source = _compiled(linear_chain, x, w1, b1, w2)
    torch.testing.assert_close(out, linear_chain(x, w1, b1, w2), rtol=1e-4, atol=1e-5)
    # matmul.GemmCall: kN_fn(...) or linear(...) in the graph's code
    assert "_fn(" in source or "linear(" in source, source


def pooler(h, w1, b1, w2, b2):
    # BERT's pooler + classifier: a Linear + tanh on the strided [:, 0] select
    return F.linear(torch.tanh(F.linear(h[:, 0], w1, b1)), w2, b2)


def ffn_residual(x, w1, b1, w2):
    # a 3-D Linear + GELU (the product reshaped onto the epilogue's domain), whose bare
    # product is an output too, and a second GEMM with a residual epilogue
    y = F.linear(x, w1, b1)
    return F.linear(F.gelu(y), w2) + x.sin(), y


def two_outputs(x, w, b):
    y = x @ w + b
    return torch.sigmoid(y) * 2, torch.relu(y) - 1


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
@pytest.mark.parametrize("case", ["pooler", "ffn_residual", "two_outputs"])
def test_gemm_epilogues_are_inline_in_the_graph_code(case, dynamic, monkeypatch):
    # matmul.EpilogueCall: the GEMM call, then the epilogue kernel's launch, written into
    # the graph's code (no call of the tile's Python wrapper, "kernN("); GEMM tiles even
    # where tiny (lowering.matmul.TINY_GEMMS would make them a multiply and a sum)
    monkeypatch.setattr(matmul_lowering, "TINY_GEMMS", False)
    if case == "pooler":
        fn, make = pooler, lambda b: (torch.randn(b, 9, 16), torch.randn(16, 16),
                                      torch.randn(16), torch.randn(3, 16), torch.randn(3))
    elif case == "ffn_residual":
        fn, make = ffn_residual, lambda b: (torch.randn(b, 5, 16), torch.randn(32, 16),
                                            torch.randn(32), torch.randn(16, 32))
    else:
        fn, make = two_outputs, lambda b: (torch.randn(b, 16), torch.randn(16, 24),
                                           torch.randn(24))
    inputs = make(4)
    out, source = _compiled(fn, *inputs, dynamic=dynamic)
    torch.testing.assert_close(out, fn(*inputs), rtol=1e-4, atol=1e-5)
    assert "e_layouts" in source and "kern" not in source, source
    compiled = torch.compile(fn, backend="pypto", dynamic=dynamic)
    for b in (4, 3, 6):  # again (the layout cache), and other batch sizes
        inputs = make(b)
        torch.testing.assert_close(compiled(*inputs), fn(*inputs), rtol=1e-4, atol=1e-5)


def linears_2d(x, w1, b1, w2, w3):
    h = torch.tanh(F.linear(x, w1, b1))  # addmm(b1, x, w1.T)
    return F.linear(h, w2) * 2 + h @ w3.t() @ w3  # mm(h, w2.T); w3.T also read by a matmul


def test_linear_weights_are_read_untransposed():
    # a 2-D transpose read only as a GEMM's right operand: F.linear on the weight itself
    # (views.linear_weights), the same ATen call without a view per call
    x, w1, b1 = torch.randn(5, 16), torch.randn(32, 16), torch.randn(32)
    w2, w3 = torch.randn(32, 32), torch.randn(8, 32)
    out, source = _compiled(linears_2d, x, w1, b1, w2, w3)
    torch.testing.assert_close(out, linears_2d(x, w1, b1, w2, w3), rtol=1e-4, atol=1e-4)
    assert "linear(" in source, source
    assert re.search(r"linear\(\w+, \w+, \w+\)", source), source  # the biased addmm too
    fn = torch.compile(linears_2d, backend="pypto", dynamic=True)
    for rows in (3, 9):
        args = (torch.randn(rows, 16), w1, b1, w2, w3)
        torch.testing.assert_close(fn(*args), linears_2d(*args), rtol=1e-4, atol=1e-4)


def small_and_large(x, y, w):
    a, b = torch.exp(x) * 2 + 1, torch.sin(y) - 1  # each read by a GEMM: kernels of their own
    return torch.cos(a @ w).sum(-1), torch.cos(b @ w).sum(-1)


def test_small_static_outputs_are_allocated_directly():
    # outputs of at most buffers.SMALL_OUTPUT_BYTES with a static shape: empty_strided with
    # the strides written out, not the buffer pool (y's 128 KiB sin still takes the pool)
    x, y, w = torch.randn(4, 16), torch.randn(2048, 16), torch.randn(16, 16)
    out, source = _compiled(small_and_large, x, y, w)
    for got, want in zip(out, small_and_large(x, y, w)):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert "empty_strided((4, 16), (16, 1)" in source, source
    assert "pool_empty(meta" in source, source
    compiled = torch.compile(small_and_large, backend="pypto")
    for _ in range(3):  # called again: fresh buffers, the same results
        x, y = torch.randn(4, 16), torch.randn(2048, 16)
        for got, want in zip(compiled(x, y, w), small_and_large(x, y, w)):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_small_outputs_with_dynamic_sizes_take_the_pool():
    def fn(x):
        return torch.cos(torch.exp(x) * 2).sum(-1)

    compiled = torch.compile(fn, backend="pypto", dynamic=True)
    torch._dynamo.reset()
    for n in (3, 5, 3, 8):
        x = torch.randn(n, 16)
        torch.testing.assert_close(compiled(x), fn(x), rtol=1e-4, atol=1e-4)


def gemm_and_sdpa_readers(x, w1, w2):
    # each pooled kernel output dies in a GEMM or SDPA (fresh results, no reference kept):
    # a later kernel writes into it, decided at compile time (buffers.static_reuse)
    a = torch.exp(x) * 2
    b = torch.tanh(a @ w1) + a
    c = torch.sin(b @ w2) * b
    q = torch.cos(c).reshape(4, 128, 2, 32).transpose(1, 2)
    o = F.scaled_dot_product_attention(q, torch.sigmoid(q), q * 3)
    return torch.exp(o.transpose(1, 2).reshape(4, 128, 64) @ w1) * 2 + 1


def test_buffers_read_by_gemms_and_sdpa_are_reused_at_compile_time():
    x, w1, w2 = torch.randn(4, 128, 64), torch.randn(64, 64) / 8, torch.randn(64, 64) / 8
    out, source = _compiled(gemm_and_sdpa_readers, x, w1, w2)
    torch.testing.assert_close(out, gemm_and_sdpa_readers(x, w1, w2), rtol=1e-4, atol=1e-4)
    assert "getrefcount(" not in source, source
    assert re.search(r"^    \w+ = buf\d+$", source, re.M), source
    compiled = torch.compile(gemm_and_sdpa_readers, backend="pypto")
    for _ in range(3):  # the reused buffers hold the last call's values: fresh inputs
        x = torch.randn(4, 128, 64)
        torch.testing.assert_close(compiled(x, w1, w2), gemm_and_sdpa_readers(x, w1, w2),
                                   rtol=1e-4, atol=1e-4)


def views_of_kernel_outputs(x, w):
    a = torch.exp(x) * 2  # a fresh contiguous kernel output: its views' layouts are known
    b = a.reshape(-1, 32, 16).transpose(1, 2)
    c = torch.sin(b) + 1
    return c @ w, a.narrow(0, 1, 2).t()  # a returned view keeps its view calls


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
def test_views_of_kernel_outputs_are_reinterpreted(dynamic, monkeypatch):
    # layouts.REINTERPRET_VIEWS: a view of a static kernel output is Inductor's
    # reinterpret_tensor with the sizes, strides and offset written out (where a reader
    # needs the tensor: layouts.FOLD_VIEWS, off here, passes it to native kernels as its
    # base and an offset: test_views_read_by_native_kernels_are_offsets)
    monkeypatch.setattr(layouts, "FOLD_VIEWS", False)
    monkeypatch.setattr(layouts, "RETURNED_REINTERPRET", False)  # see the test below
    x, w = torch.randn(128, 16), torch.randn(32, 8)
    out, source = _compiled(views_of_kernel_outputs, x, w, dynamic=dynamic)
    for got, want in zip(out, views_of_kernel_outputs(x, w)):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    if not dynamic:
        assert re.search(r"reinterpret\(buf\d+, \(4, 32, 16\), \(512, 16, 1\), 0\)", source), source
        assert ".narrow(" in source or ".as_strided(" in source, source
    compiled = torch.compile(views_of_kernel_outputs, backend="pypto", dynamic=dynamic)
    for n in (128, 64, 128):
        x = torch.randn(n, 16) if dynamic else torch.randn(128, 16)
        got, want = compiled(x, w), views_of_kernel_outputs(x, w)
        for g, e in zip(got, want):
            torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-4)
        assert got[1]._base is not None  # still a view of the compiled graph's output


def linear_heads(x, w, b):
    y = F.linear(x, w, b)  # addmm: a fresh contiguous product, its views' layouts known
    return torch.tanh(y.reshape(4, 8, 2, 16).transpose(1, 2)) * 2, torch.exp(y[:, :4])


def test_views_of_gemm_products_are_reinterpreted(monkeypatch):
    monkeypatch.setattr(layouts, "FOLD_VIEWS", False)
    x, w, b = torch.randn(32, 16), torch.randn(32, 16), torch.randn(32)
    out, source = _compiled(linear_heads, x, w, b)
    for got, want in zip(out, linear_heads(x, w, b)):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert re.search(r"reinterpret\(\w+, \(4, 8, 2, 16\)", source), source
    compiled = torch.compile(linear_heads, backend="pypto")
    for _ in range(3):
        x = torch.randn(32, 16)
        for got, want in zip(compiled(x, w, b), linear_heads(x, w, b)):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def views_for_two_readers(x, w, w2):
    y = torch.exp(x @ w)  # 2 x 5 x 24: q, k, v column blocks at offsets 0, 8 and 16
    q, k, v = y.split(8, dim=-1)
    a = torch.tanh(q) + torch.sigmoid(k) * v  # a native kernel: q, k and v as offsets
    return a, k.reshape(10, 8) @ w2  # the reshape (a copy) needs k itself: made there


@pytest.mark.parametrize("fold", [True, False])
def test_views_read_by_native_kernels_are_offsets(fold, monkeypatch):
    # layouts.FOLD_VIEWS: a view of a compile-time layout read only by native kernels is
    # never made: each kernel gets its base and the view's byte offset (the kernel's
    # metadata holds the view's sizes and strides); a view another reader needs (a GEMM)
    # is made just before that reader, and the base lives until the last reader
    monkeypatch.setattr(layouts, "FOLD_VIEWS", fold)
    x, w, w2 = torch.randn(2, 5, 6), torch.randn(6, 24), torch.randn(8, 3)
    out, source = _compiled(views_for_two_readers, x, w, w2)
    for got, want in zip(out, views_for_two_readers(x, w, w2)):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    if fold:
        offsets = re.findall(r"^offs\d+ = ", source, re.M) or re.findall(r"nthreads, offs\d+\)",
                                                                          source)
        assert offsets, source
        # k (for the reshape), not q and v; x is an input (layouts.INPUT_LAYOUTS: its view too)
        assert source.count("reinterpret(") - source.count("reinterpret(arg") <= 2, source
    compiled = torch.compile(views_for_two_readers, backend="pypto")
    for _ in range(3):
        x = torch.randn(2, 5, 6)
        for got, want in zip(compiled(x, w, w2), views_for_two_readers(x, w, w2)):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def returned_views(x):
    a = torch.exp(x) * 2
    b = torch.sin(x)
    return a.narrow(0, 1, 2).t(), b, b[1:]  # a is returned by no one; b is


def test_returned_views_of_intermediates_are_reinterpreted():
    # layouts.RETURNED_REINTERPRET: a returned view of an intermediate nothing else returned
    # shares is Inductor's reinterpret_tensor (AOTAutograd regenerates no such output); a
    # view of a returned value stays a view of it
    x = torch.randn(8, 16)
    out, source = _compiled(returned_views, x)
    for got, want in zip(out, returned_views(x)):
        torch.testing.assert_close(got, want)
    assert re.search(r"reinterpret\(buf\d+, \(16, 2\)", source), source  # a's view
    compiled = torch.compile(returned_views, backend="pypto")
    for _ in range(2):
        x = torch.randn(8, 16)
        got = compiled(x)
        for g, e in zip(got, returned_views(x)):
            torch.testing.assert_close(g, e)
        assert got[2]._base is got[1] or got[2].untyped_storage().data_ptr() == \
            got[1].untyped_storage().data_ptr()


def _train_sources(fn, *inputs):
    """fn's forward and backward graph code, after one backward through it."""
    torch._dynamo.reset()
    with collect() as reports:
        torch.compile(fn, backend="pypto")(*inputs).backward()
    return {r.name.split("_", 1)[1]: r.compiled.source for r in reports if r.compiled is not None}


def test_linear_cross_entropy_step_graph_code(monkeypatch):
    monkeypatch.setattr(matmul_lowering, "TINY_GEMMS", False)  # GEMM tiles, as above
    # layouts.SAVED_REINTERPRET: the forward's saved reshape of the logits to their own shape
    # is the logits themselves (no view call, no detach by AOTAutograd); matmul.MM_2D: the
    # weight gradient's GEMM is torch.mm, a fresh product whose transpose of a transpose
    # is the product itself (layouts.IDENTITY_VIEWS)
    lin = torch.nn.Linear(16, 5)

    def step(x, y):
        return F.cross_entropy(lin(x), y)

    x, y = torch.randn(4, 16), torch.randint(0, 5, (4,))
    sources = _train_sources(step, x, y)
    assert ".reshape(" not in sources["forward"], sources["forward"]
    assert ".permute(" not in sources["backward"], sources["backward"]
    # the input's gradient mm(grad, w) on the saved transpose's transpose: F.linear on the
    # saved tensor itself (views.linear_weights on torch.mm)
    backward = _train_sources(step, x.requires_grad_(), y)["backward"]
    assert ".permute(" not in backward and "linear(" in backward, backward
    assert ", (5, 16), (16, 1), 0)" not in sources["backward"], sources["backward"]
    compiled = torch.compile(step, backend="pypto")
    for _ in range(3):
        x, y = torch.randn(4, 16), torch.randint(0, 5, (4,))
        lin.zero_grad()
        step(x, y).backward()
        want = [p.grad.clone() for p in lin.parameters()]
        lin.zero_grad()
        compiled(x, y).backward()
        for p, w in zip(lin.parameters(), want):
            torch.testing.assert_close(p.grad, w)


def saved_view_of_output(x, w):
    y = torch.exp(x @ w)
    z = y.t()
    return y, (z * z).sum()


def test_saved_view_of_a_returned_value_keeps_its_version_check():
    # a saved view of a value the user gets back stays a real view: writing into the
    # returned value in place still makes the backward raise, as in eager
    x, w = torch.randn(4, 6), torch.randn(6, 3, requires_grad=True)
    compiled = torch.compile(saved_view_of_output, backend="pypto")
    for fn in (saved_view_of_output, compiled):
        y, loss = fn(x, w)
        with torch.no_grad():
            y.add_(1)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            loss.backward()
    y, loss = compiled(x, w)
    loss.backward()
    g = w.grad.clone()
    w.grad = None
    saved_view_of_output(x, w)[1].backward()
    torch.testing.assert_close(g, w.grad)
