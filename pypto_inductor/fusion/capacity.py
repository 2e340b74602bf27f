"""On-chip capacity: iteration domains, tile shapes and footprints.

A vector FusionTile iterates over a domain D (a shape) with optional reduction
axes A. It is tiled as (rows, cols): cols spans the reduced extent (the whole
row, so one pass suffices) or, without reductions, the last dimension; rows
split the rest. Its footprint is

    buffering * sum(itemsize(v) * tile_elems(v) for every live tile buffer v)

as a sympy expression in the tile rows/cols; it must fit the hardware model's
vector buffer (UB on Ascend, one core's L2 on the host). Matmul FusionTiles
use (tm, tn, tk) tiles against the cube buffer (L1).
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import sympy
import torch

from ..hardware import HardwareModel
from ..ir import OpKind, TensorSpec, TileGraph, TileOp
from ..sizes import numel

TILE_ROWS = sympy.Symbol("tile_rows", positive=True, integer=True)
TILE_COLS = sympy.Symbol("tile_cols", positive=True, integer=True)
TILE_M, TILE_N, TILE_K = sympy.symbols("tile_m tile_n tile_k", positive=True, integer=True)

# A row kernel (a reduction over one trailing dim of length L) tiles its elements as rows of
# L: a pointwise value of the kernel's size joins it only when its last dim is a multiple of
# L (a split of that dim into rows). A shorter last dim (a causal LM loss's labels[:, 1:]
# copy, [4, 128], summed as 512 flat labels) needs a row to span several of its rows: the
# whole tile then ran on the reference executor (GPT-2's loss: 49 us a call, for 2 us native
# kernels apart; k16x). False: admitted by size alone, as before.
ROW_LAST_DIM_SPLITS = True

_ROW_CHOICES = (1024, 512, 256, 128, 64, 32, 16, 8, 4, 2, 1)
_MAX_POINTWISE_COLS = 4096
_CUBE_CHOICES = ((256, 128, 256), (128, 128, 128), (128, 64, 128), (64, 64, 64),
                 (32, 32, 64), (16, 16, 32), (16, 16, 16))


@dataclasses.dataclass(frozen=True)
class Domain:
    """How a group of ops iterates.

    kind "pointwise": ``numel`` elements in row-major order (shape is one example);
    "row": ``numel`` rows of ``rnumel`` elements, a reduction over trailing dims;
    "reduce": a reduction over other dims, exact input ``shape`` and ``reduce_axes``;
    "matmul": ``numel`` output elements with K streamed.
    Row-major order is what lets a pointwise op of shape [32, 64] and one of
    shape [2, 16, 64] (joined by a reshape) share one kernel.
    """

    kind: str
    numel: sympy.Expr
    rnumel: sympy.Expr = sympy.Integer(1)
    shape: tuple = ()
    reduce_axes: tuple[int, ...] = ()
    column_sum: bool = False  # "reduce": a float sum over every dim but the last (column_sum)

    @property
    def matmul(self) -> bool:
        return self.kind == "matmul"

    def reduced_shapes(self) -> set[tuple]:
        keep = tuple(1 if i in self.reduce_axes else s for i, s in enumerate(self.shape))
        drop = tuple(s for i, s in enumerate(self.shape) if i not in self.reduce_axes)
        return {keep, drop}

    def admits(self, numel, shape: tuple) -> bool:
        """Can a pointwise op with this output live in a tile over this domain?"""
        if self.kind == "row":
            if numel == self.numel * self.rnumel and numel != self.numel:
                return self.splits_rows(shape)
            return numel == self.numel * self.rnumel or numel == self.numel
        if self.kind == "reduce":
            return shape == self.shape or shape in self.reduced_shapes()
        return numel == self.numel

    def splits_rows(self, shape: tuple) -> bool:
        """Whether a value of this row domain's size and ``shape`` splits into its rows: its
        last dim (trailing 1s aside) a multiple of the reduced dim (ROW_LAST_DIM_SPLITS)."""
        core = list(shape)
        while core and core[-1] == 1:
            core.pop()
        if not ROW_LAST_DIM_SPLITS or len(self.reduce_axes) != 1 or not core \
                or tuple(shape) == tuple(self.shape):
            return True
        q = sympy.simplify(sympy.sympify(core[-1]) / self.shape[-1])
        return bool(q.is_integer and q.is_positive)


def op_domain(op: TileOp, graph: TileGraph) -> Domain:
    if op.kind is OpKind.REDUCTION:
        shape = graph.specs[op.args[0]].shape
        dims = tuple(op.attrs["dims"])
        first = len(shape) - len(dims)
        if dims == tuple(range(first, len(shape))):
            return Domain("row", numel(shape[:first]), numel(shape[first:]), shape, dims)
        return Domain("reduce", numel(shape), sympy.Integer(1), shape, dims,
                      column_sum(op, graph))
    kind = "matmul" if op.kind is OpKind.MATMUL else "pointwise"
    return Domain(kind, op.out.numel, sympy.Integer(1), op.out.shape)


def group_domain(ops: list[TileOp], graph: TileGraph) -> Domain:
    """The domain a group iterates: its matmul's or reduction's; a row reduction's when the
    group also sums columns over those rows (row_column_sums); a pointwise one when it sums
    columns over the rows of elementwise values of another shape (rows_of_sums)."""
    first = None
    for op in ops:
        if op.kind is OpKind.MATMUL:
            return op_domain(op, graph)
        if op.kind is OpKind.REDUCTION:
            dom = op_domain(op, graph)
            if dom.kind == "row":
                return dom
            first = first or dom
    if first is None:
        return op_domain(ops[0], graph)
    return rows_of_sums(ops, first, graph) or first


def rows_of_sums(ops: list[TileOp], red: Domain, graph: TileGraph) -> Domain | None:
    """The pointwise domain of a group whose reductions are column sums over a reshape of
    its elementwise values (GELU's backward [B, T, H] summed as [B*T, H] over dim 0: the
    bias gradient): a column kernel over the sum's input (``red``) cannot hold values of
    another shape, so the sums are computed over the pointwise kernel's rows instead
    (row_column_sums). None when every value has the sum's shape: a column kernel."""
    if not red.column_sum or any(op.kind is OpKind.REDUCTION and not column_sum(op, graph)
                                 for op in ops):
        return None
    for op in ops:
        if op.kind is not OpKind.REDUCTION and op.out.shape != red.shape and op.out.shape \
                and sympy.expand(op.out.numel - red.numel) == 0 \
                and sympy.expand(op.out.shape[-1] - red.shape[-1]) == 0:
            return Domain("pointwise", op.out.numel, sympy.Integer(1), op.out.shape)
    return None


