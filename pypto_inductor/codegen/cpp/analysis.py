"""FusionTile -> kernel program (:class:`.program.Program`) for the native CPU target.

:func:`analyse` turns a tile into a :class:`Program`: loads, ops and reductions,
each at row or column level, or raises :class:`NotNative` naming what is
outside the native slice (the tile then runs the reference executor).

Iteration: a tile's domain D is split into rows (the outer dims, flattened,
run in parallel with OpenMP) and columns (the reduced trailing dims of a
reduction tile; for a pointwise tile the longest trailing run every input
reads contiguously or broadcast). Input sizes and strides are kernel arguments,
so dynamic sizes never recompile. Reshapes inside a tile keep the flat
(row, column) order of every value: each input is read in its own *frame*
(:class:`Access`), with the row index decomposed over the frame's leading dims.
Reductions over other dims than the innermost ones are analysed in
:mod:`.reduction`.
"""
from __future__ import annotations

import dataclasses

import sympy
import torch

from ...fusion.capacity import cat_part_ops, column_sum, group_domain
from ...ir import FusionTile, OpKind, TileGraph, TileOp
from ...sizes import is_symbolic
from ...sizes import numel as _numel
from ...sizes import same_shape as _same_shape
from ...sizes import same_size as _same
from .indexing import IndexCheck, IndexingMixin
from .ops import OPS
from .program import DTYPES, Access, Lit, Node, NotNative, Program, dim_mult
from .reduction import ReductionAnalysis


def _core(shape) -> tuple:
    """The shape without its trailing 1s."""
    shape = tuple(shape)
    while shape and _same(shape[-1], 1):
        shape = shape[:-1]
    return shape


def _unit_dims_map(shape, vshape, vdims):
    """``vdims`` (input dims of ``vshape``) re-indexed for ``shape`` when the two shapes
    differ only in 1s (an unsqueeze/squeeze as a reshape), else None."""
    big = [(s, j) for s, j in zip(vshape, vdims) if not _same(s, 1)]
    out, k = [], 0
    for s in shape:
        if _same(s, 1):
            out.append(None)
        elif k < len(big) and _same(s, big[k][0]):
            out.append(big[k][1])
            k += 1
        else:
            return None
    return tuple(out) if k == len(big) else None


