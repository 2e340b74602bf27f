"""Sizes: the one definition of each small size helper, and size functions.

Shapes, strides and sizes are sympy expressions over the graph's size symbols
(ints where static). :func:`same_size`, :func:`numel` and
:func:`contiguous_strides` are the compile-time helpers every pass shares.

Size expressions evaluated at run time never run sympy: at compile time each one
is printed once as Python source and compiled into a function of the graph's size
symbols (:func:`size_function`); at run time only that plain Python function runs.
"""
from __future__ import annotations

import math
from typing import Any, Callable, Sequence

import sympy
import torch
from torch.utils._sympy.printers import PythonPrinter

_PRINTER = PythonPrinter()


def is_symbolic(x: Any) -> bool:
    """Whether ``x`` is a sympy expression rather than a number (a size known only at run
    time)."""
    return isinstance(x, sympy.Basic) and not isinstance(x, sympy.Number)


def same_size(a: Any, b: Any) -> bool:
    """Whether two sizes (ints or sympy expressions) are equal for every value of their
    symbols."""
    if a == b:
        return True
    return sympy.expand(sympy.sympify(a) - sympy.sympify(b)) == 0


def same_shape(a, b) -> bool:
    return len(a) == len(b) and all(same_size(x, y) for x, y in zip(a, b))


def numel(shape) -> sympy.Expr:
    """The element count of a shape of sizes (1 for ``()``)."""
    return sympy.Mul(*shape) if shape else sympy.Integer(1)


def contiguous_strides(shape) -> tuple[sympy.Expr, ...]:
    """The row-major strides of a shape of sizes."""
    strides, acc = [], sympy.Integer(1)
    for size in reversed(shape):
        strides.append(acc)
        acc = acc * size
    return tuple(reversed(strides))


def _to_python(x: Any) -> Any:
    """A constant: sympy numbers become Python numbers; containers recurse."""
    if isinstance(x, sympy.Integer):
        return int(x)
    if isinstance(x, sympy.Number):
        return float(x)
    if isinstance(x, tuple):
        return tuple(_to_python(v) for v in x)
    if isinstance(x, list):
        return [_to_python(v) for v in x]
    return x


def _source(x: Any) -> str:
    if isinstance(x, (tuple, list)):
        inner = ", ".join(_source(v) for v in x)
        return f"({inner},)" if isinstance(x, tuple) else f"[{inner}]"
    if is_symbolic(x):
        return f"({_PRINTER.doprint(x)})"
    x = _to_python(x)
    if isinstance(x, float) and not math.isfinite(x):  # repr gives inf / nan: no such names
        return f"float({repr(x)!r})"
    return repr(x)


def size_source(x: Any) -> str:
    """Python source of a size (or a container of sizes) over its symbols' names."""
    return _source(x)


def contains_symbol(x: Any) -> bool:
    if isinstance(x, (tuple, list)):
        return any(contains_symbol(v) for v in x)
    return is_symbolic(x)


def size_function(value: Any, symbols: Sequence[sympy.Symbol]) -> Callable[[tuple], Any]:
    """f(sym_values) -> value with every size expression evaluated (containers kept)."""
    if not contains_symbol(value):
        const = _to_python(value)
        return lambda syms: const
    params = ", ".join(s.name for s in symbols)
    code = f"lambda {params}: {_source(value)}"
    fn = eval(code, {"math": math, "torch": torch})  # noqa: S307 - our own printed source
    return lambda syms: fn(*syms)


def resolve_static(value: Any) -> Any:
    """A value known to be constant, with sympy numbers turned into Python numbers."""
    return _to_python(value)
