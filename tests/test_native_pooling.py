"""The cpu target's native 2-D max pooling (codegen/cpp/pooling.py) against ATen: forward
values and indices bit-exact (ties: first max; NaNs: ATen's propagation), the backward's
grads bit-exact (its gather adds in ATen's scatter order), outputs in ATen's memory format;
a compiled conv + BN + ReLU + max-pool training step runs the kernels and matches eager;
what the kernels do not take runs ATen with the reason."""
from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch

from conv_blocks import ConvBnPoolBlock, loss_and_grads
from pypto_inductor.codegen.cpp import NATIVE_EXTERNS, pooling
from pypto_inductor.ir import TensorSpec
from pypto_inductor.report import collect

aten = torch.ops.aten
FP32 = {"atol": 1e-4, "rtol": 1e-4}  # convolutions and BatchNorm reorder fp32 sums
EXACT = {"rtol": 0, "atol": 0, "equal_nan": True}


def _spec(t):
    return TensorSpec(tuple(t.shape), tuple(t.stride()), t.dtype)


def _ref(name):
    return SimpleNamespace(name=name)


def _bind_forward(x, window):
    return pooling.bind_forward(SimpleNamespace(args=[_ref("x"), *window], kwargs={}),
                                {"x": _spec(x)})


def _bind_backward(go, x, ind, window):
    step = SimpleNamespace(args=[_ref("go"), _ref("x"), *window, _ref("i")], kwargs={})
    return pooling.bind_backward(step, {"go": _spec(go), "x": _spec(x), "i": _spec(ind)})


