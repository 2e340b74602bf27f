"""Fuzz seeds 95, 289 (run 1, shrunk): torch.round(x, decimals=1) on float16 differs from
eager on both targets: the lowering rounds x * 10 to float16 before rounding to an
integer (-0.5498 * 10 -> -5.5 -> -6), eager computes round(x * 10) / 10 in float32.
Run: python tests/fuzz/repros/round_decimals_half.py -> prints OK, MISMATCH or CRASH."""
import warnings

import torch

warnings.simplefilter("ignore")
x = torch.tensor([-0.5498046875, 3.05078125, 0.3500976562], dtype=torch.float16)
fn = lambda x: torch.round(x, decimals=1)  # noqa: E731
bad = []
for target in ("cpu", "reference"):
    torch._dynamo.reset()
    got = torch.compile(fn, backend="pypto", options={"target": target})(x)
    if not torch.equal(got, fn(x)):
        bad.append(f"{target}: compiled {got.tolist()}, eager {fn(x).tolist()}")
print("OK" if not bad else "MISMATCH: " + "; ".join(bad))
