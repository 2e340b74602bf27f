"""Training graphs run convolutions and max pooling channels-last (lowering/conv_layout.py):
the loss, every parameter gradient and the BatchNorm running statistics match eager (fp32,
bf16 autocast), on the zoo ResNet and on a conv + BN + ReLU + max-pool toy of odd sizes
(odd H and W, C = 5, batch 1), from NCHW and channels-last inputs, with a dynamic batch.
A spy on the convolutions' and poolings' inputs checks the switch changes the layout, and
every tile is native (BatchNorm's statistics over channels-last activations are column sums)."""
from __future__ import annotations

import copy
import warnings

import pytest
import torch

from conv_blocks import ConvBnPoolBlock, loss_and_grads
from pypto_inductor import zoo
from pypto_inductor.lowering import conv_layout, graph as lowering_graph
from pypto_inductor.report import collect

aten = torch.ops.aten
FP32 = {"atol": 1e-4, "rtol": 1e-4}  # reordered fp32 sums through a few layers
BF16 = {"atol": 2e-2, "rtol": 4e-2}  # each op rounds to bf16 in eager, not in our kernels


@pytest.fixture
def spy(monkeypatch):
    """op name -> [whether its input was channels-last] for every convolution (forward and
    backward) and max pooling the compiled graphs run."""
    seen: dict[str, list[bool]] = {}
    for op in (aten.convolution.default, aten.convolution_backward.default,
               aten.max_pool2d_with_indices.default,
               aten.max_pool2d_with_indices_backward.default):
        fn = lowering_graph.DIRECT_CALLS.get(op, op)

        def call(*args, _fn=fn, _name=op.name(), **kwargs):
            x = args[0]  # the input (forward) or the output's gradient (backward)
            seen.setdefault(_name, []).append(
                x.is_contiguous(memory_format=torch.channels_last)
                and not x.is_contiguous())
            return _fn(*args, **kwargs)
        monkeypatch.setitem(lowering_graph.DIRECT_CALLS, op, call)
    return seen


@pytest.fixture
def switch(monkeypatch):
    def set_(on: bool):
        monkeypatch.setattr(conv_layout, "CHANNELS_LAST_TRAINING", on)
    return set_


def _native(built):
    assert built and all(k.native for _, k in built), \
        [(t.name, k.reason) for t, k in built if not k.native]


def _close_scaled(a, b, tol, name):
    scale = b.abs().max().clamp_min(1e-6)
    torch.testing.assert_close(a / scale, b / scale, **tol, msg=lambda m: f"{name}: {m}")


def _step(model, batch, autocast=False):
    with torch.autocast("cpu", torch.bfloat16, enabled=autocast):
        out = model(**batch)
    out["loss"].backward()
    return out["loss"]


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16_autocast"])
def test_resnet_training_step_matches_eager(autocast, spy, built, switch):
    switch(True)
    model = zoo.build("resnet").train()
    ref = copy.deepcopy(model)
    batch = zoo.batch("resnet", seed=5)
    compiled = torch.compile(model, backend="pypto")
    with warnings.catch_warnings(), collect() as graphs:
        warnings.simplefilter("error", UserWarning)  # a graph that ran eagerly fails
        for _ in range(2):  # the second step reads the running statistics the first wrote
            model.zero_grad(set_to_none=True)
            ref.zero_grad(set_to_none=True)
            loss = _step(compiled, batch, autocast)
            ref_loss = _step(ref, batch, autocast)
    tol = BF16 if autocast else FP32
    torch.testing.assert_close(loss, ref_loss, **tol)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert p.grad is not None, name
        assert p.grad.shape == q.grad.shape and p.grad.dtype == q.grad.dtype, name
        _close_scaled(p.grad, q.grad, tol, name)
    for (name, b), c in zip(model.named_buffers(), ref.buffers()):
        torch.testing.assert_close(b, c, **tol, msg=lambda m, n=name: f"{n}: {m}")
    for op in ("aten::convolution", "aten::convolution_backward",
               "aten::max_pool2d_with_indices", "aten::max_pool2d_with_indices_backward"):
        assert spy.get(op) and all(spy[op]), (op, spy.get(op))
    _native(built)
    # an op runs eagerly only where its eager kernel is the implementation chosen (the
    # convolutions, pooling): the restriding of the channels-last mean and its backward lower
    chosen = set(lowering_graph.EAGER_BY_CHOICE.values())
    reasons = {r for g in graphs for r in g.to_dict()["extern_reasons"].values()}
    assert all(r.partition(": ")[2] in chosen for r in reasons), reasons


