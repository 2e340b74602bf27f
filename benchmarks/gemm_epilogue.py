"""GEMM epilogues at BERT-like shapes: Linear(+bias)(+GELU / SiLU / residual add), eager,
Inductor and pypto interleaved in one process; medians and ratios.

    python -m benchmarks.gemm_epilogue [--threads 2] [--rounds 5] [--repeats 20]
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from pypto_inductor.codegen.cpp import matmul

from . import interleaved_medians, md_table, parse_timing, timing_parser


def _cases(tokens=512, hidden=256, ffn=1024, dtype=torch.float32):
    g = torch.Generator().manual_seed(0)

    def r(*shape):
        return torch.randn(*shape, generator=g).to(dtype)

    x, w1, b1 = r(tokens, hidden), r(ffn, hidden) * hidden ** -0.5, r(ffn)
    h, w2, b2, res = r(tokens, ffn), r(hidden, ffn) * ffn ** -0.5, r(hidden), r(tokens, hidden)
    tag = "" if dtype == torch.float32 else f" {str(dtype).split('.')[-1]}"
    return [
        (f"linear+bias {tokens}x{hidden}@{hidden}x{ffn}{tag}", lambda x, w, b: F.linear(x, w, b),
         (x, w1, b1)),
        (f"linear+bias+gelu {tokens}x{hidden}@{hidden}x{ffn}{tag}",
         lambda x, w, b: F.gelu(F.linear(x, w, b)), (x, w1, b1)),
        (f"linear+bias+silu {tokens}x{hidden}@{hidden}x{ffn}{tag}",
         lambda x, w, b: F.silu(F.linear(x, w, b)), (x, w1, b1)),
        (f"linear+bias+residual {tokens}x{ffn}@{ffn}x{hidden}{tag}",
         lambda h, w, b, res: F.linear(h, w, b) + res, (h, w2, b2, res)),
        # a short reduction (K=64): the epilogue's pass is a larger share of the time
        (f"linear+bias+gelu {tokens * 4}x64@64x{ffn}{tag}",
         lambda x, w, b: F.gelu(F.linear(x, w, b)),
         (r(tokens * 4, 64), r(ffn, 64) * 0.125, b1)),
    ]


def run(threads: int, rounds: int, repeats: int, dtype) -> list[list[str]]:
    torch.set_num_threads(threads)
    rows = []
    for name, fn, args in _cases(dtype=dtype):
        variants = {"eager": fn, "inductor": torch.compile(fn, backend="inductor"),
                    "pypto native epilogue": torch.compile(fn, backend="pypto"),
                    "pypto": torch.compile(fn, backend="pypto", options={"buffering": 2})}
        with torch.no_grad():
            ref = fn(*args)
            tol = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else {}
            for label, f in variants.items():
                # the state before oneDNN post-ops: every epilogue a native pass (decided
                # when the graph compiles, i.e. at this first call)
                matmul.ONEDNN_POST_OPS = label != "pypto native epilogue"
                torch.testing.assert_close(f(*args), ref, **tol)
            matmul.ONEDNN_POST_OPS = True
            med = interleaved_medians(variants, lambda f: f(*args), rounds, repeats)
        rows.append([name] + [f"{med[v]:.0f}" for v in variants]
                    + [f"{med['pypto native epilogue'] / med['pypto']:.2f}x",
                       f"{med['eager'] / med['pypto']:.2f}x",
                       f"{med['inductor'] / med['pypto']:.2f}x"])
    return rows


def main(argv=None) -> int:
    p = timing_parser(__doc__, threads=2, cpu_time=False)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    a = parse_timing(p, argv)
    header = ["case", "eager us", "inductor us", "pypto native epilogue us", "pypto us",
              "pypto vs native epilogue", "pypto vs eager",
              "pypto vs inductor"]
    rows = run(a.threads, a.rounds, a.repeats, getattr(torch, a.dtype))
    print("\n".join(md_table(header, rows)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
