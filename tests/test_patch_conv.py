"""Patchifying convolutions run as one GEMM over the patches (lowering/patch_conv.py), and every
layout pass leaves the graph's outputs in eager's memory format (conv_layout.keep_eager_output_layouts).

Against eager on fresh random inputs: outputs and the gradients of the input, weight and bias
(training), inference, a dynamic batch (symbolic C, H or W keep the convolution), kernels that do not divide the image (the remainder
is skipped), non-square kernels, bf16. A spy on ATen's convolution checks that a patchifying
one no longer runs and that the others still do."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from pypto_inductor.lowering import graph as lowering_graph

aten = torch.ops.aten
TOL = {torch.float32: {"atol": 1e-4, "rtol": 1e-4}, torch.bfloat16: {"atol": 3e-2, "rtol": 3e-2}}


@pytest.fixture
def convolutions(monkeypatch):
    """The number of ATen convolutions (forward and backward) the compiled graphs ran."""
    ran = []
    for op in (aten.convolution.default, aten.convolution_backward.default):
        fn = lowering_graph.DIRECT_CALLS.get(op, op)

        def call(*args, _fn=fn, **kwargs):
            ran.append(1)
            return _fn(*args, **kwargs)
        monkeypatch.setitem(lowering_graph.DIRECT_CALLS, op, call)
    return ran


class PatchEmbed(nn.Module):
    """ViT's patch embedding: conv, flatten, transpose, position add, LayerNorm."""

    def __init__(self, c, o, k, patches, dtype):
        super().__init__()
        self.proj = nn.Conv2d(c, o, k, stride=k).to(dtype)
        self.pos = nn.Parameter(torch.randn(1, patches, o, dtype=dtype))
        self.norm = nn.LayerNorm(o).to(dtype)

    def forward(self, x):
        return self.norm(self.proj(x).flatten(2).transpose(1, 2) + self.pos)


def _grads(module, x, out):
    g = torch.randn_like(out)
    return torch.autograd.grad(out, [x, *module.parameters()], g)


@pytest.mark.parametrize("shape,k,dtype", [
    ((4, 3, 32, 32), 8, torch.float32),
    ((2, 3, 30, 35), (4, 5), torch.float32),  # remainders of 2 rows and 0 columns
    ((2, 4, 16, 16), 4, torch.bfloat16),
])
def test_patch_embedding_trains_as_eager_without_convolutions(shape, k, dtype, convolutions):
    torch.manual_seed(0)
    kh, kw = (k, k) if isinstance(k, int) else k
    m = PatchEmbed(shape[1], 24, k, (shape[2] // kh) * (shape[3] // kw), dtype)
    x = torch.randn(shape, dtype=dtype, requires_grad=True)
    compiled = torch.compile(m, backend="pypto")
    out, ref = compiled(x), m(x)
    torch.testing.assert_close(out, ref, **TOL[dtype])
    torch.manual_seed(1)
    got = _grads(m, x, out)
    torch.manual_seed(1)
    for a, b in zip(got, _grads(m, x, ref)):  # bf16 sums of 32 products: judged to scale
        scale = b.abs().max().clamp_min(1e-6)
        torch.testing.assert_close(a / scale, b / scale, **TOL[dtype])
    assert not convolutions


@pytest.mark.parametrize("all_dynamic", [False, True], ids=["batch", "all_dims"])
def test_patch_conv_inference_with_dynamic_sizes(all_dynamic, convolutions):
    """A symbolic batch keeps the GEMM; symbolic C, H, W (dynamic=True) keep the convolution."""
    torch.manual_seed(0)
    conv = nn.Conv2d(3, 16, 4, stride=4)
    compiled = torch.compile(conv, backend="pypto", dynamic=all_dynamic or None)
    with torch.no_grad():
        for n in (3, 5):
            x = torch.randn(n, 3, 20, 24)
            torch._dynamo.mark_dynamic(x, 0)
            out = compiled(x)
            torch.testing.assert_close(out, conv(x), atol=1e-4, rtol=1e-4)
            assert out.stride() == conv(x).stride()  # eager's NCHW, not the GEMM's NHWC
    assert bool(convolutions) == all_dynamic


@pytest.mark.parametrize("conv", [
    nn.Conv2d(3, 8, 3, stride=2),  # stride below the kernel: patches overlap
    nn.Conv2d(3, 8, 4, stride=4, padding=1),
    nn.Conv2d(4, 8, 2, stride=2, groups=2),
], ids=["overlapping", "padded", "grouped"])
def test_other_convolutions_stay_convolutions(conv, convolutions):
    torch.manual_seed(0)
    x = torch.randn(2, conv.in_channels, 12, 12, requires_grad=True)
    out = torch.compile(conv, backend="pypto")(x)
    ref = conv(x)
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
    torch.manual_seed(1)
    got = _grads(conv, x, out)
    torch.manual_seed(1)
    for a, b in zip(got, _grads(conv, x, ref)):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    assert convolutions


class FeatureMap(nn.Module):
    """A backbone returning its feature map (the caller flattens it with ``view``)."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                                  nn.Conv2d(8, 8, 2, stride=2))

    def forward(self, x):
        return self.body(x), self.body[0](x).flatten(2)


@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "channels_last"])
def test_outputs_keep_eager_memory_format(train, channels_last):
    """Channels-last training graphs, inference conv chains and patch GEMMs all compute
    channels-last internally; the returned tensors have eager's strides, so ``view`` works."""
    torch.manual_seed(0)
    m = FeatureMap().train(train)
    x = torch.randn(2, 3, 10, 10)
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    x.requires_grad_(train)
    with torch.set_grad_enabled(train):
        ref = m(x)
        out = torch.compile(m, backend="pypto")(x)
    for a, b in zip(out, ref):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
        assert a.stride() == b.stride()
    # the caller's flatten: a view, which raises on the other memory format
    flat = out[0].permute(0, 2, 3, 1) if channels_last else out[0]
    assert flat.view(2, -1).shape == (2, flat.numel() // 2)
