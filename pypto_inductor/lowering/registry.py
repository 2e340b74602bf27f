"""The registry from ATen overloads to lowering functions.

A lowering is ``fn(ctx, *args, **kwargs) -> value name | tuple of names``: it
receives the FX node's arguments with tensors replaced by value names and sizes
by sympy expressions, and emits TileOps through ``ctx``. Raising
:class:`Unsupported` makes that node an extern (eager) op with the reason.
"""
from __future__ import annotations

from typing import Callable

import torch

from ..ir import op_name

LOWERINGS: dict[torch._ops.OpOverload, Callable] = {}


class Unsupported(Exception):
    """This call cannot become tile ops; it runs eagerly (the message says why)."""


def _overloads(op) -> list[torch._ops.OpOverload]:
    if isinstance(op, torch._ops.OpOverloadPacket):
        return [getattr(op, name) for name in op.overloads()]
    return [op]


def register_lowering(*ops) -> Callable[[Callable], Callable]:
    """Register ``fn`` for every overload of each op (packets expand to all overloads)."""

    def decorator(fn: Callable) -> Callable:
        for op in ops:
            for overload in _overloads(op):
                LOWERINGS[overload] = fn
        return fn

    return decorator


def lowered_op_names() -> list[str]:
    """Distinct ATen ops (packets) with a lowering, e.g. 'aten.add'."""
    return sorted({op_name(op).rsplit(".", 1)[0] for op in LOWERINGS})
