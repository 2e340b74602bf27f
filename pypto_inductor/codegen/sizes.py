"""Size expressions evaluated at run time without sympy.

At compile time each sympy expression is printed once as Python source and
compiled into a function of the graph's size symbols; at run time only that
plain Python function runs.
"""
from __future__ import annotations

import math
from typing import Any, Callable, Sequence

import sympy
import torch
from torch.utils._sympy.printers import PythonPrinter

_PRINTER = PythonPrinter()


def is_symbolic(x: Any) -> bool:
    return isinstance(x, sympy.Basic) and not isinstance(x, sympy.Number)


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
    return repr(_to_python(x))


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
