"""``python -m benchmarks.rope``: RoPE (``q * cos + rotate_half(q) * sin``) and RoPE of k into
the KV cache's cat, eager vs Inductor vs pypto with and without cat parts fused into the
cat's kernel (``fusion.planner.CAT_PARTS``), at LLaMA decode (one token) and prefill sizes.

Each pypto variant is compiled with the flag set (the plan cache keys on it), checked
against eager; medians of interleaved rounds, microseconds, one thread.
"""
from __future__ import annotations

import argparse

import torch

from pypto_inductor import models
from pypto_inductor.fusion import planner

from . import interleaved_medians


def rope(q, cos, sin):
    return q * cos + models.rotate_half(q) * sin


def rope_kv(k, cache, cos, sin):
    return torch.cat([cache, rope(k, cos, sin)], 2)


def _compiled(fn, args, cat_parts: bool | None):
    torch._dynamo.reset()
    if cat_parts is None:
        c = torch.compile(fn)
    else:
        old, planner.CAT_PARTS = planner.CAT_PARTS, cat_parts
        try:
            c = torch.compile(fn, backend="pypto")
            c(*args)  # compile now, under the flag
        finally:
            planner.CAT_PARTS = old
    torch.testing.assert_close(c(*args), fn(*args), atol=1e-5, rtol=1e-5)
    return c


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--repeats", type=int, default=200)
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    cases = {  # (b, heads, tokens, head dim); the cache holds 32 tokens
        "decode 1x4x1x16": (1, 4, 1, 16), "decode 1x32x1x128": (1, 32, 1, 128),
        "prefill 1x32x128x128": (1, 32, 128, 128)}
    print("| case | pattern | eager us | Inductor us | pypto before us | pypto after us "
          "| Inductor/after | before/after |")
    print("|---|---|---|---|---|---|---|---|")
    for label, (b, h, s, d) in cases.items():
        q, cos, sin = torch.randn(b, h, s, d), torch.randn(b, 1, s, d), torch.randn(b, 1, s, d)
        cache = torch.randn(b, h, 32, d)
        for name, fn, args in (("rope", rope, (q, cos, sin)),
                               ("rope+kv cat", rope_kv, (q, cache, cos, sin))):
            variants = {"eager": fn, "inductor": _compiled(fn, args, None),
                        "before": _compiled(fn, args, False), "after": _compiled(fn, args, True)}
            med = interleaved_medians(variants, lambda f: f(*args), a.rounds, a.repeats)
            print(f"| {label} | {name} | {med['eager']:.1f} | {med['inductor']:.1f} | "
                  f"{med['before']:.1f} | {med['after']:.1f} | "
                  f"{med['inductor'] / med['after']:.2f} | {med['before'] / med['after']:.2f} |",
                  flush=True)


if __name__ == "__main__":
    main()
