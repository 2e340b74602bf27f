"""C++ source for one analysed FusionTile (a :class:`.program.Program`).

The function is ``extern "C" void pi_kernel(void* const* ptrs, const int64_t*
meta, const int64_t* syms, int nt)``: ``ptrs`` holds the inputs then the
outputs, ``meta`` each input's sizes then strides, ``syms`` the graph's size
symbols, ``nt`` the thread count. Domain sizes are printed from sympy with
torch's CppPrinter. Work items (rows, or row chunks for pointwise tiles, or blocks of
rows for pointwise tiles of a few columns) run under ``omp parallel for``; each reduction is one ``omp simd reduction`` pass
over the row; a fast path with unit/zero column strides (checked once per call)
is emitted beside a generic strided path.

This module writes the kernel's frame: its signature, sizes and strides, the fast path's
check, the work items and the parallel loop over them. The rest of :class:`RowEmitter`
comes from one mixin per concept: :mod:`.row_loop` (a work item's passes, values and
column loop), :mod:`.row_sums` (how a pass over the row sums: blocks, lanes, eager's
order), :mod:`.half_staging` (fp16 through float blocks), :mod:`.narrow_rows` (blocks of
rows of a few columns) and :mod:`.row_column_sums` (column sums over the rows).
"""
from __future__ import annotations

import sympy
import torch

from . import work_items
from .half_staging import HalfStaging
from .indexing import index_prologue
from .narrow_rows import NarrowRows
from .ops import EXTRA_PRELUDE, STORAGE, mark_contractions, size
from .prelude import PRELUDE
from .row_column_sums import ColumnSumRuns
from .row_loop import RowLoop
from .row_sums import RowSums
from .work_items import PARAMS, KernelVar
POINTWISE_CHUNK = 16384  # elements per work item in pointwise tiles
PARALLEL_MIN = 32768  # fewer elements run on one thread
# Pointwise tiles reading a strided input (a transpose) run blocks of BLOCK_ROWS rows x
# BLOCK_COLS columns, rows inner: the rows of a block share the cache lines of the strided
# reads (the block shape measured on attention's K^T copy: docs/benchmarks.md).
BLOCK_ROWS, BLOCK_COLS = 64, 32
# Reduction kernels over constant rows define the row's bounds as constants s0, s1 (one row
# per work item), so GCC unrolls short rows' loops: LayerNorm 512x64 16.2 -> 12.4 us. Only
# loops whose results cannot depend on them take them: pointwise loops and the fast path of
# sums whose order vector_lanes writes out. An `omp simd` sum keeps run-time bounds: GCC
# picks its vector factor and epilogue from what it knows of the trip count (constant
# bounds changed ViT's loss through log_softmax's sum of exp over 10 classes).
# tests/test_static_bounds.py: the same bits with the switch on and off.
STATIC_BOUNDS = True
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


class RowEmitter(RowLoop, RowSums, HalfStaging, NarrowRows, ColumnSumRuns):
    """The C++ of a row kernel: ``RowEmitter(program).source()``."""

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
            self.narrow_items()
        else:
            var("int64_t", {"NCH": nch, "W": f"{rows_per_item} * NCH"})
        self.stage_call()
        loop_start = len(self.lines)
        w("  for (int64_t wi = 0; wi < W; ++wi) {")
        if self.colsums:  # the run's rows (closed below)
            self.column_sum_item()
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
