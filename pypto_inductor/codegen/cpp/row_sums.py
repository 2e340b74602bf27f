"""How a row kernel's passes reduce over the row (:class:`RowSums`, a mixin of
:class:`.emit_rows.RowEmitter`): float sums in fp32 blocks totalled in double; the fast
path's sums in REDUCTION_LANES interleaved parts, or in lanes of VECTOR_LANES columns
whose order is written out (vector_lanes); eager's vec::reduce_all order where a softmax
needs its bits (lane_sum); ``omp simd`` reductions otherwise."""
from __future__ import annotations

import sympy
import torch

from .ops import conv, ctype, identity, sum_update

REDUCTION_LANES = 4  # independent accumulators per sum over a row (RowEmitter.interleaved)
# Rows of fewer (static) columns keep one accumulator: each lane's `omp simd` sum ends in a
# chain of scalar adds over the vector's lanes, which costs more than the split saves on a
# short row (add + LayerNorm, 512 rows of 64: 71 -> 46 us a call; of 768: 221 -> 211 us)
LANES_MIN_COLUMNS = 1024
# Float sums of cheap values add VECTOR_LANES columns at a time into as many named partial
# sums, which GCC's SLP vectoriser keeps in vector registers, then combine them as a tree of
# vector adds (RowEmitter.vector_lanes). GCC 12 ends an `omp simd reduction` with a scalar
# add per vector lane (16 dependent vaddss per accumulator, per SUM_BLOCK): on a 1024-column
# row from L1 a pass took 122 ns that way and 36 ns with 64 named lanes (docs/benchmarks.md).
# Rows of fewer than LANES_MIN_COLUMNS static columns take VECTOR_LANES lanes, longer ones
# LONG_VECTOR_LANES: 64 measured faster, but GCC 12 miscompiles 64 unrolled lanes of a
# select on a bool input (`where(mask, 0, x).sum()`: wrong sums at 1024+ columns, fuzz
# seed 50047; test_long_row_sum_of_a_select_on_a_bool_input), so long rows take 16 too.
VECTOR_LANES = 16
# ... written as an `omp simd` loop over the lanes into an array of partial sums (the
# summed value's code once, not once per lane: GPT-2's LayerNorm kernels compile in less
# time), each lane adding the same columns in the same order. False: the named lanes.
LANE_LOOP = True
LONG_VECTOR_LANES = 16
# A float sum over a row adds SUM_BLOCK columns into fp32 accumulators, then each block's sum
# into a double, a two-level cascade like eager's: the vectorised fast path's accumulators
# (REDUCTION_LANES x the vector's lanes) each take a few dozen terms, so the error stays
# near eager's (tests/test_sum_accuracy.py; 16384-column blocks were 17x farther from
# float64 than eager on a cancelling 4096-term sum). The generic (strided, index-decoding)
# loop has one scalar accumulator: SUM_BLOCK_GENERIC terms. Neither costs measurably
# (docs/benchmarks.md).
SUM_BLOCK = 256
SUM_BLOCK_GENERIC = 32
# Over constant bounds (emit_rows.STATIC_BOUNDS) the vector_lanes loop of rows up to
# UNROLL_TRIPS x its lanes columns is unrolled (the body is n copies of the summed value's
# column code: a long row's would bloat the kernel)
UNROLL_TRIPS = 8