def kernel_rows(dom: Domain) -> tuple | None:
    """(rows, columns) of a kernel iterating rows of C columns: a row reduction over one last
    dim; a pointwise kernel or a matmul's epilogue over its last dim. None otherwise."""
    if dom.kind == "row":
        return (dom.numel, dom.rnumel) if len(dom.reduce_axes) == 1 else None
    if dom.kind in ("pointwise", "matmul") and dom.shape:
        return dom.numel / dom.shape[-1], dom.shape[-1]
    return None


def sums_over_rows(ops: list[TileOp], graph: TileGraph) -> list[TileOp]:
    """The column sums a kernel of ``ops`` computes over its rows (row_column_sums): none
    unless its domain is a row reduction's, a pointwise kernel's or a matmul's."""
    sums = [op for op in ops if op.kind is OpKind.REDUCTION and column_sum(op, graph)]
    if not sums or group_domain(ops, graph).kind == "reduce":
        return []
    return sums


def column_sum(op: TileOp, graph: TileGraph) -> bool:
    """A float sum over every dim but the last: a bias or a norm weight's gradient."""
    if op.op != "sum" or not isinstance(op.args[0], str) \
            or op.out.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        return False
    shape = graph.specs[op.args[0]].shape
    return len(shape) >= 2 and tuple(op.attrs.get("dims", ())) == tuple(range(len(shape) - 1))


