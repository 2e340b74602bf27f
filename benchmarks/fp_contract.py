"""A/B of the cpu kernels' -ffp-contract=off (the emitter writes eager's fmas itself, ops.py)
against g++'s default contraction: the same kernel sources built both ways in one process
(1 thread, thread time, medians of rounds of 5 calls, the order alternating per round):
LayerNorm, GELU, softmax and var at 4096x1024 float32.

    python -m benchmarks.fp_contract [--rounds 15]
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.nn.functional as F

CASES = {
    "layernorm": "def fn(x, w, b):\n    return F.layer_norm(x, (1024,), w, b)",
    "gelu": "def fn(x, w, b):\n    return F.gelu(x * 1.5 + 0.25)",
    "softmax": "def fn(x, w, b):\n    return torch.softmax(x, -1)",
    "var(-1)": "def fn(x, w, b):\n    return x.var(-1)",
}


def _fn(src: str):
    """A fresh code object per variant (Dynamo caches compiled code per code object)."""
    ns: dict = {}
    exec(compile(src, "<fp_contract case>", "exec"), {"torch": torch, "F": F}, ns)
    return ns["fn"]


def _built_with(contract: str, src: str, args):
    """fn compiled on its first call with the probed compiler's flags' -ffp-contract=off
    replaced by -ffp-contract=<contract> (the flags are part of the kernel cache key)."""
    from pypto_inductor.codegen.cpp import compiler
    compiled = torch.compile(_fn(src), backend="pypto")
    saved = dict(compiler.compilers)
    for key, found in saved.items():
        if found is not None:
            path, version, flags = found
            compiler.compilers[key] = (path, version, tuple(
                f"-ffp-contract={contract}" if f == "-ffp-contract=off" else f for f in flags))
    try:
        compiled(*args)
    finally:
        compiler.compilers.clear()
        compiler.compilers.update(saved)
    return compiled


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=15)
    a = p.parse_args(argv)
    os.environ["PYPTO_INDUCTOR_GRAPH_CACHE"] = "0"  # else both variants share one plan
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    args = (torch.randn(4096, 1024, generator=g), torch.randn(1024, generator=g),
            torch.randn(1024, generator=g))
    torch.compile(_fn("def fn(x, w, b):\n    return x + 1"), backend="pypto")(*args)  # probe
    print("| kernel | off us | fast us | off / fast |\n|---|---|---|---|")
    for name, src in CASES.items():
        variants = {c: _built_with(c, src, args) for c in ("off", "fast")}
        times = {c: [] for c in variants}
        for r in range(a.rounds):
            for c in (("off", "fast") if r % 2 else ("fast", "off")):
                ts = []
                for _ in range(5):
                    start = time.thread_time()
                    variants[c](*args)
                    ts.append(time.thread_time() - start)
                times[c].append(statistics.median(ts))
        off, fast = (statistics.median(times[c]) * 1e6 for c in ("off", "fast"))
        print(f"| {name} | {off:.0f} | {fast:.0f} | {off / fast:.3f} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
