"""C++ source for one analysed FusionTile (a :class:`.program.Program`).

The function is ``extern "C" void pi_kernel(void* const* ptrs, const int64_t*
meta, const int64_t* syms, int nt)``: ``ptrs`` holds the inputs then the
outputs, ``meta`` each input's sizes then strides, ``syms`` the graph's size
symbols, ``nt`` the thread count. Domain sizes are printed from sympy with
torch's CppPrinter. Work items (rows, or row chunks for pointwise tiles, or blocks of
rows for pointwise tiles of a few columns) run under ``omp parallel for``; each reduction is one ``omp simd reduction`` pass
over the row; a fast path with unit/zero column strides (checked once per call)
is emitted beside a generic strided path.
"""
from __future__ import annotations

import sympy
import torch

from . import column_order, work_items
from .indexing import gather_address, index_prologue, iota
from .ops import (EXTRA_PRELUDE, STORAGE, NotEmittable, conv, ctype, expression, finalize,
                  identity, literal, load, mark_contractions, number, size, store, sum_update)
from .prelude import PRELUDE
from .program import dim_mult
from .work_items import PARAMS, KernelVar
POINTWISE_CHUNK = 16384  # elements per work item in pointwise tiles
MAX_CACHED_COLS = 1 << 16  # longest row whose costly values a thread keeps (cache_costly_values)
PARALLEL_MIN = 32768  # fewer elements run on one thread
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
# Pointwise tiles reading a strided input (a transpose) run blocks of BLOCK_ROWS rows x
# BLOCK_COLS columns, rows inner: the rows of a block share the cache lines of the strided
# reads (the block shape measured on attention's K^T copy: docs/benchmarks.md).
BLOCK_ROWS, BLOCK_COLS = 64, 32
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
# Reduction kernels over constant rows define the row's bounds as constants s0, s1 (one row
# per work item), so GCC unrolls short rows' loops: LayerNorm 512x64 16.2 -> 12.4 us. Only
# loops whose results cannot depend on them take them: pointwise loops and the fast path of
# sums whose order vector_lanes writes out. An `omp simd` sum keeps run-time bounds: GCC
# picks its vector factor and epilogue from what it knows of the trip count (constant
# bounds changed ViT's loss through log_softmax's sum of exp over 10 classes).
# tests/test_static_bounds.py: the same bits with the switch on and off.
STATIC_BOUNDS = True
# ... and unroll the vector_lanes loop of rows up to UNROLL_TRIPS x its lanes columns (the
# body is n copies of the summed value's column code: a long row's would bloat the kernel)
UNROLL_TRIPS = 8
# A call on one thread runs a copy of the loop over work items outside the OpenMP region:
# under `omp parallel for ... if(...)` even a one-thread call goes through GOMP_parallel and
# the loop is an outlined function reading every size, stride and pointer through the
# shared struct (RMSNorm's training forward, 512 x 64, one thread: 7.2 -> 6.2 us a call;
# docs/benchmarks.md, k16t). A tile whose rows x columns are a constant under
# PARALLEL_MIN has only the serial loop (no second copy to compile).
SERIAL_COPY = True
# ... both loops written once (work_items.py): the loop over work items is a lambda over a
# range of them (not inlined), which the serial branch calls on all work items and each
# thread of the parallel one on its part. The kernel's code was the body twice; g++'s time
# is code volume (GPT-2's training forward graph library: LayerNorm row kernels of 400-550
# lines). The same loop runs per work item: the same bits. False: the two copies.
ONE_BODY = True
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
# which the serial copy above hit in row kernels summing columns (LayerNorm backward,
# 512 x 64, one thread: 65 -> 15 us a call; k16x). The same value is read: bit-exact.
HOIST_BROADCAST_LOADS = True
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


