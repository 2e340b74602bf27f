"""Fuzz seeds 3, 1046, 1107: torch.lerp with a Python scalar weight crashes on target
reference (its decomposition's abs(weight) reaches the executor with a float operand).
Run: python tests/fuzz/repros/lerp_scalar_weight.py -> prints OK, MISMATCH or CRASH."""
import warnings

import torch

warnings.simplefilter("ignore")
fn = lambda a, b: torch.lerp(a, b, 0.3)  # noqa: E731
a, b = torch.randn(5, 7), torch.randn(7)
try:
    got = torch.compile(fn, backend="pypto", options={"target": "reference"})(a, b)
    print("OK" if torch.allclose(got, fn(a, b)) else "MISMATCH")
except Exception as e:  # noqa: BLE001
    print(f"CRASH: {type(e).__name__}: {str(e).splitlines()[0]}")
