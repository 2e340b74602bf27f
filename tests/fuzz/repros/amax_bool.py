"""Fuzz seed 1072 (shrunk): amax of a bool tensor on target cpu is True where eager is False.
Run: python tests/fuzz/repros/amax_bool.py -> prints OK, MISMATCH or CRASH."""
import warnings

import torch

warnings.simplefilter("ignore")
fn = lambda x: (x < x).amax()  # noqa: E731 - all False
x = torch.randn(5, 3)
got = torch.compile(fn, backend="pypto", options={"target": "cpu"})(x)
print("OK" if torch.equal(got, fn(x)) else f"MISMATCH: compiled {got}, eager {fn(x)}")
