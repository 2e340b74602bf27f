"""``python -m benchmarks``: eager, Inductor and pypto side by side in one process.

Each case is checked against eager first, then timed: medians over repeats,
interleaved (eager, inductor, pypto, eager, ...) so machine noise hits all
three alike; ratios are what to read, not absolute times.
"""
from __future__ import annotations

import argparse
import platform
import statistics
import time

import torch

from pypto_inductor import models


def _cases(scale: str):
    big = scale == "full"
    rows = 8192 if big else 1024
    ln = models.LayerNormGeluResidual(1024)
    yield "ln_gelu_residual", ln, (torch.randn(rows, 1024),), 1e-4

    def chain(x, b, s):
        return torch.relu(x * s + b) * torch.sigmoid(x) - x / (1 + s)

    yield "elementwise_broadcast", chain, (torch.randn(rows, 1024), torch.randn(1024),
                                           torch.randn(rows, 1)), 1e-4

    def masked_softmax(x, mask):
        return torch.softmax((x * 0.125).masked_fill(mask, float("-inf")), dim=-1)

    s = 256
    yield "masked_softmax", masked_softmax, (torch.randn(8 if big else 2, 8, s, s),
                                             torch.ones(s, s, dtype=torch.bool).triu(1)), 1e-4
    block = models.TransformerBlock(256, 4, 1024).eval()
    yield "transformer_block", block, (torch.randn(4 if big else 1, 128, 256),), 1e-3
    llama = models.LlamaBlock(256, 4, 688).eval()
    yield "llama_block", llama, (torch.randn(4 if big else 1, 128, 256),), 1e-3
    yield "ln_gelu_residual_bf16", ln.to(torch.bfloat16), (
        torch.randn(rows, 1024, dtype=torch.bfloat16),), 5e-2


def _median_us(fn, args, repeats):
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn(*args)
        times.append((time.perf_counter() - start) * 1e6)
    return statistics.median(times)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks")
    parser.add_argument("--scale", choices=["small", "full"], default="small")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--target", default="cpu", help="pypto target (cpu, reference, ...)")
    parser.add_argument("--no-inductor", action="store_true")
    args = parser.parse_args(argv)
    torch.set_num_threads(2)
    print(f"# {time.strftime('%Y-%m-%d')} torch {torch.__version__} on {platform.processor() or platform.machine()},"
          f" {torch.get_num_threads()} threads, scale={args.scale}, repeats={args.repeats}")
    header = f"{'case':<24}{'eager us':>12}{'inductor us':>13}{'pypto us':>12}{'eager/pypto':>13}{'inductor/pypto':>16}"
    print(header)
    for name, fn, inputs, tol in _cases(args.scale):
        torch._dynamo.reset()
        backends = {"eager": fn}
        if not args.no_inductor:
            backends["inductor"] = torch.compile(fn, backend="inductor")
        backends["pypto"] = torch.compile(fn, backend="pypto", options={"target": args.target})
        with torch.no_grad():
            expected = fn(*inputs)
            for label, f in backends.items():
                torch.testing.assert_close(f(*inputs), expected, rtol=tol, atol=tol)
            times = {label: [] for label in backends}
            for _ in range(3):  # interleave rounds so noise hits every backend alike
                for label, f in backends.items():
                    times[label].append(_median_us(f, inputs, args.repeats))
        med = {label: statistics.median(t) for label, t in times.items()}
        ind = med.get("inductor", float("nan"))
        print(f"{name:<24}{med['eager']:>12.1f}{ind:>13.1f}{med['pypto']:>12.1f}"
              f"{med['eager'] / med['pypto']:>13.2f}{ind / med['pypto']:>16.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