def row_column_sums(kernel: Domain, red: Domain) -> str | None:
    """None when a kernel iterating rows of C columns (``kernel``: a row reduction, a
    pointwise kernel, a matmul's epilogue; kernel_rows) can also compute the column sum
    ``red`` over its rows in the same pass, else the reason. The sum reads rows x C values
    in the kernel's order. C is a constant multiple of 16: the column-sum kernel
    (emit_columns) splits columns in blocks of 1024 or of a multiple of 16, and vectorises
    a block under 8 columns over the rows, in another order; the fused sums add rows
    exactly as it does."""
    if not red.column_sum:
        return "only a float sum over every dim but the last joins a row kernel"
    rows = kernel_rows(kernel)
    if rows is None:
        return "a row kernel reducing several dims does not sum columns"
    cols = red.shape[-1]
    if sympy.expand(cols - rows[1]) != 0 \
            or sympy.expand(red.numel - rows[0] * rows[1]) != 0:
        return (f"the column sum's rows are not the {kernel.kind} kernel's "
                f"({_fmt(red)} vs {_fmt(kernel)})")
    if not sympy.sympify(cols).is_Integer or int(cols) < 16 or int(cols) % 16:
        return f"a column sum over {cols} columns (not a constant multiple of 16)"
    return None


def cat_part_ops(ops: list[TileOp], outputs) -> set[str]:
    """Pointwise ops of a kernel computed only to feed cat parts (directly or through each
    other; a column cat feeding another cat counts too): a kernel computes them per part,
    at the part's elements, so they have no iteration domain of their own there
    (rotate_half's ``neg`` over half the columns of its cat)."""
    users: dict[str, list] = {op.name: [] for op in ops}
    for op in ops:
        for a in op.inputs:
            if a in users:
                users[a].append(op)
    out: set[str] = set()
    for op in reversed(ops):
        column_cat = op.op == "cat" and op.attrs["dim"] == len(op.out.shape) - 1
        if (op.kind in (OpKind.ELEMENTWISE, OpKind.BROADCAST, OpKind.CAST) or column_cat) \
                and op.name not in outputs and users[op.name] \
                and all(u.op in ("cat", "pad") or u.name in out for u in users[op.name]):
            out.add(op.name)
    return out


def pointwise_outputs(ops: list[TileOp]) -> set[tuple]:
    """(numel, shape) of every non-reduction op of a group."""
    return {(op.out.numel, op.out.shape) for op in ops if op.kind is not OpKind.REDUCTION}


def domains_compatible(a: Domain, b: Domain, pw_a: set, pw_b: set,
                       column_sums: bool = False) -> str | None:
    """None when two groups may share one iteration domain, else the reason.
    ``column_sums``: a kernel iterating rows (a row reduction, a pointwise kernel over a
    reshape of the sum's input, a matmul's epilogue) may also sum columns over its rows
    (row_column_sums)."""
    if a.matmul and b.matmul:
        return "two matmuls never share a kernel"
    if a.matmul or b.matmul:
        mm, other, other_pw = (a, b, pw_b) if a.matmul else (b, a, pw_a)
        if column_sums and other.kind == "reduce" and other.column_sum:
            return _sums_join(mm, other, other_pw, "a matmul epilogue must have the matmul's "
                                                   "output size")
        if other.kind in ("row", "reduce"):
            return "a matmul epilogue must be elementwise (the other side reduces)"
        if any(n != mm.numel for n, _ in other_pw):
            return "a matmul epilogue must have the matmul's output size"
        return None
    if column_sums and {a.kind, b.kind} == {"row", "reduce"}:
        row, red, red_pw = (a, b, pw_b) if a.kind == "row" else (b, a, pw_a)
        return _sums_join(row, red, red_pw, f"iteration domains differ ({_fmt(a)} vs {_fmt(b)})")
    if a.kind in ("row", "reduce") and b.kind in ("row", "reduce"):
        same = (a.kind == b.kind and a.numel == b.numel and a.rnumel == b.rnumel
                and (a.kind == "row" or (a.shape, a.reduce_axes) == (b.shape, b.reduce_axes)))
        return None if same else f"reductions over different domains ({_fmt(a)} vs {_fmt(b)})"
    dom, other_pw = (a, pw_b) if a.kind != "pointwise" or b.kind == "pointwise" else (b, pw_a)
    if all(dom.admits(n, shape) for n, shape in other_pw):
        return None
    if column_sums and {a.kind, b.kind} == {"pointwise", "reduce"}:
        # a column kernel cannot hold the pointwise values (another shape): the pointwise
        # kernel sums the columns over its rows (rows_of_sums)
        pw, red, red_pw = (a, b, pw_b) if a.kind == "pointwise" else (b, a, pw_a)
        return _sums_join(pw, red, red_pw, f"iteration domains differ ({_fmt(a)} vs {_fmt(b)})")
    return f"iteration domains differ ({_fmt(a)} vs {_fmt(b)})"


