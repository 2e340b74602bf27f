"""The op catalogue: every canonical tile op, with its kind, arity, cost and dtypes.

Lowering turns ATen calls into these ops (``TileOp.op``); every table keyed by
op name agrees with this one (``tests/test_layout.py`` checks): lowering's
``UNARY``/``BINARY``, the reference executor's ``REFERENCE`` (every op has one),
the C++ target's ``OPS`` and the pypto emitter's ``OPS`` (each a subset: an op
a target lacks runs another way), and the ROI model's cost, read from here.

- ``kind``: the op's family (:class:`ir.OpKind`); lowering marks an elementwise
  op whose operand is broadcast ``BROADCAST``;
- ``arity``: tensor or scalar operands (attributes aside); ``None`` when it varies
  (``cat``, and the indexed ops taking one index per indexed dim);
- ``flops``: the ROI model's cost of one element, in adds (1 for an add);
- ``float_only``: the op's math is floating-point: a target computes it in a
  float type (the C++ target refuses an integer compute dtype for it).
"""
from __future__ import annotations

import dataclasses

from .ir import OpKind


@dataclasses.dataclass(frozen=True)
class OpInfo:
    name: str
    kind: OpKind
    arity: int | None
    flops: int = 1
    float_only: bool = False


OPS: dict[str, OpInfo] = {}


def _add(kind: OpKind, arity: int | None, names: str, flops: int = 1,
         float_only: bool = False) -> None:
    for name in names.split():
        assert name not in OPS, name
        OPS[name] = OpInfo(name, kind, arity, flops, float_only)


E, R = OpKind.ELEMENTWISE, OpKind.REDUCTION
# Unary elementwise ops.
_add(E, 1, "abs neg relu sign logical_not bitwise_not isnan isinf copy clamp")
_add(E, 1, "floor ceil round trunc frac hardswish hardsigmoid leaky_relu", float_only=True)
_add(E, 1, "rsqrt sqrt reciprocal", flops=4, float_only=True)
_add(E, 1, "exp exp2 expm1 log log1p log2 log10 sin cos", flops=8, float_only=True)
_add(E, 1, "tan tanh sigmoid silu erf erfc elu asin acos atan sinh cosh asinh acosh atanh",
     flops=10, float_only=True)
_add(E, 1, "softplus", flops=12, float_only=True)
_add(E, 1, "gelu", flops=14, float_only=True)
_add(E, 1, "mish", flops=20, float_only=True)
# Binary elementwise ops (either operand may be a scalar).
_add(E, 2, "add sub mul maximum minimum fmax fmin eq ne lt le gt ge logical_and logical_or "
     "logical_xor bitwise_and bitwise_or bitwise_xor remainder fmod copysign")
_add(E, 2, "div", flops=4, float_only=True)
_add(E, 2, "hypot", flops=6, float_only=True)
_add(E, 2, "pow", flops=10)
_add(E, 2, "atan2", flops=12, float_only=True)
_add(E, 3, "where")
_add(E, 0, "full arange")
_add(E, 2, "copy_")  # copy_(dst, src): src written into the graph input dst
# Indexed reads and writes (lowering/indexing.py), which lowering marks BROADCAST: their
# operands have other shapes than the result. ``None``: an index operand per indexed dim.
B = OpKind.BROADCAST
_add(B, None, "gather index_put")
_add(B, 1, "pad")
_add(B, 2, "slice_scatter")
_add(B, 3, "scatter scatter_add scatter_reduce")
_add(OpKind.CAST, 1, "cast")
# Reductions (attributes dims, keepdim), and reductions with an epilogue.
_add(R, 1, "sum mean prod amax amin any all argmax argmin")
_add(R, 1, "var", flops=4, float_only=True)
_add(R, 1, "std", flops=5, float_only=True)
_add(R, 1, "softmax log_softmax logsumexp", flops=12, float_only=True)
_add(OpKind.MATMUL, 2, "matmul")
# Layout: views run zero-copy; cat materialises.
_add(OpKind.LAYOUT, 1, "view permute expand slice select")
_add(OpKind.LAYOUT, None, "cat")
del E, R, B


def flop_weight(op: str) -> int:
    """The ROI model's flops per element of a tile op (1 for an add)."""
    return OPS[op].flops if op in OPS else 1


def float_only(names) -> set[str]:
    """The ops among ``names`` whose math is floating-point only."""
    return {n for n in names if n in OPS and OPS[n].float_only}