class _Analyser(IndexingMixin, ReductionAnalysis):
    def __init__(self, tile: FusionTile, graph: TileGraph):
        self.tile, self.graph = tile, graph
        self.nodes: list[Node] = []
        self.env: dict[str, Node] = {}
        self.accesses: dict[tuple, int] = {}
        self.access_list: list[Access] = []
        self.loads: dict[tuple, Node] = {}
        self.slot = {name: i for i, name in enumerate(tile.inputs)}
        self.input_views: dict[str, tuple] = {}  # view -> (input, shape, input dim per dim)
        # cats: the ops computed only for their parts are lowered once per part
        # (``shift``: the cat dim, the part's first index there, the cat's shape)
        self.ops = {op.name: op for op in tile.ops}
        self.deferred: set[str] = set()
        self.shift: tuple | None = None
        self.row_outer: tuple = ()  # (dim, offset) of the row cat part a column cat is in
        self.part_env: dict[tuple, Node] = {}
        self.cat_bounds: list | None = None
        self.row_cat_dims: list[int] = []  # domain dims a cat runs along (rows, not columns)
        self.made: dict[tuple, Node] = {}  # pure nodes by (kind, level, args, dtype, attrs)
        self.perm: tuple | None = None  # a column reduction's domain dims order, see tshape
        self.mixed = 0  # a mixed reduction's reduced dims before its kept ones (transpose)
        # a column reduction's values indexed by its kept dims only (a view dropping the
        # reduced 1s of its result, the ops over such values): see ReductionAnalysis.kept_view
        self.kept_values: set[str] = set()
        self.in_kept = False  # the op being lowered is one of them (align reads into kept)
        self.origin = ""  # the tile op being lowered (Node.origin)
        self.group = ""  # its ATen op call (Node.group)
        self.checks: list[IndexCheck] = []  # index inputs scanned before the loop
        self.copies: dict[str, str] = {}  # copy_ op -> the input it writes
        self.where_used: set[str] = set()  # gathers read where used (cpp_indexing)
        self.row_sums = False  # a pointwise tile summing columns over its rows

    # --- nodes -------------------------------------------------------------------
    def node(self, kind, level, args, vdtype, shape=None, /, **attrs) -> Node:
        n = Node(len(self.nodes), kind, level, list(args), vdtype, attrs, shape, self.origin,
                 self.group)
        self.nodes.append(n)
        return n

    def expr(self, level, fmt, *args) -> Node:
        return self.shared("expr", level, args, None, fmt=fmt)

    def reduce(self, red, x: Node, acc_dtype=None) -> Node:
        return self.shared("reduce", "row", [x], acc_dtype, red=red)

    def shared(self, kind, level, args, vdtype, **attrs) -> Node:
        """A pure node, made once: LayerNorm's var_mean and mean both sum the row, and
        the kernel then keeps one accumulator for the two."""
        key = (kind, level, tuple(getattr(a, "id", a) for a in args), vdtype,
               tuple(sorted(attrs.items())))
        if key not in self.made:
            self.made[key] = self.node(kind, level, args, vdtype, **attrs)
        return self.made[key]

    # --- contexts ------------------------------------------------------------------
    def context(self, shape) -> tuple:
        """(kind, shape, frame, cut) of an op of this output shape.

        kind "col": one value per element (the shape has the domain's element count and
        ends with its column dims; a reshape of the domain when it differs); "keep" /
        "drop": one value per row (the row count, with or without the reduced dims as
        1s). ``frame`` is the shape inputs are read in (see :class:`Access`): in a
        pointwise tile, the shape without its last ``cut`` dims (trailing 1s) and with
        its last dim split to the column length (see :meth:`split_last`).
        """
        shape = tuple(shape)
        D, m = self.D, self.m_red
        if self.shift is not None:  # a value feeding a cat part: the part's shape
            axis, _, full = self.shift
            if len(shape) != len(full) or not all(
                    _same(x, y) for e, (x, y) in enumerate(zip(shape, full)) if e != axis):
                raise NotNative(f"a value of shape {list(shape)} feeds a cat part of "
                                f"{list(full)} along dim {axis}")
            return ("col", shape, shape, 0)
        if shape == D:
            return ("col", shape, shape, 0)
        if not m:
            if _same(_numel(shape), _numel(D)):
                core = _core(shape)
                return ("col", shape, self.split_last(core), len(shape) - len(core))
        else:
            tail = D[len(D) - m:]
            if len(shape) >= m and _same_shape(shape[len(shape) - m:], tail) \
                    and _same(_numel(shape), _numel(D)):
                return ("col", shape, shape, 0)
            rows = _numel(D[:len(D) - m])
            if len(shape) >= m and all(_same(x, 1) for x in shape[len(shape) - m:]) \
                    and _same(_numel(shape[:len(shape) - m]), rows):
                return ("keep", shape, shape[:len(shape) - m] + tail, 0)
            if _same(_numel(shape), rows):
                return ("drop", shape, shape + tail, 0)
            if m == 1 and shape and _same(_numel(shape), _numel(D)):
                core = _core(shape)  # trailing 1s (a gather's [N, 1]) cut, as pointwise
                return ("col", shape, self.split_last(core), len(shape) - len(core))
        raise NotNative(f"a value of shape {list(shape)} does not fit the tile domain "
                        f"{list(D)}" + (f" reducing its last {m} dims" if m else ""))

    def split_last(self, shape) -> tuple:
        """The frame of a value of the tile's size whose last dim is a multiple of the
        column length L: [..., q*L] read as [..., q, L] (a split needs no stride check)."""
        L = self.col_len
        if L is None or (shape and _same(shape[-1], L)):
            return tuple(shape)
        q = sympy.simplify(sympy.sympify(shape[-1]) / L) if shape else None
        if q is None or not q.is_integer or not q.is_positive:
            raise NotNative(f"a reshape inside the tile changes its last dim ({list(shape)} "
                            f"vs columns of {L}); only splitting it is native")
        return tuple(shape[:-1]) + (q, L)

    def load(self, name: str, ctx: tuple, dims=None) -> Node:
        """The input ``name`` read in ``ctx``; ``dims`` maps the op's dims to input dims
        (default: the input broadcast to the op's shape, aligned right)."""
        k = self.access(name, ctx, dims)
        key = (name, self.access_list[k])
        if key not in self.loads:
            level = "col" if ctx[0] == "col" else "row"
            spec = self.graph.specs[name]
            self.loads[key] = self.node("load", level, [], spec.dtype, spec.shape, access=k)
        return self.loads[key]

    def access(self, name: str, ctx: tuple, dims=None) -> int:
        """The index of the :class:`Access` reading input ``name`` in ``ctx`` (see load)."""
        kind, shape, frame, cut = ctx
        spec = self.graph.specs[name]
        q = len(spec.shape)
        if dims is None:
            if q > len(shape):
                raise NotNative(f"input {name} has more dims than its use")
            dims = [None] * (len(shape) - q) + list(range(q))
            if self.perm is not None:  # shape is a tshape: read the input permuted alike
                at = self.align(spec.shape)
                dims = [at[p] for p in self.perm]
        dims = list(dims)[:len(shape) - cut]
        if kind == "col" and len(frame) == len(shape) - cut + 1:  # last dim split (q, L)
            j = dims[-1]
            dims[-1:] = [None, None] if j is None else [(j, frame[-1]), j]
        dims = dims + [None] * (len(frame) - len(dims))
        nf, m = len(frame), self.m_red
        if kind == "keep":
            for e in range(nf - m, nf):
                if dims[e] is not None and not _same(spec.shape[dims[e]], 1):
                    raise NotNative(f"input {name} is not constant along the reduced dims")
        if kind != "col":
            dims = [None if e >= nf - m else j for e, j in enumerate(dims)]
        offset, row_shift = None, ()
        if self.shift is not None:
            axis, off, full = self.shift
            if axis == len(full) - 1:
                offset = off
                row_shift = self.row_outer
            else:
                row_shift = (axis, off)
        access = Access(self.slot[name], tuple(dims), kind == "col", tuple(frame), offset,
                        row_shift)
        if access not in self.accesses:
            self.accesses[access] = len(self.access_list)
            self.access_list.append(access)
        return self.accesses[access]

    def operand(self, a, ctx: tuple):
        if not isinstance(a, str):
            if isinstance(a, (bool, int, float)) or is_symbolic(a) or isinstance(a, sympy.Number):
                return Lit(a)
            raise NotNative(f"operand {a!r} is not a tensor or scalar")
        kind, out_shape = ctx[:2]
        if a in self.deferred:
            return self.lower_part(a)
        if a in self.where_used:  # a broadcast gather, read at this op's elements
            return self.lower_gather_at(a, ctx)
        if a in self.input_views:  # a tile input seen through a view adding/removing 1s
            src, vshape, vdims = self.input_views[a]
            if len(vshape) > len(out_shape):
                raise NotNative(f"input {src} has more dims than its use")
            return self.load(src, ctx, [None] * (len(out_shape) - len(vshape)) + list(vdims))
        if a not in self.env:
            return self.load(a, ctx)
        v = self.env[a]
        if self.shift is not None and v.level == "col":
            raise NotNative(f"a cat part reads {a}, computed over the whole tile")
        if v.level == "col" and kind != "col":
            raise NotNative("a per-row value depends on a per-element one")
        if v.level == "row":
            aligned = (1,) * (len(out_shape) - len(v.shape)) + tuple(v.shape)
            if len(aligned) != len(out_shape):
                raise NotNative("per-row operand of higher rank")
            n = len(out_shape)
            for d, (q, p) in enumerate(zip(aligned, out_shape)):
                col_dim = kind == "col" and d >= n - self.m
                if (col_dim and not _same(q, 1)) or (not col_dim and not _same(q, p)):
                    raise NotNative(f"per-row value of shape {list(v.shape)} broadcast to "
                                    f"{list(out_shape)}")
        return v

    def lower_view(self, op: TileOp):
        """A reshape keeping the element order: the same values under another shape.

        A computed value keeps its node (an alias with the new shape); a tile input of
        the tile's size (or row count) is read in its own shape; a smaller input (a
        broadcast operand) only through views that add or remove 1s.
        """
        src, shape = op.args[0], tuple(op.out.shape)
        if not isinstance(src, str):
            raise NotNative("view of a scalar")
        if src in self.env:
            v = self.env[src]
            if v.kind == "colsum":  # only stored: any shape of its elements
                return dataclasses.replace(v, shape=shape)
            kind = self.context(shape)[0]
            if (kind == "col") != (v.level == "col"):
                raise NotNative(f"a reshape to {list(shape)} moves values between rows and "
                                f"columns of the tile domain {list(self.D)}")
            return dataclasses.replace(v, shape=shape)
        if src in self.input_views:
            base, vshape, vdims = self.input_views[src]
        else:
            base = src
            vshape = tuple(self.graph.specs[src].shape)
            vdims = tuple(range(len(vshape)))
        dims = _unit_dims_map(shape, vshape, vdims)
        if dims is not None:
            self.input_views[op.name] = (base, shape, dims)
            return None
        if base != src:
            raise NotNative(f"a reshape of a broadcast input {base} is not native yet")
        try:
            ctx = self.context(vshape)
        except NotNative:
            raise NotNative(f"a reshape of input {src} ({list(vshape)}) to {list(shape)} "
                            f"does not fit the tile domain {list(self.D)}") from None
        v = self.load(src, ctx, vdims)
        if (self.context(shape)[0] == "col") != (v.level == "col"):
            raise NotNative(f"a reshape to {list(shape)} moves values between rows and "
                            f"columns of the tile domain {list(self.D)}")
        return dataclasses.replace(v, shape=shape)

    # --- the tile -------------------------------------------------------------------
    def run(self) -> Program:
        tile, graph = self.tile, self.graph
        if tile.kind not in (OpKind.ELEMENTWISE, OpKind.BROADCAST, OpKind.CAST,
                             OpKind.REDUCTION):
            raise NotNative(f"{tile.kind.value} tiles are not native yet")
        for name in list(tile.inputs) + [op.name for op in tile.ops]:
            dt = graph.specs[name].dtype
            if dt not in DTYPES:
                raise NotNative(f"dtype {dt} is not in the native slice")
        self.deferred = self.cat_part_ops()
        self.where_used = self.gathers_read_where_used()
        dom_ops = [op for op in tile.ops if op.name not in self.deferred
                   and op.name not in self.where_used]
        dom = group_domain(dom_ops, graph)
        # a pointwise tile summing columns over its rows (capacity.rows_of_sums)
        self.row_sums = dom.kind == "pointwise" and any(
            op.kind is OpKind.REDUCTION for op in dom_ops)
        self.D = tuple(dom.shape)
        n = len(self.D)
        axes = tuple(dom.reduce_axes)
        self.m_red = len(axes)
        if axes and axes != tuple(range(n - len(axes), n)):
            self.transpose(tile, axes)
            n = len(self.D)
        self.m = len(axes)  # a pointwise tile's column dims are chosen after its accesses
        # the column length every value's frame ends with: the reduced dim, or for a
        # pointwise tile the shortest last dim (longer ones are split, see split_last)
        self.col_len = self.D[-1] if n and self.m == 1 else None
        if n and not axes:
            shapes = [op.out.shape for op in dom_ops] + [
                graph.specs[a].shape for op in tile.ops if op.op == "view"
                for a in op.inputs if a in self.slot]
            lasts = [_core(s)[-1] for s in shapes if _core(s)]
            self.col_len = min(lasts, key=graph.hint, default=None)
            if self.col_len is not None:
                self.D = self.split_last(_core(self.D))
                n = len(self.D)
        for op in dom_ops:
            v = self.lower(op)
            if v is not None:
                self.env[op.name] = v
        for name in tile.outputs:
            if name not in self.env:
                raise NotNative(f"tile output {name} is a view of an input")
        outputs = [(self.env[name], graph.specs[name]) for name in tile.outputs]
        # per-element outputs are stored in the tile's order: the domain's own shape, or
        # any of its size when the reduced dims are 1s (then both orders agree)
        unit = all(_same(d, 1) for d in self.D[n - self.m:])
        # (a mixed reduction's kernel writes them in the tile's own order: emit_mixed)
        if self.perm is not None and any(
                x.level == "col" and not (unit and _same(_numel(spec.shape), _numel(dom.shape)))
                and not (_same_shape(spec.shape, dom.shape)
                         and (axes == tuple(range(self.m)) or self.mixed))
                for x, spec in outputs):
            raise NotNative("a column reduction's per-element output is not in the tile's "
                            "order (another shape, or reduced dims not leading)")
        self.column_segments()
        m = self.m if axes else self.pointwise_columns()
        if self.row_sums:  # the rows the column sums add are the tile's rows of C columns
            m = 1
            for x, spec in outputs:
                if x.kind == "colsum" and not _same(x.attrs["cols"], self.D[-1]):
                    raise NotNative(f"a column sum over {x.attrs['cols']} columns in a "
                                    f"pointwise tile of {self.D[-1]} columns")
        # a column reduction vectorises along its last kept dim, a mixed one along its
        # reduced dims after the kept ones, the others along columns
        along = range(n - m + self.mixed, n) if self.mixed else \
            range(n - m - 1, n - m) if self.perm is not None else range(n - m, n)
        return Program(self.D, m, bool(axes), self.nodes, self.access_list,
                       [graph.specs[i] for i in tile.inputs], outputs,
                       [self.classify(a, along) for a in self.access_list], graph.symbols,
                       list(self.cat_bounds or []), self.perm is not None, list(self.checks),
                       self.direct_writes(outputs), self.mixed)

    # --- cat along the columns --------------------------------------------------------
    def cat_part_ops(self) -> set:
        """Pointwise ops computed only to feed cat parts (directly or through each other):
        lowered per part, at the part's columns, not over the tile's domain."""
        return cat_part_ops(self.tile.ops, self.tile.outputs)

    def lower_part(self, name: str) -> Node:
        """A deferred op (see :meth:`cat_part_ops`) at the current cat part's columns."""
        key = (name, self.shift, self.row_outer)
        if key not in self.part_env:
            origin, group = self.origin, self.group
            self.part_env[key] = self.lower(self.ops[name])
            self.origin, self.group = origin, group
        return self.part_env[key]

    def lower_cat(self, op: TileOp, ctx: tuple) -> Node:
        """cat along the tile's columns: out[.., c] = part k at c - offset k for c in part
        k's columns. The column loop runs one segment per part (``Program.cat_bounds``),
        where the cat is that part's value; every column cat of a tile splits alike.
        Along a row dim d of the domain: each part's row index is i_d - offset clamped into
        the part (in bounds), and the cat selects on i_d (constant along the row)."""
        if not all(isinstance(a, str) for a in op.args):
            raise NotNative("cat of a scalar")
        dim = op.attrs["dim"]
        parts = [(a, self.graph.specs[a].shape[dim]) for a in op.args]
        nonempty = [(a, n) for a, n in parts if not _same(n, 0)]
        return self.lower_parts(op, ctx, dim, nonempty or parts[:1])  # empty parts: never read

    def lower_parts(self, op: TileOp, ctx: tuple, dim: int, parts: list) -> Node:
        """The cat of ``parts`` ((value name or Lit, length along ``dim``), see lower_cat)
        as the result of ``op`` (a cat, or a pad whose fills are Lit parts)."""
        shape = tuple(op.out.shape)
        kind, _, frame, cut = ctx
        n = len(self.D)
        row = dim < len(shape) - 1  # along a leading dim: a select on the row index
        outer = self.shift  # a column cat inside a column cat's part: nested
        nested = outer is not None and not row and outer[0] == len(outer[2]) - 1
        # a column cat inside a row cat's part (RoPE of k into the KV cache's cat): its
        # parts read at the row part's rows (clamped) and at their own columns
        in_row = outer is not None and not row and not nested and not self.row_outer
        if (outer is not None and not nested and not in_row) or kind != "col" or cut \
                or tuple(frame) != shape or (
                row and (not _same_shape(shape, self.D) or dim >= n - max(self.m_red, 1))) \
                or (not row and ((not nested and not _same(shape[-1], self.D[-1]))
                                 or self.m_red > 1)):
            raise NotNative(f"{op.op} along dim {dim} of {list(shape)} is not native yet "
                            f"(only along the tile's columns or its row dims)")
        base = outer[1] if nested else sympy.Integer(0)
        full = outer[2] if nested else shape
        row_outer = self.row_outer
        args, bounds, spans, off = [], [], [], sympy.Integer(0)
        for a, length in parts:
            if isinstance(a, Lit):  # a pad's fill
                args.append(a)
            else:
                part = tuple(self.graph.specs[a].shape)
                self.shift = (dim, base + off, full)
                if in_row:
                    self.row_outer = (outer[0], outer[1])
                try:
                    args.append(self.operand(a, self.context(part)))
                finally:
                    self.shift, self.row_outer = outer, row_outer
            spans.append((base + off, base + off + sympy.sympify(length)))
            off = off + sympy.sympify(length)
            bounds.append(off)
        bounds = bounds[:-1]
        if row:  # each part's rows read clamped into it, the select per row
            self.row_cat_dims.append(dim)
            return self.node("op", "col", args, op.out.dtype, shape, op="cat",
                             common=op.out.dtype, dim=dim, row_bounds=bounds)
        # the column loop runs one segment between each two part bounds of any cat
        # (column_segments); each cat takes the part spanning the segment
        self.cat_bounds = (self.cat_bounds or []) + [b for b, _ in spans[1:]]
        if nested:
            self.cat_bounds += [spans[0][0], spans[-1][1]]
        return self.node("op", "col", args, op.out.dtype, shape, op="cat",
                         common=op.out.dtype, dim=dim, spans=tuple(spans))

    def column_segments(self) -> None:
        """``cat_bounds``: every column cat's part bounds, in order (so provably, sizes being
        symbolic); each cat node gets ``segments``: the index of its part spanning each
        segment (None where the cat is not read: outside an enclosing cat's part)."""
        if not self.cat_bounds:
            return
        cols = self.D[-1]
        cuts: list = []
        for b in self.cat_bounds:
            if not any(_same(b, c) for c in cuts) and not _same(b, 0) and not _same(b, cols):
                cuts.append(b)
        spans = {tuple(x.attrs["spans"]) for x in self.nodes
                 if x.kind == "op" and "spans" in x.attrs}
        one_split = len(spans) == 1 and all(_same(b, c) for b, c in zip(
            [b for _, b in next(iter(spans))[:-1]], cuts))
        if not one_split:  # the parts of several cats: their order must hold at every size
            cuts.sort(key=self.graph.hint)
            for lo, hi in zip([sympy.Integer(0), *cuts], [*cuts, cols]):
                if (sympy.sympify(hi) - sympy.sympify(lo)).is_nonnegative is not True:
                    raise NotNative("cats whose parts' order depends on the sizes are not "
                                    "native yet")
        self.cat_bounds = cuts
        ends = [sympy.Integer(0), *cuts, cols]
        hint = self.graph.hint
        for x in self.nodes:
            spans = x.attrs.get("spans") if x.kind == "op" else None
            if spans is None:
                continue
            x.attrs["segments"] = [
                next((k for k, (a, b) in enumerate(spans)
                      if hint(a) <= hint(lo) and hint(hi) <= hint(b)), None)
                for lo, hi in zip(ends[:-1], ends[1:])]

    def pointwise_columns(self) -> int:
        n = len(self.D)
        top = n  # the trailing dims every frame shares with the domain
        for a in self.access_list:
            if a.offset is not None or a.row_shift:  # a cat part's read: the part's frame
                continue
            k = 0
            while k < min(top, len(a.frame)) and \
                    _same(a.frame[len(a.frame) - 1 - k], self.D[n - 1 - k]):
                k += 1
            top = k
        if n and not top:
            raise NotNative("a reshape inside the tile changes its last dim "
                            f"({sorted({str(list(a.frame)) for a in self.access_list})})")
        if self.cat_bounds is not None:  # the column index is the cat's
            return min(top, 1)
        if self.row_cat_dims:  # a row cat's dim stays a row dim
            top = min(top, n - 1 - max(self.row_cat_dims))
        for m in range(top, 1, -1):
            if all(not a.col or self.classify(a, range(n - m, n)) != "strided"
                   for a in self.access_list):
                return m
        return min(top, 1)

    def classify(self, a: Access, dims: range) -> str:
        """The expected layout of an access over the given (trailing) domain dims, from the
        size hints."""
        if not a.col and self.perm is None:
            return "bcast"
        spec = self.graph.specs[self.tile.inputs[a.input]]
        hint = self.graph.hint
        n = len(self.D)
        shift = len(a.frame) - n  # frame dim of domain dim d: d + shift (column dims)
        unit = bcast = True
        contiguous = 1
        for d in reversed(dims):
            size = hint(self.D[d])
            j, mult = dim_mult(a.dims[d + shift])
            es = 0 if j is None or hint(spec.shape[j]) == 1 else \
                hint(spec.stride[j]) * hint(mult)
            if size != 1:
                unit &= es == contiguous
                bcast &= es == 0
            contiguous *= size
        return "unit" if unit else "bcast" if bcast else "strided"

    def lower(self, op: TileOp) -> Node | None:
        self.origin = f"{op.name} ({op.op})"
        self.group = op.group
        if op.op == "view":
            return self.lower_kept_view(op) if self.perm is not None else self.lower_view(op)
        if op.kind is OpKind.REDUCTION and self.perm is None \
                and (self.m_red == 1 or self.row_sums) and column_sum(op, self.graph):
            return self.lower_column_sum(op)
        if op.op == "cast" and op.args[0] in self.env and self.env[op.args[0]].kind == "colsum":
            # a column sum's cast: the same sums, rounded by their store
            return dataclasses.replace(self.env[op.args[0]], shape=tuple(op.out.shape))
        self.in_kept = self.perm is not None and (self.reads_kept_values(op)
                                                  or self.kept_only(op))
        ctx = self.context(self.tshape(op.out.shape, op.kind is OpKind.REDUCTION or self.in_kept))
        if op.op == "cat":
            return self.lower_cat(op, ctx)
        lower = {"gather": self.lower_gather, "pad": self.lower_pad, "copy_": self.lower_copy_,
                 "arange": self.lower_arange}.get(op.op)
        if lower is not None:
            return lower(op, ctx)
        if op.kind is OpKind.REDUCTION:
            return self.lower_reduction(op, ctx)
        if op.kind not in (OpKind.ELEMENTWISE, OpKind.BROADCAST, OpKind.CAST):
            raise NotNative(f"{op.op} ({op.kind.value}) is not native yet")
        if op.op not in OPS:
            raise NotNative(f"tile op {op.op} is not native yet")
        if op.op == "div" and op.attrs.get("rounding_mode"):
            raise NotNative("div with a rounding mode is not native yet")
        args = [self.operand(a, ctx) for a in op.args]
        common = self.common_dtype(op, args)
        level = "col" if ctx[0] == "col" else "row"
        self.in_kept = False
        return self.node("op", level, args, op.out.dtype, ctx[1], op=op.op,
                         common=common, **op.attrs)

    def lower_column_sum(self, op: TileOp) -> Node:
        """A float sum over the rows of a row kernel's [rows, C] values (a bias or norm
        weight's gradient, fusion.capacity.row_column_sums): a ``colsum`` node over its
        summand, which the row emitter adds into per-column partials as the column-sum
        kernel (emit_columns) would. Its summand is the same value, converted to fp32 as
        that kernel converts it; no mul contracts into it (that kernel reads the stored
        product)."""
        src = op.args[0]
        ctx = self.context(tuple(self.graph.specs[src].shape))
        if ctx[0] != "col":
            raise NotNative(f"column sum {op.name} does not read the row kernel's elements")
        x = self.operand(src, ctx)
        if x.level != "col":
            raise NotNative(f"column sum {op.name} of a per-row value")
        acc = torch.float32
        if x.dtype != acc:
            x = self.node("op", "col", [x], acc, self.D, op="copy", common=acc)
        return self.node("colsum", "col", [x], acc, tuple(op.out.shape), red="sum",
                         cols=self.graph.specs[src].shape[-1])

    def common_dtype(self, op: TileOp, args) -> torch.dtype:
        """The dtype operands are converted to before the op computes (torch promotion)."""
        if op.op in ("cast", "full", "clamp"):
            # clamp: its bounds (attributes) take part in the promotion, so compute in the
            # result's dtype: clamp(bool, min=2) is 2 in int64, not True
            return op.out.dtype
        if op.op == "where":
            args = args[1:]
        vals = []
        for a in args:
            if isinstance(a, Lit):
                v = a.value
                vals.append(v if isinstance(v, (bool, int, float)) else
                            (1.0 if isinstance(v, sympy.Float) else 1))
            else:
                dt = a.dtype or torch.float32
                vals.append(torch.empty((1,) * len(a.shape or ()), dtype=dt, device="meta"))
        tensors = [v for v in vals if isinstance(v, torch.Tensor)]
        if not tensors:
            return op.out.dtype
        common = tensors[0].dtype
        if len(vals) > 1:
            common = torch.result_type(vals[0], vals[1]) if len(vals) == 2 else op.out.dtype
        if op.out.dtype.is_floating_point and not common.is_floating_point:
            common = op.out.dtype
        if op.op in ("logical_and", "logical_or", "logical_xor", "logical_not"):
            common = torch.bool
        if op.op.startswith("bitwise") and common.is_floating_point:
            raise NotNative(f"{op.op} on {common}")
        if common not in DTYPES:
            raise NotNative(f"computing {op.op} in {common} is not native")
        return common


def analyse(tile: FusionTile, graph: TileGraph) -> Program:
    return _Analyser(tile, graph).run()