class RowSums:
    """A pass's reductions, their accumulators and the orders they add in."""

    def reduction_pass(self, reds, has_fast: bool) -> None:
        """The pass over the row computing the reductions ``reds`` (one stage), then their
        values v<id>: float sums blocked (fp32 per SUM_BLOCK columns, double across blocks),
        the fast path in the order explicit_order writes out where it can."""
        w = self.w
        wide = [x for x in reds if x.attrs["red"] == "sum" and ctype(x.dtype) == "float"]
        for x in reds:
            if x in wide:  # blocked: fp32 per SUM_BLOCK columns, double across blocks
                w(f"    double tot{x.id} = 0.0;")
                continue
            w(f"    {ctype(x.dtype)} acc{x.id} = {identity(x)};")
            if x.attrs["red"] != "sum" and ctype(x.dtype) == "float":
                w(f"    int nan{x.id} = 0;")

        def tail(path, lane, reds=reds):
            out = []
            for x in reds:
                v = conv(self.var(x.args[0]), x.args[0].dtype, x.dtype)
                red, acc = x.attrs["red"], f"acc{x.id}{lane}"
                if red == "sum":
                    out.append(sum_update(x, acc, v, self.var))
                    continue
                cmp = ">" if red == "max" else "<"
                out.append(f"{acc} = ({v} {cmp} {acc}) ? {v} : {acc};")
                if ctype(x.dtype) == "float":
                    out.append(f"nan{x.id}{lane} |= ({v} != {v});")
            return out

        # a pass of conditional reductions only (var's double redo of an overflowed
        # row, reduction.variance) runs where its row condition holds
        when = all(x.attrs.get("when") for x in reds)
        self.pass_open()
        if when:
            w(f"    if ({' || '.join(self.var(x.args[1]) for x in reds)}) {{")
        if wide and has_fast and self.explicit_order(reds):
            # the fast path's order is written out (vector_lanes): it may run over the
            # constant bounds; the generic path's omp simd sum keeps c0, c1 either way,
            # so both settings of STATIC_BOUNDS add in the same order
            for path, block, (lo, hi) in (
                    ("fast", SUM_BLOCK, ("s0", "s1") if self.static else ("c0", "c1")),
                    ("generic", SUM_BLOCK_GENERIC, ("c0", "c1"))):
                w("    if (fast) {" if path == "fast" else "    else {")
                w(f"    for (int64_t cb0 = {lo}; cb0 < {hi}; cb0 += {block}) {{")
                w(f"    const int64_t cb1 = std::min<int64_t>(cb0 + {block}, {hi});")
                for x in wide:
                    w(f"    float acc{x.id} = 0.0f;")
                self.constant_bounds = lo == "s0"
                self.loop(has_fast, reds, tail, ("cb0", "cb1"), only=path)
                self.constant_bounds = False
                for x in wide:
                    w(f"    tot{x.id} += acc{x.id};")
                w("    }")
                w("    }")
        elif wide:
            sb = f"(fast ? {SUM_BLOCK} : {SUM_BLOCK_GENERIC})" if has_fast \
                else str(SUM_BLOCK_GENERIC)
            w(f"    for (int64_t cb0 = c0; cb0 < c1; cb0 += {sb}) {{")
            w(f"    const int64_t cb1 = std::min<int64_t>(cb0 + {sb}, c1);")
            for x in wide:
                w(f"    float acc{x.id} = 0.0f;")
            self.loop(has_fast, reds, tail, ("cb0", "cb1"))
            for x in wide:
                w(f"    tot{x.id} += acc{x.id};")
            w("    }")
        else:
            self.loop(has_fast, reds, tail)
        if when:
            w("    }")
        self.pass_close()
        self.stored |= self.storing
        for x in reds:
            val = f"(nan{x.id} ? NAN : acc{x.id})" if x.attrs["red"] != "sum" \
                and ctype(x.dtype) == "float" else f"acc{x.id}"
            val = f"(float)tot{x.id}" if x in wide else val
            w(f"    const {ctype(x.dtype)} v{x.id} = {val};")

    def lane_split(self, reductions, segs: int) -> tuple[int, bool, int]:
        """How the fast path of a column loop over ``segs`` segments accumulates
        ``reductions``: (its parts, each with its own accumulators (interleaved; 1: one
        part), whether vector_lanes adds them, vector_lanes' lane count)."""
        # a sum's one accumulator is a chain of dependent adds, the bound of a cheap pass:
        # split the fast path's row in REDUCTION_LANES parts, each with its own accumulators
        # (not around math calls: softmax's exp pass stopped vectorising)
        cols = sympy.Mul(*self.p.shape[self.outer:])
        short = cols.is_Integer and int(cols) < LANES_MIN_COLUMNS
        vec = self.explicit_order(reductions)
        nvec = VECTOR_LANES if short else LONG_VECTOR_LANES
        lanes = REDUCTION_LANES if segs == 1 and not short and not vec and any(
            x.attrs["red"] == "sum" for x in reductions) and not any(
            self.calls_math(x) for x in self.col_deps([a for x in reductions for a in x.args])
        ) and not self.streams(reductions) else 1
        return lanes, vec, nvec

    def explicit_order(self, reductions) -> bool:
        """Whether the fast path adds ``reductions`` in an order written out here
        (vector_lanes, then a plain loop over the remaining columns), not in an ``omp simd``
        reduction's, whose vector factor and epilogue GCC picks from what it knows of the
        trip count: float sums of cheap values in a row of one segment."""
        segs = len(getattr(self.p, "cat_bounds", None) or []) + 1
        cheap = not any(self.calls_math(x) for x in self.col_deps(
            [a for x in reductions for a in x.args]))
        return segs == 1 and cheap and bool(reductions) and all(
            x.attrs["red"] == "sum" and ctype(x.dtype) == "float" for x in reductions)

    def streams(self, reductions) -> bool:
        """Whether the pass computing ``reductions`` is the row's first (stage 1) and reads a
        column input from memory (not a row staged on the stack). Its sum keeps one
        accumulator: the REDUCTION_LANES parts read the row as four streams a quarter row
        apart, which the prefetcher follows badly: a 4096x1024 bf16 row sum from memory
        took 2x as long in four parts as in one (docs/benchmarks.md, half-type section).
        Later passes read the row from L1, where the parts hide the adds' latency. (Passes
        of float sums of cheap values take vector_lanes instead, one stream.)"""
        if not reductions or any(self.stage[x.id] != 1 for x in reductions):
            return False
        return any(x.kind in ("load", "gather") and x.attrs["access"] not in self.row_staged
                   for x in self.col_deps([a for x in reductions for a in x.args]))

    def pragma(self, reductions, lanes=("",)) -> str:
        clauses = []
        for x in reductions:
            op = "+" if x.attrs["red"] == "sum" else x.attrs["red"]
            clauses.append(f"reduction({op}:{','.join(f'acc{x.id}{s}' for s in lanes)})")
            if x.attrs["red"] != "sum" and ctype(x.dtype) == "float":
                clauses.append(f"reduction(|:{','.join(f'nan{x.id}{s}' for s in lanes)})")
        return "      #pragma omp simd " + " ".join(clauses)

    def interleaved(self, reductions, deps, tail, lo, hi, lanes) -> None:
        """Columns [lo, lo + lanes * cq) as ``lanes`` parts of cq columns, one loop over
        them all: lane 0 keeps acc, lane k > 0 has acc_k (an RMSNorm row's sum of squares
        runs faster: docs/benchmarks.md)."""
        suffixes = [""] + [f"_{k}" for k in range(1, lanes)]
        self.w(f"      const int64_t cq = ({hi} - {lo}) / {lanes};")
        for x in reductions:
            for sfx in suffixes[1:]:
                self.w(f"      {ctype(x.dtype)} acc{x.id}{sfx} = {identity(x)};")
                if x.attrs["red"] != "sum" and ctype(x.dtype) == "float":
                    self.w(f"      int nan{x.id}{sfx} = 0;")
        self.w(self.pragma(reductions, suffixes))
        self.w("      for (int64_t q = 0; q < cq; ++q) {")
        for k, sfx in enumerate(suffixes):
            self.w(f"       {{ const int64_t c = {lo} + q + {k} * cq;")
            for x in deps:
                self.define(x, "        ", col=True)
            for line in tail("fast", sfx):
                self.w("        " + line)
            self.w("       }")
        self.w("      }")

    def vector_lanes(self, reductions, deps, tail, lo, hi, n) -> None:
        """Columns [lo, lo + n * cv) of a row's float sums: partial sum acc<id>_s<l> adds
        the columns l mod n (one named variable per lane, each block of n columns written
        out, so GCC's SLP vectoriser holds them in n / 16 vector registers without
        reassociating any of them; with LANE_LOOP an ``omp simd`` loop over the lanes into
        the array acc<id>_v, which GCC also keeps in vector registers), then the lanes add
        as a tree of vector adds into acc<id>."""
        self.w(f"      const int64_t cv = ({hi} - {lo}) / {n};")
        for x in reductions:
            self.w(f"      alignas(64) float acc{x.id}_v[{n}] = {{}};" if LANE_LOOP else
                   f"      float {', '.join(f'acc{x.id}_s{l} = 0.0f' for l in range(n))};")
        cols = self.static_cols()
        if self.constant_bounds and cols <= UNROLL_TRIPS * n:  # a short row
            self.w(f"      #pragma GCC unroll {UNROLL_TRIPS}")
        self.w("      for (int64_t q = 0; q < cv; ++q) {")
        if LANE_LOOP:  # lane l adds the same columns in the same order
            self.w("      #pragma omp simd")
            self.w(f"      for (int64_t l = 0; l < {n}; ++l) {{")
            self.w(f"        const int64_t c = {lo} + q * {n} + l;")
            for x in deps:
                self.define(x, "        ", col=True)
            for line in tail("fast", "_v[l]"):
                self.w("        " + line)
            self.w("      }")
        for l in range(0 if LANE_LOOP else n):
            self.w(f"       {{ const int64_t c = {lo} + q * {n} + {l};")
            for x in deps:
                self.define(x, "        ", col=True)
            for line in tail("fast", f"_s{l}"):
                self.w("        " + line)
            self.w("       }")
        self.w("      }")
        for x in reductions if not LANE_LOOP else ():
            self.w(f"      alignas(64) float acc{x.id}_v[{n}] = "
                   f"{{{', '.join(f'acc{x.id}_s{l}' for l in range(n))}}};")
        width = n // 2
        while width:
            for x in reductions:
                self.w("      #pragma omp simd")
                self.w(f"      for (int64_t l = 0; l < {width}; ++l) "
                       f"acc{x.id}_v[l] += acc{x.id}_v[l + {width}];")
            width //= 2
        for x in reductions:
            self.w(f"      acc{x.id} += acc{x.id}_v[0];")

    def lane_sum(self, x, has_fast: bool) -> None:
        """Float sum x in eager's vec::reduce_all order (``x.attrs["lanes"]`` = V floats a
        vector; reduction.SOFTMAX_EAGER_ORDER): lane l adds the columns l mod V in order
        (groups of V columns, an inner ``omp simd`` loop over the lanes that GCC vectorises
        math calls and all), the row's last C mod V columns go into lanes 0.., then the
        lanes add as a halving tree (V/2 apart, then V/4, ...: eager's shuffles); a row of
        fewer than V columns adds in column order. Lanes start at -0.0, the exact identity
        (0 + -0 is +0). With ``x.attrs["tail_after"]`` (eager's float16/bfloat16 softmax) the
        last C mod V columns are added in order after the tree instead."""
        n, i = x.attrs["lanes"], x.id
        after = bool(x.attrs.get("tail_after"))
        v = conv(self.var(x.args[0]), x.args[0].dtype, torch.float32)
        w = self.w
        w(f"    alignas(64) float ln{i}[{n}];")
        w(f"    for (int l = 0; l < {n}; ++l) ln{i}[l] = -0.0f;")
        if after:
            w(f"    alignas(64) float tt{i}[{n}];")
        w(f"    const int64_t cg{i} = c0 + (c1 - c0) / {n} * {n};")
        deps = self.col_deps([x.args[0]])
        for path in (["fast", "generic"] if has_fast else ["generic"]):
            w("    if (fast) {" if path == "fast" else "    else {" if has_fast else "    {")
            if path == "fast":  # a select reading a broadcast load: a branch unless hoisted
                self.hoist_broadcast_loads(deps, "c0", "c1")
            simd = "" if self.fallback(path, has_fast) else "      #pragma omp simd\n"
            for head, col, lane in (
                    (f"      for (int64_t cb = c0; cb < cg{i}; cb += {n}) {{\n{simd}"
                     f"      for (int64_t l = 0; l < {n}; ++l) {{\n"
                     "        const int64_t c = cb + l;", "      }", "l"),
                    (f"      for (int64_t c = cg{i}; c < c1; ++c) {{", "", f"c - cg{i}")):
                w(head)
                if path == "generic" and self.p.m > 1:
                    w("        int64_t u = c; (void)u;")
                    for d in range(self.n - 1, self.outer - 1, -1):
                        w(f"        const int64_t j{d} = u % D{d}; u /= D{d};")
                for y in deps:
                    self.define(y, "        ", col=True, path=path)
                w(f"        tt{i}[c - cg{i}] = {v};" if after and lane != "l" else
                  f"        ln{i}[{lane}] += {v};")
                w("      }")
                if col:
                    w(col)
            w("    }")
            self.hoisted = set()
        w(f"    float acc{i} = ln{i}[0];")
        w(f"    if ({'true' if after else f'c1 - c0 >= {n}'}) {{")
        width = n // 2
        while width:
            w(f"      for (int l = 0; l < {width}; ++l) ln{i}[l] += ln{i}[l + {width}];")
            width //= 2
        w(f"      acc{i} = ln{i}[0];")
        w("    } else {")
        w(f"      for (int64_t l = 1; l < c1 - c0; ++l) acc{i} += ln{i}[l];")
        w("    }")
        if after:
            w(f"    for (int64_t l = 0; l < c1 - cg{i}; ++l) acc{i} += tt{i}[l];")
        w(f"    const float v{i} = acc{i};")

    def combine_lanes(self, reductions, lanes) -> None:
        for x in reductions:
            a = f"acc{x.id}"
            for k in range(1, lanes):
                b = f"{a}_{k}"
                if x.attrs["red"] == "sum":
                    self.w(f"      {a} += {b};")
                else:
                    cmp = ">" if x.attrs["red"] == "max" else "<"
                    self.w(f"      {a} = ({b} {cmp} {a}) ? {b} : {a};")
                    if ctype(x.dtype) == "float":
                        self.w(f"      nan{x.id} |= nan{x.id}_{k};")

