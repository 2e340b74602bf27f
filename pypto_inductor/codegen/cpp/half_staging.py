"""fp16 through float blocks (:class:`HalfStaging`, a mixin of
:class:`.emit_rows.RowEmitter`): GCC does not vectorise fp16 conversions, so the fast path
converts contiguous fp16 inputs and outputs a block at a time with the prelude's vector
conversions, and rounds fp16 intermediates of loops calling a math function in loops of
their own. Bool rows of a multi-pass row kernel go through float rows too (BOOL_ROWS)."""
from __future__ import annotations

import sympy
import torch

from .ops import expression
from .program import dim_mult
from .work_items import KernelVar

# Contiguous fp16 columns of the fast path are converted STAGE columns at a time into
# float blocks before the loop over them and fp16 outputs from one after it, with the
# prelude's vector conversions (pi_ld_f16_n / pi_st_f16_n): GCC does not vectorise fp16
# conversions, and the integer ones cost ~3x bf16's (docs/benchmarks.md). 1024 floats
# (4 KiB) a block keeps a few blocks in L1.
STAGE = 1024
STAGE_HALF = True  # switch (the benchmark's "before")
# A row kernel with passes over rows of at most ROW_STAGE columns (a constant) converts each
# fp16 row input once per row into a float row on the stack that every pass reads
# (LayerNorm: once, not three times).
ROW_STAGE = 8192
# In a staged fp16 loop that calls a prelude math function (silu's exp), each rounded fp16
# intermediate is computed in a loop of its own into a float block and rounded there by
# pi_rnd_f16_n (vcvtps2ph + vcvtph2ps); the last loop reads the blocks. Inline, rnd_f16's
# 9-op chain made the x * w + b -> silu fp16 kernel twice as slow as without the roundings
# (4439 vs 2324 us); split, 3122 us. Loops without a math call keep rnd_f16 inline (an
# RMSNorm output loop was slower split: docs/benchmarks.md).
SPLIT_ROUNDINGS = True
# A multi-pass row kernel's contiguous bool inputs (a mask: where(mask, bias, min) + x ->
# softmax) are converted once per row into float rows of 0 and 1 that the passes compare
# with 0. A byte's compare selecting floats in a 16-lane loop (eager's softmax sum order,
# row_sums.lane_sum) is what GCC 12 cannot vectorise with 16 lanes ("conversion not
# supported" for the 16-lane byte mask: it fell back to 2 lanes): T5's masked softmax kernel
# ran 800 us at 262k elements. Switch: the benchmark's "before".
BOOL_ROWS = True


