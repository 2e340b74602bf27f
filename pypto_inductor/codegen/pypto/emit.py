"""FusionTile -> pypto 0.2.0 tile kernel module: the emitter's entry points.

pypto's frontend re-parses the decorated function's source with ``inspect``, so
a kernel is emitted as a whole module (``import pypto`` plus one
``@pypto.frontend.jit`` function) that the caller writes to a real ``.py`` file
and imports. Every tile input and output is an annotated parameter
``pypto.Tensor(shape, dtype)``; outputs are written with ``out[:] = ...`` (or
``pypto.assemble`` per row tile when the rows are dynamic).

The emitter is split by concern; this module re-exports the public names:

====================  ===================================================================
``kernel``            :class:`PyptoKernel`, :class:`KernelParam`, :class:`PyptoEmitError`,
                      dtype table, shared helpers
``layout``            :class:`TileLayout`: each value's 2-D (or N-D) kernel shape, which
                      values span the (dynamic) rows, what dynamic sizes are refused
``tiling``            vector and cube tile shapes from the planner's tile and the device's
                      hardware model
``rows``              :class:`RowLoop`: the ``pypto.loop`` over row tiles (dynamic rows)
``columns``           :class:`ColumnPasses`: loops over column chunks with accumulated
                      reductions (dynamic columns / reduced length)
``writer``            :class:`KernelWriter`: parameters, casts, ops, stores, module text;
                      :func:`emit_tile`
``ops``               the op table: one pypto form per tile op
``split``             one-op tiles; splitting a tile at ops with no pypto form
====================  ===================================================================

A tile op with no pypto form raises :class:`PyptoEmitError` naming the op;
:func:`split_tile` then splits the tile at such ops into pypto sub-tiles with
the ops between them run as extern ops.
"""
from __future__ import annotations

from .kernel import PYPTO_DTYPES, KernelParam, PyptoEmitError, PyptoKernel, kernel_name
from .ops import supported_ops
from .split import TileSplit, single_op_tile, split_tile, unsupported_ops
from .writer import emit_tile

__all__ = ["PyptoEmitError", "KernelParam", "PyptoKernel", "emit_tile", "single_op_tile",
           "PYPTO_DTYPES", "supported_ops", "TileSplit", "split_tile", "unsupported_ops",
           "kernel_name"]
