"""How each value of a FusionTile is laid out in its pypto kernel.

Vector tiles are emitted over a 2-D view of their iteration domain, the same
(rows, cols) split the planner's tile shape uses: a domain D reducing its
trailing axes becomes (prod(kept axes), prod(reduced axes)); a domain reducing
its leading axes becomes (prod(reduced), prod(kept)); a pointwise domain splits
before its last axis. Every value of the tile is then declared as (R, C), a
per-row (R, 1), a per-column (1, C) or a scalar (1, 1) tensor.

Tiles around a 2-D matmul (``x @ W`` with its elementwise epilogue) use the
same 2-D form: rows are the matmul's M (e.g. ``s0*s1`` for a 3-D ``x``), columns
its N; its operands keep their own shapes, (M, K) and (K, N). In every 2-D
layout a reshape that keeps (rows, cols) (``[s0*s1, N] -> [s0, s1, N]``, the
same row-major matrix) is free. Batched matmul tiles (3-D/4-D) keep their N-D
shapes, epilogue operands padded with leading 1s.

A layout is dynamic when its rows and/or columns are size expressions: values
that span dynamic rows are loaded and stored one row tile at a time
(:mod:`.rows`), values that span dynamic columns one column chunk at a
time, reductions over them accumulated (:mod:`.columns`). A matmul's K
and N must be static, as must every size of a batched matmul tile and of a
reduction over leading dims; those cases raise :class:`PyptoEmitError` saying
"... not supported yet".
"""
from __future__ import annotations

import sympy

from ...ir import FusionTile, OpKind, TileGraph
from ...sizes import is_symbolic as symbolic
from ...sizes import numel, same_size
from .kernel import PyptoEmitError