class HalfStaging:
    """Which fp16 accesses, outputs and intermediates go through float blocks, and the
    blocks' code."""

    def staging(self, deps, outs) -> tuple[list, list]:
        """The fast path's fp16 loads (accesses) and outputs staged in float blocks: those
        read or written contiguously along the columns, unless an output aliases an input."""
        p = self.p
        if not STAGE_HALF or any(wr.direct for wr in getattr(p, "writes", {}).values()):
            return [], []
        ins = sorted(self.unit_accesses(deps) - self.row_staged)
        return ins, [o for o in outs if o[2].dtype == torch.float16]

    def unit_accesses(self, nodes, dtype=torch.float16) -> set[int]:
        """The accesses of the ``dtype`` column loads among ``nodes`` read with unit
        stride."""
        p = self.p
        return {x.attrs["access"] for x in nodes if x.kind == "load" and x.level == "col"
                and x.id not in self.stored and p.fast[x.attrs["access"]] == "unit"
                and p.input_specs[p.accesses[x.attrs["access"]].input].dtype == dtype}

    def row_stageable(self) -> int:
        """The row length when whole fp16 rows may be staged (a constant up to ROW_STAGE
        columns, no column cat, no output aliasing an input), else 0."""
        p = self.p
        cols = sympy.Mul(*p.shape[self.outer:])
        if not STAGE_HALF or getattr(p, "cat_bounds", None) or not cols.is_Integer \
                or int(cols) > ROW_STAGE \
                or any(wr.direct for wr in getattr(p, "writes", {}).values()):
            return 0
        return int(cols)

    def stage_call(self) -> None:
        """fp16 inputs read the same for every row (a LayerNorm weight, a bias) convert once
        per call, before the parallel loop, into a float row all threads read."""
        cols = self.row_stageable()
        if not cols:
            return
        p = self.p
        shared = {k for k in self.unit_accesses([x for x in p.nodes if x.id in self.needed])
                  if all(dim_mult(e)[0] is None
                         for e in p.accesses[k].dims[:len(self.frame_rows(k))])}
        for k in sorted(shared):
            self.w(f"  alignas(64) float sr{k}[{cols}];")
            self.kernel_var(KernelVar(f"sr{k}", "float", array=True))
            self.w(f"  if (fast) pi_ld_f16_n(in{p.accesses[k].input}, sr{k}, C);")
        self.row_staged |= shared

    def stage_rows(self) -> None:
        """Convert the fp16 row inputs of a multi-pass row kernel once per row (ROW_STAGE),
        and its bool ones (BOOL_ROWS) into float rows of 0 and 1."""
        p = self.p
        cols = self.row_stageable()
        if not cols or not p.reduction or self.passes < 1 or not self.outer:
            return
        nodes = [x for x in p.nodes if x.id in self.needed and x.id not in self.stored]
        rows = self.unit_accesses(nodes) - self.row_staged
        bools = self.unit_accesses(nodes, torch.bool) - self.row_staged if BOOL_ROWS else set()
        self.row_staged |= rows | bools
        for k in sorted(rows | bools):
            src = f"in{p.accesses[k].input} + b{k}"
            self.w(f"    alignas(64) float sr{k}[{int(cols)}];")
            self.w(f"    if (fast) pi_ld_f16_n({src}, sr{k}, C);" if k in rows else
                   f"    if (fast) for (int64_t c = 0; c < C; ++c) sr{k}[c] = ({src})[c];")

    def split_roundings(self, deps, reductions, segs, targets) -> bool:
        """In a staged block [cs, ce) of a loop without reductions that calls a math
        function, compute each rounded fp16 intermediate among ``deps`` in a loop of its own
        into a float block, rounded by pi_rnd_f16_n (SPLIT_ROUNDINGS); later loops read it.
        A block (a staged input's or an earlier intermediate's) the loop being written
        reads for the last time takes that loop's result in place: fewer blocks stay in L1
        (the silu kernel with a second block 4027 us, in place 3103 us; gelu(x + y) with a
        block of its own 3209 us, in x's 2587 us, rnd_f16 inline 2773 us)."""
        points = self.rounding_points(deps, reductions, segs, torch.float16) + \
            self.rounding_points(deps, reductions, segs, torch.bfloat16)
        points = [x for x in deps if x in points]  # in order
        if not points:
            return False

        def reads(nodes, before) -> set:  # the blocks a loop computing `nodes` reads
            self.blocked = {y.id: "" for y in before}
            deps = self.col_deps(nodes)
            got = {("sh", y.id) for y in deps if y.id in self.blocked}
            got |= {("sa", y.attrs["access"]) for y in deps if y.kind == "load"
                    and y.attrs["access"] in self.staged and y.id not in self.blocked}
            self.blocked = {}
            return got
        loops = [reads([a for a in x.args if hasattr(a, "id")], points[:k])
                 for k, x in enumerate(points)]
        loops.append(reads(targets, points))
        last = {key: k for k, r in enumerate(loops) for key in r}  # the last loop reading it
        names = {("sa", a): name for a, name in self.staged.items()}
        free: list[str] = []
        for k, x in enumerate(points):
            # a block (a staged input's or an earlier point's) this loop reads last
            dying = [names[key] for key in sorted(loops[k], key=str) if last[key] == k]
            if dying:  # in place: each column reads its value before writing the new one
                name = dying[0]
                free += dying[1:]
            elif free:
                name = free.pop()
            else:
                name = f"sh{k}"
                self.w(f"      alignas(64) float {name}[{STAGE}];")
            self.w("      #pragma omp simd")
            self.w("      for (int64_t c = cs; c < ce; ++c) {")
            for y in self.col_deps([a for a in x.args if hasattr(a, "id")]):
                self.define(y, "        ", col=True)
            if x.dtype == torch.float16:  # rounded by the block conversion after the loop
                self.w(f"        {name}[c - cs] = {expression(x, self.var, rounded=False)};")
                self.w("      }")
                self.w(f"      pi_rnd_f16_n({name}, ce - cs);")
            else:  # bf16: rnd_bf16 in the loop, which GCC vectorises as integer ops
                self.w(f"        {name}[c - cs] = {expression(x, self.var)};")
                self.w("      }")
            names[("sh", x.id)] = name
            self.blocked[x.id] = name
        return True

    def rounding_points(self, deps, reductions, segs, dtype) -> list:
        """The rounded ``dtype`` intermediates among ``deps`` split_roundings computes in
        loops of their own (none unless the loop has no reductions and calls a math
        function)."""
        if not SPLIT_ROUNDINGS or reductions or segs != 1 or (self.cached - self.stored) \
                or not any(self.calls_math(x) for x in deps):
            return []
        fn = "rnd_f16(" if dtype == torch.float16 else "rnd_bf16("
        return [x for x in deps if x.level == "col" and x.kind in ("op", "expr")
                and x.dtype == dtype and x.attrs.get("op") != "cat"
                and x.id not in self.store_only and x.id not in self.stored
                and expression(x, self.var).startswith(fn)]

    def open_blocks(self, ins, souts, lo: str, hi: str) -> None:
        """Open the loop over blocks [cs, ce) of STAGE columns of [lo, hi): the staged
        accesses ``ins`` converted into float blocks sa<k>, a float block so<k> for each
        staged output of ``souts`` ((k, node, spec))."""
        self.w(f"      for (int64_t cs = {lo}; cs < {hi}; cs += {STAGE}) {{")
        self.w(f"      const int64_t ce = std::min<int64_t>(cs + {STAGE}, {hi});")
        for k in ins:
            a = self.p.accesses[k]
            off = "cs" if a.offset is None else f"(cs - co{k})"
            self.w(f"      alignas(64) float sa{k}[{STAGE}];")
            self.w(f"      pi_ld_f16_n(in{a.input} + b{k} + {off}, sa{k}, ce - cs);")
            self.staged[k] = f"sa{k}"
        for k, _, _ in souts:
            self.w(f"      alignas(64) float so{k}[{STAGE}];")

    def close_blocks(self, staged_outs) -> None:
        """Store the blocks of the staged outputs ``staged_outs`` and close the loop over
        blocks."""
        for k in sorted(staged_outs):
            self.w(f"      pi_st_f16_n(so{k}, out{k} + {self.out_row()} + cs, ce - cs);")
        self.w("      }")
        self.staged = {}
        self.blocked = {}
