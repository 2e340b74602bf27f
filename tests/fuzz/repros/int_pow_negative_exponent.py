"""Fuzz seed 79 (run 1, shrunk): integer pow with a negative exponent on target cpu gives
INT64_MIN for 0 ** -2 where eager gives 0 (the native kernel takes a float pow and casts
inf to int; eager's integer pow is exact: 0 for |base| > 1, +-1 for +-1, 0 for 0).
Run: python tests/fuzz/repros/int_pow_negative_exponent.py -> prints OK, MISMATCH or CRASH."""
import warnings

import torch

warnings.simplefilter("ignore")
base, exp = torch.tensor([0, 1, -1, 2, -3, 5]), torch.tensor([-2])
got = torch.compile(torch.pow, backend="pypto", options={"target": "cpu"})(base, exp)
ref = torch.pow(base, exp)
print("OK" if torch.equal(got, ref) else f"MISMATCH: compiled {got.tolist()}, eager {ref.tolist()}")
