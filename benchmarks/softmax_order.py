"""Softmax / log_softmax (float32 and half types): eager, pypto (Inductor: --inductor)

float32 over the last dim and dim 0, float16/bfloat16 over the last dim, interleaved in one
process; medians and ratios. ``--ab 1,0,1,0`` adds "pypto@N" variants, the same kernels built with
reduction's SOFTMAX_EAGER_ORDER, SOFTMAX_COLUMN_EAGER_ORDER, HALF_SOFTMAX_EAGER_ORDER and
HALF_LOG_SOFTMAX_AS_EAGER = bool(N) (1: exp(x - max) summed in eager's order, over the last
dim its vector-lane order and softmax multiplied by the sum's reciprocal, over dim 0 one fp32
sum per column in order, half log_softmax's sum and log rounded; 0: the blocked fp32/double
sums and a division), for a before/after in one process; listing each
value twice, in both orders, shows how much a variant's place in the round moves it.
``--accuracy`` prints instead each variant's mean and max error against float64 (in ulps
of the result) beside eager's.

    python -m benchmarks.softmax_order [--threads 1] [--cpu-time] [--rounds 7] [--ab 1,0]
"""
from __future__ import annotations

import os

import torch

from . import interleaved_medians, md_table, parse_timing, timing_parser

# name: (source of fn(x, m), shape of x); m is an additive mask of x's last two dims
CASES = {
    "softmax 512x128": ("def fn(x, m):\n    return torch.softmax(x, -1)", (512, 128)),
    "softmax 4096x1024": ("def fn(x, m):\n    return torch.softmax(x, -1)", (4096, 1024)),
    "attention 4x2x128x128": ("def fn(x, m):\n    return torch.softmax(x * 0.125 + m, -1)",
                              (4, 2, 128, 128)),
    "log_softmax 4096x1024": ("def fn(x, m):\n    return torch.log_softmax(x, -1)",
                              (4096, 1024)),
    "softmax 2048x77": ("def fn(x, m):\n    return torch.softmax(x, -1)", (2048, 77)),
    "softmax dim0 2048x1024": ("def fn(x, m):\n    return torch.softmax(x, 0)", (2048, 1024)),
    "log_softmax dim0 2048x1024": ("def fn(x, m):\n    return torch.log_softmax(x, 0)",
                                   (2048, 1024)),
    "softmax dim0 16384x4": ("def fn(x, m):\n    return torch.softmax(x, 0)", (16384, 4)),
    "softmax dim0 64x4096": ("def fn(x, m):\n    return torch.softmax(x, 0)", (64, 4096)),
    "fp16 softmax 4096x1024": ("def fn(x, m):\n    return torch.softmax(x.half(), -1)",
                               (4096, 1024)),
    "bf16 softmax 2048x77": ("def fn(x, m):\n    return torch.softmax(x.bfloat16(), -1)",
                             (2048, 77)),
    "bf16 log_softmax 4096x1024": (
        "def fn(x, m):\n    return torch.log_softmax(x.bfloat16(), -1)", (4096, 1024)),
}


def _fn(src: str):
    ns: dict = {}
    exec(compile(src, "<softmax_order case>", "exec"), {"torch": torch}, ns)
    return ns["fn"]


def _with_order(fn, eager_order: bool):
    """fn compiled with reduction.SOFTMAX_EAGER_ORDER and SOFTMAX_COLUMN_EAGER_ORDER =
    eager_order (set for its first call, which compiles)."""
    from pypto_inductor.codegen.cpp import reduction
    compiled = torch.compile(fn, backend="pypto")
    names = ("SOFTMAX_EAGER_ORDER", "SOFTMAX_COLUMN_EAGER_ORDER", "HALF_SOFTMAX_EAGER_ORDER",
             "HALF_LOG_SOFTMAX_AS_EAGER")

    def first(*args):
        old = [getattr(reduction, n) for n in names]
        for n in names:
            setattr(reduction, n, eager_order)
        try:
            return compiled(*args)
        finally:
            for n, v in zip(names, old):
                setattr(reduction, n, v)
    return compiled, first


def _inputs(shape, g):
    x = torch.randn(*shape, generator=g) * 3
    m = torch.where(torch.rand(shape[-2:], generator=g) < 0.1, -1e4, 0.0) \
        if len(shape) > 1 else torch.zeros(shape)
    return x, m


def _ulps(v, ref):
    """|v - ref| in ulps of float32 at ref."""
    spacing = torch.nextafter(ref.float(), torch.tensor(float("inf"))).double() - ref
    return ((v.double() - ref) / spacing.abs().clamp_min(1e-300)).abs()


def run(threads, rounds, repeats, cases, ab=None, inductor=False, accuracy=False):
    torch.set_num_threads(threads)
    if ab is not None:  # the graph cache would hand both variants the first one's kernels
        os.environ["PYPTO_INDUCTOR_GRAPH_CACHE"] = "0"
    g = torch.Generator().manual_seed(0)
    out = []
    for name in cases:
        src, shape = CASES[name]
        x, m = _inputs(shape, g)
        variants = {"eager": _fn(src)}
        if inductor:
            variants["inductor"] = torch.compile(_fn(src), backend="inductor")
        if not ab:
            variants["pypto"] = torch.compile(_fn(src), backend="pypto")
        for k, flag in enumerate(ab or []):
            compiled, first = _with_order(_fn(src), bool(flag))
            with torch.no_grad():
                first(x, m)
            variants[f"pypto@{flag}" + "'" * k] = compiled
        with torch.no_grad():
            ref = variants["eager"](x, m)
            for v, f in variants.items():
                if "@0" not in v:  # the old half log_softmax is an ulp off eager's (by design)
                    torch.testing.assert_close(f(x, m), ref)
            if accuracy:
                f64 = _fn(src)(x.double(), m.double())
                row = [name]
                for v, f in variants.items():
                    u = _ulps(f(x, m), f64)
                    same = (f(x, m) == ref).double().mean().item()
                    row.append(f"{u.mean().item():.3f} / {u.max().item():.1f} / {same:.4f}")
                out.append(row)
                continue
            med = interleaved_medians(variants, lambda f: f(x, m), rounds, repeats)
        row = [name] + [f"{med[v]:.0f}" for v in variants]
        base = [v for v in variants if v.startswith("pypto")]
        row += [f"{med[base[0]] / med[v]:.3f}" for v in base[1:]]
        out.append(row)
    return out, list(variants)


def main(argv=None) -> int:
    p = timing_parser(__doc__, threads=1)
    p.add_argument("--cases", default=",".join(CASES), help="comma-separated (default: all)")
    p.add_argument("--ab", default=None,
                   help="also time reduction's softmax switches = each of these (comma-separated "
                        "0/1)")
    p.add_argument("--inductor", action="store_true")
    p.add_argument("--accuracy", action="store_true",
                   help="mean / max error in ulps against float64, share equal to eager")
    a = parse_timing(p, argv)
    ab = [int(b) for b in a.ab.split(",")] if a.ab else None
    rows, labels = run(a.threads, a.rounds, a.repeats, a.cases.split(","), ab, a.inductor,
                       a.accuracy)
    if a.accuracy:
        cols = ["case"] + [f"{v}: mean / max ulps / equal to eager" for v in labels]
    else:
        pv = [v for v in labels if v.startswith("pypto")]
        cols = ["case"] + [f"{v} us" for v in labels] + [f"{pv[0]} / {v}" for v in pv[1:]]
    print("\n".join(md_table(cols, rows)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