def _sums_join(kernel: Domain, red: Domain, red_pw: set, differ: str) -> str | None:
    """None when the column-sum group ``red`` (pointwise outputs ``red_pw``) may join the
    kernel iterating rows ``kernel``, else the reason."""
    why = row_column_sums(kernel, red)
    # the sum's result and its casts (stored by the kernel after its last row:
    # planner.column_sums_read) have the sum's shape
    red_pw = {(n, shape) for n, shape in red_pw if shape not in red.reduced_shapes()}
    if why is None and not all(kernel.admits(n, shape) for n, shape in red_pw):
        why = differ
    return why


def _fmt(d: Domain) -> str:
    shape = "[" + ", ".join(str(s) for s in d.shape) + "]"
    return f"{shape} reducing {list(d.reduce_axes)}" if d.kind in ("row", "reduce") else shape


@dataclasses.dataclass(frozen=True)
class TilePlan:
    tile_shape: tuple[int, ...]
    footprint_bytes: int  # at the chosen tile and example sizes
    capacity_bytes: int
    fits: bool
    # builds footprint_expr: the planner sizes ~1000 candidate tiles of a GPT-2 step and
    # keeps ~100, and only those kept show the sympy expression (kernel listing, report)
    expr_of: Callable[[], sympy.Expr] = dataclasses.field(repr=False, compare=False)

    @functools.cached_property
    def footprint_expr(self) -> sympy.Expr:
        """The footprint in bytes over the TILE_* symbols."""
        return self.expr_of()


# what one (rows x cols) tile of a domain touches of a value: rows x cols, rows or cols
_ROWS_COLS, _ROWS, _COLS = "rows x cols", "rows", "cols"
_ELEMS_EXPR = {_ROWS_COLS: TILE_ROWS * TILE_COLS, _ROWS: TILE_ROWS, _COLS: TILE_COLS}


def _tile_extent(spec: TensorSpec, domain: Domain) -> str:
    """Which elements of ``spec`` one (rows x cols) tile of ``domain`` touches."""
    full = domain.numel * domain.rnumel
    if spec.numel == full:
        return _ROWS_COLS
    if domain.kind == "row" and spec.numel == domain.numel:
        return _ROWS
    if domain.kind == "reduce" and spec.shape in domain.reduced_shapes():
        return _ROWS
    if spec.shape and spec.shape[-1] == 1:
        return _ROWS  # a per-row operand, e.g. [B, S, 1]
    return _COLS  # a per-column operand, e.g. a bias [H]


def _tile_elems(spec: TensorSpec, domain: Domain) -> sympy.Expr:
    """Elements of ``spec`` that one (rows x cols) tile of ``domain`` touches."""
    return _ELEMS_EXPR[_tile_extent(spec, domain)]


def _elems(extent: str, rows: int, cols: int) -> int:
    return rows * cols if extent == _ROWS_COLS else rows if extent == _ROWS else cols


