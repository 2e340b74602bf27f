"""Column sums in a row kernel (``colsum`` nodes: a LayerNorm backward's bias and weight
gradients): runs of rows per work item, each adding its rows into fp32 partial rows,
totalled in double after the loop (:class:`ColumnSumRuns`, a mixin of
:class:`.emit_rows.RowEmitter`)."""
from __future__ import annotations

from . import column_order
from .ops import conv, store, sum_update


class ColumnSumRuns:
    """The column sums' work items, their partials and totals; the sums' order is
    column_order's, shared with the column-sum kernel (emit_columns)."""

    def column_sum_runs(self) -> None:
        """Work items for a row kernel that also sums columns over its rows: runs of
        column_order.SUM_BLOCK rows, each adding its rows into an fp32 partial per column
        (``pcs<k>``, one row of C per run), totalled in double in run order after the loop
        (column_sum_totals). Runs and totals are the column-sum kernel's (emit_columns):
        SUM_BLOCK rows from its first row, and where that kernel splits the rows between
        nt threads (CSS parts; its condition, over the same sizes), runs start at each
        part's first row and each part is totalled before the parts are added. So the sums
        are bit for bit the unfused kernel's, at any thread count."""
        w, var = self.w, self.declare_kernel_vars
        self.run = column_order.SUM_BLOCK
        per_block = column_order.ROWS_PER_BLOCK
        var("int64_t", {"CSS": f"(nt > 1 && (C + {per_block - 1}) / {per_block} < nt"
                               f" && R >= {column_order.SPLIT_MIN} * nt) ? nt : 1"})
        var("int64_t*", {"CSF": "(int64_t*)std::malloc(sizeof(int64_t) * (CSS + 1))"},
            const=False)
        w("  CSF[0] = 0;")
        w("  for (int64_t s = 0; s < CSS; ++s)")
        w(f"    CSF[s + 1] = CSF[s] + (R * (s + 1) / CSS - R * s / CSS + {self.run - 1}) / "
          f"{self.run};")
        var("int64_t", {"NCH": "1", "W": "CSF[CSS]"}, unused=("NCH",))
        for k, _, _ in self.colsums:
            var("float* __restrict__",
                {f"pcs{k}": "(float*)std::malloc(sizeof(float) * std::max<int64_t>(W * C, 1))"},
                const=False)

    def column_sum_item(self) -> None:
        """Work item wi's head: its run of rows rb..re, its partial rows zeroed, the loop over
        its rows opened (the caller closes it)."""
        w = self.w
        w("    int64_t s = 0; while (wi >= CSF[s + 1]) ++s;")
        w(f"    const int64_t rb = R * s / CSS + {self.run} * (wi - CSF[s]);")
        w(f"    const int64_t re = std::min<int64_t>(rb + {self.run}, R * (s + 1) / CSS);")
        for k, _, _ in self.colsums:
            w(f"    float* __restrict__ ps{k} = pcs{k} + wi * C;")
            w(f"    for (int64_t c = 0; c < C; ++c) ps{k}[c] = 0.0f;")
        w("    for (int64_t r = rb; r < re; ++r) {")
        # the row's bounds written as the other row kernels' (NCH = 1; constants only as
        # s0, s1 after this, see emit_rows.STATIC_BOUNDS): with `c0 = 0, c1 = C` g++ 12
        # compiled this LayerNorm backward's passes 2.3x slower (98 vs 43 us a 512 x 128 call)
        w("    const int64_t c0 = (wi % NCH) * CH, c1 = std::min(c0 + CH, C);")

    def column_sum_totals(self) -> None:
        """Each column sum's runs added in double in order, per part then the parts."""
        w, var = self.w, self.declare_kernel_vars
        var("double* __restrict__",
            {"ctot": "(double*)std::malloc(sizeof(double) * std::max<int64_t>(2 * C, 1))"},
            const=False)
        var("double* __restrict__", {"cpart": "ctot + C"}, const=False)
        for k, x, spec in self.colsums:
            w("  for (int64_t c = 0; c < C; ++c) ctot[c] = 0.0;")
            w("  for (int64_t s = 0; s < CSS; ++s) {")
            w("    for (int64_t c = 0; c < C; ++c) cpart[c] = 0.0;")
            w("    for (int64_t q = CSF[s]; q < CSF[s + 1]; ++q) {")
            w(f"      const float* __restrict__ pq = pcs{k} + q * C;")
            w("      for (int64_t c = 0; c < C; ++c) cpart[c] += pq[c];")
            w("    }")
            w("    for (int64_t c = 0; c < C; ++c) ctot[c] += cpart[c];")
            w("  }")
            w(f"  for (int64_t c = 0; c < C; ++c) out{k}[c] = {store('(float)ctot[c]', spec.dtype, x)};")
            w(f"  std::free(pcs{k});")
        w("  std::free(ctot);")
        w("  std::free(CSF);")

    def column_sum_tail(self, path, lane) -> list[str]:
        """Lines adding column c's summands into this run's partials (as emit_columns'
        sweep adds them: converted to fp32, one add)."""
        return [sum_update(x, f"ps{k}[c]", conv(self.var(x.args[0]), x.args[0].dtype, x.dtype),
                           self.var) for k, x, _ in self.colsums]

