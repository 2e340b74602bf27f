"""Run 2 seed 193 (shrunk): var_mean's mean over values with an inf is inf compiled (both
targets: the lowering takes sum / N, as torch.mean does) and NaN in eager (its Welford
update meets inf - inf after the inf; the order of the elements decides, [40.25, inf] gives
inf). Decided: compiled keeps the mean's definition, torch.mean's answer; the fuzzer's
float64 run takes var_mean's mean as torch.mean (tests/fuzz/check.py, docs/fuzz.md).
Run: python tests/fuzz/repros/var_mean_inf.py -> prints OK (compiled == torch.mean) or
MISMATCH."""
import warnings

import torch

warnings.simplefilter("ignore")
x = torch.tensor([[float("inf"), 40.25], [1.5, -2.0]])
fn = lambda x: torch.var_mean(x, dim=1)  # noqa: E731
bad = []
for target in ("cpu", "reference"):
    torch._dynamo.reset()
    var, mean = torch.compile(fn, backend="pypto", options={"target": target})(x)
    ev, em = fn(x)
    if not (torch.equal(mean, x.mean(1)) and torch.allclose(var, ev, equal_nan=True)):
        bad.append(f"{target}: compiled {mean.tolist()}, eager {em.tolist()}")
print("OK" if not bad else "MISMATCH: " + "; ".join(bad) + f" (torch.mean: {x.mean(1).tolist()})")
