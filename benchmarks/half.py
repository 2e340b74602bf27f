"""Half-type tiles (bf16, fp16): pointwise chains and row reductions (LayerNorm with weight,
RMSNorm, softmax) at 4096x1024, eager, Inductor and pypto interleaved in one process;
medians and ratios.

    python -m benchmarks.half [--threads 1] [--cpu-time] [--rounds 5] [--repeats 20] [--cases ln,softmax]
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from . import interleaved_medians, md_table, parse_timing, timing_parser


def _rms(x, w):
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype) * w


CASES = {
    "add_gelu": lambda x, y, w, b: F.gelu(x + y),
    "mul_add_silu": lambda x, y, w, b: F.silu(x * w + b),
    "layernorm": lambda x, y, w, b: F.layer_norm(x, (x.shape[-1],), w, b),
    "rmsnorm": lambda x, y, w, b: _rms(x, w),
    "softmax": lambda x, y, w, b: torch.softmax(x, -1),
}


def run(threads, rounds, repeats, dtypes, cases, rows=4096, cols=1024) -> list[list[str]]:
    torch.set_num_threads(threads)
    g = torch.Generator().manual_seed(0)
    out = []
    for dtype in dtypes:
        x, y = (torch.randn(rows, cols, generator=g).to(dtype) for _ in range(2))
        w, b = (torch.randn(cols, generator=g).to(dtype) for _ in range(2))
        for name in cases:
            fn = CASES[name]
            variants = {"eager": fn, "inductor": torch.compile(fn, backend="inductor"),
                        "pypto": torch.compile(fn, backend="pypto")}
            with torch.no_grad():
                ref = fn(x, y, w, b)
                for f in variants.values():
                    torch.testing.assert_close(f(x, y, w, b), ref, rtol=5e-2, atol=5e-2)
                med = interleaved_medians(variants, lambda f: f(x, y, w, b), rounds, repeats)
            tag = str(dtype).split(".")[-1]
            out.append([f"{name} {rows}x{cols} {tag}"] + [f"{med[v]:.0f}" for v in variants]
                       + [f"{med['eager'] / med['pypto']:.2f}x",
                          f"{med['inductor'] / med['pypto']:.2f}x"])
    return out


def main(argv=None) -> int:
    p = timing_parser(__doc__, threads=1)
    p.add_argument("--dtypes", default="bfloat16,float16")
    p.add_argument("--cases", default=",".join(CASES))
    a = parse_timing(p, argv)
    rows = run(a.threads, a.rounds, a.repeats, [getattr(torch, d) for d in a.dtypes.split(",")],
               a.cases.split(","))
    print("\n".join(md_table(["case", "eager us", "inductor us", "pypto us", "pypto vs eager",
                              "pypto vs inductor"], rows)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