@pytest.mark.parametrize("channels_last_input", [False, True], ids=["nchw_in", "cl_in"])
@pytest.mark.parametrize("shape", [(1, 3, 13, 11), (3, 3, 9, 17)], ids=["batch1", "odd"])
@pytest.mark.parametrize("on", [True, False], ids=["switch_on", "switch_off"])
def test_toy_conv_bn_relu_pool(shape, channels_last_input, on, spy, built, switch):
    switch(on)
    torch.manual_seed(sum(shape))
    model = ConvBnPoolBlock().train()
    ref = copy.deepcopy(model)
    x = torch.randn(*shape) * 2 + 0.5
    if channels_last_input:
        x = x.contiguous(memory_format=torch.channels_last)
    compiled = torch.compile(model, backend="pypto")
    loss, gx, grads = loss_and_grads(compiled, x)
    ref_loss, ref_gx, ref_grads = loss_and_grads(ref, x)
    torch.testing.assert_close(loss, ref_loss, **FP32)
    _close_scaled(gx, ref_gx, FP32, "input")
    for i, (a, b) in enumerate(zip(grads, ref_grads)):
        _close_scaled(a, b, FP32, f"parameter {i}")
    for (name, b), c in zip(model.named_buffers(), ref.buffers()):
        torch.testing.assert_close(b, c, **FP32, msg=lambda m, n=name: f"{n}: {m}")
    convs = spy["aten::convolution"] + spy["aten::convolution_backward"] \
        + spy["aten::max_pool2d_with_indices"]
    if on:
        assert all(convs), spy
    elif not channels_last_input:
        assert not any(convs), spy  # the switch is what changed the layout
    _native(built)


def test_dynamic_batch(spy, built, switch):
    switch(True)
    torch.manual_seed(3)
    model = ConvBnPoolBlock(c=6).train()
    ref = copy.deepcopy(model)
    compiled = torch.compile(model, backend="pypto", dynamic=True)
    for n in (2, 3, 5):
        x = torch.randn(n, 3, 15, 10)
        loss, gx, grads = loss_and_grads(compiled, x)
        ref_loss, ref_gx, ref_grads = loss_and_grads(ref, x)
        torch.testing.assert_close(loss, ref_loss, **FP32)
        _close_scaled(gx, ref_gx, FP32, f"input n={n}")
        for i, (a, b) in enumerate(zip(grads, ref_grads)):
            _close_scaled(a, b, FP32, f"parameter {i}, n={n}")
        model.zero_grad(set_to_none=True)
        ref.zero_grad(set_to_none=True)
    assert all(spy["aten::convolution"]), spy
    _native(built)


def test_max_pool_indices_are_per_plane_in_either_format():
    # the backward scatters through these indices: the same positions either way
    x = torch.randn(2, 5, 9, 7)
    _, i = aten.max_pool2d_with_indices(x, [3, 3], [2, 2], [1, 1])
    _, j = aten.max_pool2d_with_indices(x.contiguous(memory_format=torch.channels_last),
                                        [3, 3], [2, 2], [1, 1])
    torch.testing.assert_close(i, j, rtol=0, atol=0)
    assert int(i.max()) < 9 * 7