def _buffers(ops: list[TileOp], graph: TileGraph) -> list[TensorSpec]:
    names: list[str] = []
    for op in ops:
        for n in op.inputs + [op.name]:
            if n not in names:
                names.append(n)
    return [graph.specs[n] for n in names]


def _compute_itemsize(spec: TensorSpec) -> int:
    """Bytes of one element inside a kernel: floats compute in fp32 (or wider)."""
    return max(spec.itemsize, 4) if spec.dtype.is_floating_point else spec.itemsize


def _footprint_expr(ops: list[TileOp], graph: TileGraph, hw: HardwareModel, buffering: int,
                    domain: Domain) -> sympy.Expr:
    """The footprint over TILE_ROWS/TILE_COLS.

    The footprint follows ``hw.footprint_model``: "all_live" is buffering x every
    live tile buffer; "per_op" is the largest operand + result working set of one op
    in the compute dtype (pypto places UB buffers per op, reusing them).
    """
    if hw.footprint_model == "per_op":
        sets = []
        for op in ops:
            names = list(dict.fromkeys(op.inputs + [op.name]))
            sets.append(sum(_compute_itemsize(graph.specs[n]) * _tile_elems(graph.specs[n], domain)
                            for n in names))
        return sympy.Max(*sets) if len(sets) > 1 else sets[0]
    return buffering * sum(spec.itemsize * _tile_elems(spec, domain)
                           for spec in _buffers(ops, graph))


def _footprint_functions(ops: list[TileOp], graph: TileGraph, hw: HardwareModel,
                         buffering: int, domain: Domain):
    """(footprint, largest single tile buffer or None) as functions of (rows, cols) ->
    bytes: :func:`_footprint_expr`'s integer sums (and maxima) without sympy per tile
    shape tried; the largest buffer where ``hw.max_tile_buffer_fraction`` limits it."""
    names = list(dict.fromkeys(n for op in ops for n in op.inputs + [op.name]))  # _buffers'
    extent = {n: _tile_extent(graph.specs[n], domain) for n in names}
    buffers = [(graph.specs[n], extent[n]) for n in names]
    if hw.footprint_model == "per_op":
        sets = [[(_compute_itemsize(graph.specs[n]), extent[n])
                 for n in dict.fromkeys(op.inputs + [op.name])] for op in ops]

        def footprint(rows: int, cols: int) -> int:
            return max(sum(size * _elems(e, rows, cols) for size, e in terms) for terms in sets)
    else:
        terms = [(spec.itemsize, e) for spec, e in buffers]

        def footprint(rows: int, cols: int) -> int:
            return buffering * sum(size * _elems(e, rows, cols) for size, e in terms)
    largest = None
    if hw.max_tile_buffer_fraction is not None:
        bufs = [(_compute_itemsize(spec), e) for spec, e in buffers]

        def largest(rows: int, cols: int) -> int:
            return max(size * _elems(e, rows, cols) for size, e in bufs)
    return footprint, largest