class TileLayout:
    """Kernel shapes of a tile's values (2-D, or N-D for batched matmul tiles)."""

    def __init__(self, tile: FusionTile, graph: TileGraph):
        self.graph = graph
        self.hint = lambda shape: tuple(graph.hint(s) for s in shape)
        self.matmul = next((op for op in tile.ops if op.kind is OpKind.MATMUL), None)
        self.dynamic = False  # rows are a size expression: a pypto.loop over row tiles
        self.rows_expr = None
        self.nd = False  # batched matmul tile: N-D shapes, no 2-D view
        self.reduce_axes: tuple[int, ...] = ()
        self.reduce_dim = None
        self.cols_dynamic = False  # columns (or the reduced extent) are a size expression
        self.cols_expr = None
        self.body_cols = None
        if self.matmul is not None and len(self.matmul.out.shape) != 2:
            self._batched_matmul()
            return
        what = self._domain(tile)
        self._split(what)
        if self.matmul is None and not self.reduce_axes:
            self._pick_domain(tile, what)

    # construction -----------------------------------------------------------------------
    def _batched_matmul(self) -> None:
        mm = self.matmul
        self.nd = True
        self.sym_domain = tuple(mm.out.shape)
        self.domain = self.hint(mm.out.shape)
        if any(symbolic(x) for x in self.sym_domain) or any(
                symbolic(x) for a in mm.args[:2] if isinstance(a, str)
                for x in self.graph.specs[a].shape):
            raise PyptoEmitError(mm.op, "dynamic sizes are not supported yet in batched matmul "
                                 "tiles (only the rows M of a 2-D matmul, e.g. x @ W)")

    def _domain(self, tile: FusionTile) -> str:
        """Sets the (symbolic) domain and reduced axes; returns the op errors are named after."""
        graph = self.graph
        reductions = [op for op in tile.ops if op.kind is OpKind.REDUCTION]
        if self.matmul is not None:
            mm = self.matmul
            if not all(isinstance(a, str) for a in mm.args[:2]):
                raise PyptoEmitError(mm.op, "a constant operand")
            a, b = (graph.specs[x].shape for x in mm.args[:2])
            if symbolic(a[-1]) or any(symbolic(x) for x in b):
                raise PyptoEmitError(mm.op, f"a dynamic K or N extent ([{a[-1]}] x {list(b)}) "
                                     "is not supported yet in matmul tiles: only the rows M "
                                     "may be dynamic")
        if reductions and self.matmul is None:
            red = reductions[0]
            self.sym_domain = tuple(graph.specs[red.args[0]].shape)
            self.reduce_axes = tuple(red.attrs["dims"])
            return red.op
        # pointwise and matmul tiles: the largest value (the epilogue's shape for a matmul)
        shapes = [tuple(op.out.shape) for op in tile.ops]
        self.sym_domain = max(shapes, key=lambda s: (int(numel(self.hint(s))), len(s)))
        return (self.matmul or tile.ops[0]).op

    def _pick_domain(self, tile: FusionTile, what: str) -> None:
        """Among the pointwise tile's largest shapes, the first every value places in: two
        independent chains of equal size ([2, 4, 16, 8] q half and [2, 2, 16, 16] k of
        phi3's rotary) take the domain whose broadcasts have a 2-D form."""
        shapes = [tuple(op.out.shape) for op in tile.ops]
        key = lambda sh: (int(numel(self.hint(sh))), len(sh))  # noqa: E731
        best = key(self.sym_domain)
        others = [sh for sh in dict.fromkeys(shapes) if key(sh) == best and sh != self.sym_domain]
        if not others or self._placeable(tile):
            return
        first = self.sym_domain
        for sh in others:
            self.sym_domain = sh
            try:
                self._split(what)
            except PyptoEmitError:
                continue
            if self._placeable(tile):
                return
        self.sym_domain = first
        self._split(what)

    def _placeable(self, tile: FusionTile) -> bool:
        for value in list(tile.inputs) + [op.name for op in tile.ops]:
            shape = self.graph.specs[value].shape
            try:
                self.place(shape, value)
            except PyptoEmitError:
                if not (value in tile.inputs and self.expands_to_domain(shape)):
                    return False
        return True

    def _split(self, what: str) -> None:
        self.domain = self.hint(self.sym_domain)
        d, a = self.domain, self.reduce_axes
        n = len(d)
        if not a:
            split, self.reduce_dim = max(n - 1, 0), None
        elif a == tuple(range(n - len(a), n)):
            split, self.reduce_dim = n - len(a), 1
        elif a == tuple(range(len(a))):
            split, self.reduce_dim = len(a), 0
        else:
            raise PyptoEmitError(what, f"reduction over dims {list(a)} of {list(d)} "
                                 "is neither leading nor trailing")
        self.split = split
        self.rows, self.cols = int(numel(d[:split])), int(numel(d[split:]))
        rows_expr = sympy.Mul(*self.sym_domain[:split]) if split else sympy.Integer(1)
        cols_expr = sympy.Mul(*self.sym_domain[split:]) if split < n else sympy.Integer(1)
        self.rows_sym, self.cols_sym = rows_expr, cols_expr
        if self.matmul is not None:
            m, nn = self.matmul.out.shape
            if not (same_size(cols_expr, nn) and same_size(rows_expr, m)):
                raise PyptoEmitError(what, f"an epilogue of shape {list(self.sym_domain)} "
                                     f"that does not keep the matmul's [{m}, {nn}] rows and "
                                     "columns")
        if self.reduce_dim == 0 and (symbolic(rows_expr) or symbolic(cols_expr)):
            raise PyptoEmitError(what, f"a reduction over a leading extent ({rows_expr}) with "
                                 "dynamic sizes is not supported yet")
        if symbolic(cols_expr):  # columns in chunks, reductions accumulated (columns.py)
            self.cols_dynamic, self.cols_expr = True, cols_expr
        if symbolic(rows_expr):
            self.dynamic, self.rows_expr = True, rows_expr
        self.body_rows = self.rows  # rows of the values the body computes (a row tile if dynamic)
        self.body_cols = self.cols  # columns of them (a column chunk if the columns are dynamic)

    # kernel shapes -------------------------------------------------------------------------
    def reduced(self) -> tuple[int, int]:
        return (self.rows, 1) if self.reduce_dim == 1 else (1, self.cols)

    def classify(self, shape: tuple, what: str) -> tuple[int, ...]:
        """The kernel shape (at the example sizes) of a value of this (symbolic) shape."""
        return self.place(shape, what)[0]

    def spans_rows(self, shape: tuple, what: str) -> bool:
        """Whether a value of this (symbolic) shape spans the dynamic rows."""
        return self.place(shape, what)[1]

    def place(self, shape: tuple, what: str) -> tuple[tuple[int, ...], bool]:
        """(kernel shape at the example sizes, whether it spans the dynamic rows).

        Static tiles compare example sizes; dynamic tiles compare the size
        expressions, so an example size that happens to equal a static one is
        not taken for it.
        """
        if self.dynamic or self.cols_dynamic:
            d, shape = self.sym_domain, tuple(sympy.sympify(s) for s in shape)
        else:
            d, shape = self.domain, self.hint(shape)
        if self.nd:
            if len(shape) > len(d):
                raise PyptoEmitError(what, f"shape {list(shape)} has more dims than {list(d)}")
            return (1,) * (len(d) - len(shape)) + tuple(shape), False
        full = ((self.rows, self.cols), self.dynamic)
        if tuple(shape) == d:
            return full
        if self._keeps_rows_and_cols(shape):
            return full  # a row-major reshape of the domain, e.g. [s0*s1, N] <-> [s0, s1, N]
        if not (self.dynamic or self.cols_dynamic) and int(numel(shape)) == self.rows * self.cols:
            # a row-major reshape splitting elsewhere ([32] of a [2, 16] domain): same elements
            # in the same order (a permute that moves them is refused by the view handler)
            return full
        if len(shape) > len(d):
            raise PyptoEmitError(what, f"shape {list(shape)} has more dims than the domain "
                                 f"{list(d)}")
        padded = (1,) * (len(d) - len(shape)) + tuple(shape)
        rows_p, cols_p = padded[:self.split], padded[self.split:]
        rows_match, cols_match = rows_p == d[:self.split], cols_p == d[self.split:]
        rows_one, cols_one = all(s == 1 for s in rows_p), all(s == 1 for s in cols_p)
        if rows_match and cols_match:
            return full
        if rows_one and cols_match:
            return (1, self.cols), False
        if rows_match and cols_one:
            return (self.rows, 1), self.dynamic
        if rows_one and cols_one:
            return (1, 1), False
        if rows_match and len(cols_p) == 1 and cols_p[0] < self.cols and self.reduce_dim is None \
                and self.matmul is None and not (self.dynamic or self.cols_dynamic):
            # a part of the columns (rotate_half's halves, concatenated in the tile)
            return (self.rows, int(cols_p[0])), False
        if self.reduce_axes:  # a reduced value without keepdim, e.g. [B, S] of [B, S, H]
            kept = tuple(s for i, s in enumerate(d) if i not in self.reduce_axes)
            if tuple(shape) == kept:
                return self.reduced(), self.dynamic and self.reduce_dim == 1
        raise PyptoEmitError(what, f"broadcast of {list(shape)} against the tile domain "
                             f"{list(d)} has no 2-D form")

    def expands_to_domain(self, shape: tuple) -> bool:
        """Whether a value of this shape broadcasts to the (static, 2-D) domain: an input
        the launcher can expand to the domain when the broadcast has no 2-D form."""
        if self.nd or self.dynamic or self.cols_dynamic:
            return False
        d, shape = self.domain, self.hint(shape)
        if len(shape) > len(d):
            return False
        padded = (1,) * (len(d) - len(shape)) + tuple(shape)
        return all(a == b or a == 1 for a, b in zip(padded, d))

    def _keeps_rows_and_cols(self, shape: tuple) -> bool:
        symbolic_shapes = self.dynamic or self.cols_dynamic
        rows, cols = (self.rows_sym, self.cols_sym) if symbolic_shapes else (self.rows, self.cols)
        for k in range(len(shape) + 1):
            if same_size(sympy.Mul(*shape[:k]), rows) and same_size(sympy.Mul(*shape[k:]), cols):
                return True
        return False

    def operand_place(self, value: str) -> tuple[tuple[int, ...], bool]:
        """A matmul operand's kernel shape (its own) and whether it spans the rows (A does)."""
        shape = self.graph.specs[value].shape
        spans = self.dynamic and value == self.matmul.args[0] and not self.nd
        if spans and not same_size(sympy.Mul(*shape[:-1]), self.rows_sym):
            raise PyptoEmitError(self.matmul.op, f"operand {value} of shape {list(shape)} does "
                                 f"not span the tile's rows {self.rows_sym}")
        return self.hint(shape), spans

    def is_matmul_operand(self, value: str) -> bool:
        return self.matmul is not None and value in self.matmul.args[:2]

    def spans_cols(self, kshape: tuple[int, ...]) -> bool:
        """Whether a value of this kernel shape spans the dynamic columns (2-D shapes are
        (rows or 1, cols or 1), and a dynamic extent is never 1)."""
        return self.cols_dynamic and len(kshape) == 2 and kshape[1] == self.cols

    def body_shape(self, kshape: tuple[int, ...], spans: bool) -> tuple[int, ...]:
        """The shape of a value inside the kernel body: one row tile if it spans dynamic
        rows, one column chunk if it spans dynamic columns."""
        shape = list(kshape)
        if spans:
            shape[0] = self.body_rows
        if self.spans_cols(tuple(kshape)):
            shape[1] = self.body_cols
        return tuple(shape)


