"""C++ source for a mixed reduction (a :class:`.program.Program` with ``mixed``).

A reduction over dims both before and after its kept dims, the kept dims one
contiguous block (BatchNorm's training statistics: NCHW over [0, 2, 3], C kept),
is analysed as a column reduction (domain: kept dims, then the reduced ones in
order), but neither the row nor the column kernel suits it: the reduced
elements of a kept element are ``NO`` runs (the outer reduced index) of ``CI``
contiguous elements (the inner reduced dims). So this kernel is a row kernel
whose rows are the kept elements (one work item each, under ``omp parallel
for``) and whose every pass over the row is a loop over the outer index around
the row kernel's column loop over the inner run: the same vectorised fast path
(unit/zero strides along the inner dims, checked once per call), the same
blocked float sums (fp32 per block of the run, double across), the pointwise
producers computed in the loop and the per-element outputs written in the
tile's own order (outer index, kept element, inner run).
"""
from __future__ import annotations

import dataclasses

from .emit_rows import RowEmitter
from .ops import NotEmittable


class MixedEmitter(RowEmitter):
    def __init__(self, p):
        # the row kernel's columns are the inner reduced dims; the outer ones are looped
        # over by each pass (pass_open)
        super().__init__(dataclasses.replace(p, m=p.m - p.mixed))
        self.kept = len(p.shape) - p.m

    def source(self) -> str:
        p, w, n, nk = self.p, self.w, self.n, self.kept
        if any(tuple(a.frame) not in ((), tuple(p.shape)) or a.offset is not None
               or a.row_shift for a in p.accesses) \
                or p.cat_bounds or p.checks or self.colsums \
                or any(x.kind in ("gather", "iota") for x in p.nodes):
            raise NotEmittable("a mixed reduction with frames, cats, gathers or aranges "
                               "is not native yet")
        self.outer = nk
        self.head()  # R: the kept elements; C: all reduced ones (var's and mean's count)
        self.outer = nk + p.mixed
        outer = " * ".join(f"D{d}" for d in range(nk, self.outer)) or "1"
        inner = " * ".join(f"D{d}" for d in range(self.outer, n)) or "1"
        self.declare_kernel_vars("int64_t", {"NO": outer, "CI": inner})
        fast_checks = self.fast_checks()
        has_fast = p.m <= 1 or all(f != "strided" for a, f in zip(p.accesses, p.fast) if a.col)
        self.declare_kernel_vars("bool", {"fast": " && ".join(fast_checks) or "true"},
                                 unused=("fast",))
        loop_start = len(self.lines)
        w("  for (int64_t r = 0; r < R; ++r) {")
        w("    const int64_t c0 = 0, c1 = CI; (void)c0; (void)c1;")
        if self.static:
            w(f"    constexpr int64_t s0 = 0, s1 = {self.static_cols()}; (void)s0; (void)s1;")
        w("    int64_t t = r; (void)t;")
        for d in range(nk - 1, -1, -1):
            w(f"    const int64_t i{d} = t % D{d}; t /= D{d};")
        for k in range(len(p.accesses)):
            base = " + ".join(f"i{d} * a{k}_{d}" for d in range(nk)) or "0"
            w(f"    const int64_t b{k} = {base};")
        self.body(has_fast)
        w("  }")
        self.parallel_loop(loop_start, "R")
        w("}")
        return "\n".join(self.lines) + "\n"

    # --- the loop over the outer reduced index around each pass --------------------------
    def pass_open(self) -> None:
        w, nk = self.w, self.kept
        w("    for (int64_t o = 0; o < NO; ++o) {")
        w("    int64_t to = o; (void)to;")
        for d in range(self.outer - 1, nk - 1, -1):
            w(f"    const int64_t i{d} = to % D{d}; to /= D{d};")
        for k in range(len(self.p.accesses)):
            off = " + ".join(f"i{d} * a{k}_{d}" for d in range(nk, self.outer)) or "0"
            w(f"    const int64_t oo{k} = {off}; (void)oo{k};")
        w("    const int64_t ro = o * R + r; (void)ro;")  # the row of the tile's own order

    def pass_close(self) -> None:
        self.w("    }")

    def out_row(self) -> str:
        return "ro * CI"

    def col_offset(self, k: int, path: str) -> str:
        return f"oo{k} + {super().col_offset(k, path)}"

    # --- row-kernel features that assume one contiguous run per row: off ----------------
    def row_stageable(self) -> int:
        return 0

    def staging(self, deps, outs) -> tuple[list, list]:
        return [], []

    def cache_costly_values(self) -> None:
        return