def plan_tile(ops: list[TileOp], graph: TileGraph, hw: HardwareModel, buffering: int) -> TilePlan:
    """The tile shape of a group of ops and its footprint against the hardware's buffer.

    Vector tiles: the most rows (from _ROW_CHOICES) that fit, over cols spanning the
    reduced extent (row/reduce domains) or the last dim (pointwise: halved until it
    fits). The hardware model's tile preferences (``preferred_max_tile_cols``,
    ``tile_col_align_bytes``, ``min_tile_rows``, ``max_tile_buffer_fraction``) shape
    pointwise tiles for targets such as pypto; with their defaults (the host) none
    of them applies.
    """
    domain = group_domain(ops, graph)
    if domain.matmul:
        return _plan_cube_tile(ops, graph, hw, buffering, domain)
    capacity = hw.vector_capacity_bytes
    at_tile, largest = _footprint_functions(ops, graph, hw, buffering, domain)
    buffer_cap = (None if hw.max_tile_buffer_fraction is None
                  else int(hw.max_tile_buffer_fraction * capacity))
    if domain.kind == "row":
        cols_expr = domain.rnumel
    elif domain.kind == "reduce":
        cols_expr = numel([domain.shape[a] for a in domain.reduce_axes])
    else:
        cols_expr = domain.shape[-1] if domain.shape else sympy.Integer(1)
    cols = graph.hint(cols_expr)
    full_cols = cols
    if domain.kind == "pointwise":
        cols = min(cols, _MAX_POINTWISE_COLS)
    total = graph.hint(domain.numel * domain.rnumel)
    item = max((_compute_itemsize(s) for s in _buffers(ops, graph)), default=4)
    align = max(hw.tile_col_align_bytes // item, 1)

    def aligned(c: int) -> int:
        return c if c >= full_cols or align <= 1 else max(align, c - c % align)

    if domain.kind == "pointwise" and hw.preferred_max_tile_cols is not None:
        # Few rows: keep wider columns so one tile still holds a full buffer's worth.
        per_buffer = (buffer_cap or capacity) // item
        domain_rows = max(total // max(full_cols, 1), 1)
        cols = aligned(min(cols, max(hw.preferred_max_tile_cols, per_buffer // domain_rows)))

    def measure(rows: int, c: int) -> tuple[int, bool]:
        footprint = at_tile(rows, c)
        ok = footprint <= capacity and (largest is None or largest(rows, c) <= buffer_cap)
        return footprint, ok

    def choose_rows(c: int) -> tuple[int, int, bool]:
        rows_max = max(total // max(c, 1), 1)
        for rows in _ROW_CHOICES:
            if rows > rows_max and rows != 1:
                continue
            footprint, ok = measure(rows, c)
            if ok or rows == 1:
                return rows, footprint, ok
        raise AssertionError("unreachable")

    rows, footprint, ok = choose_rows(cols)
    if domain.kind == "pointwise":
        # Keep at least min_tile_rows rows (where the domain has them) by narrowing.
        want = min(hw.min_tile_rows, max(total // max(cols, 1), 1))
        while rows < want and cols > align and aligned(cols // 2) < cols:
            cols = aligned(cols // 2)
            rows, footprint, ok = choose_rows(cols)
            want = min(hw.min_tile_rows, max(total // max(cols, 1), 1))
        # narrower columns still fit
        while not ok and cols > 1:
            cols //= 2
            footprint, ok = measure(rows, cols)
    ops = list(ops)
    return TilePlan((rows, cols), footprint, capacity, ok,
                    lambda: _footprint_expr(ops, graph, hw, buffering, domain))


def _plan_cube_tile(ops, graph, hw, buffering, domain) -> TilePlan:
    matmul = next(op for op in ops if op.kind is OpKind.MATMUL)
    itemsize = matmul.out.itemsize
    epilogue = [spec for spec in _buffers(ops, graph) if spec.numel == domain.numel]
    if hw.footprint_model == "per_op":
        # The cube buffer holds the operand tiles and the accumulator; the epilogue
        # runs op by op on the vector unit, in its own buffer (UB on Ascend).
        epilogue = []
    epilogue_bytes = sum(s.itemsize for s in epilogue)

    def expr() -> sympy.Expr:
        return (buffering * itemsize * (TILE_M * TILE_K + TILE_K * TILE_N)
                + TILE_M * TILE_N * 4  # fp32 accumulator
                + buffering * TILE_M * TILE_N * epilogue_bytes)
    capacity = hw.cube_capacity_bytes
    a_shape = graph.specs[matmul.args[0]].shape
    m, n, k = (graph.hint(a_shape[-2]), graph.hint(domain.shape[-1]), graph.hint(a_shape[-1]))
    for tm, tn, tk in _CUBE_CHOICES:
        tm, tn, tk = min(tm, m), min(tn, n), min(tk, k)  # never larger than the problem
        footprint = (buffering * itemsize * (tm * tk + tk * tn) + tm * tn * 4
                     + buffering * tm * tn * epilogue_bytes)
        if footprint <= capacity:
            break
    return TilePlan((tm, tn, tk), footprint, capacity, footprint <= capacity, expr)
