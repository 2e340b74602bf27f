"""The Python code of a compiled graph: one straight-line function per graph.

:class:`runtime.CompiledGraph` describes its plan as a list of steps (kernel, view,
extern) with the slots they read and define; :func:`graph_source` writes that list out
as Python source, the way Inductor's output code does, and :func:`compile_graph` runs
it once at compile time. Per call there is no step loop and no dispatch: every value is
a local variable, kernels, extern ops and constants are bound as default arguments
(fast locals), size symbols are read once from the inputs and size expressions are
plain Python arithmetic on them (printed from sympy at compile time), views are tensor
method calls written inline (or aliases of layouts known at compile time), each
intermediate is deleted right after its last reader, and a dead pooled kernel output
goes back to the buffer pool on the spot.

One concept per module:

- :mod:`.program`: which slot holds which graph value;
- :mod:`.source`: the source's lines, bound objects, literals, view and extern calls;
- :mod:`.layouts`: layouts known at compile time; which views may be aliases;
- :mod:`.views`: view chains as one ``as_strided``, Linear weights' transposes;
- :mod:`.buffers`: small outputs allocated directly, dead buffers reused;
- :mod:`.memo`: kernels of the size symbols alone, launched once per sizes;
- :mod:`.keys`: native kernels' layout keys;
- :mod:`.write`: :func:`graph_source`, the loop over the steps applying all of these.

The benchmarks' "before" switches are module attributes of the module that reads them
(``layouts.FOLD_VIEWS``, ``buffers.SMALL_OUTPUT_BYTES``, ...), read when a graph is
compiled. ``PYPTO_INDUCTOR_GRAPH_CODE=1`` prints each graph's source at compile time;
it is also kept on ``CompiledGraph.source``.
"""
from __future__ import annotations

from .buffers import small_outputs, static_reuse
from .memo import size_only_steps
from .source import compile_graph
from .write import graph_source

__all__ = ["compile_graph", "graph_source", "size_only_steps", "small_outputs", "static_reuse"]
