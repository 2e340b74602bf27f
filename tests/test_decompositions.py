"""The decomposition table keeps the forward/backward contract, and random ops match eager.

AOTAutograd applies the table below autograd: a decomposed op's own derivative
formula still runs, on the decomposed outputs, and its backward op (often run
eagerly) reads them. So every output of a decomposition must equal the op's own
output, not just the first. Every multi-output entry of the table whose op has
its own autograd formula (not CompositeImplicitAutograd, whose gradient comes
from the decomposition's ops) is checked here against the op's kernel, or
listed in NOT_CHECKED with why.
"""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch.utils._pytree import tree_flatten, tree_map

import pypto_inductor
from pypto_inductor.lowering import decomposition_table
from pypto_inductor.report import collect

aten = torch.ops.aten


def _needs_check(op) -> bool:
    """A multi-output entry that is not an out= variant and has its own autograd formula."""
    schema = op._schema
    return (len(schema.returns) > 1 and not any(a.is_out for a in schema.arguments)
            and not torch._C._dispatch_has_kernel_for_dispatch_key(
                op.name(), "CompositeImplicitAutograd"))


def _rand(*shape):
    return torch.randn(*shape)


def _pos(*shape):
    return torch.rand(*shape) + 0.5


def _layer_norm_stats():
    x, w, b = _rand(4, 6, 8), _rand(8), _rand(8)
    _, mean, rstd = aten.native_layer_norm(x, [8], w, b, 1e-5)
    return (_rand(4, 6, 8), x, [8], mean, rstd, w, b, [True, True, True])


def _group_norm_stats():
    x, w, b = _rand(2, 6, 5), _rand(6), _rand(6)
    _, mean, rstd = aten.native_group_norm(x, w, b, 2, 6, 5, 3, 1e-5)
    return (_rand(2, 6, 5), x, mean, rstd, w, 2, 6, 5, 3, [True, True, True])


def _batch_norm_backward(train: bool):
    x, w, rm, rv = _rand(4, 3, 5), _rand(3), _rand(3), _pos(3)
    _, save_mean, save_invstd = aten.native_batch_norm(x, w, _rand(3), rm.clone(), rv.clone(),
                                                       train, 0.1, 1e-5)
    return (_rand(4, 3, 5), x, w, rm, rv, save_mean, save_invstd, train, 1e-5,
            [True, True, True])


def _rms_norm_backward_reference(grad, x, shape, rstd, w, mask):
    """_fused_rms_norm_backward has no CPU kernel: autograd through rms_norm's formula."""
    x, w = x.detach().requires_grad_(), w.detach().requires_grad_()
    out = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w
    return torch.autograd.grad(out, (x, w), grad)


def _rms_norm_backward_args():
    x = _rand(4, 6)
    rstd = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
    return (_rand(4, 6), x, [6], rstd, _rand(6), [True, True])


