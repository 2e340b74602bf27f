"""C++ source for a column reduction (a :class:`.program.Program` with ``transposed``).

A reduction over dims other than the innermost, the last dim kept (a bias
gradient: ``grad.sum([0, 1])``; pooling: ``x.mean(1)``), is analysed as a row
reduction over the domain with those dims moved last, so its rows are the kept
elements; but in memory the last kept dim is the innermost.
Walking each row would read one element per cache line. So the kernel takes
blocks of ``ROWS_PER_BLOCK`` consecutive rows along the last kept dim, runs the
reduced elements in its outer loop, and in the inner loop updates one
accumulator per row of the block from consecutive addresses (vectorised). Row
values (per kept element) are arrays over the block. Work items are blocks,
under ``omp parallel for``; when there are fewer blocks than threads, a
one-pass tile splits the reduced elements into parts instead, each item
writing partial accumulators that a second loop combines. A fast path with
unit/zero strides along the block (checked once per call) sits beside a
generic strided one.
"""
from __future__ import annotations

# the column sums' order, shared with row kernels that also sum columns (emit_rows)
from .column_order import ROWS_PER_BLOCK, SPLIT_MIN, SUM_BLOCK
from .emit_rows import RowEmitter
from .ops import conv, ctype, expression, identity, load, store, sum_update

# The narrow path (few kept elements) vectorises over the reduced elements, its lanes already
# interleave the terms: SUM_BLOCK_NARROW keeps its vector loop long.
SUM_BLOCK_NARROW = 32
# A pass of float sums only over fewer than NARROW_ROWS kept elements takes eager's partials
# there too (ColumnEmitter.narrow_sums; fuzz run 7 measured 1.1-1.7x eager's mean error at
# 8-100 rows with the vector loop above). Eager (ATen's scalar_outer_sum) sums the kept
# elements in groups of 4 with one fp32 accumulator each, in runs of 16 rows, and each of the
# last K mod 4 with ``row_sum``: 4 accumulators over the rows mod 4, runs of 16 rows each;
# a lone kept element (K = 1) is a contiguous inner sum: 8 vector lanes of 4 such
# accumulators, rows mod 32. Our runs are the same, totalled in double. Switch: the
# benchmark's "before".
NARROW_EAGER_ORDER = True
# Compile time: the narrow sums are a template over the kept count NR, one instance per case
# of ``switch (nr)``, each with unrolled loops (~0.3 s of g++ per case per pass: a BatchNorm
# statistics kernel took 2.2 s, 0.3 s without them). With the last kept size K a constant,
# only the cases nr can take are written (:func:`narrow_counts`): none for K a multiple of
# NARROW_ROWS (every block then has a multiple of it), only K for K < NARROW_ROWS. Same code
# at run time. Switch: the benchmark's "before".
STATIC_NARROW_CASES = True
NARROW_EAGER_BLOCK = 512  # reduced elements a block of the narrow sums spans (16 runs of 32)
# Blocks of fewer kept elements ([N, 4].sum(0)) loop over them outside and vectorise over the
# reduced elements inside: a vector loop over 4 elements per reduced one is slow
# (docs/benchmarks.md).
NARROW_ROWS = 8
# The reduced dims of every column access merge into one stride (a contiguous NHWC
# activation's N, H, W under BatchNorm's statistics): a run-time check once per call, then a
# reduced element's offset is c times the innermost reduced stride instead of c decomposed
# per dim (a % and a / per dim and per reduced element, in the loops that run one reduced
# element at a time). The same elements are read in the same order: bit-exact.
# Switch: the benchmark's "before".
MERGED_REDUCED_DIMS = True
# Blocks run along the last kept dim, so a column sum keeping [4, 128, 128] of a contiguous
# [4, 4, 128, 128] (the gradient of a bias broadcast over the batch: T5's position bias) ran
# 512 blocks of 128 rows, 4 reduced elements each: 109 us, ATen 35. When every access's kept
# dims merge (a run-time check once per call, as MERGED_REDUCED_DIMS), the blocks run along
# all the kept elements instead: the same elements summed in the same order, bit-exact.
# Switch: the benchmark's "before".
MERGED_KEPT_DIMS = True
# A tile of several passes (BatchNorm's statistics: the mean, then the squared deviations
# from it) with too few blocks of kept elements for the threads (16 channels: one block)
# ran on one thread. It splits the reduced elements between the threads per pass too, as a
# one-pass tile does: each pass one parallel loop into partial totals, one loop per block
# adding them and keeping the pass's results (per kept element) for the next pass. Only
# without per-element outputs. Switch: the benchmark's "before".
SPLIT_PASSES = True


