"""The layout keys of native kernels' metadata entries (launcher.Launch): the source of a
key holding only what the entry depends on, so a kernel of static shapes keeps its entry
while a decode step's cache length (a size symbol) grows, and one reading only
compile-time layouts looks up a constant key.
"""
from __future__ import annotations

import sympy

from ...sizes import is_symbolic
from .source import GraphCode


SHORT_KEYS = True  # likewise: native layout keys of what the entry depends on (layout_key)


def epilogue_key(code: GraphCode, k: str, launch, ins, names, fresh, fixed, known,
                 spec_of) -> str | None:
    """layout_key of a GEMM tile's native epilogue (matmul.EpilogueCall, named ``k``):
    its feeds are tile inputs (reshaped onto its domain: their layouts follow the
    input's and the domain's symbols) and the GEMM's product (``{k}_r``, or its reshape
    ``{k}_f<j>``: its strides, unless a static reinterpret of a fresh product)."""
    slots, parts = [], []
    shapes = [*launch.native.shapes, launch.T]
    for s in ins:
        spec = spec_of.get(s)
        if spec is None or not hasattr(spec, "shape"):
            return None
        shapes.append(spec.shape)  # the product's shape follows the GEMM's inputs'
    for j, (i, dims) in enumerate(launch.feeds):
        if dims is not None:
            shapes.append(dims)
        if i >= 0:
            slots.append(ins[i])
        elif dims is None:
            parts.append(f"{k}_r.stride()")
        elif not (fresh and all(not is_symbolic(sympy.sympify(d)) for d in dims)):
            parts.append(f"{k}_f{j}.stride()")
    return layout_key(code, slots, names, shapes, fixed, known, spec_of, parts)


def layout_key(code: GraphCode, ins, names, shapes, fixed, known, spec_of,
               parts=()) -> str | None:
    """The source of a native kernel's layout key (launcher.Launch.source): what its
    metadata (its inputs' sizes and strides, its outputs' shapes) depends on. An input
    whose layout is known at compile time (``fixed``) adds nothing; one whose strides
    the size symbols fix (``known``) adds all of them; any other its strides and the
    symbols of its shape; the outputs their shapes' symbols. So a kernel of static shapes
    keeps its entry while a decode step's cache length (a size symbol) grows, and a
    kernel reading only compile-time layouts looks up a constant key. None: the default
    key (an input without a spec)."""
    used: set = set()
    parts, every = list(parts), False
    for s in ins:
        if s in fixed:
            continue
        if s in known:
            every = True
            continue
        spec = spec_of.get(s)
        if spec is None or not hasattr(spec, "shape"):
            return None
        parts.append(f"{names[s]}.stride()")
        used.update(*(sympy.sympify(d).free_symbols for d in spec.shape))
    for shape in shapes:
        used.update(*(sympy.sympify(d).free_symbols for d in shape))
    if every or any(x not in code.rename for x in used):
        head = ["syms"]
    else:
        head = [code.size(x) for x in sorted(used, key=lambda x: str(code.rename[x]))]
    if not parts and not head:
        return "0"
    if not parts and head == ["syms"]:
        return "syms"
    return f"({''.join(p + ', ' for p in head + parts)})"
