"""A row kernel's work item (:class:`RowLoop`, a mixin of :class:`.emit_rows.RowEmitter`):
its passes over the row (a reduction's, :mod:`.row_sums`, then the per-element outputs'),
the row- and column-level values each computes, and the column loop that computes them on
the fast path (unit or zero column strides) and the generic one."""
from __future__ import annotations

import sympy
import torch

from .indexing import gather_address, iota
from .ops import (NotEmittable, conv, ctype, expression, finalize, literal, load, number,
                  store)

MAX_CACHED_COLS = 1 << 16  # longest row whose costly values a thread keeps (cache_costly_values)
# The generic (strided) path beside a fast one is a fallback, run only when a call's strides
# are not the traced ones (static layouts are guarded or fixed; k19c): its loops are plain
# scalar loops, no `omp simd` (whose vectorised gathers were a third of a LayerNorm
# kernel's g++ time). Its sums then add in column order (a different order than the
# vector lanes', as close to eager's); its other loops compute the same bits. A kernel with
# no fast path keeps its vectorised generic loops. False: vectorised fallbacks.
COMPACT_FALLBACK = True
# The fast path reads a column-broadcast input (stride 0: a LayerNorm's mean and rstd per
# row) once per column loop, before it, not in every iteration: kept in the loop, GCC's PRE
# reloads it in the latch (the stores may alias it) and the loop no longer vectorises,
# which the serial copy (emit_rows.SERIAL_COPY) hit in row kernels summing columns
# (LayerNorm backward, 512 x 64, one thread: 65 -> 15 us a call; k16x). The same value is
# read: bit-exact.
HOIST_BROADCAST_LOADS = True


