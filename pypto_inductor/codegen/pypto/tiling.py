"""Tile-shape choice for pypto kernels: ``set_vec_tile_shapes`` and ``set_cube_tile_shapes``.

The planner picks a tile shape per FusionTile against its hardware model
(``fusion/capacity.py``); here that shape becomes pypto's tiling, clamped to the
kernel's domain and shrunk to what pypto 0.2.0 and the device's hardware model
(``hw``, Ascend A2: :func:`hardware.ascend_a2`) accept:

- vector tiles: (rows, cols) of the 2-D layout (leading 1s for a batched
  matmul tile); a dynamic tile's rows (columns) are the planner's row tile
  (column chunk): a loop covers any size, so they do not depend on the example
  size; at most a third of UB;
- cube tiles: [L0, L1] per m, k, n, rounded to the cube unit's 16x16 fractals
  and shrunk until the double-buffered L0A, L0B and L0C tiles fit.
"""
from __future__ import annotations

from ...hardware import HardwareModel
from .layout import TileLayout


def vec_tile(layout: TileLayout, tile_shape: tuple[int, ...], hw: HardwareModel) -> tuple[int, ...]:
    """pypto vector tile shape from the planner's (rows, cols), clamped to the domain."""
    if layout.matmul is not None:
        tm, tn = tile_shape[0], tile_shape[1]
        lead = (1,) * (len(layout.domain) - 2) if layout.nd else ()
        rows = layout.domain[-2] if layout.nd else layout.rows
        cols = layout.domain[-1] if layout.nd else layout.cols
        # Dynamic rows: the planner's row tile (the loop's), whatever the example size.
        return lead + (tm if layout.dynamic else min(tm, rows), min(tn, cols))
    t_rows = tile_shape[0] if tile_shape else 1
    t_cols = tile_shape[1] if len(tile_shape) > 1 else layout.cols
    if layout.reduce_dim == 0:  # the planner's cols span the reduced (here leading) extent
        t_rows, t_cols = t_cols, t_rows
    # Dynamic rows: the row tile does not depend on the example size (a loop covers any).
    t_rows = max(1, t_rows if layout.dynamic else min(t_rows, layout.rows))
    # Dynamic columns: the planner's column chunk, likewise.
    t_cols = max(1, t_cols if layout.cols_dynamic else min(t_cols, layout.cols))
    # pypto 0.2.0 fails to place a vector tile beyond a third of UB (64x256 fp32 compiles,
    # 128x256 does not); shrink rows, then columns.
    budget = int(hw.vector_capacity_bytes) // 3
    while t_rows * t_cols * 4 > budget and (t_rows > 1 or t_cols > 8):
        if t_rows > 1:
            t_rows = (t_rows + 1) // 2
        else:
            t_cols //= 2
    if t_cols < layout.cols or layout.cols_dynamic:  # keep a tile row 32-byte aligned
        t_cols = max(8, t_cols - t_cols % 8)
    return (t_rows, t_cols)


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
