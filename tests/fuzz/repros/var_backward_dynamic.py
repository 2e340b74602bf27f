"""Fuzz seed 3 (shrunk): the backward of var over every dim (keepdim) under dynamic=True
crashes on both targets: the graph's float size arithmetic (sym_float(numel) - 1.0,
2.0 / that) is not lowered, so the scale reaches mul as None.
Run: python tests/fuzz/repros/var_backward_dynamic.py -> prints OK, MISMATCH or CRASH."""
import warnings

import torch

warnings.simplefilter("ignore")
fn = lambda x: torch.var(x, dim=(0, 1, 2), correction=1, keepdim=True)  # noqa: E731
x = torch.randn(5, 3, 6, requires_grad=True)
try:
    out = torch.compile(fn, backend="pypto", options={"target": "cpu"}, dynamic=True)(x)
    grad, = torch.autograd.grad(out, x, torch.ones_like(out))
    x2 = x.detach().requires_grad_()
    ref = fn(x2)
    grad2, = torch.autograd.grad(ref, x2, torch.ones_like(ref))
    print("OK" if torch.allclose(out, ref) and torch.allclose(grad, grad2) else "MISMATCH")
except Exception as e:  # noqa: BLE001
    print(f"CRASH: {type(e).__name__}: {str(e).splitlines()[0]}")
