"""``python -m benchmarks.pypto_attention``: the pypto flash-attention kernel vs the unfused chain.

For B=1, H=4, D=64 fp16 at several sequence lengths, causal or not: simulated cycles
(pypto's RunMode.SIM "Total Cycles") of the one flash kernel of
``codegen/pypto/attention.py`` against the three kernels of the same attention unfused
(scores, softmax, probs @ v, with the [S, S] scores in global memory), and the flash
kernel's value check in pypto's host interpreter against eager SDPA (``--verify``).
"""
from __future__ import annotations

import argparse

import torch

from pypto_inductor.codegen.pypto import attention as A
from pypto_inductor.codegen.pypto.sim import simulate_kernels


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq", type=int, nargs="*", default=[128, 512, 1024])
    ap.add_argument("--verify", action="store_true")
    args = ap.parse_args(argv)
    specs = [A.AttentionSpec(1, 4, s, s, 64, 64, torch.float16, 0.125, causal=c,
                             name=f"s{s}{'_causal' if c else ''}")
             for s in args.seq for c in (False, True)]
    if args.verify:
        sims = A.simulate_attention(specs)
        rows = [(s.spec, s.fused_cycles, s.unfused_cycles, s.verified) for s in sims]
    else:
        kernels = [k for s in specs for k in [A.emit_flash(s)] + A.emit_unfused(s)]
        res = simulate_kernels(kernels)
        rows = []
        for i, s in enumerate(specs):
            parts = res[4 * i + 1:4 * i + 4]
            unfused = sum(r.cycles for r in parts) if all(r.cycles for r in parts) else None
            rows.append((s, res[4 * i].cycles, unfused, None))
    print("| S | causal | blocks (tq, tk) | flash cycles | unfused cycles | unfused / flash |"
          " verified |")
    print("|---|---|---|---|---|---|---|")
    for s, f, u, v in rows:
        ratio = f"{u / f:.2f}" if f and u else "-"
        print(f"| {s.Sq} | {s.causal} | {A.blocks(s)} | {f} | {u} | {ratio} | "
              f"{'-' if v is None else v} |")


if __name__ == "__main__":
    main()
