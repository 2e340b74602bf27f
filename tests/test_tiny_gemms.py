"""Tiny static GEMMs (lowering.matmul.TINY_GEMMS: at most TINY_GEMM_MACS multiply-adds, a
ResNet's classifier head and its backward products) lowered as a broadcast multiply and a
sum, a native kernel, not a GEMM tile's MKL call; larger or dynamic ones stay GEMM tiles.
Checked against eager on fresh random inputs."""
from __future__ import annotations

import pytest
import torch

from pypto_inductor.lowering import matmul
from pypto_inductor.report import collect


def _gemm_tiles(reports) -> int:
    return sum(bool(getattr(getattr(k, "launch", None), "gemm", False))
               or "mm" in name.split("_")[-1]
               for r in reports if r.compiled is not None for name, k in r.compiled.kernels.items())


def linear(x, w, b):
    return torch.nn.functional.linear(x, w, b)


def mm_t(x, y):
    return torch.mm(x.t(), y)


@pytest.mark.parametrize("on", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("fn, shapes", [(linear, [(4, 32), (10, 32), (10,)]),
                                        (mm_t, [(4, 32), (4, 10)]),
                                        (linear, [(8, 64), (32, 64), (32,)])])  # too big
def test_tiny_gemm_is_a_native_kernel(fn, shapes, dtype, on, monkeypatch):
    monkeypatch.setattr(matmul, "TINY_GEMMS", on)
    torch._dynamo.reset()
    compiled = torch.compile(fn, backend="pypto")
    with collect() as reports:
        for _ in range(3):
            args = [torch.randn(s, dtype=dtype) for s in shapes]
            torch.testing.assert_close(compiled(*args), fn(*args))
    macs = shapes[0][0] * shapes[0][1] * shapes[1][0 if fn is linear else 1]
    tiny = on and macs <= matmul.TINY_GEMM_MACS
    assert (_gemm_tiles(reports) == 0) == tiny


def test_tiny_head_training_step(monkeypatch):
    # a classifier head's forward (addmm) and backward (two mm): no GEMM tile, eager's grads
    monkeypatch.setattr(matmul, "TINY_GEMMS", True)
    torch._dynamo.reset()
    torch.manual_seed(0)
    head = torch.nn.Linear(32, 10)
    ref = torch.nn.Linear(32, 10)
    ref.load_state_dict(head.state_dict())
    compiled = torch.compile(lambda x, m=head: torch.log_softmax(m(x.relu()), -1).sum(),
                             backend="pypto")
    with collect() as reports:
        for _ in range(3):
            x = torch.randn(4, 32)
            xa, xb = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
            compiled(xa).backward()
            torch.log_softmax(ref(xb.relu()), -1).sum().backward()
            torch.testing.assert_close(xa.grad, xb.grad)
            for p, q in zip(head.parameters(), ref.parameters()):
                torch.testing.assert_close(p.grad, q.grad)
                p.grad = q.grad = None
    assert _gemm_tiles(reports) == 0
    assert sum(r.compiled is not None for r in reports) == 2  # a forward and a backward
