"""Views the graph code does not make one by one: chains of views as one ``as_strided``
(:class:`ViewChain`), and a Linear weight's transpose read by a GEMM as the weight itself
(:func:`linear_weights`).
"""
from __future__ import annotations

import torch

from .program import graph_slots, has_refs, slot_specs


COLLAPSE_VIEWS = True  # the benchmark turns it off to compile the "before" form
LINEAR_WEIGHTS = True  # likewise: F.linear on a transposed weight (linear_weights)
LINEAR_ANY_POSITION = True  # likewise: ... wherever the tile's inputs list the transpose
_MIN_CHAIN = 3  # views in a chain worth one as_strided call (its key costs about a view)


class ViewChain:
    """A chain of views (reshape, narrow, permute, ...) from one base, each the only
    reader of the one before, as one ``as_strided`` call: the chain runs through its
    views once per base sizes and strides (and size symbols, where a view's attribute
    is a size expression) and the result's sizes, strides and
    offset from the base are kept; a chain whose reshape had to copy keeps running
    through its views (its entry is False)."""

    def __init__(self, fns):
        self.fns = fns
        self.layouts: dict = {}

    def run(self, base, syms, key):
        t = base
        for fn in self.fns:
            t = fn([t], syms)
        same = t.untyped_storage().data_ptr() == base.untyped_storage().data_ptr() \
            and t.dtype == base.dtype and t.device == base.device
        if len(self.layouts) >= 256:
            self.layouts.pop(next(iter(self.layouts)))
        self.layouts[key] = (tuple(t.shape), tuple(t.stride()),
                             t.storage_offset() - base.storage_offset()) if same else False
        return t


def view_chains(graph, program) -> dict[int, tuple[int, list[int], list, bool]]:
    """tail slot -> (base slot, the chain's view slots in order, their runners, whether
    an attribute of theirs is a size expression) for each chain of at least _MIN_CHAIN
    views where every view but the tail is read by the next view only and returned by
    no one."""
    readers: dict[int, list] = {}
    for kind, name, fn, ins, outs, step in program:
        for s in ins:
            readers.setdefault(s, []).append(kind)
    slots = dict(graph_slots(graph, program))
    returned = {slots[o] for o in graph.outputs if isinstance(o, str) and o in slots}
    views = {outs[0]: (ins[0], fn, has_refs(step.attrs))
             for kind, name, fn, ins, outs, step in program
             if kind == "view" and len(ins) == 1 and outs and outs[0] is not None}
    chains = {}
    for tail in views:
        chain, s = [tail], views[tail][0]
        while s in views and readers.get(s) == ["view"] and s not in returned:
            chain.append(s)
            s = views[s][0]
        if len(chain) >= _MIN_CHAIN:
            chains[tail] = (s, chain[::-1], [views[v][1] for v in chain[::-1]],
                            any(views[v][2] for v in chain))
    # a tail that is itself inside a longer chain is not a tail
    inner = {v for _, c, _, _ in chains.values() for v in c[:-1]}
    return {t: c for t, c in chains.items() if t not in inner}


def linear_weights(graph, program, kernels, chains, interior) -> set[int]:
    """Slots of 2-D transposes (``permute(1, 0)``: an ``nn.Linear``'s weight) whose one
    reader is a GEMM's right operand, ``mm(x, w.T)`` or ``addmm(b, x, w.T)`` on 2-D ``x``
    and 1-D ``b``: the generated code calls ``F.linear(x, w[, b])`` on the weight itself,
    which makes the same ATen call (``at::linear``: ``matmul(x, w.t())``, or
    ``addmm(b, x, w.t())``) with the transpose taken in C++: no view call per GEMM (a
    LLaMA decode step has 14)."""
    readers: dict[int, list[int]] = {}
    for i, (kind, name, fn, ins, outs, step) in enumerate(program):
        for s in ins:
            readers.setdefault(s, []).append(i)
    slots = dict(graph_slots(graph, program))
    returned = {slots[o] for o in graph.outputs if isinstance(o, str) and o in slots}
    spec_of, found = slot_specs(graph, program), set()
    for kind, name, fn, ins, outs, step in program:
        if kind != "view" or step.op != "permute" or tuple(step.attrs.get("dims", ())) != (1, 0) \
                or len(ins) != 1 or not outs or outs[0] is None or outs[0] in returned \
                or outs[0] in chains or outs[0] in interior or len(step.out.shape) != 2:
            continue
        users = readers.get(outs[0], [])
        if len(users) != 1:
            continue
        ukind, uname, _, uins, _, ustep = program[users[0]]
        launch = getattr(kernels.get(uname), "launch", None) if ukind == "kernel" else None
        if not getattr(launch, "gemm", False) or not uins or uins.count(outs[0]) != 1:
            continue
        ops = launch.operands
        specs = [spec_of.get(s) for s in uins]
        if any(op[0] != "in" for op in ops) or any(sp is None for sp in specs) \
                or uins[ops[-1][1]] != outs[0]:  # the transpose is the GEMM's right operand
            continue
        if not LINEAR_ANY_POSITION and uins[-1] != outs[0]:  # the benchmark's "before"
            continue
        x = specs[ops[-2][1]]
        if launch.fn in (torch.matmul, torch.mm) and len(ops) == 2 and len(x.shape) == 2:
            found.add(outs[0])
        elif launch.fn is torch.addmm and len(ops) == 3 and len(x.shape) == 2 \
                and len(specs[ops[0][1]].shape) == 1:
            found.add(outs[0])
    return found
