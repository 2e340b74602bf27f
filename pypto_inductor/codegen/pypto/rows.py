"""Dynamic rows: one kernel source for every size, by a ``pypto.loop`` over row tiles.

pypto 0.2.0 fails on whole-tensor ops over a dynamic dim ("shape size must be
<= INT32_MAX"), so a kernel whose rows are a size expression (``s0*s1``)
declares ``R = pypto.frontend.dynamic("R")``, annotates every row-spanning
parameter ``(R, C)`` / ``(R, 1)`` (a matmul's A operand ``(R, K)``) and runs its
body once per row tile of ``tr`` rows::

    for i in pypto.loop((R + tr - 1) // tr):
        r0 = i * tr
        rn = pypto.min(r0 + tr, R) - r0
        x = pypto.view(in_x, [tr, C], [r0, 0], valid_shape=[rn, C])  # each row-spanning input
        ...                                                           # the tile's ops
        pypto.assemble(result, [r0, 0], out_y)                        # each output

Values that do not span the rows (a bias (1, C), a weight (K, N)) are used
whole in every iteration. Every output must span the rows. With dynamic
columns too, the column passes of :mod:`.columns` run inside this loop
and views take both offsets (:func:`view`). The kernel's
parameters record the dynamic dim by name (``("R", C)``) and their graph shapes
as size expressions, so :meth:`.PyptoKernel.at_sizes` and the launcher size
each call from its inputs.
"""
from __future__ import annotations

import sympy

DIM = "R"  # the dynamic kernel dim of the rows


class RowLoop:
    """The loop over row tiles of a dynamic-rows kernel (``tr`` rows per iteration)."""

    def __init__(self, rows_expr: sympy.Expr, tile_rows: int):
        self.rows_expr, self.tr = rows_expr, int(tile_rows)

    @staticmethod
    def declaration() -> str:
        return f'{DIM} = pypto.frontend.dynamic("{DIM}")\n'

    @staticmethod
    def dims(kshape: tuple, spans: bool) -> tuple:
        """A parameter's kernel dims with the dynamic one named."""
        return (DIM,) + tuple(kshape[1:]) if spans else tuple(kshape)

    @staticmethod
    def store(expr: str, out: str, col: str = "0") -> str:
        return f"pypto.assemble({expr}, [r0, {col}], {out})"

    def wrap(self, lines: list[str]) -> list[str]:
        """The loop header and the body indented under it."""
        tr = self.tr
        return [f"for i in pypto.loop(({DIM} + {tr - 1}) // {tr}):",
                f"    r0 = i * {tr}",
                f"    rn = pypto.min(r0 + {tr}, {DIM}) - r0"] + ["    " + x for x in lines]

    def describe(self) -> str:
        return f"dynamic rows {DIM} = {self.rows_expr}, in row tiles of {self.tr}"

    def dynamic_dims(self) -> dict[str, str]:
        return {DIM: str(self.rows_expr)}


def view(ident: str, body: tuple[int, ...], row: tuple[str, str] | None,
         col: tuple[str, str] | None) -> str:
    """A row tile and/or column chunk of a kernel parameter: ``row``/``col`` are the
    (offset, valid extent) names of the loop it is in, None for a whole static dim."""
    body = list(body)
    offsets = [row[0] if row else "0", col[0] if col else "0"]
    valid = [row[1] if row else str(body[0]), col[1] if col else str(body[1])]
    return (f"pypto.view({ident}, {body!r}, [{offsets[0]}, {offsets[1]}], "
            f"valid_shape=[{valid[0]}, {valid[1]}])")