def narrow_counts(k) -> range | tuple:
    """The block sizes nr < NARROW_ROWS a kernel whose last kept dim has size ``k`` (an int,
    or a symbolic size) can see. ``source`` sets NB to min(ROWS_PER_BLOCK, K), or to a
    multiple of 16, and nr = min(NB, K - k0) with k0 a multiple of NB."""
    k = int(k) if isinstance(k, int) or getattr(k, "is_Integer", False) else None
    if not STATIC_NARROW_CASES or k is None or k < 1:
        return range(1, NARROW_ROWS)
    if k < NARROW_ROWS:  # one block of K rows whatever NB is (NB >= 16 or NB = K)
        return (k,)
    if k % NARROW_ROWS == 0 and 16 % NARROW_ROWS == 0 and ROWS_PER_BLOCK % NARROW_ROWS == 0:
        return ()  # NB and K - k0 multiples of NARROW_ROWS: nr >= NARROW_ROWS
    return range(1, NARROW_ROWS)


class ColumnEmitter(RowEmitter):
    def source(self) -> str:
        p, w, var = self.p, self.w, self.declare_kernel_vars
        last = self.outer - 1  # the last kept dim: blocks run along it
        self.last = last
        self.head()
        checks = [f"(D{last} == 1 || a{k}_{last} == {'1' if f == 'unit' else '0'})"
                  for k, f in enumerate(p.fast) if f != "strided"]
        var("bool", {"fast": " && ".join(checks) or "true"}, unused=("fast",))
        self.merge = MERGED_REDUCED_DIMS and self.n - self.outer > 1 \
            and any(a.col for a in p.accesses)
        if self.merge:
            var("bool", {"merged": " && ".join(self.merged_checks())})
        reds = self.reductions(1)
        outs = [(k, x, spec) for k, (x, spec) in enumerate(p.outputs) if x.level == "col"]
        # one pass, per-element outputs known before it: the columns may be split
        splittable = self.passes == 1 and all(self.stage[x.id] == 0 for _, x, _ in outs)
        # several passes, no per-element output: split pass by pass
        staged = SPLIT_PASSES and self.passes > 1 and not outs
        # Blocks of whole memory rows (up to ROWS_PER_BLOCK) read memory in long runs: a
        # block split between the threads reads each row in parts, a page apart, and the
        # prefetcher starts over on every one (two threads then run as slowly as one:
        # docs/benchmarks.md). So too few blocks for the threads split the columns (partial
        # sums), or when there is more than one pass, the blocks.
        # MERGED_KEPT_DIMS: blocks along all the kept elements when their dims merge
        cases = narrow_counts(p.shape[last])
        if MERGED_KEPT_DIMS and last > 0 and (not cases or cases == range(1, NARROW_ROWS)) \
                and not any(x.kind in ("gather", "iota") for x in p.nodes):
            var("bool", {"kept_merged": " && ".join(self.kept_checks())})
            var("int64_t", {"K": f"kept_merged ? R : D{last}", "Ro": "K > 0 ? R / K : 0"})
        else:
            var("int64_t", {"K": f"D{last}", "Ro": "K > 0 ? R / K : 0"})
        var("int64_t", {"NB": f"std::min<int64_t>({ROWS_PER_BLOCK}, std::max<int64_t>(K, 1))",
                        "S": "1"}, const=False)
        w("  if (nt > 1 && Ro * ((K + NB - 1) / NB) < nt) {")
        if splittable or staged:
            w(f"    if (C >= {SPLIT_MIN} * nt) S = nt; else")
        w("    NB = std::max<int64_t>(16, ((K + nt - 1) / nt + 15) / 16 * 16);")
        w("  }")
        var("int64_t", {"NKB": "(K + NB - 1) / NB", "W": "Ro * NKB"})
        if staged:
            w("  if (S > 1) {")
            outside = dict(self.kernel_vars)
            self.split_passes()
            self.kernel_vars = outside  # split_passes' arrays are out of scope
            w("  } else {")
            self.work_items("W", split=False)
            self.body(outs)
            self.end_items()
            w("  }")
            w("}")
            return "\n".join(self.lines) + "\n"
        if not splittable:
            self.work_items("W", split=False)
            self.body(outs)
            self.end_items()
            w("}")
            return "\n".join(self.lines) + "\n"
        # unsplit (S = 1: one thread, or blocks enough for the threads): one loop, no part
        # arrays (S * R totals written, read back and freed per call: 512 KiB for 64K kept
        # elements, page faults included)
        w("  if (S == 1) {")
        outside = dict(self.kernel_vars)
        self.work_items("W", split=False)
        self.body(outs)
        self.end_items()
        self.kernel_vars = outside
        w("  } else {")
        # pass 1 per (block, column part) into partial accumulators, then one item per
        # block combines them
        self.alloc_parts(reds)
        self.work_items("W * S", split=True)
        self.row_nodes(0)
        self.init(reds)
        self.sweep(reds, outs)
        self.store_parts(reds)
        self.end_items()
        self.work_items("W", split=False)
        self.row_nodes(0)
        self.combine_parts(reds)
        self.finish(reds, 1)
        self.outputs()
        self.end_items()
        self.free_parts(reds)
        w("  }")
        w("}")
        return "\n".join(self.lines) + "\n"

    def split_passes(self) -> None:
        """SPLIT_PASSES: per pass, one loop over (block, part of the reduced elements)
        items into partial totals (``part<id>``), then one over blocks adding the parts in
        order; a pass's reduction values go to ``kept<id>`` (per kept element), which the
        later passes' items read back before recomputing the row values that follow from
        them. The last pass's combining loop writes the outputs."""
        w, var = self.w, self.declare_kernel_vars
        kept = [x for s in range(1, self.passes) for x in self.reductions(s)]
        for x in kept:
            t = ctype(x.dtype)
            var(f"{t}* __restrict__",
                {f"kept{x.id}": f"({t}*)std::malloc(sizeof({t}) * std::max<int64_t>(R, 1))"},
                const=False)
        # a conditional pass (body's ``when``) runs in the blocks where a row needs it: the
        # previous pass's combining loop flags those blocks (need<stage>), and a pass no
        # block needs opens no parallel loop (BatchNorm's correction passes rarely run)
        conditional = {s for s in range(2, self.passes + 1)
                       if all(x.attrs.get("when") for x in self.reductions(s))}
        for stage in sorted(conditional):
            var("int* __restrict__",
                {f"need{stage}": "(int*)std::malloc(sizeof(int) * std::max<int64_t>(W, 1))"},
                const=False)
        for stage in range(1, self.passes + 1):
            reds = self.reductions(stage)
            self.alloc_parts(reds)
            if stage in conditional:
                var("bool", {f"any{stage}": "false"}, const=False)
                w(f"  for (int64_t wb = 0; wb < W; ++wb) any{stage} = any{stage} || need{stage}[wb];")
                w(f"  if (!any{stage}) {{")
                for x in reds:
                    w(f"    for (int64_t i = 0; i < S * R; ++i) part{x.id}[i] = {identity(x)};")
                    if self.has_nan(x):
                        w(f"    for (int64_t i = 0; i < S * R; ++i) pnan{x.id}[i] = 0;")
                w("  } else {")
            self.work_items("W * S", split=True)
            self.kept_values(stage)
            self.init(reds)
            # a conditional pass (body): run where a row of the block needs it, the same
            # rows in every part
            when = all(x.attrs.get("when") for x in reds)
            if when:
                w(f"    bool run{stage} = false;")
                self.block_loop([f"run{stage} |= {' || '.join(self.var(x.args[1]) for x in reds)};"])
                w(f"    if (run{stage}) {{")
            self.sweep(reds, [])
            if when:
                w("    }")
            self.store_parts(reds)
            self.end_items()
            if stage in conditional:
                w("  }")
            self.work_items("W", split=False)
            self.kept_values(stage)
            self.combine_parts(reds)
            self.finish(reds, stage)
            if stage + 1 in conditional:
                nxt = self.reductions(stage + 1)
                w("    bool flag = false;")
                self.block_loop([f"flag |= {' || '.join(self.var(x.args[1]) for x in nxt)};"])
                w(f"    need{stage + 1}[wb] = flag;")
            if stage < self.passes:
                self.block_loop([f"kept{x.id}[r0 + j] = v{x.id}[j];" for x in reds])
            else:
                self.outputs()
            self.end_items()
            self.free_parts(reds)
        for x in kept:
            w(f"  std::free(kept{x.id});")
        for stage in sorted(conditional):
            w(f"  std::free(need{stage});")

    def alloc_parts(self, reds) -> None:
        """The part arrays of a split reduction's totals (and NaN flags): S per row."""
        var = self.declare_kernel_vars
        for x in reds:
            t = "double" if self.wide(x) else ctype(x.dtype)
            var(f"{t}* __restrict__", {f"part{x.id}": f"({t}*)std::malloc(sizeof({t}) * S * R)"},
                const=False)
            if self.has_nan(x):
                var("int* __restrict__", {f"pnan{x.id}": "(int*)std::malloc(sizeof(int) * S * R)"},
                    const=False)

    def store_parts(self, reds) -> None:
        """Each work item's partial totals (and NaN flags) to its slot of the part arrays."""
        self.block_loop([f"part{x.id}[s * R + r0 + j] = {self.total(x)}[j];" for x in reds] +
                        [f"pnan{x.id}[s * R + r0 + j] = nan{x.id}[j];"
                         for x in reds if self.has_nan(x)])

    def combine_parts(self, reds) -> None:
        """The totals of a split reduction: its S work items' parts, in item order."""
        for x in reds:
            self.declare(x)
            acc = self.total(x)
            lines = [f"{acc}[j] = part{x.id}[r0 + j];"]
            if self.has_nan(x):
                lines.append(f"nan{x.id}[j] = pnan{x.id}[r0 + j];")
            lines.append("for (int64_t q = 1; q < S; ++q) {")
            if self.wide(x):
                lines.append(f"  {acc}[j] += part{x.id}[q * R + r0 + j];")
            else:
                lines += ["  " + line for line in self.update(
                    x, f"part{x.id}[q * R + r0 + j]", f"pnan{x.id}[q * R + r0 + j]")]
            lines.append("}")
            self.block_loop(lines)

    def free_parts(self, reds) -> None:
        for x in reds:
            self.w(f"  std::free(part{x.id});")
            if self.has_nan(x):
                self.w(f"  std::free(pnan{x.id});")

    def kept_values(self, stage: int) -> None:
        """In a work item of pass ``stage`` (split_passes): the row values before it, the
        earlier passes' reduction values read back from ``kept<id>``."""
        self.row_nodes(0)
        for s in range(1, stage):
            xs = self.reductions(s)
            for x in xs:
                self.w(f"    {ctype(x.dtype)} v{x.id}[{ROWS_PER_BLOCK}];")
            self.block_loop([f"v{x.id}[j] = kept{x.id}[r0 + j];" for x in xs])
            self.row_nodes(s)

    def end_items(self) -> None:
        """Close the loop work_items opened, under ``omp parallel for`` (and its serial copy:
        RowEmitter.parallel_loop)."""
        self.w("  }")
        self.parallel_loop(*self.items)

    def work_items(self, count: str, split: bool) -> None:
        """Open the parallel loop over work items: a block of NB rows along the last kept
        dim (rows r0 + j for j < nr), and with ``split`` the columns' part s of S."""
        p, w, last = self.p, self.w, self.last
        self.items = (len(self.lines), count)  # closed by end_items
        w(f"  for (int64_t wi = 0; wi < {count}; ++wi) {{")
        if split:
            w("    const int64_t s = wi % S, wb = wi / S;")
            w("    const int64_t c_lo = C * s / S, c_hi = C * (s + 1) / S;")
        else:
            w("    const int64_t wb = wi, c_lo = 0, c_hi = C;")
        w("    (void)c_lo; (void)c_hi;")
        w("    const int64_t ro = wb / NKB, k0 = (wb % NKB) * NB, r0 = ro * K + k0;")
        w("    const int64_t nr = std::min<int64_t>(NB, K - k0);")
        w("    int64_t t = ro; (void)t;")
        for d in range(last - 1, -1, -1):
            w(f"    const int64_t i{d} = t % D{d}; t /= D{d};")
        w(f"    const int64_t i{last} = k0;")
        for k in range(len(p.accesses)):
            base = " + ".join(f"i{d} * a{k}_{d}" for d in range(self.outer))
            w(f"    const int64_t b{k} = {base};")

    # --- values ------------------------------------------------------------------------
    def var(self, x) -> str:
        return f"v{x.id}[j]" if x.level == "row" else f"v{x.id}"

    def along(self, k: int, path: str) -> str:
        """Access k's offset for row j of the block."""
        if path == "fast" and self.p.fast[k] != "strided":
            return "j" if self.p.fast[k] == "unit" else "0"
        return f"j * a{k}_{self.last}"

    def define(self, x, ind: str, col: bool, path: str = "fast") -> None:
        if x.kind == "load":
            k = x.attrs["access"]
            a = self.p.accesses[k]
            idx = f"b{k} + {f'o{k} + ' if a.col else ''}{self.along(k, path)}"
            rhs = load(f"in{a.input}[{idx}]", self.p.input_specs[a.input].dtype)
            if col and path == "fast" and k in self.staged:
                rhs = f"{self.staged[k]}[j]"
        else:
            rhs = expression(x, self.var)
        self.w(f"{ind}const {ctype(x.dtype)} v{x.id} = {rhs};" if col else
               f"{ind}{self.var(x)} = {rhs};")

    def block_loop(self, lines: list[str], ind: str = "    ") -> None:
        self.w(f"{ind}for (int64_t j = 0; j < nr; ++j) {{")
        for line in lines:
            self.w(f"{ind}  {line}")
        self.w(f"{ind}}}")

    def row_nodes(self, stage: int) -> None:
        xs = [x for x in self.p.nodes if x.level == "row" and x.id in self.needed
              and self.stage[x.id] == stage and x.kind != "reduce"]
        for x in xs:
            self.w(f"    {ctype(x.dtype)} v{x.id}[{ROWS_PER_BLOCK}];")
        if xs:
            self.w("    for (int64_t j = 0; j < nr; ++j) {")
            for x in xs:
                self.define(x, "      ", col=False, path="generic")
            self.w("    }")

    # --- passes ------------------------------------------------------------------------
    def reductions(self, stage: int) -> list:
        return [x for x in self.p.nodes if x.kind == "reduce" and x.id in self.needed
                and self.stage[x.id] == stage]

    @staticmethod
    def has_nan(x) -> bool:  # a float max/min keeps a NaN flag (the result is NaN if any)
        return ctype(x.dtype) == "float" and x.attrs["red"] != "sum"

    @staticmethod
    def wide(x) -> bool:  # a float sum: fp32 partials per SUM_BLOCK, a double total
        return ctype(x.dtype) == "float" and x.attrs["red"] == "sum" \
            and not x.attrs.get("sequential")

    @staticmethod
    def sequential(x) -> bool:
        """A float sum in one fp32 accumulator over the reduced elements in order (a
        column softmax's, as eager's _vec_softmax): never blocked, nor vectorised over the
        reduced elements (the narrow path)."""
        return x.attrs["red"] == "sum" and bool(x.attrs.get("sequential"))

    def total(self, x) -> str:
        """The array holding x's running result over the block (``tot`` for a float sum)."""
        return f"tot{x.id}" if self.wide(x) else f"acc{x.id}"

    def declare(self, x) -> None:
        """Reduction x's per-row accumulators, values and NaN flags over the block."""
        self.w(f"    {ctype(x.dtype)} acc{x.id}[{ROWS_PER_BLOCK}], v{x.id}[{ROWS_PER_BLOCK}];")
        if self.wide(x):
            self.w(f"    double tot{x.id}[{ROWS_PER_BLOCK}];")
        if self.has_nan(x):
            self.w(f"    int nan{x.id}[{ROWS_PER_BLOCK}];")

    def init(self, reds) -> None:
        for x in reds:
            self.declare(x)
            self.block_loop([f"{self.total(x)}[j] = {identity(x)};"] +
                            ([f"acc{x.id}[j] = 0;"] if self.wide(x) else []) +
                            ([f"nan{x.id}[j] = 0;"] if self.has_nan(x) else []))

    def update(self, x, v: str, nan: str) -> list[str]:
        """Lines folding value v (and its NaN flag, for a float max/min) into x's row j."""
        acc = f"acc{x.id}[j]"
        if x.attrs["red"] == "sum":
            return [f"{acc} += {v};"]
        cmp = ">" if x.attrs["red"] == "max" else "<"
        return [f"{acc} = ({v} {cmp} {acc}) ? {v} : {acc};"] + (
            [f"nan{x.id}[j] |= {nan};"] if self.has_nan(x) else [])

    def finish(self, reds, stage: int) -> None:
        """The reductions' values, then the row values computed from them."""
        self.block_loop([f"v{x.id}[j] = nan{x.id}[j] ? NAN : acc{x.id}[j];" if self.has_nan(x)
                         else f"v{x.id}[j] = ({ctype(x.dtype)}){self.total(x)}[j];"
                         for x in reds])
        self.row_nodes(stage)

    def outputs(self) -> None:
        self.block_loop([f"out{k}[r0 + j] = {store(self.var(x), spec.dtype, x)};"
                         for k, (x, spec) in enumerate(self.p.outputs) if x.level == "row"])

    def body(self, outs) -> None:
        """Every pass for one block over all columns. A per-element output is written by
        the first pass that has its value, or by one more pass after the last."""
        self.row_nodes(0)
        for stage in range(1, self.passes + 1):
            reds = self.reductions(stage)
            self.init(reds)
            done = [o for o in outs if self.stage[o[1].id] < stage]
            # conditional reductions only (see row_sums): the pass runs when a row of the
            # block needs it
            when = not done and all(x.attrs.get("when") for x in reds)
            if when:
                self.w(f"    bool run{stage} = false;")
                self.block_loop([f"run{stage} |= {' || '.join(self.var(x.args[1]) for x in reds)};"])
                self.w(f"    if (run{stage}) {{")
            self.sweep(reds, done)
            if when:
                self.w("    }")
            outs = [o for o in outs if self.stage[o[1].id] >= stage]
            self.finish(reds, stage)
        if outs:
            self.sweep([], outs)
        self.outputs()

    def sweep(self, reds, outs) -> None:
        """One pass over columns c_lo..c_hi (reduced elements) for the block: reductions
        ``reds`` accumulate, per-element outputs ``outs`` are stored (the tile's order in
        memory is column-major over the analysed domain)."""
        w = self.w
        deps = self.col_deps([a for x in reds for a in x.args] + [x for _, x, _ in outs])
        wide = [x for x in reds if self.wide(x)]
        lo, hi = "c_lo", "c_hi"
        eager = NARROW_EAGER_ORDER and bool(reds) and len(wide) == len(reds) and not outs
        if wide:  # blocks of SUM_BLOCK reduced elements: fp32 partials, then double totals
            narrow = NARROW_EAGER_BLOCK if eager else SUM_BLOCK_NARROW
            w(f"    for (int64_t sb = fast && nr < {NARROW_ROWS} ? {narrow} : {SUM_BLOCK}, "
              "cb = c_lo; cb < c_hi; cb += sb) {")
            w("    const int64_t ce = std::min<int64_t>(cb + sb, c_hi);")
            lo, hi = "cb", "ce"
        # the narrow path vectorises over the reduced elements: not for a sequential sum
        narrow_ok = "false && " if any(self.sequential(x) for x in reds) else ""
        for path in ("narrow", "fast", "generic"):
            w({"narrow": f"    if ({narrow_ok}fast && nr < {NARROW_ROWS}) {{",
               "fast": "    else if (fast) {", "generic": "    else {"}[path])
            if path == "narrow":
                if eager:
                    self.narrow_sums(reds, deps, lo, hi)
                else:
                    self.narrow(reds, outs, deps, lo, hi)
                w("    }")
                continue
            w(f"     for (int64_t c = {lo}; c < {hi}; ++c) {{")
            self.offsets("      ", merged=True)
            # fp16 columns of the block through float buffers (half_staging.STAGE_HALF)
            ins, souts = self.staging([x for x in deps if x.level == "col"
                                       and (x.kind != "load"
                                            or self.p.accesses[x.attrs["access"]].col)],
                                      outs) if path == "fast" else ([], [])
            for k in ins:
                a = self.p.accesses[k]
                self.w(f"      alignas(64) float sa{k}[{ROWS_PER_BLOCK}];")
                self.w(f"      pi_ld_f16_n(in{a.input} + b{k} + o{k}, sa{k}, nr);")
                self.staged[k] = f"sa{k}"
            for k, _, _ in souts:
                self.w(f"      alignas(64) float so{k}[{ROWS_PER_BLOCK}];")
            staged_outs = {k for k, _, _ in souts}
            if not self.fallback(path, True):  # the same bits: each j its own accumulators
                w("      #pragma omp simd")
            w("      for (int64_t j = 0; j < nr; ++j) {")
            for x in deps:
                self.define(x, "        ", col=True, path=path)
            for x in reds:
                v = conv(self.var(x.args[0]), x.args[0].dtype, x.dtype)
                lines = [sum_update(x, f"acc{x.id}[j]", v, self.var)] \
                    if x.attrs["red"] == "sum" else self.update(x, v, f"({v} != {v})")
                for line in lines:
                    w(f"        {line}")
            for k, x, spec in outs:
                w(f"        so{k}[j] = {self.var(x)};" if k in staged_outs else
                  f"        out{k}[c * R + r0 + j] = {store(self.var(x), spec.dtype, x)};")
            w("      }")
            for k in sorted(staged_outs):
                w(f"      pi_st_f16_n(so{k}, out{k} + c * R + r0, nr);")
            self.staged = {}
            w("     }")
            w("    }")
        if wide:
            # each block's partial into the total, the partial reset for the next block
            self.block_loop([f"tot{x.id}[j] += acc{x.id}[j]; acc{x.id}[j] = 0;" for x in wide])
            w("    }")

    def kept_checks(self) -> list[str]:
        """Conditions under which kept element r's offset in every access is r times its
        stride along the last kept dim (MERGED_KEPT_DIMS): that dim is not of size 1 and
        each outer kept dim of size over 1 has the stride of the dims inside it merged."""
        last, checks = self.last, [f"D{self.last} > 1"]
        for k in range(len(self.p.accesses)):
            inner = []
            for d in range(last - 1, -1, -1):
                inner.append(f"D{d + 1}")
                checks.append(f"(D{d} == 1 || a{k}_{d} == a{k}_{last} * {' * '.join(inner)})")
        return checks

    def merged_checks(self) -> list[str]:
        """Conditions under which every column access's offset at reduced element c is
        c * its innermost reduced stride: each reduced dim of size over 1 has the stride of
        the dims inside it merged (size-1 dims have index 0: any stride)."""
        last, checks = self.n - 1, []
        for k, a in enumerate(self.p.accesses):
            if not a.col:
                continue
            inner = []
            for d in range(last - 1, self.outer - 1, -1):
                inner.append(f"D{d + 1}")
                checks.append(f"(D{d} == 1 || a{k}_{d} == a{k}_{last} * {' * '.join(inner)})")
        return checks

    def offsets(self, ind: str, merged: bool = False) -> None:
        """Reduced element c's index per reduced dim (u<d>) and each access's offset there;
        with ``merged`` (a loop over one reduced element at a time), c times one stride when
        the run-time check ``merged`` holds (MERGED_REDUCED_DIMS)."""
        w = self.w
        cols = [k for k, a in enumerate(self.p.accesses) if a.col]
        if merged and self.merge:
            w(f"{ind}int64_t {', '.join(f'o{k}' for k in cols)};")
            w(f"{ind}if (merged) {{")
            for k in cols:
                w(f"{ind}  o{k} = c * a{k}_{self.n - 1};")
            w(f"{ind}}} else {{")
            self.decompose(ind + "  ", assign=True)
            w(f"{ind}}}")
            return
        self.decompose(ind, assign=False)

    def decompose(self, ind: str, assign: bool) -> None:
        w = self.w
        w(f"{ind}int64_t u = c; (void)u;")
        for d in range(self.n - 1, self.outer, -1):
            w(f"{ind}const int64_t u{d} = u % D{d}; u /= D{d};")
        w(f"{ind}const int64_t u{self.outer} = u;")  # below D{outer}: no division
        for k, a in enumerate(self.p.accesses):
            if a.col:
                off = " + ".join(f"u{d} * a{k}_{d}" for d in range(self.outer, self.n))
                w(f"{ind}{'' if assign else 'const int64_t '}o{k} = {off};")

    def narrow_sums(self, reds, deps, lo: str, hi: str) -> None:
        """The narrow path of a pass of float sums only, in eager's partials
        (NARROW_EAGER_ORDER): the first NR / 4 * 4 kept elements a run of 16 rows at a
        time into one fp32 partial each; the others 4 partials over the rows mod 4 (a lone
        kept element: 32), 16 rows each; every partial then into the double total, as are
        the rows after the last whole group of 4 (32) rows (eager adds them to an fp32
        partial). One loop over the rows reads each row once; it is a template over the
        kept count NR (1..NARROW_ROWS - 1), so the partials stay in registers. [lo, hi) is
        a block of NARROW_EAGER_BLOCK reduced elements from c_lo (runs start at its start)."""
        w = self.w

        def add(ind: str, j: str, target: str) -> None:
            """The summands at reduced element c, kept element j, added into target."""
            w(f"{ind}{{ const int64_t j = {j}; (void)j;")
            self.offsets(ind + "  ", merged=True)
            for y in deps:
                self.define(y, ind + "  ", col=True, path="fast")
            for x in reds:
                v = conv(self.var(x.args[0]), x.args[0].dtype, x.dtype)
                acc = target.format(id=x.id)
                w(f"{ind}  {f'{acc} += {v};' if acc.startswith('tot') else sum_update(x, acc, v, self.var)}")
            w(f"{ind}}}")

        w("     auto sums = [&](auto nrc) {")
        w("      constexpr int64_t NR = decltype(nrc)::value;")
        w("      if constexpr (NR == 1) {  // eager's contiguous inner sum: 8 lanes x 4 partials")
        w(f"       for (int64_t q = {lo}; q < {hi}; q += 512) {{")
        w(f"        const int64_t qe = std::min<int64_t>(q + 512, {hi}), qw = q + (qe - q) / 32 * 32;")
        for x in reds:
            w(f"        float sp{x.id}[32] = {{}};")
        w("        for (int64_t c0 = q; c0 < qw; c0 += 32)")
        w("        for (int64_t k = 0; k < 32; ++k) {")
        w("         const int64_t c = c0 + k;")
        add("         ", "0", "sp{id}[k]")
        w("        }")
        for x in reds:
            w(f"        for (int64_t k = 0; k < 32; ++k) tot{x.id}[0] += sp{x.id}[k];")
        w("        for (int64_t c = qw; c < qe; ++c)")
        add("         ", "0", "tot{id}[0]")
        w("       }")
        w("      } else {")
        w("       constexpr int64_t NG = NR / 4 * 4;  // in groups of 4: runs of 16 rows")
        w(f"       for (int64_t q = {lo}; q < {hi}; q += 64) {{")
        w(f"        const int64_t qe = std::min<int64_t>(q + 64, {hi}), qw = q + (qe - q) / 4 * 4;")
        for x in reds:
            w(f"        float sp{x.id}[4][NR] = {{}};  // the others': rows mod 4")
        w("        for (int64_t s = q; s < qe; s += 16) {")
        w("         const int64_t se = std::min<int64_t>(s + 16, qe), sw = std::min(se, qw);")
        for x in reds:
            w(f"         float sg{x.id}[NR] = {{}};")
        w("         for (int64_t c0 = s; c0 < sw; c0 += 4)")
        w("         _Pragma(\"GCC unroll 4\") for (int64_t k = 0; k < 4; ++k) {")
        w("          const int64_t c = c0 + k;")
        w("          _Pragma(\"GCC unroll 8\") for (int64_t jj = 0; jj < NG; ++jj)")
        add("           ", "jj", "sg{id}[j]")
        w("          _Pragma(\"GCC unroll 8\") for (int64_t jj = NG; jj < NR; ++jj)")
        add("           ", "jj", "sp{id}[k][j]")
        w("         }")
        w("         for (int64_t c = sw; c < se; ++c) {")
        w("          for (int64_t jj = 0; jj < NG; ++jj)")
        add("           ", "jj", "sg{id}[j]")
        w("          for (int64_t jj = NG; jj < NR; ++jj)")
        add("           ", "jj", "tot{id}[j]")
        w("         }")
        for x in reds:
            w(f"         for (int64_t j = 0; j < NG; ++j) tot{x.id}[j] += sg{x.id}[j];")
        w("        }")
        for x in reds:
            w("        for (int64_t j = NG; j < NR; ++j)")
            w(f"         for (int64_t k = 0; k < 4; ++k) tot{x.id}[j] += sp{x.id}[k][j];")
        w("       }")
        w("      }")
        w("     };")
        w("     switch (nr) {")
        for k in narrow_counts(self.p.shape[self.last]):
            w(f"      case {k}: sums(std::integral_constant<int64_t, {k}>{{}}); break;")
        w("      default: break;")
        w("     }")

    def narrow(self, reds, outs, deps, lo: str, hi: str) -> None:
        """The fast path for a block of few kept elements: each kept element j in turn, a
        vector loop over the reduced elements into scalar accumulators, folded into j's.
        The accumulators are ``sa<id>``: ``s<N>`` is a size symbol's name (fuzz seed
        31475: ``s4 / (s4 * s4)`` read the accumulator of node 4 as the size)."""
        w = self.w
        w("     for (int64_t j = 0; j < nr; ++j) {")
        clauses = []
        for x in reds:
            t, red = ctype(x.dtype), x.attrs["red"]
            w(f"      {t} sa{x.id} = {'0' if red == 'sum' else identity(x)};")
            clauses.append(f"reduction({'+' if red == 'sum' else red}:sa{x.id})")
            if self.has_nan(x):
                w(f"      int sna{x.id} = 0;")
                clauses.append(f"reduction(|:sna{x.id})")
        w(f"      #pragma omp simd {' '.join(clauses)}")
        w(f"      for (int64_t c = {lo}; c < {hi}; ++c) {{")
        self.offsets("        ")
        for x in deps:
            self.define(x, "        ", col=True, path="fast")
        for x in reds:
            v = conv(self.var(x.args[0]), x.args[0].dtype, x.dtype)
            if x.attrs["red"] == "sum":
                w(f"        {sum_update(x, f'sa{x.id}', v, self.var)}")
                continue
            cmp = ">" if x.attrs["red"] == "max" else "<"
            w(f"        sa{x.id} = ({v} {cmp} sa{x.id}) ? {v} : sa{x.id};")
            if self.has_nan(x):
                w(f"        sna{x.id} |= ({v} != {v});")
        for k, x, spec in outs:
            w(f"        out{k}[c * R + r0 + j] = {store(self.var(x), spec.dtype, x)};")
        w("      }")
        for x in reds:
            for line in self.update(x, f"sa{x.id}", f"sna{x.id}"):
                w(f"      {line}")
        w("     }")
