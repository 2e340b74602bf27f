"""Column reductions (over dim 0, the last dim kept): sum, mean, a fused difference's sum,
var; eager, pypto (and Inductor with --inductor) interleaved in one process; medians and
ratios. ``--ab 32,16,32,16`` adds "pypto@N" variants, the same kernels built with
``emit_columns.SUM_BLOCK = N`` (the rows a fp32 partial sum takes before its double total),
for a before/after of that constant in one process; listing each value twice, in both
orders, shows how much a variant's place in the round moves it. ``--narrow-ab 1,0`` does
the same with ``emit_columns.NARROW_EAGER_ORDER`` (the narrow path's sums in eager's
partials, or in its vector loop), variants "pypto~N".

    python -m benchmarks.column_sums [--threads 1] [--cpu-time] [--rounds 7] [--ab 32,16]
        [--narrow-ab 1,0] [--cases "sum0 1048576x4,sum0 1048576x1"]
"""
from __future__ import annotations

import os

import torch

from . import interleaved_medians, md_table, parse_timing, timing_parser

# name: (source of fn(x, y), shape); each is exec'd anew per variant so every variant has
# its own code object (Dynamo caches compiled code per code object)
CASES = {
    "sum0 8192x1024": ("def fn(x, y):\n    return x.sum(0)", (8192, 1024)),
    "sum0 32x1024": ("def fn(x, y):\n    return x.sum(0)", (32, 1024)),
    "sum0 4096x64": ("def fn(x, y):\n    return x.sum(0)", (4096, 64)),
    "sum0 1048576x4": ("def fn(x, y):\n    return x.sum(0)", (1 << 20, 4)),
    "sum0 1048576x1": ("def fn(x, y):\n    return x.sum(0)", (1 << 20, 1)),
    "sum0 262144x7": ("def fn(x, y):\n    return x.sum(0)", (1 << 18, 7)),
    "(x-y).sum0 524288x3": ("def fn(x, y):\n    return (x - y).sum(0)", (1 << 19, 3)),
    "mean0 8192x1024": ("def fn(x, y):\n    return x.mean(0)", (8192, 1024)),
    "(x-y).sum0 4096x1024": ("def fn(x, y):\n    return (x - y).sum(0)", (4096, 1024)),
    "var0 4096x1024": ("def fn(x, y):\n    return x.var(0)", (4096, 1024)),
}


def _fn(src: str):
    ns: dict = {}
    exec(compile(src, "<column_sums case>", "exec"), {"torch": torch}, ns)
    return ns["fn"]


def _with_sum_block(fn, block: int, name: str = "SUM_BLOCK"):
    """fn compiled with emit_columns.<name> = block (the compile runs on the first call)."""
    from pypto_inductor.codegen.cpp import emit_columns
    compiled = torch.compile(fn, backend="pypto")

    def first(*args):
        old = getattr(emit_columns, name)
        setattr(emit_columns, name, block)
        try:
            return compiled(*args)
        finally:
            setattr(emit_columns, name, old)
    return compiled, first


def run(threads, rounds, repeats, cases, ab=None, inductor=False,
        narrow_ab=None) -> list[list[str]]:
    torch.set_num_threads(threads)
    if ab is not None or narrow_ab is not None:  # the graph cache would hand both variants
        # the first one's kernels
        os.environ["PYPTO_INDUCTOR_GRAPH_CACHE"] = "0"
    g = torch.Generator().manual_seed(0)
    out = []
    for name in cases:
        src, shape = CASES[name]
        x, y = (torch.randn(*shape, generator=g) for _ in range(2))
        variants = {"eager": _fn(src)}
        if inductor:
            variants["inductor"] = torch.compile(_fn(src), backend="inductor")
        variants["pypto"] = torch.compile(_fn(src), backend="pypto")
        for k, block in enumerate(ab or []):
            compiled, first = _with_sum_block(_fn(src), block)
            with torch.no_grad():
                first(x, y)
            variants[f"pypto@{block}" + "'" * k] = compiled
        for k, flag in enumerate(narrow_ab or []):
            compiled, first = _with_sum_block(_fn(src), bool(flag), "NARROW_EAGER_ORDER")
            with torch.no_grad():
                first(x, y)
            variants[f"pypto~{flag}" + "'" * k] = compiled
        with torch.no_grad():
            ref = variants["eager"](x, y)
            for f in variants.values():
                torch.testing.assert_close(f(x, y), ref, rtol=1e-3, atol=1e-3)
            med = interleaved_medians(variants, lambda f: f(x, y), rounds, repeats)
        row = [name] + [f"{med[v]:.0f}" for v in variants]
        row.append(f"{med['eager'] / med['pypto']:.2f}x")
        out.append(row)
    return out, list(variants)


def main(argv=None) -> int:
    p = timing_parser(__doc__, threads=1)
    p.add_argument("--cases", default=",".join(CASES))
    p.add_argument("--ab", default=None, help="also time SUM_BLOCK = each of these (comma-separated)")
    p.add_argument("--narrow-ab", default=None,
                   help="also time NARROW_EAGER_ORDER = each of these (comma-separated 0/1)")
    p.add_argument("--inductor", action="store_true")
    a = parse_timing(p, argv)
    ab = [int(b) for b in a.ab.split(",")] if a.ab else None
    nab = [int(b) for b in a.narrow_ab.split(",")] if a.narrow_ab else None
    rows, labels = run(a.threads, a.rounds, a.repeats, a.cases.split(","), ab, a.inductor, nab)
    cols = ["case"] + [f"{v} us" for v in labels] + ["eager / pypto"]
    print("\n".join(md_table(cols, rows)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