def _input(shape, channels_last, seed):
    """Small integers (ties in most windows), -inf and NaNs."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(-3, 4, shape, generator=g).float()
    r = torch.rand(shape, generator=g)
    x[r < 0.04] = float("nan")
    x[(r > 0.5) & (r < 0.53)] = float("-inf")
    return x.contiguous(memory_format=torch.channels_last) if channels_last else x


WINDOWS = [  # kernel, stride, padding, dilation, ceil_mode
    ([3, 3], [2, 2], [1, 1], [1, 1], False),  # ResNet's stem
    ([3, 3], [2, 2], [1, 1], [1, 1], True),
    ([2, 2], [2, 2], [0, 0], [1, 1], False),
    ([3, 2], [1, 2], [1, 0], [2, 1], True),
    ([3, 3], [], [0, 0], [1, 1], True),  # stride defaults to the kernel
    ([5, 4], [3, 1], [2, 2], [1, 2], False),
]
SHAPES = [(2, 19, 9, 11), (1, 80, 8, 13), (3, 5, 10, 7), (2, 64, 16, 16), (1, 3, 40, 37)]  # 37: 16-output runs (NCHW)


@pytest.mark.parametrize("channels_last", [True, False], ids=["cl", "nchw"])
@pytest.mark.parametrize("window", WINDOWS, ids=lambda w: "-".join(map(str, w[0] + w[1] + w[2] + w[3] + [w[4]])))
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_forward_and_backward_bit_exact(shape, window, channels_last):
    x = _input(shape, channels_last, seed=sum(shape))
    fwd, why = _bind_forward(x, window)
    assert fwd is not None, why
    ref_out, ref_ind = aten.max_pool2d_with_indices(x, *window)
    out, ind = fwd(x, *window)
    torch.testing.assert_close(out, ref_out, **EXACT)
    torch.testing.assert_close(ind, ref_ind, rtol=0, atol=0)
    assert (out.stride(), ind.stride()) == (ref_out.stride(), ref_ind.stride())
    go = torch.randn(ref_out.shape).contiguous(memory_format=torch.channels_last
                                               if channels_last else torch.contiguous_format)
    bwd, why = _bind_backward(go, x, ref_ind, window)
    if not channels_last:  # the native backward is channels-last only
        assert bwd is None and "NCHW" in why
        return
    assert bwd is not None, why
    ref_gi = aten.max_pool2d_with_indices_backward(go, x, *window, ref_ind)
    gi = bwd(go, x, *window, ref_ind)
    torch.testing.assert_close(gi, ref_gi, **EXACT)
    assert gi.stride() == ref_gi.stride()


@pytest.mark.parametrize("shape", [(4, 64, 32, 32), (1, 48, 17, 15)])  # 1 image: channel blocks
@pytest.mark.parametrize("threads", [1, 2])
def test_threads_and_random_floats(threads, shape):
    prev = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        x = torch.randn(shape).contiguous(memory_format=torch.channels_last)
        window = ([3, 3], [2, 2], [1, 1], [1, 1], False)
        fwd, _ = _bind_forward(x, window)
        out, ind = fwd(x, *window)
        ref_out, ref_ind = aten.max_pool2d_with_indices(x, *window)
        torch.testing.assert_close(out, ref_out, rtol=0, atol=0)
        assert torch.equal(ind, ref_ind)
        go = torch.randn_like(ref_out)
        bwd, _ = _bind_backward(go, x, ind, window)
        torch.testing.assert_close(bwd(go, x, *window, ind),
                                   aten.max_pool2d_with_indices_backward(go, x, *window, ind),
                                   rtol=0, atol=0)
    finally:
        torch.set_num_threads(prev)


def test_ineligible_inputs_keep_aten_with_a_reason(monkeypatch):
    window = ([3, 3], [2, 2], [1, 1], [1, 1], False)
    cases = {
        "dtype torch.float64": torch.randn(1, 4, 8, 8, dtype=torch.float64),
        "dtype torch.bfloat16": torch.randn(1, 4, 8, 8, dtype=torch.bfloat16),
        "input of 3 dims": torch.randn(4, 8, 8),
        "neither channels-last nor contiguous": torch.randn(1, 4, 8, 16)[..., ::2],
    }
    for why, x in cases.items():
        fn, reason = _bind_forward(x, window)
        assert fn is None and why in reason, (why, reason)
    x = torch.randn(1, 4, 8, 8)
    fn, reason = _bind_forward(x, ([2, 2], [2, 2], [2, 2], [1, 1], False))
    assert fn is None and "ATen rejects" in reason
    monkeypatch.setattr(pooling, "NATIVE_POOLING", False)
    assert _bind_forward(x, window) == (None, "NATIVE_POOLING is off")
    _, ind = aten.max_pool2d_with_indices(x, *window)
    assert _bind_backward(torch.randn(1, 4, 4, 4), x, ind, window) == (None, "NATIVE_POOLING is off")


def test_other_strides_per_call_run_aten():
    """The binder planned for the graph's strides: a call with others is ATen's."""
    window = ([3, 3], [2, 2], [1, 1], [1, 1], False)
    x = torch.randn(2, 16, 9, 9).contiguous(memory_format=torch.channels_last)
    fwd, _ = _bind_forward(x, window)
    y = torch.randn(2, 16, 9, 9)
    out, ind = fwd(y, *window)
    ref_out, ref_ind = aten.max_pool2d_with_indices(y, *window)
    torch.testing.assert_close(out, ref_out, rtol=0, atol=0)
    assert torch.equal(ind, ref_ind) and out.stride() == ref_out.stride()


@pytest.fixture
def kernel_calls(monkeypatch):
    """[the kernel's address per native pooling call] (counted at the extension call)."""
    calls = []
    call, fwd, bwd = pooling.kernels()

    def counted(address, *args):
        calls.append({fwd: "forward", bwd: "backward"}[address])
        return call(address, *args)
    monkeypatch.setattr(pooling, "library", [(counted, fwd, bwd)])
    return calls


@pytest.mark.parametrize("c", [64, 20])
def test_compiled_training_step_runs_native_pooling(c, kernel_calls):
    torch._dynamo.reset()
    torch.manual_seed(c)
    model = ConvBnPoolBlock(c=c, stem=(7, 2, 3)).train()
    ref = copy.deepcopy(model)
    x = torch.randn(2, 3, 38, 30) * 2 + 0.5
    with collect() as graphs:
        loss, gx, grads = loss_and_grads(torch.compile(model, backend="pypto"), x)
    ref_loss, ref_gx, ref_grads = loss_and_grads(ref, x)
    torch.testing.assert_close(loss, ref_loss, **FP32)
    for name, a, b in [("input", gx, ref_gx)] + [(f"parameter {i}", a, b) for i, (a, b)
                                                  in enumerate(zip(grads, ref_grads))]:
        scale = b.abs().max().clamp_min(1e-6)
        torch.testing.assert_close(a / scale, b / scale, **FP32, msg=lambda m, n=name: f"{n}: {m}")
    assert sorted(kernel_calls) == ["backward", "forward"], kernel_calls
    native = {k: e for g in graphs for k, e in g.to_dict()["extern_native"].items()}
    pools = [e for e in native.values() if "max pool" in e["reason"]]
    assert len(pools) == 2 and all(e["native"] for e in pools), native


def test_switch_off_or_no_table_entry_runs_aten(kernel_calls, monkeypatch):
    x = torch.randn(2, 3, 20, 20)
    for undo in ("switch", "table"):
        torch._dynamo.reset()
        with monkeypatch.context() as m:
            if undo == "switch":
                m.setattr(pooling, "NATIVE_POOLING", False)
            else:
                m.delitem(NATIVE_EXTERNS, pooling.ATEN_FORWARD)
                m.delitem(NATIVE_EXTERNS, pooling.ATEN_BACKWARD)
            torch.manual_seed(1)
            model = ConvBnPoolBlock(c=8, stem=(7, 2, 3)).train()
            ref = copy.deepcopy(model)
            loss, gx, _ = loss_and_grads(torch.compile(model, backend="pypto"), x)
            ref_loss, ref_gx, _ = loss_and_grads(ref, x)
        torch.testing.assert_close(loss, ref_loss, **FP32)
        assert not kernel_calls, undo
