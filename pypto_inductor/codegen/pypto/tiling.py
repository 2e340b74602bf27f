"""Tile-shape choice for pypto kernels: ``set_vec_tile_shapes`` and ``set_cube_tile_shapes``.

The planner picks a tile shape per FusionTile against its hardware model
(``fusion/capacity.py``); here that shape becomes pypto's tiling, clamped to the
kernel's domain and shrunk to what pypto 0.2.0 and the device's hardware model
(``hw``, Ascend A2: :func:`hardware.ascend_a2`) accept:

- vector tiles: (rows, cols) of the 2-D layout (leading 1s for a batched
  matmul tile); a dynamic tile's rows (columns) are the planner's row tile
  (column chunk): a loop covers any size, so they do not depend on the example
  size; shrunk until every vector op's inputs and output fit UB at the tile
  size (:func:`vec_footprint`, pypto's own check);
- cube tiles: [L0, L1] per m, k, n, rounded to the cube unit's 16x16 fractals
  and shrunk until the double-buffered L0A, L0B and L0C tiles fit.
"""
from __future__ import annotations

from ...hardware import HardwareModel
from .layout import TileLayout


def vec_operands(tile) -> int:
    """How many tile-sized buffers one vector op holds in UB at once: its tensor inputs
    plus its output, over the tile's vector ops (at least 3: the emitted expansions of
    gelu, softmax, norms are chains of binary ops)."""
    arities = [len(op.inputs) for op in tile.ops if op.op != "matmul"]
    return max([3] + [n + 1 for n in arities])


def vec_footprint(vec: tuple[int, ...], operands: int, itemsize: int = 4) -> int:
    """UB bytes pypto checks for one vector op at vector tile ``vec``: every input and
    the output live at the tile size ("ADD in/output total size [262144] exceeds MEM_UB
    size [196608]" is 2 x 256x128 fp32)."""
    n = 1
    for d in vec:
        n *= int(d)
    return operands * n * itemsize


def vec_tile(layout: TileLayout, tile_shape: tuple[int, ...], hw: HardwareModel,
             operands: int = 3, shrink: int = 0) -> tuple[int, ...]:
    """pypto vector tile shape from the planner's (rows, cols), clamped to the domain and
    shrunk until :func:`vec_footprint` (``operands`` buffers, fp32) fits UB; ``shrink``
    halves it that many more times (a retry after pypto rejected a tile)."""
    if layout.matmul is not None:
        tm, tn = tile_shape[0], tile_shape[1]
        lead = (1,) * (len(layout.domain) - 2) if layout.nd else ()
        rows = layout.domain[-2] if layout.nd else layout.rows
        cols = layout.domain[-1] if layout.nd else layout.cols
        # Dynamic rows: the planner's row tile (the loop's), whatever the example size.
        t_rows, t_cols = (tm if layout.dynamic else min(tm, rows)), min(tn, cols)
    else:
        lead = ()
        t_rows = tile_shape[0] if tile_shape else 1
        t_cols = tile_shape[1] if len(tile_shape) > 1 else layout.cols
        if layout.reduce_dim == 0:  # the planner's cols span the reduced (here leading) extent
            t_rows, t_cols = t_cols, t_rows
        # Dynamic rows: the row tile does not depend on the example size (a loop covers any).
        t_rows = max(1, t_rows if layout.dynamic else min(t_rows, layout.rows))
    # Dynamic columns: the planner's column chunk, likewise.
    if layout.matmul is None:
        t_cols = max(1, t_cols if layout.cols_dynamic else min(t_cols, layout.cols))
    # pypto checks every vector op's inputs and output at the tile size against UB
    # (matmul epilogues too); shrink rows, then columns.
    budget = int(hw.vector_capacity_bytes)
    halvings = shrink
    while (vec_footprint((t_rows, t_cols), operands) > budget or halvings > 0) \
            and (t_rows > 1 or t_cols > 8):
        if vec_footprint((t_rows, t_cols), operands) <= budget:
            halvings -= 1
        if t_rows > 1:
            t_rows = (t_rows + 1) // 2
        else:
            t_cols //= 2
    if layout.matmul is not None:
        t_rows = max(16, t_rows - t_rows % 16) if t_rows >= 16 else t_rows
    if t_cols < (layout.cols if layout.matmul is None else cols) or layout.cols_dynamic:
        t_cols = max(8, t_cols - t_cols % 8)  # keep a tile row 32-byte aligned
    return lead + (t_rows, t_cols)


def cube_tile(tile_shape: tuple[int, ...], m: int, n: int, k: int, itemsize: int,
              hw: HardwareModel) -> tuple[tuple[int, int], ...]:
    """pypto cube tiles ([L0, L1] per m, k, n) from the planner's (tm, tn, tk).

    Rounded to the cube unit's 16x16 fractals and shrunk until the double-buffered
    L0A (tm x tk), L0B (tk x tn) and L0C (tm x tn fp32) tiles fit the model ``hw``.
    """
    details = dict(hw.details)
    l0a, l0b, l0c = (int(details.get(key, default)) for key, default in
                     (("l0a_bytes", 65536), ("l0b_bytes", 65536), ("l0c_bytes", 131072)))

    def fit(t: int, extent: int) -> int:
        t = min(t, extent)
        return max(16, -(-t // 16) * 16)
    tm, tn, tk = (tuple(tile_shape) + (128, 128, 128))[:3]
    tm, tn, tk = fit(tm, m), fit(tn, n), fit(tk, k)
    while 2 * tm * tk * itemsize > l0a and (tk > 16 or tm > 16):
        if tk >= tm and tk > 16:
            tk //= 2
        else:
            tm //= 2
    while 2 * tk * tn * itemsize > l0b and tn > 16:
        tn //= 2
    while 2 * tm * tn * 4 > l0c and tn > 16:
        tn //= 2
    tm, tn, tk = (max(16, x - x % 16) for x in (tm, tn, tk))
    return ((tm, tm), (tk, tk), (tn, tn))
