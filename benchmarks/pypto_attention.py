"""``python -m benchmarks.pypto_attention``: the pypto flash-attention kernel vs the unfused chain.

For B=1, H=4, D=64 fp16 at several sequence lengths, causal or not: the one flash kernel
of ``codegen/pypto/attention.py`` against the three kernels of the same attention
unfused (scores, softmax, probs @ v, with the [S, S] scores in global memory), in
pypto's simulator (RunMode.SIM). Two measures: **work cycles** (each kernel's task
span in pypto's trace + an empty kernel's launch cost, :attr:`.SimResult.work_cycles`;
the unfused chain pays three launches) and pypto's "Total Cycles" (quantized: steps of
about 2881 cycles that mostly count tasks). ``--blocks TQ,TK ...`` also measures other
(query block, key block) choices; ``--online`` also measures the online softmax form
(a loop over key blocks carrying the running max, sum and accumulator) at the default
blocks; ``--verify`` value-checks
the default flash kernels in pypto's host interpreter against eager SDPA.
"""
from __future__ import annotations

import argparse

import torch

from pypto_inductor.codegen.pypto import attention as A
from pypto_inductor.codegen.pypto.sim import simulate_kernels


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq", type=int, nargs="*", default=[128, 512, 1024])
    ap.add_argument("--blocks", nargs="*", default=[], help="extra TQ,TK block choices")
    ap.add_argument("--online", action="store_true",
                    help="also the online softmax form at the default blocks")
    ap.add_argument("--causal", choices=["both", "yes", "no"], default="both")
    ap.add_argument("--verify", action="store_true")
    args = ap.parse_args(argv)
    flags = {"both": (False, True), "yes": (True,), "no": (False,)}[args.causal]
    specs = [A.AttentionSpec(1, 4, s, s, 64, 64, torch.float16, 0.125, causal=c,
                             name=f"s{s}{'_causal' if c else ''}")
             for s in args.seq for c in flags]
    variants = [("default", {})] + [("online", {"online": True})] * args.online + [
        (f"blocks {b}", {"tq": int(b.split(",")[0]), "tk": int(b.split(",")[1])})
        for b in args.blocks]
    kernels, slots = [], []
    for s in specs:
        unfused = A.emit_unfused(s)
        slots.append((s, len(kernels), [(v, len(kernels) + 3 + i)
                                        for i, (v, _) in enumerate(variants)]))
        kernels += unfused + [A.emit_flash(s, **kw) for _, kw in variants]
    res = simulate_kernels(kernels)
    verified = {}
    if args.verify:
        from pypto_inductor.codegen.pypto.verify import verify_kernels
        cases = []
        for s, _, vs in slots:
            inputs = A.random_inputs(s)
            cases.append((kernels[vs[0][1]], inputs, A.reference(s, inputs)))
        for (s, _, _), check in zip(slots, verify_kernels(cases)):
            verified[s.name] = f"{check.verified} ({check.max_abs_err:.1e})" \
                if check.max_abs_err is not None else str(check.verified)
    print("| S | causal | flash kernel | flash work | unfused work | unfused / flash (work) |"
          " flash total | unfused total | unfused / flash (total) | flash tasks | "
          "unfused tasks | verified |")
    print("|" + "---|" * 12)

    def tasks(r) -> int | None:
        return (r.stats or {}).get("total_submit_tasks") if r.ok else None
    for s, u0, vs in slots:
        parts = res[u0:u0 + 3]
        uw = sum(r.work_cycles for r in parts) if all(r.ok for r in parts) else None
        ut = sum(r.cycles for r in parts) if all(r.ok for r in parts) else None
        un_tasks = [tasks(r) for r in parts]
        un_tasks = sum(un_tasks) if None not in un_tasks else None
        for v, k in vs:
            r = res[k]
            label = f"{v}: {A.blocks(s) if v == 'default' else ''}".rstrip(": ")
            if not r.ok:
                print(f"| {s.Sq} | {s.causal} | {label} | failed: "
                      f"{(r.error or '').splitlines()[0][:80]} | | | | | | | | |")
                continue
            fw, ft = r.work_cycles, r.cycles
            print(f"| {s.Sq} | {s.causal} | {label} | {fw} | {uw} | "
                  f"{uw / fw:.2f} | {ft} | {ut} | {ut / ft:.2f} | {tasks(r)} | {un_tasks} | "
                  f"{verified.get(s.name, '-') if v == 'default' else '-'} |")


if __name__ == "__main__":
    main()
