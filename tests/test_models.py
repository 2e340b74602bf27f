"""Model zoo and small op-pattern modules through backend="pypto", against eager PyTorch."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pypto_inductor import models

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
DTYPE_IDS = ["fp32", "fp16", "bf16"]


def _zoo(name: str, dtype: torch.dtype, seed: int = 0):
    model, inputs = models.build(name, seed=seed)
    torch.manual_seed(seed + 1)  # fresh inputs, not the zoo's example ones
    inputs = tuple(torch.randn_like(x) for x in inputs)
    return model.to(dtype), tuple(x.to(dtype) for x in inputs)


# --- the built-in model zoo --------------------------------------------------------------
# Ops of a zoo model known to run eagerly (no tile lowering yet), by model.
_SDPA = "aten._scaled_dot_product_flash_attention_for_cpu.default"
KNOWN_EAGER = {
    # The causal mask's torch.ones(s, s).tril() decomposes into arange + compare (when the
    # attention is not rewritten), and the attention chain is one ATen SDPA call
    # (lowering/attention.py).
    "transformer": {"aten.arange.start_step", _SDPA},
    "llama": {_SDPA},
}


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("name", ["mlp", "transformer", "llama", "ln_gelu_residual"])
def test_zoo_matches_eager(name, dtype, run_both):
    model, inputs = _zoo(name, dtype)
    run = run_both(model, *inputs)
    assert run.out.dtype == dtype and run.out.shape == run.ref.shape
    s = run.summary
    # Everything else in these models has a tile lowering, and no graph runs eagerly.
    assert set(run.fallback_ops()) <= KNOWN_EAGER.get(name, set())
    assert s["eager_graphs"] == 0
    assert 0 < s["kernels_fused"] < s["kernels_unfused"]


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_conv_bn_relu_is_one_convolution_call(dtype, run_both):
    """Eval, no grad: BatchNorm folds into the weights and ReLU is the convolution's
    post-op (lowering/conv.py), so the whole model is one extern call."""
    model, inputs = _zoo("conv_bn_relu", dtype)
    run = run_both(model, *inputs)
    assert set(run.fallback_ops()) == {"pypto_inductor.conv_fused.default"}


def test_conv_bn_relu_training_mode_updates_running_stats(run_both):
    """BatchNorm in train mode mutates its running stats: the compiled model must too."""
    torch.manual_seed(3)
    model = models.ConvBNReLU().train()
    eager = models.ConvBNReLU().train()
    eager.load_state_dict(model.state_dict())
    x = torch.randn(4, 3, 8, 8)
    compiled = torch.compile(model, backend="pypto")
    with torch.no_grad():
        for _ in range(2):
            out, ref = compiled(x), eager(x)
            torch.testing.assert_close(out, ref)
    torch.testing.assert_close(model.bn.running_mean, eager.bn.running_mean)
    torch.testing.assert_close(model.bn.running_var, eager.bn.running_var)
    assert int(model.bn.num_batches_tracked) == int(eager.bn.num_batches_tracked) == 2


def test_zoo_second_call_reuses_compiled_graph(run_both):
    """Calling again with new values of the same shape gives fresh, correct results."""
    model, inputs = _zoo("transformer", torch.float32)
    compiled = torch.compile(model, backend="pypto")
    with torch.no_grad():
        for seed in range(3):
            torch.manual_seed(100 + seed)
            x = torch.randn_like(inputs[0])
            torch.testing.assert_close(compiled(x), model(x))


# --- reductions over several dims ------------------------------------------------------
REDUCTIONS = {
    "sum": lambda x, d, k: x.sum(d, keepdim=k),
    "mean": lambda x, d, k: x.mean(d, keepdim=k),
    "amax": lambda x, d, k: x.amax(d, keepdim=k),
    "amin": lambda x, d, k: x.amin(d, keepdim=k),
    "var": lambda x, d, k: x.var(d, keepdim=k),
    "var_unbiased0": lambda x, d, k: torch.var(x, d, correction=0, keepdim=k),
    "std": lambda x, d, k: x.std(d, keepdim=k),
}


@pytest.mark.parametrize("keepdim", [False, True], ids=["nokeep", "keep"])
@pytest.mark.parametrize("dims", [(-1,), (0, 2), (1, 2), (0, 1, 2), (0, -1)],
                         ids=lambda d: "dims" + "_".join(map(str, d)))
def test_reductions_over_dims(dims, keepdim, run_both):
    """Every reduction over the same dims in one graph (the planner may share kernels)."""
    def f(x):  # an elementwise prologue and epilogue around each reduction
        y = x * 1.5 + 0.25
        return tuple(fn(y, dims, keepdim).relu() + 1.0 for fn in REDUCTIONS.values())

    run = run_both(f, torch.randn(4, 6, 10))
    assert run.fallback_ops() == {}


@pytest.mark.parametrize("op", sorted(REDUCTIONS))
def test_each_reduction_alone(op, run_both):
    run_both(lambda x: REDUCTIONS[op](x.exp(), (0, 2), False), torch.randn(3, 5, 7))


@pytest.mark.parametrize("keepdim", [False, True], ids=["nokeep", "keep"])
@pytest.mark.parametrize("dim", [0, 1, -1])
@pytest.mark.parametrize("op", ["argmax", "argmin", "max", "min"])
def test_arg_reductions(op, dim, keepdim, run_both):
    def f(x):
        y = torch.tanh(x)
        if op in ("argmax", "argmin"):
            return getattr(torch, op)(y, dim=dim, keepdim=keepdim)
        values, indices = getattr(torch, op)(y, dim=dim, keepdim=keepdim)
        return values * 2, indices

    run = run_both(f, torch.randn(5, 7, 9))
    assert run.fallback_ops() == {}


def test_reduction_fp16_and_bf16(run_both):
    def f(x):
        y = x * x
        return y.sum((0, 2)), y.mean(-1, keepdim=True), y.amax((1, 2)), x.var(1)

    for dtype in (torch.float16, torch.bfloat16):
        torch._dynamo.reset()
        run_both(f, torch.randn(4, 8, 16).to(dtype))


def test_softmax_and_log_softmax(run_both):
    def f(x):
        return torch.softmax(x, -1) + torch.log_softmax(x * 0.5, 1).exp(), torch.logsumexp(x, 2)

    run_both(f, torch.randn(3, 5, 7))


# --- broadcasting ------------------------------------------------------------------------
def test_broadcast_size_one_and_rank_mismatch(run_both):
    def f(a, b, c, d, s):
        # a [4, 1, 6], b [5, 1], c [6], d [1, 1, 1], s a 0-d tensor
        return (a + b) * c - d / (s + 2.0), torch.maximum(a, c), b * c

    run_both(f, torch.randn(4, 1, 6), torch.randn(5, 1), torch.randn(6),
             torch.randn(1, 1, 1), torch.randn(()))


def test_broadcast_per_row_and_per_column(run_both):
    def f(x, row, col):
        # row [8, 1] broadcasts along columns, col [16] along rows; then a reduction
        y = torch.sigmoid(x - row) * col
        return y.sum(-1, keepdim=True) * row + y

    run_both(f, torch.randn(8, 16), torch.randn(8, 1), torch.randn(16))


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_broadcast_mixed_dtypes(dtype, run_both):
    def f(x, w):  # a low-precision activation times an fp32 weight (type promotion)
        return (x.float() * w).to(x.dtype) + x

    run_both(f, torch.randn(4, 3, 8).to(dtype), torch.randn(3, 1), dtype=dtype)


# --- layout chains -----------------------------------------------------------------------
def test_slice_cat_permute_view_chain(run_both):
    def f(x):
        a = x[:, 1:5]  # slice
        b = x[:, -3:]  # negative start
        c = torch.cat([a, b * 2, a.exp()], dim=1)  # [4, 11, 6]
        d = c.permute(2, 0, 1).contiguous()  # [6, 4, 11]
        e = d.view(6, 44).t()  # [44, 6]
        return e.reshape(4, 11, 6) + c, e[::2].sum(0)

    run_both(f, torch.randn(4, 8, 6))


def test_split_chunk_unbind_select(run_both):
    def f(x):
        p, q = x.chunk(2, dim=-1)
        r, s, t = x.split([2, 3, 1], dim=1)
        u = x.unbind(0)
        return p * q, (r.sum(1) + s.mean(1) - t.squeeze(1)), u[1] - u[-1], x.select(2, 3)

    run_both(f, torch.randn(3, 6, 8))


def test_transpose_matmul_view(run_both):
    def f(a, b):
        h = (a.transpose(-2, -1) @ b).view(2, -1)
        return torch.relu(h).unsqueeze(1).expand(2, 3, h.shape[1]) * 0.5

    run_both(f, torch.randn(2, 6, 4), torch.randn(2, 6, 5))


def test_rotate_half_pattern(run_both):
    def f(x, cos, sin):
        return x * cos + models.rotate_half(x) * sin

    run_both(f, torch.randn(2, 4, 16, 8), torch.randn(16, 8), torch.randn(16, 8))


# --- where, masks, comparisons -----------------------------------------------------------
def test_where_masks_comparisons(run_both):
    def f(x, y):
        mask = (x > 0.1) & (y <= 0.5) | (x == y)
        z = torch.where(mask, x * y, -y)
        w = torch.where(x.abs() < 1, x, torch.zeros_like(x))
        ne = (x != y).float().sum(-1)
        return z, w, ne, torch.logical_not(mask).to(torch.int32)

    run_both(f, torch.randn(6, 10), torch.randn(6, 10))


def test_masked_fill_causal_softmax(run_both):
    def f(scores):
        s = scores.shape[-1]
        mask = torch.ones(s, s, dtype=torch.bool).tril()
        return torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)

    run_both(f, torch.randn(2, 3, 8, 8))


def test_where_with_scalar_and_clamp(run_both):
    def f(x):
        return torch.where(x > 0, x, 0.1 * x).clamp(-0.5, 2.0), torch.clamp_min(x, 0.0).max()

    run_both(f, torch.randn(7, 9))


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_pattern_mix_in_each_dtype(dtype, run_both):
    def f(x, y):
        m = x.amax(-1, keepdim=True)
        z = torch.where(x > y, x - m, y * 0.5)
        return torch.cat([z, F.silu(y)], dim=-1).permute(1, 0, 2).sum(0)

    run_both(f, torch.randn(4, 5, 6).to(dtype), torch.randn(4, 5, 6).to(dtype))