# case -> (op, argument maker, reference or None for the op's own kernel[, kwargs])
CASES = {
    "native_layer_norm": (aten.native_layer_norm.default,
                          lambda: (_rand(4, 6, 8), [8], _rand(8), _rand(8), 1e-5), None),
    "native_layer_norm_backward": (aten.native_layer_norm_backward.default, _layer_norm_stats,
                                   None),
    "native_group_norm": (aten.native_group_norm.default,
                          lambda: (_rand(2, 6, 5), _rand(6), _rand(6), 2, 6, 5, 3, 1e-5), None),
    "native_group_norm_backward": (aten.native_group_norm_backward.default, _group_norm_stats,
                                   None),
    "native_batch_norm.train": (aten.native_batch_norm.default, lambda: (
        _rand(4, 3, 5), _rand(3), _rand(3), _rand(3), _pos(3), True, 0.1, 1e-5), None),
    "native_batch_norm.eval": (aten.native_batch_norm.default, lambda: (
        _rand(4, 3, 5), _rand(3), _rand(3), _rand(3), _pos(3), False, 0.1, 1e-5), None),
    "native_batch_norm_backward.train": (aten.native_batch_norm_backward.default,
                                         lambda: _batch_norm_backward(True), None),
    "native_batch_norm_backward.eval": (aten.native_batch_norm_backward.default,
                                        lambda: _batch_norm_backward(False), None),
    "_native_batch_norm_legit": (aten._native_batch_norm_legit.default, lambda: (
        _rand(4, 3, 5), _rand(3), _rand(3), _rand(3), _pos(3), True, 0.1, 1e-5), None),
    "_native_batch_norm_legit.no_stats": (aten._native_batch_norm_legit.no_stats, lambda: (
        _rand(4, 3, 5), _rand(3), _rand(3), True, 0.1, 1e-5), None),
    "_native_batch_norm_legit_functional": (
        aten._native_batch_norm_legit_functional.default,
        lambda: (_rand(4, 3, 5), _rand(3), _rand(3), _rand(3), _pos(3), True, 0.1, 1e-5), None),
    "_native_batch_norm_legit_no_training": (
        aten._native_batch_norm_legit_no_training.default,
        lambda: (_rand(4, 3, 5), _rand(3), _rand(3), _rand(3), _pos(3), 0.1, 1e-5), None),
    "_fused_rms_norm_backward": (aten._fused_rms_norm_backward.default, _rms_norm_backward_args,
                                 _rms_norm_backward_reference),
    "_prelu_kernel_backward": (aten._prelu_kernel_backward.default,
                               lambda: (_rand(4, 3, 5), _rand(4, 3, 5), _rand(3, 1)), None),
    "_weight_norm_interface": (aten._weight_norm_interface.default,
                               lambda: (_rand(6, 4), _pos(6, 1), 0), None),
    "aminmax": (aten.aminmax.default, lambda: (_rand(5, 7),), None),
    "aminmax.dim": (aten.aminmax.default, lambda: (_rand(5, 7),), None,
                    {"dim": 1, "keepdim": True}),
    "log_sigmoid_forward": (aten.log_sigmoid_forward.default, lambda: (_rand(5, 7),), None),
    "nll_loss_forward": (aten.nll_loss_forward.default, lambda: (
        F.log_softmax(_rand(6, 5), 1), torch.tensor([0, 4, 2, 1, -100, 3]), _pos(5), 1,
        -100), None),
    "nll_loss2d_forward": (aten.nll_loss2d_forward.default, lambda: (
        F.log_softmax(_rand(2, 5, 3, 3), 1), torch.randint(0, 5, (2, 3, 3)), None, 1, -100),
        None),
}  # std_mean is not decomposed (lowered whole: decompositions._KEEP)

NOT_CHECKED = {
    "aten.cudnn_batch_norm.default": "CUDA only: no CPU kernel to compare with",
    "aten.cudnn_batch_norm_backward.default": "CUDA only: no CPU kernel to compare with",
    "aten.miopen_batch_norm_backward.default": "ROCm only: no CPU kernel to compare with",
}


def _outputs_equal(actual, expected, what: str) -> None:
    a, e = tree_flatten(actual)[0], tree_flatten(expected)[0]
    assert len(a) == len(e), f"{what}: {len(a)} outputs, the op has {len(e)}"
    for i, (x, y) in enumerate(zip(a, e)):
        if isinstance(y, torch.Tensor):
            torch.testing.assert_close(x, y, atol=1e-5, rtol=1e-5,
                                       msg=lambda m: f"{what}, output {i}: {m}")


def test_every_multi_output_entry_is_checked():
    table = decomposition_table()
    entries = {str(op) for op in table if isinstance(op, torch._ops.OpOverload)
               and _needs_check(op)}
    checked = {str(case[0]) for case in CASES.values()}
    unaccounted = sorted(entries - checked - set(NOT_CHECKED))
    assert not unaccounted, (f"decomposed multi-output ops nobody checked: {unaccounted}; add a "
                             "case to CASES (or a reason to NOT_CHECKED)")
    stale = sorted((checked | set(NOT_CHECKED)) - entries)
    assert not stale, f"no longer in the table (or no longer multi-output): {stale}"


