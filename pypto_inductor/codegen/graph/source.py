"""Writing Python source: the lines, the objects they bind, literals and size expressions.

:class:`GraphCode` collects a graph function's lines and the objects bound as its default
arguments (fast locals); size expressions are printed from sympy once, here. View steps
become tensor method calls and extern ops their ATen call with the arguments written
out (:func:`view_source`, :func:`extern_source`); :func:`compile_graph` runs the source
once. ``PYPTO_INDUCTOR_GRAPH_CODE=1`` prints each graph's source at compile time.
"""
from __future__ import annotations

import math
import os
import sys

import sympy
import torch

from ...ir import ValueRef
from ...sizes import is_symbolic, resolve_static, size_source
from .program import has_refs


# view tile ops written inline as tensor methods: op -> (method, attribute order)
_INLINE_VIEWS = {
    "view": ("reshape", ("shape",)),
    "permute": ("permute", ("dims",)),
    "expand": ("expand", ("shape",)),
    "select": ("select", ("dim", "index")),
}


class _NotInline(Exception):
    """An argument the generator does not write as a literal (the step runs its closure)."""


class GraphCode:
    """Collects the source lines and the objects the source binds (default arguments)."""

    def __init__(self, symbols):
        self.lines: list[str] = []
        self.bound: dict[str, object] = {}  # name -> object, bound as a default argument
        self.constants: dict[tuple, str] = {}  # (prefix, tuple of ints) -> its name
        self.rename = {s: sympy.Symbol(f"sym{j}", integer=True) for j, s in enumerate(symbols)}

    def bind(self, prefix: str, obj) -> str:
        for name, known in self.bound.items():
            if known is obj and name.startswith(prefix):
                return name
        name = f"{prefix}{len(self.bound)}"
        self.bound[name] = obj
        return name

    def constant(self, prefix: str, value: tuple) -> str:
        """bind() for a tuple of ints, one name per value."""
        name = self.constants.get((prefix, value))
        if name is None:
            name = self.constants[prefix, value] = self.bind(prefix, value)
        return name

    def size(self, expr) -> str:
        return size_source(sympy.sympify(expr).xreplace(self.rename))

    def literal(self, x, names: dict[int, str], slot) -> str:
        """Python source for an extern op's argument (ValueRefs become variables)."""
        if isinstance(x, ValueRef):
            return names[slot[x.name]]
        if is_symbolic(x):
            return self.size(x)
        x = resolve_static(x) if isinstance(x, sympy.Basic) else x
        if type(x) is tuple or isinstance(x, list):  # list subclasses (fx's) as lists
            inner = "".join(f"{self.literal(v, names, slot)}, " for v in x)
            return f"({inner})" if type(x) is tuple else f"[{inner}]"
        if type(x) is dict and all(type(k) is str for k in x):
            return "{" + ", ".join(f"{k!r}: {self.literal(v, names, slot)}"
                                   for k, v in x.items()) + "}"
        if x is None or type(x) in (bool, int, str) or (type(x) is float and math.isfinite(x)):
            return repr(x)
        if has_refs(x):
            raise _NotInline(type(x).__name__)
        return self.bind("cst", x)


def view_source(code: GraphCode, step, fn, args: str) -> str:
    """A view step as a tensor method call (or its runner when it has no inline form)."""
    inline = _INLINE_VIEWS.get(step.op)
    operands_ok = len(step.args) == 1 and isinstance(step.args[0], str)
    attrs = step.attrs
    if step.op == "slice" and operands_ok and attrs.get("step") == 1:
        return (f"{args}.narrow({code.size(attrs['dim'])}, {code.size(attrs['start'])}, "
                f"{code.size(attrs['length'])})")
    if inline and operands_ok and set(attrs) == set(inline[1]):
        try:
            vals = ", ".join(code.literal(attrs[a], {}, {}) for a in inline[1])
        except (_NotInline, KeyError):
            vals = None
        if vals is not None:
            return f"{args}.{inline[0]}({vals})"
    return f"{code.bind('view', fn)}([{args}], syms)"


def extern_source(code: GraphCode, step, closure, defs: list[str], args: str, names,
                  slot) -> list[str]:
    """An extern op's call with its arguments written out (its closure if they cannot be)."""
    try:
        pos = "".join(f"{code.literal(a, names, slot)}, " for a in step.args)
        kw = "".join(f"{k}={code.literal(v, names, slot)}, " for k, v in step.kwargs.items())
        call = f"{code.bind('ext', step.fn)}({pos}{kw})"
    except _NotInline:
        call = None
    if call is None:  # the closure returns a list of results
        c = f"{code.bind('extcall', closure)}([{args}], syms)"
        if not any(d != "_" for d in defs):
            return [f"    {c}"]
        return [f"    result = {c}",
                *(f"    {d} = result[{j}]" for j, d in enumerate(defs) if d != "_"),
                "    del result"]
    if not step.tuple_result:
        return [f"    {defs[0]} = {call}" if defs and defs[0] != "_" else f"    {call}"]
    if not any(d != "_" for d in defs):
        return [f"    {call}"]
    return [f"    result = {call}",
            *(f"    {d} = result[{j}]" for j, d in enumerate(defs) if d != "_"),
            "    del result"]


def compile_graph(name: str, source: str, bound: dict, scope: dict):
    """exec the source once; the function ``call(args)``."""
    if os.environ.get("PYPTO_INDUCTOR_GRAPH_CODE"):
        print(f"# pypto_inductor graph {name}\n{source}", file=sys.stderr)
    glb = {"math": math, "torch": torch, **scope, **bound}
    exec(compile(source, f"<pypto graph {name}>", "exec"), glb)  # noqa: S102 - our own source
    return glb["call"]
