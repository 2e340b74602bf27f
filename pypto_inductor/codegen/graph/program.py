"""The runtime's step list as the graph code sees it: which slot holds which graph value.

:class:`runtime.CompiledGraph` numbers the values in slots (the inputs, then the
constants, then each value a step defines); every part of the graph code looks values up
through these.
"""
from __future__ import annotations

import torch

from ...ir import ValueRef
from ...sizes import is_symbolic


def has_refs(x) -> bool:
    return any(isinstance(v, ValueRef) or is_symbolic(v)
               for v in torch.utils._pytree.tree_leaves(x))


def slot_specs(graph, program) -> dict:
    """slot -> the spec of the graph value it holds (None for a value without one)."""
    return {s: graph.specs.get(n) for n, s in graph_slots(graph, program)}


def graph_slots(graph, program):
    """(value name, slot) of every graph value the program knows."""
    seen = {}
    for i, n in enumerate(graph.inputs):
        seen[n] = i
    for j, n in enumerate(graph.constants):
        seen[n] = len(graph.inputs) + j
    for kind, name, fn, ins, outs, step in program:
        names = step.outputs if kind != "view" else [step.name]
        for n, s in zip(names, outs):
            if n is not None and s is not None:
                seen[n] = s
    return seen.items()
