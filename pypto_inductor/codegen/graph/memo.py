"""Kernels whose outputs depend on the size symbols alone: computed once per sizes.

A native kernel that reads no tensor (an ``arange``, an iota, T5's relative-position
buckets: two aranges, a ``log`` per element, an integer bucket) or reads only such
kernels' outputs computes the same values on every call with the same size symbols. The
graph code keeps its outputs in a dict keyed by the symbols and launches it on a miss
only: nothing per call that can be done once. (T5's bucket kernel, 128 x 128 with a log
per element, was 80-100 us of each forward; Inductor recomputes it, vectorised.)

Held out, so a kept buffer can never be written: outputs returned by the graph, or viewed
by a returned value (the caller may write into them), and outputs read by an op whose
schema may write an argument. Kept outputs are never pooled or written into by a later
kernel (the runtime leaves them out of the pool, :func:`size_only_steps`' caller).
"""
from __future__ import annotations

from .program import graph_slots

MEMO_SIZE_ONLY = True  # the benchmarks' "before" turns it off (read when a graph compiles)
MEMO_ENTRIES = 8  # size tuples kept per kernel: a dynamic graph's sizes vary per call


def size_only_steps(graph, program, kernels) -> set[int]:
    """Indices of the program's inline native kernels computed from the size symbols
    alone (see the module docstring)."""
    if not MEMO_SIZE_ONLY:
        return set()
    slots = dict(graph_slots(graph, program))
    returned = {slots[o] for o in graph.outputs if isinstance(o, str) and o in slots}
    bad: set[int] = set()  # kept-out kernel outputs; grows until nothing changes
    while True:
        steps, kept, root = set(), set(), {}  # root: a view's slot -> the kernel output
        for i, (kind, name, fn, ins, outs, step) in enumerate(program):
            launch = getattr(kernels.get(name), "launch", None) if kind == "kernel" else None
            writes = bool(getattr(launch, "writes", None))  # an input written in place
            inline = launch is not None and not getattr(launch, "gemm", False) and not writes
            if inline and None not in outs and not bad.intersection(outs) \
                    and all(root.get(s, s) in kept for s in ins):
                steps.add(i)
                kept.update(outs)
            elif kind == "view" and ins and root.get(ins[0], ins[0]) in kept:
                root[outs[0]] = root.get(ins[0], ins[0])
            elif not inline and (launch is None or writes) \
                    and not (kind == "extern" and _fresh(step)):
                # a wrapper kernel may write an input (copy_); an extern op may return
                # an alias of one, or write it
                bad.update(root.get(s, s) for s in ins if root.get(s, s) in kept)
        out = {root.get(s, s) for s in returned} & kept
        if not out - bad and not any(bad.intersection(program[i][4]) for i in steps):
            return steps
        bad |= out


def _fresh(step) -> bool:
    """Whether an extern op's schema says it neither writes nor returns an alias of any
    argument."""
    schema = getattr(step.fn, "_schema", None)
    return schema is not None and not any(
        a.alias_info is not None for a in (*schema.arguments, *schema.returns))


def memo_source(memo: str, launch: list[str], defs: list[str]) -> list[str]:
    """The lines ``launch`` (a kernel's inline launch, defining ``defs``) run on a miss
    of the dict ``memo`` only, keyed by the size symbols."""
    outs = "".join(d + ", " for d in defs)
    return [f"    kept = {memo}.get(syms)",
            "    if kept is None:",
            *("    " + line for line in launch),
            f"        if len({memo}) >= {MEMO_ENTRIES}:",
            f"            {memo}.clear()",
            f"        {memo}[syms] = ({outs})",
            "    else:",
            f"        {outs}= kept"]
