"""Run 2 seed 111 (shrunk): a (1, 1) @ (1, n) matmul whose operand is then clamped in place
crashes on target cpu with IndexError in codegen/cpp_matmul.py's kernel: the epilogue's
output is written in place into the input (the copy_ of the mutation), so no buffer is
allocated for it, and `buffers[idx]` runs past the list.
Run: python tests/fuzz/repros/matmul_inplace_operand.py -> prints OK, MISMATCH or CRASH."""
import warnings

import torch

warnings.simplefilter("ignore")


def fn(a, b):
    product = a @ b
    b.clamp_(min=0)
    return product


a, b = torch.randn(1, 1), torch.randn(1, 5)
try:
    b1, b2 = b.clone(), b.clone()
    got = torch.compile(fn, backend="pypto", options={"target": "cpu"})(a, b1)
    ref = fn(a, b2)
    print("OK" if torch.allclose(got, ref) and torch.equal(b1, b2) else "MISMATCH")
except Exception as e:  # noqa: BLE001
    print(f"CRASH: {type(e).__name__}: {str(e).splitlines()[0]}")