class RowLoop:
    """The work item's passes, values and column loops."""

    def body(self, has_fast: bool) -> None:
        p, w = self.p, self.w
        self.cache_costly_values()
        self.stage_rows()
        self.row_nodes(0)
        for stage in range(1, self.passes + 1):
            reds = [x for x in p.nodes if x.kind == "reduce" and x.id in self.needed
                    and self.stage[x.id] == stage]
            if len(reds) == 1 and reds[0].attrs.get("lanes") and not reds[0].attrs.get("when") \
                    and not getattr(p, "cat_bounds", None):
                self.lane_sum(reds[0], has_fast)
                self.stored |= self.storing
            else:
                self.reduction_pass(reds, has_fast)
            self.row_nodes(stage)
        col_outs = [(k, x, spec) for k, (x, spec) in enumerate(p.outputs)
                    if x.level == "col" and x.kind != "colsum"]
        if self.colsums:
            self.loop(has_fast, self.output_targets(), self.column_sum_tail, outs=col_outs)
        elif col_outs:
            self.pass_open()
            self.row_part_loops(has_fast, [x for _, x, _ in col_outs], col_outs)
            self.pass_close()
        for k, (x, spec) in enumerate(p.outputs):
            if x.level == "row":
                w(f"    if (c0 == 0) out{k}[r] = {store(self.var(x), spec.dtype, x)};")

    def output_targets(self) -> list:
        """The column values the last pass computes: the per-element outputs and the
        summands of the column sums."""
        return [x for x, _ in self.p.outputs if x.level == "col" and x.kind != "colsum"] + \
            [x.args[0] for _, x, _ in self.colsums]

    # --- the work item -------------------------------------------------------------
    def var(self, x) -> str:
        return f"v{x.id}"

    def row_nodes(self, stage: int) -> None:
        for x in self.p.nodes:
            if x.level == "row" and x.id in self.needed and self.stage[x.id] == stage \
                    and x.kind != "reduce":
                self.define(x, "    ", col=False)

    def define(self, x, ind: str, col: bool, path: str = "fast") -> None:
        if col and path == "fast" and x.id in self.hoisted:  # defined before the loop
            return
        if col and path == "fast" and x.id in self.blocked:
            rhs = f"{self.blocked[x.id]}[c - cs]"
        elif x.kind == "load":
            spec = self.p.input_specs[self.p.accesses[x.attrs["access"]].input]
            k = x.attrs["access"]
            idx = f"b{k} + {self.col_offset(k, path)}" if col else f"b{k}"
            rhs = load(f"in{self.p.accesses[k].input}[{idx}]", spec.dtype)
            if col and path == "fast" and k in self.staged:
                rhs = f"{self.staged[k]}[c - cs]"
            elif col and path == "fast" and k in self.row_staged:
                rhs = f"(sr{k}[c] != 0.0f)" if spec.dtype == torch.bool else f"sr{k}[c]"
        elif x.kind == "op" and x.attrs["op"] == "cat" and self.row_part \
                and self.row_part[0] == x.id:  # the part of this row branch
            rhs = self.part(x, x.args[self.row_part[1]])
        elif x.kind == "op" and x.attrs["op"] == "cat" and "row_bounds" in x.attrs:
            rhs = self.part(x, x.args[-1])
            for s in range(len(x.args) - 2, -1, -1):
                rhs = f"(i{x.attrs['dim']} < RB{x.id}_{s} ? {self.part(x, x.args[s])} : {rhs})"
        elif x.kind == "op" and x.attrs["op"] == "cat":  # this segment's part
            rhs = self.part(x, self.segment_part(x))
        elif x.kind == "gather":  # an indexed read (indexing.py)
            k = x.attrs["access"]
            inp = self.p.accesses[k].input
            address = gather_address(x, self.var, self.col_offset(k, path) if col else None)
            rhs = load(f"in{inp}[{address}]", self.p.input_specs[inp].dtype)
        elif x.kind == "iota":  # arange: start + step * (the element's flat index)
            rhs = finalize(iota(x.attrs["start"], x.attrs["step"], x.dtype, "(r * C + c)",
                                number), x.dtype)
        elif x.id in self.stored:
            rhs = f"sc{x.id}[c]"
        else:
            rhs = expression(x, self.var, rounded=x.id not in self.store_only)
        self.w(f"{ind}const {ctype(x.dtype)} {self.var(x)} = {rhs};")
        if col and x.id in self.cached and x.id not in self.stored:
            self.w(f"{ind}sc{x.id}[c] = {self.var(x)};")
            self.storing.add(x.id)

    def segment_part(self, x):
        """The operand a column cat takes in the segment being emitted."""
        segments = x.attrs.get("segments")
        k = self.seg if segments is None else segments[self.seg]
        if k is None:
            raise NotEmittable(f"a cat ({x.origin}) read outside its enclosing part")
        return x.args[k]

    def part(self, x, a) -> str:
        """A cat part's value in the cat's dtype (a pad's fill is a literal)."""
        if hasattr(a, "id"):
            return conv(self.var(a), a.dtype, x.dtype)
        return finalize(literal(a.value, x.dtype), x.dtype)

    def col_offset(self, k: int, path: str) -> str:
        p = self.p
        c = "c" if p.accesses[k].offset is None else f"(c - co{k})"  # a cat part's column
        if path == "fast":
            kind = p.fast[k]
            if kind == "unit":
                return c
            if kind == "bcast":
                return "0"
            return f"{c} * {self.stride(k, self.n - 1)}" if p.m >= 1 else "0"
        if p.m == 1:
            return f"{c} * {self.stride(k, self.n - 1)}"
        return " + ".join(f"j{d} * {self.stride(k, d)}" for d in range(self.outer, self.n)) or "0"

    def col_deps(self, targets) -> list:
        seen: set[int] = set()
        stack = list(targets)
        while stack:
            x = stack.pop()
            if x.level == "col" and x.id not in seen:
                seen.add(x.id)
                if x.id in self.stored or x.id in self.blocked:  # read back, not recomputed
                    continue
                args = x.args
                if x.kind == "op" and x.attrs["op"] == "cat" and "row_bounds" not in x.attrs:
                    args = [self.segment_part(x)]
                elif self.row_part and self.row_part[0] == x.id:
                    args = [x.args[self.row_part[1]]]
                stack += [a for a in args if hasattr(a, "id")]
        return [x for x in self.p.nodes if x.id in seen]

    def calls_math(self, x) -> bool:
        """Whether computing x calls a prelude math function (pi_exp, ...). A cat only
        selects one of its parts (whose own costs count where they are computed)."""
        if x.kind == "op" and x.attrs["op"] == "cat":
            return False
        return x.kind in ("expr", "op") and "pi_" in expression(x, self.var)

    def cache_costly_values(self) -> None:
        """Pick the column values to keep in a per-thread row scratch: values more than one
        pass over the row needs whose computation includes a prelude math call
        (``pi_exp``, ...), nearest to their uses (a later pass reads the very value an
        earlier one reduced, so argmax's equality test still holds). Softmax's
        exp(x - max) is summed in one pass and divided in the next: stored, it is
        computed once."""
        p = self.p
        cols = sympy.Mul(*p.shape[self.outer:])
        if not p.reduction or getattr(p, "cat_bounds", None) or not self.outer \
                or (cols.is_Integer and int(cols) > MAX_CACHED_COLS):
            return
        loops = [[a for x in p.nodes if x.kind == "reduce" and x.id in self.needed
                  and self.stage[x.id] == stage for a in x.args]
                 for stage in range(1, self.passes + 1)]
        loops.append(self.output_targets())
        uses: dict[int, int] = {}
        for targets in loops:
            for x in self.col_deps(targets):
                uses[x.id] = uses.get(x.id, 0) + 1
        costly: set[int] = set()
        for x in p.nodes:  # topological order
            if x.level == "col" and x.attrs.get("op") != "cat" and (
                    self.calls_math(x) or any(getattr(a, "id", None) in costly for a in x.args)):
                costly.add(x.id)
        shared = {x.id for x in p.nodes if uses.get(x.id, 0) > 1 and x.id in costly
                  and ctype(x.dtype) == "float"}
        self.stored = shared  # as if all were stored: which of them do later passes read?
        self.cached = {x.id for targets in loops[1:] for x in self.col_deps(targets)
                       if x.id in shared}
        self.stored = set()
        for i in sorted(self.cached):  # one row per thread, kept for the thread's life
            self.w(f"    static thread_local float* pi_sc{i} = nullptr;")
            self.w(f"    static thread_local int64_t pi_cap{i} = 0;")
            self.w(f"    if (pi_cap{i} < C) {{ std::free(pi_sc{i}); "
                   f"pi_sc{i} = (float*)std::malloc(sizeof(float) * C); pi_cap{i} = C; }}")
            self.w(f"    float* __restrict__ sc{i} = pi_sc{i};")

    @staticmethod
    def fallback(path: str, has_fast: bool) -> bool:
        """Whether ``path`` is a generic path written as COMPACT_FALLBACK's scalar loops."""
        return COMPACT_FALLBACK and has_fast and path == "generic"

    def loop(self, has_fast: bool, targets, tail, bounds=("c0", "c1"), outs=(),
             only: str | None = None) -> None:
        """The column loop computing ``targets`` then running ``tail(path, lane)`` lines and
        storing the per-element outputs ``outs`` ((k, node, spec)); ``only``: that path
        alone, in a plain block (the caller branches on ``fast``)."""
        reductions = [x for x in targets if x.kind == "reduce"]
        paths = [only] if only else ["fast", "generic"] if has_fast else ["generic"]
        segs = len(getattr(self.p, "cat_bounds", None) or []) + 1
        lanes, vec, nvec = self.lane_split(reductions, segs)
        for path in paths:
            if only:
                self.w("    {")
            elif path == "fast":
                self.w("    if (fast) {")
            else:
                self.w("    else {" if has_fast else "    {")
            for s in range(segs):  # column cats: one loop per part, over its columns
                self.seg = s
                deps = self.col_deps([a for x in reductions for a in x.args] + [
                    x for x in targets if x.kind != "reduce"])
                c0, c1 = bounds
                lo = c0 if s == 0 else f"std::max<int64_t>({c0}, CB{s})"
                hi = c1 if s == segs - 1 else f"std::min<int64_t>({c1}, CB{s + 1})"
                ins, souts = self.staging(deps, outs) if path == "fast" else ([], [])
                # bf16 loops are not staged; a split of their roundings needs the blocks too
                blocks = bool(ins or souts) or (path == "fast" and bool(
                    self.rounding_points(deps, reductions, segs, torch.bfloat16)))
                if blocks:  # blocks of half_staging.STAGE columns through float buffers
                    self.open_blocks(ins, souts, lo, hi)
                    lo, hi = "cs", "ce"
                    if self.split_roundings(deps, reductions, segs, targets):
                        deps = self.col_deps([a for x in reductions for a in x.args] + [
                            x for x in targets if x.kind != "reduce"])
                staged_outs = {k for k, _, _ in souts}
                if path == "fast" and segs == 1:
                    self.hoist_broadcast_loads(deps, lo, hi)
                if path == "fast" and lanes > 1:
                    self.interleaved(reductions, deps, tail, lo, hi, lanes)
                    lo = f"{lo} + {lanes} * cq"  # the remaining columns
                if path == "fast" and vec:
                    self.vector_lanes(reductions, deps, tail, lo, hi, nvec)
                    lo = f"{lo} + {nvec} * cv"  # the remaining columns, in order
                elif not self.fallback(path, has_fast):
                    self.w(self.pragma(reductions))
                self.w(f"      for (int64_t c = {lo}; c < {hi}; ++c) {{")
                if path == "generic" and self.p.m > 1:
                    self.w("        int64_t u = c; (void)u;")
                    for d in range(self.n - 1, self.outer - 1, -1):
                        self.w(f"        const int64_t j{d} = u % D{d}; u /= D{d};")
                for x in deps:
                    self.define(x, "        ", col=True, path=path)
                for line in tail(path, ""):
                    self.w("        " + line)
                for k, x, spec in outs:
                    self.w(f"        so{k}[c - cs] = {self.var(x)};" if k in staged_outs else
                           f"        out{k}[{self.out_row()} + c] = "
                           f"{store(self.var(x), spec.dtype, x)};")
                self.w("      }")
                if path == "fast" and lanes > 1:
                    self.combine_lanes(reductions, lanes)
                if blocks:
                    self.close_blocks(staged_outs)
            self.seg = 0
            self.hoisted = set()
            self.w("    }")

    def hoist_broadcast_loads(self, deps, lo: str, hi: str) -> None:
        """Define the fast path's column-broadcast loads among ``deps`` before the column
        loop (HOIST_BROADCAST_LOADS); read only when the loop has a column to run."""
        if not HOIST_BROADCAST_LOADS:
            return
        p = self.p
        for x in deps:
            k = x.attrs.get("access") if x.kind == "load" else None
            if k is None or p.fast[k] != "bcast" or p.accesses[k].offset is not None \
                    or x.id in self.cached or x.id in self.stored or x.id in self.blocked \
                    or k in self.staged or k in self.row_staged:
                continue
            spec = p.input_specs[p.accesses[k].input]
            # the fast path's own offset: a mixed reduction's pass adds its outer index's
            rhs = load(f"in{p.accesses[k].input}[b{k} + {self.col_offset(k, 'fast')}]",
                       spec.dtype)
            t = ctype(x.dtype)
            self.w(f"      const {t} {self.var(x)} = {lo} < {hi} ? ({t})({rhs}) : ({t})0;")
            self.hoisted.add(x.id)

    def row_part_loops(self, has_fast: bool, targets, outs) -> None:
        """The per-element outputs' column loop. A row cat picks its part on the row index,
        constant along the row: one loop per part under a branch on it, each computing only
        its part (a decode step's KV cache rows are copied, k's RoPE computed on its row
        only), instead of every part at every element and a select."""
        cats = [x for x in self.col_deps(targets) if x.kind == "op"
                and x.attrs["op"] == "cat" and "row_bounds" in x.attrs]
        if len(cats) != 1 or self.p.reduction:
            # no sums: the same values in any order, over constant bounds if any
            self.loop(has_fast, targets, lambda path, lane: [], outs=outs,
                      bounds=("s0", "s1") if self.static else ("c0", "c1"))
            return
        x = cats[0]
        last = len(x.args) - 1
        for s in range(last + 1):
            cond = f"i{x.attrs['dim']} < RB{x.id}_{s}"
            self.w(f"    if ({cond}) {{" if s == 0 else
                   f"    else if ({cond}) {{" if s < last else "    else {")
            self.row_part = (x.id, s)
            try:
                self.loop(has_fast, targets, lambda path, lane: [], outs=outs)
            finally:
                self.row_part = None
            self.w("    }")

