"""Bit-exactness checks of a compiled function and its gradients, shared by the tests of
emit switches that must not change any result (test_static_bounds, test_lane_loop)."""
from __future__ import annotations

import torch


def same_bits(out, ref, what):
    assert out.dtype == ref.dtype and out.shape == ref.shape, what
    nan = ref.isnan()
    assert torch.equal(out.isnan(), nan), f"{what}: NaN placement differs"
    bits = torch.int16 if out.element_size() == 2 else torch.int32
    bad = out[~nan].view(bits) != ref[~nan].view(bits)
    assert not bad.any(), f"{what}: {int(bad.sum())} of {bad.numel()} differ in bits"


def with_grads(fn, args, grad_out):
    """``fn`` on copies of ``args``: its output and the gradients of the floating-point
    arguments for ``grad_out``."""
    leaves = [a.detach().clone().requires_grad_(a.is_floating_point()) for a in args]
    out = fn(*leaves)
    out.backward(grad_out)
    return [out.detach()] + [a.grad for a in leaves if a.grad is not None]


def compiled_with_grads(fn, args, grad_out):
    """:func:`with_grads` of ``fn`` compiled with backend="pypto" afresh."""
    torch._dynamo.reset()
    return with_grads(torch.compile(fn, backend="pypto"), args, grad_out)