@pytest.mark.parametrize("case", sorted(CASES))
def test_decomposition_computes_every_output_of_the_op(case):
    op, make_args, reference, *kwargs = CASES[case]
    kwargs = kwargs[0] if kwargs else {}
    torch.manual_seed(0)
    args = make_args()
    clone = lambda: tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, args)
    mine, theirs = clone(), clone()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        actual = decomposition_table()[op](*mine, **kwargs)
        expected = (reference or op)(*theirs, **kwargs)
    _outputs_equal(actual, expected, case)
    # ops that update arguments in place (running statistics) update them alike
    _outputs_equal(mine, theirs, f"{case} (arguments after the call)")


def test_sdpa_and_random_ops_stay_whole():
    table = decomposition_table()
    for op in (aten._scaled_dot_product_flash_attention_for_cpu.default,
               aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
               aten._scaled_dot_product_flash_attention.default,
               aten._scaled_dot_product_efficient_attention.default,
               aten._scaled_dot_product_cudnn_attention.default,
               aten._scaled_dot_product_fused_attention_overrideable.default,
               aten.native_dropout.default, aten.bernoulli.default, aten.bernoulli.p,
               aten.multilabel_margin_loss_forward.default):
        assert op not in table, f"{op} must not be decomposed"
    random = [str(op) for op in table if isinstance(op, torch._ops.OpOverload)
              and torch.Tag.nondeterministic_seeded in op.tags
              and not torch._C._dispatch_has_kernel_for_dispatch_key(
                  op.name(), "CompositeImplicitAutograd")]
    assert not random, f"random ops decomposed (they would draw another stream): {random}"


def test_multilabel_margin_loss_matches_eager(tol):
    """PyTorch's decomposition of multilabel_margin_loss_forward (registered at the
    Autograd key, so it runs while tracing) counts the padding after the -1 end
    marker; the backend traces with it set aside (PyTorch's doc example: 0.85)."""
    x = torch.tensor([[0.1, 0.2, 0.4, 0.8], [0.9, 0.2, 0.4, 0.8], [0.3, -1.0, 2.0, 0.1]])
    y = torch.tensor([[3, 0, -1, 1], [1, -1, 0, 0], [2, 1, 0, 3]])

    def loss(x):
        return F.multilabel_margin_loss(x + 0, y, reduction="none") * 2

    def grad(fn):
        leaf = x.clone().requires_grad_()
        out = fn(leaf)
        return out.detach(), torch.autograd.grad(out, leaf, torch.tensor([1.0, -2.0, 0.5]))[0]

    with collect() as graphs, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out, g = grad(torch.compile(loss, backend="pypto"))
    ref, ref_g = grad(loss)
    torch.testing.assert_close(out, ref, **tol(torch.float32))
    torch.testing.assert_close(out[0], torch.tensor(0.85 * 2))
    torch.testing.assert_close(g, ref_g, **tol(torch.float32))
    assert pypto_inductor.FusionReport(graphs).to_dict()["summary"]["eager_graphs"] == 0
    # the wrong decomposition is back in place for everyone else
    assert torch._C.DispatchKey.Autograd in aten.multilabel_margin_loss_forward.default.py_kernels


# --- SDPA, forward and backward --------------------------------------------------------
def _sdpa_grads(fn, q, k, v, autocast: bool):
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        out = fn(q, k, v)
    torch.manual_seed(7)
    grads = torch.autograd.grad(out, (q, k, v), torch.randn_like(out))
    return out.detach(), grads


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16_autocast"])
@pytest.mark.parametrize("mask", ["causal", "bool_mask", "float_mask"])
def test_sdpa_gradients_match_eager(mask, autocast, tol):
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 4, 16, 8) for _ in range(3))
    attn_mask = {"causal": None, "bool_mask": torch.rand(16, 16) > 0.3,
                 "float_mask": torch.randn(2, 1, 16, 16)}[mask]

    def attend(q, k, v):
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask,
                                             is_causal=mask == "causal")
        return out * 2 + 1

    with collect() as graphs, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out, grads = _sdpa_grads(torch.compile(attend, backend="pypto"), q, k, v, autocast)
    ref, ref_grads = _sdpa_grads(attend, q, k, v, autocast)
    dtype = torch.bfloat16 if autocast else torch.float32
    assert out.dtype == ref.dtype
    torch.testing.assert_close(out, ref, **tol(dtype))
    for name, g, r in zip("qkv", grads, ref_grads):
        torch.testing.assert_close(g, r, **tol(dtype), msg=lambda m: f"grad of {name}: {m}")
    summary = pypto_inductor.FusionReport(graphs).to_dict()["summary"]
    assert summary["eager_graphs"] == 0
    externs = [r for g in graphs for r in g.to_dict()["extern_reasons"].values()]
    # the report's reason is the true one: kept whole by choice (not a random op, not missing)
    assert any(r.startswith("aten._scaled_dot_product_flash_attention_for_cpu.default: SDPA's "
                            "fused CPU kernel, kept whole") for r in externs), externs


