"""Layouts the graph code takes from the trace (codegen/graph/layouts.py): an extern op's
fresh outputs (EXTERN_LAYOUTS) and the inputs a graph only reads (INPUT_LAYOUTS) have
their traced strides written out, checked once per call; views of them are reinterprets
or byte offsets for native kernels. Every case is checked against eager on fresh inputs,
including a run-time layout other than the traced one (the check's copy)."""
from __future__ import annotations

import copy

import pytest
import torch

from conv_blocks import ConvBnPoolBlock, loss_and_grads
from pypto_inductor.codegen.cpp import launcher
from pypto_inductor.codegen.graph import layouts
from pypto_inductor.report import collect


@pytest.mark.parametrize("inline_writes", [True, False])
@pytest.mark.parametrize("on", [True, False])
def test_conv_outputs_and_saved_inputs_need_no_view_calls(on, inline_writes, monkeypatch):
    # a ResNet stem's training step: the convolutions' channels-last outputs, read by the
    # BatchNorm kernels through an NHWC permute, the backward's saved activations, and
    # BatchNorm's rsqrt from the kernel updating its running variance (WRAPPED_LAYOUTS
    # when that kernel goes through its wrapper: launcher.INLINE_WRITES off)
    monkeypatch.setattr(launcher, "INLINE_WRITES", inline_writes)
    monkeypatch.setattr(layouts, "EXTERN_LAYOUTS", on)
    monkeypatch.setattr(layouts, "INPUT_LAYOUTS", on)
    monkeypatch.setattr(layouts, "WRAPPED_LAYOUTS", on)
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = ConvBnPoolBlock(c=8).to(memory_format=torch.channels_last)
    ref = copy.deepcopy(model)
    compiled = torch.compile(model, backend="pypto")
    with collect() as reports:
        for step in range(3):
            x = torch.randn(2, 3, 12, 12).to(memory_format=torch.channels_last)
            loss, gx, grads = loss_and_grads(compiled, x)
            want, wgx, wgrads = loss_and_grads(ref, x)
            torch.testing.assert_close(loss, want, rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(gx, wgx, rtol=1e-4, atol=1e-4)
            for g, w in zip(grads, wgrads):  # scaled: reordered fp32 sums through 2 layers
                scale = w.abs().max().clamp_min(1e-6)
                torch.testing.assert_close(g / scale, w / scale, rtol=1e-4, atol=1e-4)
            for p in (*model.parameters(), *ref.parameters()):
                p.grad = None
    source = "\n".join(r.compiled.source for r in reports if r.compiled is not None)
    assert "ext" in source, source  # the convolutions are extern calls
    if on:
        assert "relayout(" in source, source
        assert ".permute(" not in source and ".reshape(" not in source, source
    else:
        assert ".permute(" in source, source


def _traced_contiguous_lib():
    # an op whose meta function says contiguous while its kernel returns channels-last:
    # an ATen kernel choosing another layout than the trace (the check's copy must run)
    lib = torch.library.Library("pypto_k19c_test", "FRAGMENT")
    lib.define("twice(Tensor x) -> Tensor")
    lib.impl("twice", lambda x: (x * 2).contiguous(memory_format=torch.channels_last), "CPU")
    lib.impl("twice", lambda x: torch.empty_like(x, memory_format=torch.contiguous_format),
             "Meta")
    return lib


_LIB = _traced_contiguous_lib()


def other_layout(x):
    y = torch.ops.pypto_k19c_test.twice(x)
    return torch.sin(y.permute(0, 2, 3, 1)) + 1, torch.cos(y.reshape(-1)[5:40])


def test_extern_output_of_another_layout_is_copied_to_the_traced_one():
    torch._dynamo.reset()
    fn = torch.compile(other_layout, backend="pypto")
    for _ in range(3):
        x = torch.randn(2, 3, 4, 5)
        with collect() as reports:
            got = fn(x)
        for g, w in zip(got, other_layout(x)):
            torch.testing.assert_close(g, w)  # our sin/cos: within an ulp or two
    source = "\n".join(r.compiled.source for r in reports if r.compiled is not None)
    if not source:  # compiled in the first iteration's collect
        return
    assert "relayout(" in source, source


def read_only_input(x, w):
    # x is only read: a view of it feeds a native kernel, another a GEMM
    return torch.tanh(x.permute(0, 2, 1)) * 3, x.reshape(-1, 6) @ w


def test_input_of_another_layout_is_copied_to_the_traced_one():
    # Dynamo guards an input's strides, so a compiled graph only meets other strides when
    # called directly (an AOTAutograd backward's saved tensor, say): call it so
    torch._dynamo.reset()
    x, w = torch.randn(2, 5, 6), torch.randn(6, 4)
    with collect() as reports:
        torch.compile(read_only_input, backend="pypto")(x, w)
    graph = next(r.compiled for r in reports if r.compiled is not None)
    assert "relayout(" in graph.source, graph.source
    for _ in range(2):
        x = torch.randn(6, 5, 2).permute(2, 1, 0)  # same sizes, other strides
        w = torch.randn(6, 4)
        got = graph([x, w])
        for g, want in zip(got, read_only_input(x, w)):
            torch.testing.assert_close(g, want, rtol=1e-5, atol=1e-5)
