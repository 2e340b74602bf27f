"""Fuzz seed 1072 (first generator), run 2 seed 83 (shrunk): amax of a bool tensor on
target cpu is True where eager is False, over all dims and over the last dim.
Run: python tests/fuzz/repros/amax_bool.py -> prints OK, MISMATCH or CRASH."""
import warnings

import torch

warnings.simplefilter("ignore")
x = torch.randn(5, 3)
bad = []
for fn in (lambda x: (x < x).amax(), lambda x: (x < x).amax(-1)):  # all False
    torch._dynamo.reset()
    got = torch.compile(fn, backend="pypto", options={"target": "cpu"})(x)
    if not torch.equal(got, fn(x)):
        bad.append(f"compiled {got.tolist()}, eager {fn(x).tolist()}")
print("OK" if not bad else "MISMATCH: " + "; ".join(bad))
