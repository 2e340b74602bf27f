"""Linear epilogues through the GEMM call: bias by addmm, one activation or a residual add
as a oneDNN post-op (codegen/cpp/matmul.py). Compared with eager on fresh random inputs;
the tests also check which form each tile took."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pypto_inductor.codegen.cpp import matmul

needs_onednn = pytest.mark.skipif(not (torch.backends.mkldnn.is_available() and hasattr(
    torch.ops.mkldnn, "_linear_pointwise")), reason="this torch has no oneDNN linear")


@pytest.fixture
def onednn_calls(monkeypatch):
    """The OneDnnLinear forms of the tiles built while the test runs (the post-ops taken
    at every weight size but where a test sets ONEDNN_POST_OPS_MIN_WEIGHT itself)."""
    monkeypatch.setattr(matmul, "ONEDNN_POST_OPS_MIN_WEIGHT", 0)
    calls = []
    build = matmul.onednn_kernel

    def spy(tile, graph, mm, bias, linear, getters):
        calls.append(linear)
        return build(tile, graph, mm, bias, linear, getters)

    monkeypatch.setattr(matmul, "onednn_kernel", spy)
    return calls


EPILOGUES = {
    "gelu": (lambda y: F.gelu(y), "gelu"),
    "gelu_tanh": (lambda y: F.gelu(y, approximate="tanh"), "gelu"),
    "silu": (F.silu, "swish"),
    "sigmoid": (torch.sigmoid, "sigmoid"),
    "tanh": (torch.tanh, "tanh"),
}


def _tol(dtype):
    return {} if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)


def _rand(*shape, dtype=torch.float32, g=None):
    return torch.randn(*shape, generator=g).to(dtype)


@needs_onednn
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("rows", [(96,), (3, 40)], ids=["2d", "3d"])
@pytest.mark.parametrize("epilogue", sorted(EPILOGUES))
def test_linear_activation_is_one_onednn_call(epilogue, rows, dtype, onednn_calls):
    act, attr = EPILOGUES[epilogue]
    g = torch.Generator().manual_seed(len(epilogue) + len(rows))
    x, w, b = _rand(*rows, 48, dtype=dtype, g=g), _rand(80, 48, dtype=dtype, g=g), \
        _rand(80, dtype=dtype, g=g)

    def fn(x, w, b):
        return act(F.linear(x, w, b))

    torch._dynamo.reset()
    with torch.no_grad():
        out = torch.compile(fn, backend="pypto")(x, w, b)
    torch.testing.assert_close(out, fn(x, w, b), **_tol(dtype))
    assert [c.attr for c in onednn_calls] == [attr]


@needs_onednn
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_linear_residual_add_is_one_onednn_call(dtype, onednn_calls):
    g = torch.Generator().manual_seed(3)
    h, w, b, res = (_rand(4, 24, 64, dtype=dtype, g=g), _rand(32, 64, dtype=dtype, g=g),
                    _rand(32, dtype=dtype, g=g), _rand(4, 24, 32, dtype=dtype, g=g))

    def fn(h, w, b, res):
        return res + F.linear(h, w, b)

    torch._dynamo.reset()
    with torch.no_grad():
        out = torch.compile(fn, backend="pypto")(h, w, b, res)
    torch.testing.assert_close(out, fn(h, w, b, res), **_tol(dtype))
    assert [c.attr for c in onednn_calls] == ["add"]


def product_is_output(x, w, b):  # the pre-activation is returned too: BLAS + native pass
    y = F.linear(x, w, b)
    return y, F.gelu(y)


def two_ops(x, w, b):  # two epilogue ops: one native pass after addmm
    return F.gelu(F.linear(x, w, b)) * 2


def no_bias_scaled(x, w, b):
    return F.relu(x @ w.t() * 0.5)


def transposed_input(x, w, b):  # x is not row-major
    return F.gelu(F.linear(x.t(), w, b))


@needs_onednn
@pytest.mark.parametrize("fn", [product_is_output, two_ops, no_bias_scaled, transposed_input],
                         ids=lambda f: f.__name__)
def test_other_epilogues_stay_native(fn, onednn_calls):
    g = torch.Generator().manual_seed(5)
    x, w, b = _rand(64, 48, g=g), _rand(80, 48, g=g), _rand(80, g=g)
    if fn is transposed_input:
        x = _rand(48, 64, g=g)
    torch._dynamo.reset()
    with torch.no_grad():
        out = torch.compile(fn, backend="pypto")(x, w, b)
    torch.testing.assert_close(out, fn(x, w, b))
    assert onednn_calls == []


@pytest.mark.parametrize("epilogue", ["gelu", "silu"])
def test_linear_activation_training(epilogue):
    # training saves the pre-activation for the backward: forward and gradients match
    act = EPILOGUES[epilogue][0]
    g = torch.Generator().manual_seed(9)
    inputs = [_rand(2, 16, 32, g=g), _rand(40, 32, g=g), _rand(40, g=g)]

    def fn(x, w, b):
        return act(F.linear(x, w, b))

    results = []
    for compiled in (False, True):
        torch._dynamo.reset()
        args = [t.clone().requires_grad_() for t in inputs]
        out = (torch.compile(fn, backend="pypto") if compiled else fn)(*args)
        out.backward(torch.ones_like(out))
        results.append((out, [a.grad for a in args]))
    (eo, eg), (co, cg) = results
    torch.testing.assert_close(co, eo)
    for c, e in zip(cg, eg):
        torch.testing.assert_close(c, e)


def test_onednn_switch_off_keeps_native_epilogue(monkeypatch, onednn_calls):
    monkeypatch.setattr(matmul, "ONEDNN_POST_OPS", False)
    x, w, b = torch.randn(64, 48), torch.randn(80, 48), torch.randn(80)
    torch._dynamo.reset()
    with torch.no_grad():
        out = torch.compile(lambda x, w, b: F.gelu(F.linear(x, w, b)), backend="pypto")(x, w, b)
    torch.testing.assert_close(out, F.gelu(F.linear(x, w, b)))
    assert onednn_calls == []


@needs_onednn
@pytest.mark.parametrize("epilogue", ["gelu", "silu", "add"])
def test_onednn_post_op_by_weight_size(epilogue, monkeypatch, onednn_calls):
    """Below ONEDNN_POST_OPS_MIN_WEIGHT weight elements addmm + a native pass is faster
    (BERT's 64 -> 128 FFN), from it on the oneDNN post-op (docs/benchmarks.md)."""
    monkeypatch.setattr(matmul, "ONEDNN_POST_OPS_MIN_WEIGHT", 256 * 256)
    g = torch.Generator().manual_seed(11)
    forms = []
    for k, n in ((64, 128), (256, 256)):
        x, w, b, res = _rand(24, k, g=g), _rand(n, k, g=g) / k ** 0.5, _rand(n, g=g), \
            _rand(24, n, g=g)

        def fn(x, w, b, res):
            y = F.linear(x, w, b)
            return res + y if epilogue == "add" else EPILOGUES[epilogue][0](y)

        torch._dynamo.reset()
        onednn_calls.clear()
        with torch.no_grad():
            out = torch.compile(fn, backend="pypto", options={"roi_threshold": 0.01})(
                x, w, b, res)
        torch.testing.assert_close(out, fn(x, w, b, res), atol=1e-5, rtol=1e-5)
        forms.append([c.attr for c in onednn_calls])
    assert forms == [[], [EPILOGUES[epilogue][1] if epilogue != "add" else "add"]], forms


@needs_onednn
@pytest.mark.parametrize("epilogue", ["gelu", "silu", "add"])
def test_onednn_post_op_by_rows_static(epilogue, monkeypatch, onednn_calls):
    """At fewer than ONEDNN_POST_OPS_MIN_ROWS rows (a decode step's one token) addmm + a
    native pass is faster than oneDNN's post-op linear (docs/benchmarks.md, "oneDNN
    post-ops by rows"); from it on the post-op. The fusion report says which and why."""
    from pypto_inductor.report import collect

    g = torch.Generator().manual_seed(12)
    forms, notes = [], []
    for m in (1, 16):
        x, w, b, res = _rand(m, 64, g=g), _rand(96, 64, g=g) / 8, _rand(96, g=g), \
            _rand(m, 96, g=g)

        def fn(x, w, b, res):
            y = F.linear(x, w, b)
            return res + y if epilogue == "add" else EPILOGUES[epilogue][0](y)

        torch._dynamo.reset()
        onednn_calls.clear()
        with torch.no_grad(), collect() as graphs:
            out = torch.compile(fn, backend="pypto", options={"roi_threshold": 0.01})(
                x, w, b, res)
        torch.testing.assert_close(out, fn(x, w, b, res), atol=1e-5, rtol=1e-5)
        forms.append([(c.attr, c.min_rows) for c in onednn_calls])
        notes += [(t.get("native") or {}).get("reason") or "" for r in graphs
                  for t in r.to_dict()["fusion_tiles"]]
    attr = EPILOGUES[epilogue][1] if epilogue != "add" else "add"
    assert forms == [[], [(attr, 0)]], forms
    assert any("1 rows < 4 (ONEDNN_POST_OPS_MIN_ROWS)" in n for n in notes), notes
    assert any("16 rows >= 4" in n for n in notes), notes


@needs_onednn
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("epilogue", ["gelu", "silu", "add"])
def test_onednn_post_op_by_rows_dynamic(epilogue, dtype, monkeypatch, onednn_calls):
    """Dynamic rows: one compiled graph that takes oneDNN's post-op from
    ONEDNN_POST_OPS_MIN_ROWS rows on and addmm + ATen's op below (one compare per call)."""
    few_calls = []
    form = matmul.few_rows_form

    def counted(linear):
        fn = form(linear)

        def few(*args):
            few_calls.append(args[0].shape[0])
            return fn(*args)
        return few

    monkeypatch.setattr(matmul, "few_rows_form", counted)
    g = torch.Generator().manual_seed(13)

    def fn(x, w, b, res):
        y = F.linear(x, w, b)
        return res + y if epilogue == "add" else EPILOGUES[epilogue][0](y)

    torch._dynamo.reset()
    compiled = torch.compile(fn, backend="pypto", dynamic=True,
                             options={"roi_threshold": 0.01})
    w, b = _rand(96, 64, dtype=dtype, g=g) / 8, _rand(96, dtype=dtype, g=g)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else _tol(dtype)
    with torch.no_grad():
        for m in (16, 2, 3, 9):
            x, res = _rand(m, 64, dtype=dtype, g=g), _rand(m, 96, dtype=dtype, g=g)
            torch.testing.assert_close(compiled(x, w, b, res), fn(x, w, b, res), **tol)
    assert [c.min_rows for c in onednn_calls] == [4], onednn_calls
    assert few_calls == [2, 3], few_calls


@needs_onednn
def test_onednn_post_op_rows_switch_off(monkeypatch, onednn_calls):
    """ONEDNN_POST_OPS_BY_ROWS = False: the weight size alone chooses (the state before)."""
    monkeypatch.setattr(matmul, "ONEDNN_POST_OPS_BY_ROWS", False)
    g = torch.Generator().manual_seed(14)
    x, w, b = _rand(1, 64, g=g), _rand(96, 64, g=g) / 8, _rand(96, g=g)
    torch._dynamo.reset()
    with torch.no_grad():
        out = torch.compile(lambda x, w, b: F.gelu(F.linear(x, w, b)), backend="pypto",
                            options={"roi_threshold": 0.01})(x, w, b)
    torch.testing.assert_close(out, F.gelu(F.linear(x, w, b)), atol=1e-5, rtol=1e-5)
    assert [(c.attr, c.min_rows) for c in onednn_calls] == [("gelu", 0)]