# --- random ops ---------------------------------------------------------------------
def _dropout_step(model, x, seed):
    torch.manual_seed(seed)
    x = x.detach().clone().requires_grad_()
    out = model(x)
    (g,) = torch.autograd.grad(out, x, torch.ones_like(out))
    return out.detach(), g


@pytest.mark.parametrize("p", [0.1, 0.5])
def test_dropout_mask_matches_eager_for_the_same_seed(p):
    """nn.Dropout compiled draws the very mask eager draws: native_dropout stays whole
    and runs eagerly on the same generator state."""
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Dropout(p),
                                torch.nn.GELU()).train()
    x = torch.randn(16, 32)
    compiled = torch.compile(model, backend="pypto")
    with collect() as graphs, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        runs = [_dropout_step(compiled, x, seed) for seed in (1, 2)]
    for seed, (out, g) in zip((1, 2), runs):
        ref, ref_g = _dropout_step(model, x, seed)
        assert torch.equal(out == 0, ref == 0)  # the same elements dropped
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1.3e-5)
        torch.testing.assert_close(g, ref_g, atol=1e-5, rtol=1.3e-5)
    assert not torch.equal(runs[0][0] == 0, runs[1][0] == 0)  # a new mask per seed
    reasons = [r for g in graphs for r in g.to_dict()["extern_reasons"].values()]
    assert any(r.startswith("aten.native_dropout.default: random op: no kernel of ours draws")
               for r in reasons)


@pytest.mark.parametrize("name,fn", [
    ("rand_like", lambda x: torch.rand_like(x) * x),
    ("randn", lambda x: torch.randn(x.shape) + x.relu()),
    ("bernoulli", lambda x: torch.bernoulli(torch.sigmoid(x)) * 3),
    ("rrelu", lambda x: F.rrelu(x, training=True)),
    ("dropout", lambda x: F.dropout(x * 2, 0.3, training=True)),
])
def test_random_ops_draw_what_eager_draws(name, fn):
    x = torch.randn(8, 33)
    compiled = torch.compile(fn, backend="pypto")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.manual_seed(3)
        out = compiled(x)
    torch.manual_seed(3)
    torch.testing.assert_close(out, fn(x), atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("ord", [2, 1, float("inf"), 0, 3, 0.5])
@pytest.mark.parametrize("dim,keepdim", [(None, False), (-1, True), ((0, 2), False)])
def test_vector_norm_is_lowered_and_matches_eager(ord, dim, keepdim, dtype, tol):
    """linalg_vector_norm (weight norm, gradient clipping, CLIP's normalisation) is decomposed
    into tile ops (abs, pow, sum, sqrt) rather than run as an extern op."""
    torch._dynamo.reset()

    def f(x):
        return torch.linalg.vector_norm(x, ord=ord, dim=dim, keepdim=keepdim) * 2

    x = torch.randn(3, 4, 5, dtype=dtype, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    with collect() as graphs:
        out = torch.compile(f, backend="pypto")(x)
        grads = torch.autograd.grad(out.sum(), x) if ord != 0 else ()
    ref = f(x_ref)
    ref_grads = torch.autograd.grad(ref.sum(), x_ref) if ord != 0 else ()
    torch.testing.assert_close(out, ref, **tol(dtype))
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, **tol(dtype))
    for graph in graphs:
        assert "aten.linalg_vector_norm.default" not in graph.to_dict().get("fallback_ops", {})