class RowEmitter:
    def __init__(self, p):
        self.p = p
        mark_contractions(p.nodes, p.outputs)
        self.n = len(p.shape)
        self.outer = self.n - p.m
        self.lines: list[str] = []
        # the kernel's variables in scope, by name: a loop over work items copies the ones it
        # names (work_items.local_copies)
        self.kernel_vars: dict[str, KernelVar] = {}
        nodes = p.nodes
        needed: set[int] = set()
        stack = [node for node, _ in p.outputs]
        while stack:
            x = stack.pop()
            if x.id not in needed:
                needed.add(x.id)
                stack += [a for a in x.args if hasattr(a, "id")]
        self.needed = needed
        # stages: row value available after pass k; col value needs passes <= k
        self.stage: dict[int, int] = {}
        for x in nodes:
            deps = [self.stage[a.id] for a in x.args if hasattr(a, "id")]
            s = max(deps, default=0)
            self.stage[x.id] = s + 1 if x.kind == "reduce" else s
        self.passes = max((self.stage[x.id] for x in nodes if x.kind == "reduce"
                           and x.id in needed), default=0)
        self.constant_bounds = False  # vector_lanes runs over s0, s1 (unrolls a short row)
        self.seg = 0  # the column segment (cat part) being emitted, see Program.cat_bounds
        self.row_part: tuple | None = None  # (row cat node id, its part) of a row branch
        self.cached: set[int] = set()  # col values a row pass stores for the later passes
        self.stored: set[int] = set()  # of those, the ones stored by a pass already emitted
        self.storing: set[int] = set()  # ... and by the pass being emitted
        self.hoisted: set[int] = set()  # fast-path loads defined before the column loop
        # half values only stored (as their own dtype): left unrounded, the store rounds
        users: dict[int, int] = {}
        for x in nodes:
            for a in x.args:
                if hasattr(a, "id"):
                    users[a.id] = users.get(a.id, 0) + 1
        self.store_only = {x.id for x, spec in p.outputs
                           if x.level == "col" and x.kind in ("op", "expr")
                           and x.dtype in (torch.float16, torch.bfloat16)
                           and not users.get(x.id)
                           and all(s.dtype == x.dtype for y, s in p.outputs if y is x)}
        # column sums over the rows (analysis.lower_column_sum): (output, node, spec)
        self.colsums = [(k, x, spec) for k, (x, spec) in enumerate(p.outputs)
                        if x.kind == "colsum"]
        self.staged: dict[int, str] = {}  # access -> its float block in the loop being written
        self.row_staged: set[int] = set()  # accesses converted once per row (stage_rows)
        self.blocked: dict[int, str] = {}  # fp16 value -> its rounded float block

    def w(self, line: str) -> None:
        self.lines.append(line)

    def kernel_var(self, var: KernelVar) -> None:
        """Record a variable declared in the kernel's scope (or a block of it still open
        where the next loop over work items is written)."""
        self.kernel_vars[var.name] = var

    def declare_kernel_vars(self, ctype: str, values: dict[str, str], const: bool = True,
                            unused: tuple[str, ...] = ()) -> None:
        """The kernel-scope declaration ``[const] ctype name = value, ...;`` (then
        ``(void)name;`` for each name of ``unused``), its variables recorded."""
        inits = ", ".join(f"{name} = {value}" for name, value in values.items())
        self.w(f"  {'const ' if const else ''}{ctype} {inits};"
               + "".join(f" (void){name};" for name in unused))
        for name in values:
            self.kernel_var(KernelVar(name, ctype))

    def head(self) -> None:
        """The function's start: sizes, rows R and columns C, pointers, and each access's
        stride per frame dim (``a<k>_<d>``)."""
        p, n = self.p, self.n
        w, var = self.w, self.declare_kernel_vars
        w(PRELUDE + EXTRA_PRELUDE)
        w(f'extern "C" void pi_kernel({", ".join(f"{v.ctype} {v.name}" for v in PARAMS)}) {{')
        for v in PARAMS:
            self.kernel_var(v)
        for i, s in enumerate(p.symbols):
            var("int64_t", {s.name: f"syms[{i}]"}, unused=(s.name,))
        for d, s in enumerate(p.shape):
            var("int64_t", {f"D{d}": size(s)})
        rows = " * ".join(f"D{d}" for d in range(self.outer)) or "1"
        cols = " * ".join(f"D{d}" for d in range(self.outer, n)) or "1"
        var("int64_t", {"R": rows, "C": cols})
        off = 0
        offsets = []
        # a copy_ written straight into its input: that input and output alias
        writes = getattr(p, "writes", {})
        aliased = {wr.input for wr in writes.values() if wr.direct}
        for k, spec in enumerate(p.input_specs):
            r = "" if k in aliased else " __restrict__"
            t = STORAGE[spec.dtype]
            var(f"const {t}*{r}", {f"in{k}": f"(const {t}*)ptrs[{k}]"}, const=False)
            offsets.append(off)
            off += 2 * len(spec.shape)
        for k, (_, spec) in enumerate(p.outputs):
            r = "" if k in writes and writes[k].direct else " __restrict__"
            t = STORAGE[spec.dtype]
            var(f"{t}*{r}", {f"out{k}": f"({t}*)ptrs[{len(p.input_specs) + k}]"}, const=False)
        for k, a in enumerate(p.accesses):
            q = len(p.input_specs[a.input].shape)
            o = offsets[a.input]
            for d, j in enumerate(a.dims):
                j, mult = j if isinstance(j, tuple) else (j, 1)  # (dim, multiplier): split
                e = "0" if j is None else f"(meta[{o + j}] == 1 ? 0 : meta[{o + q + j}])"
                if j is not None and mult != 1:
                    e = f"({e} * {size(mult)})"
                var("int64_t", {f"a{k}_{d}": e})
            if a.offset is not None:
                var("int64_t", {f"co{k}": size(a.offset)}, unused=(f"co{k}",))
            if a.row_shift:  # a row cat's part: its first index and length along the dim
                e, off = a.row_shift
                var("int64_t", {f"ro{k}": size(off), f"rn{k}": size(a.frame[e])})
        index_prologue(self, offsets)

    def fast_checks(self) -> list[str]:
        """The run-time conditions of the fast path: each column access's strides along
        the dims from ``self.outer`` on are unit (contiguous) or zero (broadcast)."""
        p, n, checks = self.p, self.n, []
        for k, a in enumerate(p.accesses):
            if a.col and p.fast[k] != "strided":
                contiguous = "1"
                for d in range(n - 1, self.outer - 1, -1):
                    want = contiguous if p.fast[k] == "unit" else "0"
                    checks.append(f"(D{d} == 1 || {self.stride(k, d)} == {want})")
                    contiguous = f"{contiguous} * D{d}"
        return checks

    def source(self) -> str:
        p, n = self.p, self.n
        w, var = self.w, self.declare_kernel_vars
        self.head()
        fast_checks = self.fast_checks()
        # rows of the frames other than the domain's: the row index decomposed over them
        self.frame_of: dict[int, int | None] = {}
        frames: list[tuple] = []
        for k, a in enumerate(p.accesses):
            rows = self.frame_rows(k)
            if rows == tuple(p.shape[:self.outer]) or a.row_shift:
                self.frame_of[k] = None
                continue
            if rows not in frames:
                g = len(frames)
                frames.append(rows)
                for e, sz in enumerate(rows):
                    var("int64_t", {f"F{g}_{e}": size(sz)}, unused=(f"F{g}_{e}",))
            self.frame_of[k] = frames.index(rows)
        has_fast = p.m <= 1 or all(f != "strided" for a, f in zip(p.accesses, p.fast) if a.col)
        for s, b in enumerate(getattr(p, "cat_bounds", None) or []):
            var("int64_t", {f"CB{s + 1}": size(b)})
        for x in p.nodes:
            for s, b in enumerate(x.attrs.get("row_bounds", ()) if x.kind == "op" else ()):
                var("int64_t", {f"RB{x.id}_{s}": size(b)})
        var("bool", {"fast": " && ".join(fast_checks) or "true"})
        if has_fast:
            w("  (void)fast;")
        # column sums (a row kernel's or a pointwise one's) take whole rows
        chunk = "C" if p.reduction or self.colsums else f"std::min<int64_t>(C, {POINTWISE_CHUNK})"
        var("int64_t", {"CH": f"std::max<int64_t>({chunk}, 1)"})
        nch = "1" if p.reduction else "(C + CH - 1) / CH"  # a reduction of nothing still writes
        blocked = not p.reduction and any(
            a.col and f == "strided" for a, f in zip(p.accesses, p.fast))
        rows_per_item = f"((R + {BLOCK_ROWS} - 1) / {BLOCK_ROWS})" if blocked else "R"
        narrow = not blocked and self.narrow_rows(has_fast)
        if self.colsums:  # work items are runs of rows (column_sum_runs)
            self.column_sum_runs()
        elif narrow:  # blocks of rows along the innermost row dim (NARROW_ROWS)
            last = self.outer - 1
            var("int64_t", {"NCH": "1", "NJB": f"(D{last} + {NARROW_BLOCK - 1}) / {NARROW_BLOCK}",
                            "W": f"(D{last} > 0 ? R / D{last} : 0) * NJB"}, unused=("NCH",))
        else:
            var("int64_t", {"NCH": nch, "W": f"{rows_per_item} * NCH"})
        self.stage_call()
        loop_start = len(self.lines)
        w("  for (int64_t wi = 0; wi < W; ++wi) {")
        if self.colsums:
            w("    int64_t s = 0; while (wi >= CSF[s + 1]) ++s;")
            w(f"    const int64_t rb = R * s / CSS + {self.run} * (wi - CSF[s]);")
            w(f"    const int64_t re = std::min<int64_t>(rb + {self.run}, R * (s + 1) / CSS);")
            for k, _, _ in self.colsums:
                w(f"    float* __restrict__ ps{k} = pcs{k} + wi * C;")
                w(f"    for (int64_t c = 0; c < C; ++c) ps{k}[c] = 0.0f;")
            w("    for (int64_t r = rb; r < re; ++r) {")
            # the row's bounds written as the other row kernels' (NCH = 1; constants only as
            # s0, s1 below, see STATIC_BOUNDS): with `c0 = 0, c1 = C` g++ 12 compiled this
            # LayerNorm backward's passes 2.3x slower (98 vs 43 us a 512 x 128 call)
            w("    const int64_t c0 = (wi % NCH) * CH, c1 = std::min(c0 + CH, C);")
        elif blocked:
            w(f"   const int64_t rb0 = (wi / NCH) * {BLOCK_ROWS}, "
              f"rb1 = std::min<int64_t>(rb0 + {BLOCK_ROWS}, R);")
            w("   const int64_t cc0 = (wi % NCH) * CH, cc1 = std::min(cc0 + CH, C);")
            w(f"   for (int64_t cb = cc0; cb < cc1; cb += {BLOCK_COLS})")
            w("   for (int64_t r = rb0; r < rb1; ++r) {")
            w(f"    const int64_t c0 = cb, c1 = std::min<int64_t>(cb + {BLOCK_COLS}, cc1);")
        elif narrow:  # the block's rows, then the row's code (no index decomposition)
            self.narrow_block()
            self.body(has_fast)
            w("   }")
            w("  }")
            self.parallel_loop(loop_start)
            w("}")
            return "\n".join(self.lines) + "\n"
        else:
            w("    const int64_t r = wi / NCH, c0 = (wi % NCH) * CH, c1 = std::min(c0 + CH, C);")
        if self.static:
            # the row's bounds as constants (one row per work item, NCH = 1) for the loops
            # whose order does not depend on them: GCC unrolls a short row's loops and drops
            # their tails (bias + residual + LayerNorm, 512 x 64, one thread: 16.2 -> 12.4
            # us, Inductor's 12.1; docs/benchmarks.md, k16k)
            w(f"    constexpr int64_t s0 = 0, s1 = {self.static_cols()}; (void)s0; (void)s1;")
        w("    (void)c0; (void)c1;")
        w("    int64_t t = r; (void)t;")
        for d in range(self.outer - 1, -1, -1):
            w(f"    const int64_t i{d} = t % D{d}; t /= D{d};")
        for g, rows in enumerate(frames):
            w(f"    int64_t t{g} = r; (void)t{g};")
            for e in range(len(rows) - 1, -1, -1):
                w(f"    const int64_t i{g}_{e} = t{g} % F{g}_{e}; t{g} /= F{g}_{e};")
        for k, a in enumerate(p.accesses):
            g = self.frame_of[k]
            idx = [f"i{d}" for d in range(self.outer)] if g is None else \
                [f"i{g}_{e}" for e in range(len(self.frame_rows(k)))]
            if a.row_shift:  # the part's row, clamped into it (the select picks the part)
                e = a.row_shift[0]
                idx[e] = f"std::min<int64_t>(std::max<int64_t>(i{e} - ro{k}, 0), rn{k} - 1)"
            base = " + ".join(f"{i} * a{k}_{e}" for e, i in enumerate(idx)) or "0"
            w(f"    const int64_t b{k} = {base};")
        self.body(has_fast)
        if blocked or self.colsums:
            w("   }")
        w("  }")
        self.parallel_loop(loop_start)
        if self.colsums:
            self.column_sum_totals()
        w("}")
        return "\n".join(self.lines) + "\n"

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

    # hooks of a mixed reduction's kernel (emit_mixed): each pass over the row in a loop
    # over the outer reduced index, and where that row's per-element outputs start
    def pass_open(self) -> None:
        pass

    def pass_close(self) -> None:
        pass

    def out_row(self) -> str:
        """The offset of row r's per-element outputs."""
        return "r * C"

    def parallel_loop(self, start: int, count: str = "W") -> None:
        """Put the loop over ``count`` work items (``self.lines[start:]``) under ``omp
        parallel for``, with a serial copy for one-thread calls (SERIAL_COPY)."""
        condition = f"nt > 1 && {count} > 1 && R * C >= {PARALLEL_MIN}"
        pragma = "  #pragma omp parallel for num_threads(nt) schedule(static)"
        loop = self.lines[start:]
        del self.lines[start:]
        if not SERIAL_COPY:
            self.lines += [f"{pragma} if({condition})", *loop]
            return
        elements = sympy.Mul(*self.p.shape)
        if elements.is_Integer and int(elements) < PARALLEL_MIN:
            self.lines += loop
            return
        if not ONE_BODY:
            self.lines += [f"  if ({condition}) {{", pragma, *loop, "  } else {", *loop, "  }"]
            return
        self.lines += work_items.one_body(self.kernel_vars.values(), loop, count, condition,
                                          pragma)

    @property
    def static(self) -> bool:
        """Whether the work item defines the row's bounds as constants s0, s1 (see
        STATIC_BOUNDS; one row per work item)."""
        return STATIC_BOUNDS and self.p.reduction and self.static_cols() is not None

    # --- column sums over the rows -----------------------------------------------------
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

    def output_targets(self) -> list:
        """The column values the last pass computes: the per-element outputs and the
        summands of the column sums."""
        return [x for x, _ in self.p.outputs if x.level == "col" and x.kind != "colsum"] + \
            [x.args[0] for _, x, _ in self.colsums]

    def column_sum_tail(self, path, lane) -> list[str]:
        """Lines adding column c's summands into this run's partials (as emit_columns'
        sweep adds them: converted to fp32, one add)."""
        return [sum_update(x, f"ps{k}[c]", conv(self.var(x.args[0]), x.args[0].dtype, x.dtype),
                           self.var) for k, x, _ in self.colsums]

    def static_cols(self) -> int | None:
        """The row length when it is a constant, else None."""
        cols = sympy.Mul(*self.p.shape[self.outer:])
        return int(cols) if cols.is_Integer else None

    # --- frames ---------------------------------------------------------------------
    def frame_rows(self, k: int) -> tuple:
        """The leading (row) dims of access k's frame (see ``program.Access``)."""
        a = self.p.accesses[k]
        frame = tuple(a.frame) or tuple(self.p.shape)
        return frame[:len(frame) - self.p.m]

    def stride(self, k: int, d: int) -> str:
        """Access k's stride along column dim d of the domain."""
        a = self.p.accesses[k]
        nf = len(a.frame) if a.frame else self.n
        return f"a{k}_{d + nf - self.n}"

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
                rhs = f"sr{k}[c]"
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

    def staging(self, deps, outs) -> tuple[list, list]:
        """The fast path's fp16 loads (accesses) and outputs staged in float blocks: those
        read or written contiguously along the columns, unless an output aliases an input."""
        p = self.p
        if not STAGE_HALF or any(wr.direct for wr in getattr(p, "writes", {}).values()):
            return [], []
        ins = sorted(self.half_accesses(deps) - self.row_staged)
        return ins, [o for o in outs if o[2].dtype == torch.float16]

    def half_accesses(self, nodes) -> set[int]:
        """The accesses of the fp16 column loads among ``nodes`` read with unit stride."""
        p = self.p
        return {x.attrs["access"] for x in nodes if x.kind == "load" and x.level == "col"
                and x.id not in self.stored and p.fast[x.attrs["access"]] == "unit"
                and p.input_specs[p.accesses[x.attrs["access"]].input].dtype == torch.float16}

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
        shared = {k for k in self.half_accesses([x for x in p.nodes if x.id in self.needed])
                  if all(dim_mult(e)[0] is None
                         for e in p.accesses[k].dims[:len(self.frame_rows(k))])}
        for k in sorted(shared):
            self.w(f"  alignas(64) float sr{k}[{cols}];")
            self.kernel_var(KernelVar(f"sr{k}", "float", array=True))
            self.w(f"  if (fast) pi_ld_f16_n(in{p.accesses[k].input}, sr{k}, C);")
        self.row_staged |= shared

    def stage_rows(self) -> None:
        """Convert the fp16 row inputs of a multi-pass row kernel once per row (ROW_STAGE)."""
        p = self.p
        cols = self.row_stageable()
        if not cols or not p.reduction or self.passes < 1 or not self.outer:
            return
        rows = self.half_accesses(
            [x for x in p.nodes if x.id in self.needed and x.id not in self.stored]) \
            - self.row_staged
        self.row_staged |= rows
        for k in sorted(rows):
            self.w(f"    alignas(64) float sr{k}[{int(cols)}];")
            self.w(f"    if (fast) pi_ld_f16_n(in{p.accesses[k].input} + b{k}, sr{k}, C);")

    @staticmethod
    def fallback(path: str, has_fast: bool) -> bool:
        """Whether ``path`` is a generic path written as COMPACT_FALLBACK's scalar loops."""
        return COMPACT_FALLBACK and has_fast and path == "generic"

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

    def loop(self, has_fast: bool, targets, tail, bounds=("c0", "c1"), outs=(),
             only: str | None = None) -> None:
        """The column loop computing ``targets`` then running ``tail(path, lane)`` lines and
        storing the per-element outputs ``outs`` ((k, node, spec)); ``only``: that path
        alone, in a plain block (the caller branches on ``fast``)."""
        reductions = [x for x in targets if x.kind == "reduce"]
        paths = [only] if only else ["fast", "generic"] if has_fast else ["generic"]
        segs = len(getattr(self.p, "cat_bounds", None) or []) + 1
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
                if blocks:  # blocks of STAGE columns through float buffers
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
                    for k in sorted(staged_outs):
                        self.w(f"      pi_st_f16_n(so{k}, out{k} + {self.out_row()} + cs, "
                               "ce - cs);")
                    self.w("      }")
                    self.staged = {}
                    self.blocked = {}
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
                self.row_nodes(stage)
                continue
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
