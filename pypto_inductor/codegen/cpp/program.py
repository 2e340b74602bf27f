"""The native CPU target's kernel program: what the analysis makes and the emitters write.

:func:`analysis.analyse` turns a FusionTile into a :class:`Program`: the tile's
domain D (rows and columns), its input reads (:class:`Access`), and its values as
:class:`Node` s (loads, ops and reductions, each at row or column level), or raises
:class:`NotNative` naming what is outside the native slice (the tile then runs the
reference executor). :mod:`.emit_rows` and :mod:`.emit_columns` write C++ for it.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import torch

FLOATS = (torch.float32, torch.float16, torch.bfloat16)
INTS = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)
DTYPES = FLOATS + INTS + (torch.bool,)
SYMBOL = "pi_kernel"


class NotNative(Exception):
    """This tile is outside the native slice; the message says why."""


@dataclasses.dataclass(frozen=True)
class Lit:
    """A scalar operand: a Python number or a sympy size expression."""

    value: Any


@dataclasses.dataclass(eq=False)
class Node:
    id: int
    kind: str  # "load", "op" (a tile op), "expr" (internal float math), "reduce"
    level: str  # "row" (once per row) or "col" (per element)
    args: list  # Node | Lit
    dtype: torch.dtype | None  # the value's dtype (results are rounded to it); None = fp32 math
    attrs: dict
    shape: tuple | None = None
    origin: str = ""  # the tile op it computes, e.g. "add_3 (add)", for error messages
    group: str = ""  # the ATen op call it is part of (TileOp.group): fma only within one
    contract: bool = False  # a mul whose every use is an add/sub/sum of its group (ops.py)


@dataclasses.dataclass(frozen=True)
class Access:
    """How an input is indexed: ``dims[e]`` is the input dim read for frame dim e (or None,
    or (input dim, stride multiplier) for the outer part of a split dim).

    ``frame`` is the shape the input is read in: the shape of the op it broadcasts
    into, or its own shape when the tile reshapes it (``view``). Every frame has the
    domain's element order and ends with the domain's column dims (the last
    ``Program.m``), so only the row index is decomposed per frame (over its leading
    dims); per-row reads have ``None`` over the column dims.
    """

    input: int
    dims: tuple
    col: bool  # read per element (else once per row)
    frame: tuple = ()
    offset: Any = None  # a cat part's read: its first column in the cat (read at c - offset)
    row_shift: tuple = ()  # a row cat's part: (frame dim, first index there), read clamped


@dataclasses.dataclass
class Program:
    shape: tuple  # domain D (sympy)
    m: int  # number of trailing column dims
    reduction: bool
    nodes: list
    accesses: list
    input_specs: list
    outputs: list  # (Node, spec)
    fast: list  # per access: "unit", "bcast" or "strided" (expected column layout)
    symbols: list
    cat_bounds: list = dataclasses.field(default_factory=list)  # column cats: part ends
    # a column reduction: the domain is the tile's with its reduced dims (not the last)
    # moved last, so rows are the kept dims; the kernel walks memory rows and keeps one
    # accumulator per kept element (emit_columns)
    transposed: bool = False
    checks: list = dataclasses.field(default_factory=list)  # indexing.IndexCheck
    writes: dict = dataclasses.field(default_factory=dict)  # output -> indexing.DirectWrite
    # a mixed reduction (transposed, the kept dims between reduced ones): how many of its
    # reduced dims come before the kept ones (emit_mixed); 0 otherwise
    mixed: int = 0


def dim_mult(entry) -> tuple:
    """(input dim or None, stride multiplier) of an ``Access.dims`` entry: an int, None,
    or (input dim, multiplier) for the outer half of a split dim."""
    if isinstance(entry, tuple):
        return entry
    return entry, 1
