"""Fuzz seeds 3, 17, 30, 238, 319 (run 1, shrunk): the backward of var over every dim
(keepdim) under dynamic=True crashes on both targets: the backward graph's float size
arithmetic (sym_float(numel) - correction, 2.0 / that) is not lowered (it becomes extern
ops with no result), so the scale reaches mul as None ("Expected a proper Tensor but got
None", or with correction=0 "unsupported operand type(s) for /: 'float' and 'NoneType'").
Run: python tests/fuzz/repros/var_backward_dynamic.py -> prints OK, MISMATCH or CRASH."""
import warnings

import torch

warnings.simplefilter("ignore")
found = []
for correction in (1, 0):
    fn = lambda x: torch.var(x, dim=(0, 1, 2), correction=correction, keepdim=True)  # noqa
    x = torch.randn(5, 3, 6, requires_grad=True)
    torch._dynamo.reset()
    try:
        out = torch.compile(fn, backend="pypto", options={"target": "cpu"}, dynamic=True)(x)
        grad, = torch.autograd.grad(out, x, torch.ones_like(out))
        x2 = x.detach().requires_grad_()
        ref = fn(x2)
        grad2, = torch.autograd.grad(ref, x2, torch.ones_like(ref))
        if not (torch.allclose(out, ref) and torch.allclose(grad, grad2)):
            found.append(f"MISMATCH (correction={correction})")
    except Exception as e:  # noqa: BLE001
        found.append(f"CRASH (correction={correction}): {type(e).__name__}: "
                     f"{str(e).splitlines()[0]}")
print("; ".join(found) if found else "OK")
