"""Pointwise row kernels of a few constant columns: blocks of rows per work item
(:class:`NarrowRows`, a mixin of :class:`.emit_rows.RowEmitter`)."""
from __future__ import annotations

import torch

# A pointwise tile whose rows are a few columns (a constant up to NARROW_MAX_COLS: T5's
# masked position bias, [B, S, S, H] with H = 4 last) runs blocks of up to NARROW_BLOCK rows
# along the innermost row dim per work item, each row's offsets stepped from the block's:
# one row per work item decomposed its index and recomputed every offset per row, which
# cost more than its 4 elements (65536 rows: 206 -> 77 us a call, one thread; Inductor 62;
# docs/benchmarks.md, k18a). The same code per row runs: the same values.
NARROW_ROWS = True
NARROW_MAX_COLS = 8
NARROW_BLOCK = 1024
# ... and rows of up to NARROW_WIDE_MAX_COLS columns: a channels-last BatchNorm apply
# (+ ReLU) or its input gradient over 16 or 32 channels paid the same per-row index
# decomposition and offsets on every 16-32 elements ([4, 16, 64, 64], one thread: 96 -> 56
# us a call, its input gradient 114 -> 63; Inductor 44, 53; docs/benchmarks.md, k19a).
# Switch: the benchmark's "before".
NARROW_WIDE_ROWS = True
NARROW_WIDE_MAX_COLS = 32


class NarrowRows:
    """Work items of blocks of rows along the innermost row dim, each row's offsets
    stepped from the block's."""

    def narrow_rows(self, has_fast: bool) -> bool:
        """Whether this kernel runs blocks of rows per work item (NARROW_ROWS): a pointwise
        tile of one column dim with at most NARROW_MAX_COLS (NARROW_WIDE_MAX_COLS with
        NARROW_WIDE_ROWS) constant columns, at least one
        row dim, each access read in the domain's frame (no reshaped read, cat, row cat or
        gather) and no fp16/bf16 staging."""
        p = self.p
        cols = self.static_cols()
        most = NARROW_WIDE_MAX_COLS if NARROW_WIDE_ROWS else NARROW_MAX_COLS
        if not NARROW_ROWS or p.reduction or self.colsums or p.m != 1 or not self.outer \
                or cols is None or cols > most or not has_fast \
                or getattr(p, "cat_bounds", None) or getattr(p, "writes", None):
            return False
        halves = (torch.float16, torch.bfloat16)
        if any(s.dtype in halves for s in p.input_specs) \
                or any(s.dtype in halves for _, s in p.outputs):
            return False
        if any(self.frame_of[k] is not None or a.row_shift or a.offset is not None
               for k, a in enumerate(p.accesses)):
            return False
        return not any(x.kind in ("gather", "iota") or (x.kind == "op" and x.attrs.get("op")
                       == "cat") for x in p.nodes)

    def narrow_items(self) -> None:
        """The kernel-scope count of work items: NJB blocks per index of the outer row
        dims."""
        last = self.outer - 1
        self.declare_kernel_vars(
            "int64_t", {"NCH": "1", "NJB": f"(D{last} + {NARROW_BLOCK - 1}) / {NARROW_BLOCK}",
                        "W": f"(D{last} > 0 ? R / D{last} : 0) * NJB"}, unused=("NCH",))

    def narrow_block(self) -> None:
        """Work item wi of a narrow-row kernel: rows j0..j1 of the innermost row dim under
        one index of the outer row dims; each row's offsets b<k> step from the block's."""
        w, last = self.w, self.outer - 1
        w(f"    const int64_t q = wi / NJB, j0 = (wi % NJB) * {NARROW_BLOCK}, "
          f"j1 = std::min<int64_t>(j0 + {NARROW_BLOCK}, D{last});")
        w("    int64_t t = q; (void)t;")
        for d in range(last - 1, -1, -1):
            w(f"    const int64_t i{d} = t % D{d}; t /= D{d};")
        for k in range(len(self.p.accesses)):
            base = " + ".join(f"i{d} * a{k}_{d}" for d in range(last)) or "0"
            w(f"    const int64_t e{k} = {base};")
        w(f"   for (int64_t i{last} = j0; i{last} < j1; ++i{last}) {{")
        w(f"    const int64_t r = q * D{last} + i{last}, c0 = 0, c1 = C; (void)c0; (void)c1;")
        for k in range(len(self.p.accesses)):
            w(f"    const int64_t b{k} = e{k} + i{last} * a{k}_{last};")

