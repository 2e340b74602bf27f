"""Tiles that pypto cannot take whole: one-op tiles, and splitting at ops with no pypto form.

:func:`single_op_tile` wraps one tile op as its own FusionTile (each op's
kernel in the simulator's unfused variant). :func:`split_tile` splits a
FusionTile at its ops with no pypto form into pypto sub-tiles (by data
dependence) with those ops run eagerly between them; the simulator
(``split_ops`` in the report) and the NPU target (:func:`.build_split`) run the
resulting :class:`TileSplit` step by step.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import sympy

from ...fusion.capacity import plan_tile
from ...fusion.planner import compute_dtype
from ...ir import FusionTile, OpKind, TileGraph, TileOp
from .kernel import PyptoEmitError
from .ops import OPS
from .writer import emit_tile


def single_op_tile(op: TileOp, graph: TileGraph, tile_shape: tuple[int, ...],
                   hw=None, buffering: int = 2) -> FusionTile:
    """A one-op FusionTile for ``op`` (its own kernel in the unfused variant).

    The tile shape is the planner's choice for the op alone when the hardware
    model is given, else ``tile_shape`` (the fused tile's).
    """
    inputs = list(dict.fromkeys(op.inputs))
    shape, footprint, capacity = tuple(tile_shape), 0, 0
    if hw is not None:
        try:
            tp = plan_tile([op], graph, hw, buffering)
            shape, footprint, capacity = tuple(tp.tile_shape), tp.footprint_bytes, tp.capacity_bytes
        except Exception:  # noqa: BLE001 - the fused tile's shape is a fine fallback
            pass
    return FusionTile(name=f"{op.name}_{op.op}", ops=[op], inputs=inputs, outputs=[op.name],
                      dtype=compute_dtype([op], graph), tile_shape=shape,
                      footprint_expr=sympy.Integer(footprint), footprint_bytes=footprint,
                      capacity_bytes=capacity, kind=op.kind)


@dataclasses.dataclass
class TileSplit:
    """A FusionTile split at its ops with no pypto form.

    ``steps`` run in order: ("pypto", sub-FusionTile) kernels and ("extern", TileOp)
    ops run eagerly; ``split_ops`` are those TileOps, ``reasons`` (op name -> text) why.
    """

    tile: FusionTile
    steps: list[tuple[str, Any]]
    split_ops: list[TileOp]
    reasons: dict[str, str]

    @property
    def parts(self) -> list[FusionTile]:
        return [x for kind, x in self.steps if kind == "pypto"]


def unsupported_ops(tile: FusionTile, graph: TileGraph) -> dict[str, str]:
    """op name -> why, for every op of the tile that has no pypto form on its own."""
    out = {}
    for op in tile.ops:
        if op.op not in OPS:
            out[op.name] = str(PyptoEmitError(op.op))
            continue
        try:
            emit_tile(single_op_tile(op, graph, tile.tile_shape), graph)
        except PyptoEmitError as e:
            out[op.name] = str(e)
    return out


def split_tile(tile: FusionTile, graph: TileGraph) -> TileSplit | None:
    """Split ``tile`` at its ops with no pypto form; None when every op has one.

    Each remaining op gets a level: the most split ops on any path to it inside
    the tile. Levels never decrease along a path, so the ops of one level form a
    sub-tile no split op sits inside (no cycle through an extern op); the steps
    run level by level: the level's pypto kernel, then the split ops it feeds.
    A split op's level is that of its inputs; the ops after it are one higher.
    """
    reasons = unsupported_ops(tile, graph)
    if not reasons:
        return None
    level: dict[str, int] = {}  # value produced in the tile -> level of its readers
    op_level: dict[str, int] = {}
    for op in tile.ops:
        lv = max((level[a] for a in op.inputs if a in level), default=0)
        op_level[op.name] = lv
        level[op.name] = lv + 1 if op.name in reasons else lv
    readers: dict[str, set[str]] = {}
    for op in tile.ops:
        for a in op.inputs:
            readers.setdefault(a, set()).add(op.name)
    steps: list[tuple[str, Any]] = []
    for lv in range(max(op_level.values()) + 1):
        ops = [op for op in tile.ops if op_level[op.name] == lv and op.name not in reasons]
        if ops:
            names = {op.name for op in ops}
            inputs = list(dict.fromkeys(a for op in ops for a in op.inputs if a not in names))
            outputs = [op.name for op in ops if op.name in tile.outputs
                       or readers.get(op.name, set()) - names]
            part = dataclasses.replace(
                tile, name=f"{tile.name}_part{lv}", ops=ops, inputs=inputs, outputs=outputs,
                kind=next((o.kind for o in ops if o.kind is OpKind.MATMUL),
                          next((o.kind for o in ops if o.kind is OpKind.REDUCTION), ops[0].kind)))
            steps.append(("pypto", part))
        steps += [("extern", op) for op in tile.ops
                  if op_level[op.name] == lv and op.name in reasons]
    split = [op for op in tile.ops if op.name in reasons]
    return TileSplit(tile, steps, split, reasons)
