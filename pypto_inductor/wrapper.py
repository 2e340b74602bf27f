"""The Python code of a compiled graph: one straight-line function per graph.

:class:`runtime.CompiledGraph` describes its plan as a list of steps (kernel, view,
extern) with the slots they read and define; :func:`graph_source` writes that list out
as Python source, the way Inductor's output code does, and :func:`compile_graph` runs
it once at compile time. Per call there is no step loop and no dispatch: every value is
a local variable, kernels, extern ops and constants are bound as default arguments
(fast locals), size symbols are read once from the inputs and size expressions are
plain Python arithmetic on them (printed from sympy at compile time), views are tensor
method calls written inline, each intermediate is deleted right after its last reader,
and a dead pooled kernel output goes back to the buffer pool on the spot.

``PYPTO_INDUCTOR_GRAPH_CODE=1`` prints each graph's source at compile time; it is also
kept on ``CompiledGraph.source``.
"""
from __future__ import annotations

import math
import os
import sys

import sympy
import torch
from torch._prims_common import make_contiguous_strides_for

from .codegen.cpp import alloc
from .ir import ValueRef
from .sizes import is_symbolic, resolve_static, same_shape, size_source

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
        if _has_refs(x):
            raise _NotInline(type(x).__name__)
        return self.bind("cst", x)


def _has_refs(x) -> bool:
    return any(isinstance(v, ValueRef) or is_symbolic(v)
               for v in torch.utils._pytree.tree_leaves(x))


def graph_source(graph, program, free_after, *, probe: int, cpu_only: bool, pool,
                 profile: bool, timings: dict, kernels: dict, pool_empty: set,
                 reused: dict | None = None, pool_start: bool = True,
                 saved_from: int | None = None) -> tuple[str, dict]:
    """(source of ``call(args)``, the objects it binds). See the module docstring.

    ``program``: (kind, name, fn, input slots, output slots, step) per step; slots number
    the inputs, then the constants, then each value a step defines. ``free_after``: per
    step, the slots whose last reader it is (to drop, and to give back to ``pool``).
    ``reused`` gets, per kernel output written into a dead buffer, that buffer's slot.
    ``saved_from``: a training forward's first output saved for the backward
    (:func:`_returned_views`)."""
    code = GraphCode(graph.symbols)
    slot = dict(graph_slots(graph, program))
    names = {}  # slot -> variable name
    for i in range(len(graph.inputs)):
        names[i] = f"arg{i}"
    for j, value in enumerate(graph.constants.values()):
        names[len(graph.inputs) + j] = code.bind("const", value)
    for _, _, _, _, outs, _ in program:
        for s in outs:
            if s is not None:
                names[s] = f"buf{s}"
    outputs = graph.outputs
    out = code.lines
    n_in = len(graph.inputs)
    if n_in:
        out.append(f"    {''.join(names[i] + ', ' for i in range(n_in))}= args")
    if probe >= 0:
        p = names[probe]
        test = f"not {p}.is_cpu" if cpu_only else f"{p}.is_meta"
        out += [f"    if {p} is not None and {test}:", "        return other_device(args)"]
    for j, (i, d) in enumerate(graph.symbol_bindings.values()):
        out.append(f"    sym{j} = {names[i]}" + ("" if d is None else f".shape[{d}]"))
    out.append(f"    syms = ({''.join(f'sym{j}, ' for j in range(len(graph.symbols)))})")
    out.append("    args.clear()")  # the boxed convention: see CompiledGraph.__call__
    if pool is not None:
        if pool_start:
            out.append("    pool_start(syms)")
        code.bound["pool_empty"] = pool.empty
    static = static_reuse(graph, program, kernels, pool_empty) if pool is not None else {}
    small = small_outputs(program, kernels, pool_empty) if pool is not None else {}
    known: set[int] = set()  # slots whose strides the size symbols fix (launch outputs, views)
    chains = _view_chains(graph, program) if COLLAPSE_VIEWS else {}
    interior = {s for chain in chains.values() for s in chain[1][:-1]}
    deferred: dict[int, tuple[list, list]] = {}  # chain tail slot -> frees/recycles held back
    order = {outs[0]: i for i, (kind, _, _, _, outs, _) in enumerate(program) if kind == "view"}
    last_tail: dict[int, int] = {}  # a chain's base -> the tail of its last chain
    for tail, (base, _, _, _) in chains.items():
        if order[tail] > order.get(last_tail.get(base), -1):
            last_tail[base] = tail
    made: set[int] = set()  # chain tails emitted so far
    linear = _linear_weights(graph, program, kernels, chains, interior) if LINEAR_WEIGHTS \
        else set()
    dead: dict[tuple, list[str]] = {}  # (shape, dtype) -> dead buffers to write into
    # slot -> (sizes, strides, storage offset, dtype) known at compile time: static outputs
    # of kernels the generated code allocates (fresh, contiguous) and views of them
    fixed: dict[int, tuple] = {}
    aliased = _returned_views(graph, program, saved_from) if REINTERPRET_VIEWS else None
    spec_of = slot_specs(graph, program)
    if aliased is not None:
        code.bound["reinterpret"] = reinterpret_tensor
    first_step = len(out)
    # views of compile-time layouts not made until a reader needs the tensor: a native
    # kernel reads them as their root buffer and a byte offset (FOLD_VIEWS)
    pending: dict[int, tuple] = {}  # view slot -> (root slot, its layout)
    hold: dict[int, int] = {}  # root slot -> the last step reading a pending view of it
    postponed: set[int] = set()  # roots whose del waits for their pending views' readers
    last_read: dict[int, int] = {}
    for i, (_, _, _, ins_, _, _) in enumerate(program):
        for s in ins_:
            last_read[s] = i
    for tail, (base, _, _, _) in chains.items():  # a chain's tail reads its base
        last_read[base] = max(last_read.get(base, -1), order[tail])

    deferred_views: set[int] = set()  # views left pending ...
    made_views: set[int] = set()  # ... and those a reader made later

    def make(s):  # a pending view, made now (a reader needs the tensor)
        made_views.add(s)
        root, lay = pending.pop(s)
        out.append(_reinterpret(names[s], names[root], lay, fixed[root]))

    returned = {slot[o] for o in outputs if isinstance(o, str) and o in slot}

    def defer(s, base, lay):  # a view of a compile-time layout, left pending
        root = pending[base][0] if base in pending else base
        pending[s] = (root, lay)
        deferred_views.add(s)
        if s in returned:  # made now: its root may die before the return
            make(s)
        hold[root] = max(hold.get(root, -1), last_read.get(s, -1))

    for i, ((kind, name, fn, ins, outs, step), (free, recycle)) in enumerate(
            zip(program, free_after)):
        args = ", ".join(names[s] for s in ins)
        defs = [names[s] if s is not None else "_" for s in outs]
        launch = getattr(kernels.get(name), "launch", None) if kind == "kernel" else None
        if kind != "view" and (launch is None or getattr(launch, "gemm", False)):
            for s in dict.fromkeys(ins):
                if s in pending:
                    make(s)
        if kind == "kernel":
            if profile:
                t = code.bind("times", timings.setdefault(name, []))
                out.append("    start = perf_counter()")
            if getattr(launch, "gemm", False):  # the GEMM's torch call (matmul.GemmCall)
                k = f"k{len(code.bound)}"
                code.bound.update(launch.bindings(k))
                lin = any(s in linear for s in ins)  # F.linear on the weight itself
                if lin:
                    code.bound.setdefault("linear", torch.nn.functional.linear)
                native = getattr(launch, "native", None)  # and its epilogue (EpilogueCall)
                fresh = aliased is not None and launch.fresh(lin)
                if fresh:  # the product's layout is known: so are the outputs'
                    _fix_products(fixed, outs, step, graph, aliased, launch)
                if native is None:
                    out += launch.source(k, [names[s] for s in ins], defs, code.size, lin,
                                         {names[s] for s in outs if s in fixed})
                else:
                    code.bound.setdefault("native_call", native.call)
                    empty = ("pool_empty" if name in pool_empty
                             else code.bind("alloc", native.empty))
                    if "threads" not in code.bound:
                        code.bound["threads"] = torch.get_num_threads
                        out.insert(first_step, "    nthreads = threads()")
                    reuse = _take_dead(outs, static, dead, reused)
                    if small and alloc.empty_strided_cpu is not None:
                        code.bound.setdefault("empty_strided", alloc.empty_strided_cpu)
                    direct = {launch.getters[j][1]: small[s] for j, s in enumerate(outs)
                              if s in small and j not in reuse}
                    out += launch.source(k, [names[s] for s in ins], defs, code.size, empty,
                                         lin, {launch.getters[j][1]: v
                                               for j, v in reuse.items()}, fresh, direct,
                                         _epilogue_key(code, k, launch, ins, names, fresh, fixed,
                                                       known, spec_of) if SHORT_KEYS else None)
                    _fix_outputs(fixed, outs, launch)
                    if reuse:
                        out.append(f"    del {', '.join(reuse.values())}")
            elif launch is not None:  # the native call written out (launcher.Launch)
                k = f"k{len(code.bound)}"
                code.bound.update(launch.bindings(k))
                code.bound.setdefault("native_call", launch.call)
                empty = ("pool_empty" if name in pool_empty
                         else code.bind("alloc", launch.empty))
                reuse = _take_dead(outs, static, dead, reused)
                if "threads" not in code.bound:  # the thread count, read once per call
                    code.bound["threads"] = torch.get_num_threads
                    out.insert(first_step, "    nthreads = threads()")
                if alloc.empty_strided_cpu is not None:
                    code.bound.setdefault("empty_strided", alloc.empty_strided_cpu)
                direct = {j: small[s] for j, s in enumerate(outs)
                          if s in small and j not in reuse}
                offsets = [0] * (len(ins) + len(launch.dtypes))
                for j, s in enumerate(ins):  # a pending view: its root, from its offset
                    if s in pending:
                        root, lay = pending[s]
                        offsets[j] = (lay[2] - fixed[root][2]) * lay[3].itemsize
                out += launch.source(k, [names[pending[s][0]] if s in pending else names[s]
                                         for s in ins], defs, empty, reuse,
                                     [s in known for s in ins], direct,
                                     _layout_key(code, ins, names, launch.shapes, fixed, known,
                                                 spec_of) if SHORT_KEYS else None,
                                     {j: code.constant("lay", (*fixed[s][0], *fixed[s][1]))
                                      for j, s in enumerate(ins) if s in fixed and SHORT_KEYS},
                                     code.constant("offs", tuple(offsets)) if any(offsets)
                                     else None)
                known.update(s for s in outs if s is not None)
                _fix_outputs(fixed, outs, launch)
                if reuse:
                    out.append(f"    del {', '.join(reuse.values())}")
            else:
                call = f"{code.bind('kern', fn)}([{args}], syms)"
                out.append(f"    {''.join(d + ', ' for d in defs)}= {call}" if defs
                           else f"    {call}")
            if profile:
                out.append(f"    {t}.append((perf_counter() - start) * 1e6)")
        elif kind == "view" and outs[0] in interior:  # computed by its chain's tail
            # what dies here (the base) lives until the last chain of that base is made
            tail = next(t for t, (_, slots, _, _) in chains.items() if outs[0] in slots)
            for j, dying in enumerate((free, recycle)):
                for s in dying:
                    if s not in interior:
                        deferred.setdefault(last_tail.get(s, tail), ([], []))[j].append(s)
            free, recycle = [], []
        elif kind == "view" and outs[0] in chains:
            base, _, fns, sized = chains[outs[0]]
            b = names[base]
            lay = (_fixed_view(fixed[base], fns) if aliased is not None and base in fixed
                   and outs[0] not in aliased and not sized else None)
            if lay is not None:  # the chain's layout, known now
                fixed[outs[0]] = lay
                if FOLD_VIEWS:
                    defer(outs[0], base, lay)
                else:
                    out.append(_reinterpret(defs[0], b, lay, fixed[base]))
            else:
                if base in pending:
                    make(base)
                c = code.bind("chain", _ViewChain(fns))
                fast = (f"reinterpret({b}, view[0], view[1], view[2])"
                        if aliased is not None and outs[0] not in aliased else
                        f"{b}.as_strided(view[0], view[1], {b}.storage_offset() + view[2])")
                # views of static attributes depend on the base's layout alone: a decode
                # step's growing cache length (a size symbol) does not miss the cache
                out += [f"    key = ({'syms, ' if sized else ''}{b}.shape, {b}.stride())",
                        f"    view = {c}.layouts.get(key)",
                        "    if view:",
                        f"        {defs[0]} = {fast}",
                        "    else:",
                        f"        {defs[0]} = {c}.run({b}, syms, key)"]
            if base in known:
                known.add(outs[0])
            made.add(outs[0])
            held = deferred.pop(outs[0], ([], []))
            free, recycle = held[0] + list(free), held[1] + list(recycle)
        elif kind == "view" and outs[0] in linear:  # the weight itself: see _linear_weights
            if ins[0] in pending:
                make(ins[0])
            out.append(f"    {defs[0]} = {args}")
        elif kind == "view":
            lay = (_fixed_view(fixed[ins[0]], [fn]) if aliased is not None
                   and not _has_refs(step.attrs)
                   and len(ins) == 1 and ins[0] in fixed and outs[0] not in aliased else None)
            if lay is not None and FOLD_VIEWS:  # made when a reader needs the tensor
                fixed[outs[0]] = lay
                defer(outs[0], ins[0], lay)
            elif lay is not None:  # the view's layout, known now: no view call per call
                fixed[outs[0]] = lay
                out.append(_reinterpret(defs[0], args, lay, fixed[ins[0]]))
            elif aliased is not None and outs[0] not in aliased and len(ins) == 1 \
                    and step.op == "view" and ins[0] not in pending \
                    and _same_spec(spec_of.get(ins[0]), spec_of.get(outs[0])):
                out.append(f"    {defs[0]} = {args}")  # a reshape to its own shape
            else:
                for s in dict.fromkeys(ins):
                    if s in pending:
                        make(s)
                out.append(f"    {defs[0]} = {_view(code, step, fn, args)}")
            if ins and ins[0] in known:
                known.add(outs[0])
        else:
            out += _extern(code, step, fn, defs, args, names, slot)
        # a chain's base lives until its last chain's tail, which may come after its
        # last other reader (fuzz seed 1020: an expand of the base read after the chain)
        for j, dying in enumerate((free, recycle)):
            for s in dying:
                if s in last_tail and last_tail[s] not in made:
                    deferred.setdefault(last_tail[s], ([], []))[j].append(s)
        free = [s for s in free if s not in interior and not (
            s in last_tail and last_tail[s] not in made)]
        for s in free:  # a root outlives its pending views' readers
            if hold.get(s, -1) > i:
                postponed.add(s)
        free = [s for s in free if s not in postponed]
        for s in free:
            pending.pop(s, None)  # dead: no reader will make it
        free = [s for s in free if s not in deferred_views or s in made_views]
        for s in sorted(postponed):
            if hold[s] <= i:
                postponed.discard(s)
                free.append(s)
        recycle = [s for s in recycle if not (s in last_tail and last_tail[s] not in made)]
        if free:  # first: a dead view still holds its base's storage
            out.append(f"    del {', '.join(names[s] for s in free)}")
        for s in [s for s in recycle if s in static]:  # kept for a later kernel's output
            dead.setdefault(static[s], []).append(names[s])
        recycle = [s for s in recycle if s not in static]
        for s in recycle:
            if s in small:  # back to glibc's caches: no refcount check, no pool
                continue
            v = names[s]
            out += [f"    if getrefcount({v}) == ALONE_REFS and "
                    f"use_count({v}.untyped_storage()._cdata) == ALONE_USES and "
                    f"{v}.is_contiguous():",
                    f"        pool_give({v})"]
        if recycle:
            out.append(f"    del {', '.join(names[s] for s in recycle)}")
    rets = []
    for o in outputs:
        if o is None:
            rets.append("None")
        elif isinstance(o, str):
            rets.append(names[slot[o]])
        else:
            rets.append(code.size(o) if is_symbolic(o) else code.literal(o, names, slot))
    spare = [v for vs in dead.values() for v in vs]
    # the next call's allocations (a small one allocates afresh: it is dropped)
    out += [f"    pool_give({v})" for v in spare if int(v[3:]) not in small]
    if spare:
        out.append(f"    del {', '.join(spare)}")
    out.append(f"    return [{', '.join(rets)}]")
    params = "".join(f", {n}={n}" for n in code.bound)
    src = f"def call(args{params}):\n" + "\n".join(out) + "\n"
    return src, code.bound


# Inductor's alias with given sizes, strides and offset increment: no dispatcher, no
# autograd view record (about 1 us against 2 for a view method or as_strided). The
# compiled graph records no autograd (AOTAutograd runs it under no_grad or with inputs
# that need no grad), and a view that is returned, or that a returned value is a view
# of, keeps the real view call (AOTAutograd regenerates aliased outputs from their base).
reinterpret_tensor = getattr(torch._C._dynamo.guards, "_reinterpret_tensor", None)
REINTERPRET_VIEWS = reinterpret_tensor is not None  # the benchmark's "before" turns it off
RETURNED_REINTERPRET = True  # likewise: a returned view of an intermediate (_returned_views)
SAVED_REINTERPRET = True  # likewise: a forward's saved view of an intermediate (_returned_views)
IDENTITY_VIEWS = True  # likewise: a view of its base's own layout is the base (_reinterpret)


def _returned_views(graph, program, saved_from: int | None = None) -> set[int]:
    """View slots that are returned or that a returned value is (a view of) a view of.

    Except (RETURNED_REINTERPRET) a returned view of a graph intermediate that nothing else
    returned shares (not the intermediate, no other view of it), as Inductor returns its
    reinterpret_tensor: AOTAutograd regenerates an output from its base only where the
    base is a graph input or an output too, or both require grad (then it makes the base an
    output), and the graph's other values are dead when it returns.

    ``saved_from``: a training forward's first output AOTAutograd saves for the backward
    (``fw_metadata.num_forward``). Those it never regenerates, and it detaches each that
    is a view: a saved view of an intermediate that no output before ``saved_from`` shares
    (SAVED_REINTERPRET) counts as not returned, so it is a reinterpret (no view record:
    no detach) or the tensor itself."""
    slots = dict(graph_slots(graph, program))
    returned = [slots[o] for o in graph.outputs if isinstance(o, str) and o in slots]
    base = {outs[0]: ins for kind, _, _, ins, outs, _ in program
            if kind == "view" and outs and outs[0] is not None}

    def chain(s):
        seen = [s]
        while seen[-1] in base and len(base[seen[-1]]) == 1:
            seen.append(base[seen[-1]][0])
        return seen

    chains = [chain(s) for s in returned]
    roots = [c[-1] for c in chains]
    first = len(graph.inputs) + len(graph.constants)  # slots of values the graph computes
    saved = set()
    if saved_from is not None and SAVED_REINTERPRET:
        at = [j for j, o in enumerate(graph.outputs) if isinstance(o, str) and o in slots]
        # roots a user-visible output shares (the user may write into it in place: the
        # saved view must keep its version counter) or reached through a multi-input view
        shared = {v for j, c in zip(at, chains) if j < saved_from for v in c}
        for j, s, c in zip(at, returned, chains):
            if j >= saved_from and c[-1] >= first and c[-1] not in base \
                    and not shared & set(c) and all(len(base.get(v, ())) == 1 for v in c[:-1]):
                saved.add(s)
    out = set(returned) - saved
    for s, c in zip(returned, chains):
        r = c[-1]
        if s in saved:
            continue
        if RETURNED_REINTERPRET and s != r and r >= first and r not in base \
                and r not in returned and roots.count(r) == 1 and all(
                    len(base.get(v, ())) == 1 for v in c[:-1]):
            out.discard(s)
            continue
        out.update(c)
    for kind, name, fn, ins, outs, step in reversed(program):
        if kind == "view" and outs and outs[0] in out:
            out.update(ins)
    return out


def _reinterpret(name: str, base: str, lay: tuple, of: tuple) -> str:
    """The line making ``name`` a view of layout ``lay`` of ``base`` (layout ``of``):
    ``base`` itself where the layouts are the same (a transpose of a transpose, a reshape
    to its own shape: no call, and a saved tensor no view for AOTAutograd to detach)."""
    if IDENTITY_VIEWS and lay[:3] == of[:3] and lay[3] == of[3]:
        return f"    {name} = {base}"
    return f"    {name} = reinterpret({base}, {lay[0]}, {lay[1]}, {lay[2] - of[2]})"


def _fix_outputs(fixed: dict, outs, launch) -> None:
    """Record the compile-time layouts of a kernel's fresh static outputs."""
    for s, (shape, dt) in zip(outs, _fresh_outputs(launch)):
        if s is None or shape is None or any(is_symbolic(sympy.sympify(d)) for d in shape):
            continue
        sizes = tuple(int(resolve_static(d)) for d in shape)
        fixed[s] = (sizes, make_contiguous_strides_for(sizes), 0, dt)


def _fix_products(fixed: dict, outs, step, graph, aliased, launch) -> None:
    """Record the layouts of a GEMM tile's outputs that are its fresh contiguous product
    (GemmCall.fresh), as is or reshaped, where static and not returned."""
    getters = getattr(launch, "getters", None)
    for j, (s, name) in enumerate(zip(outs, step.outputs)):
        if s is None or s in aliased or (getters is not None and getters[j][0] != "mm"):
            continue
        spec = graph.specs.get(name)
        if spec is None or getters is not None and getters[j][2] is not None:
            continue  # an EpilogueCall's reshaped product: written as a reshape
        if any(is_symbolic(sympy.sympify(d)) for d in spec.shape):
            continue
        sizes = tuple(int(resolve_static(d)) for d in spec.shape)
        fixed[s] = (sizes, make_contiguous_strides_for(sizes), 0, spec.dtype)


def _fixed_view(base: tuple, fns) -> tuple | None:
    """(sizes, strides, offset, dtype) of a view (a chain of views: ``fns``, runners of
    static attributes) of a base of the known layout ``base``, found by running them on a
    meta tensor of that layout; None where one copies (a reshape of a non-viewable
    layout) or changes the dtype."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.utils._python_dispatch import _disable_current_modes
    sizes, strides, offset, dt = base
    extent = offset + 1 + sum((n - 1) * st for n, st in zip(sizes, strides) if n > 0)
    try:
        with unset_fake_temporarily(), _disable_current_modes():
            t = torch.empty(extent, dtype=dt, device="meta").as_strided(sizes, strides, offset)
            v = t
            for fn in fns:
                v = fn([v], ())
    except Exception:  # noqa: BLE001 - the view call stays
        return None
    if not isinstance(v, torch.Tensor) or v.dtype != dt or not v._is_view() \
            or v._base is not t._base:
        return None
    return tuple(v.shape), tuple(v.stride()), v.storage_offset(), dt


def _epilogue_key(code: GraphCode, k: str, launch, ins, names, fresh, fixed, known,
                  spec_of) -> str | None:
    """_layout_key of a GEMM tile's native epilogue (matmul.EpilogueCall, named ``k``):
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
    return _layout_key(code, slots, names, shapes, fixed, known, spec_of, parts)


def _layout_key(code: GraphCode, ins, names, shapes, fixed, known, spec_of,
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


def _same_spec(a, b) -> bool:
    """Whether two values' specs have the same shape and dtype (a reshape from one to the
    other is the tensor itself to any reader but an aliasing check)."""
    return a is not None and b is not None and hasattr(a, "shape") and hasattr(b, "shape") \
        and a.dtype == b.dtype and len(a.shape) == len(b.shape) and same_shape(a.shape, b.shape)


def _take_dead(outs, static, dead, reused) -> dict[int, str]:
    """output index -> a dead buffer (its variable) of the output's shape and dtype that
    the kernel writes into (static_reuse)."""
    reuse = {}
    for j, s in enumerate(outs):
        if s in static and dead.get(static[s]):
            reuse[j] = dead[static[s]].pop()
            if reused is not None:
                reused[s] = int(reuse[j][3:])  # buf<slot>
    return reuse


COLLAPSE_VIEWS = True  # the benchmark turns it off to compile the "before" form
LINEAR_WEIGHTS = True  # likewise: F.linear on a transposed weight (_linear_weights)
LINEAR_ANY_POSITION = True  # likewise: ... wherever the tile's inputs list the transpose
REUSE_AFTER_TORCH_CALLS = True  # likewise: static_reuse through GEMM / extern readers
SMALL_EPILOGUE_OUTPUTS = True  # likewise: small_outputs of GEMM tiles' native epilogues
SHORT_KEYS = True  # likewise: native layout keys of what the entry depends on (_layout_key)
FOLD_VIEWS = True  # likewise: views of compile-time layouts read by native kernels as offsets
_MIN_CHAIN = 3  # views in a chain worth one as_strided call (its key costs about a view)


class _ViewChain:
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


def _view_chains(graph, program) -> dict[int, tuple[int, list[int], list, bool]]:
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
    views = {outs[0]: (ins[0], fn, _has_refs(step.attrs))
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


# A pooled output of at most this many bytes and a static shape is allocated directly and
# dropped when dead: glibc serves such chunks from its caches in about 0.5 us, against
# 1.3 us for the pool's round trip (lock, dict, and the refcount check before giving it
# back). The pool pays off for large buffers (fresh pages, glibc sorting big chunks:
# docs/runtime_overhead.md); a batch-1 decode step's activations are a few hundred bytes.
SMALL_OUTPUT_BYTES = 64 << 10


def small_outputs(program, kernels, pool_empty) -> dict[int, tuple]:
    """Outputs of kernels called inline (launcher.Launch, and the native epilogue of a
    GEMM tile: matmul.EpilogueCall) with a static shape of at most SMALL_OUTPUT_BYTES:
    slot -> (sizes, contiguous strides), written into the generated code's allocation
    (Inductor's ``empty_strided_cpu``); pooled or returned alike."""
    if alloc.empty_strided_cpu is None:
        return {}
    small = {}
    for kind, name, fn, ins, outs, step in program:
        launch = getattr(kernels.get(name), "launch", None) if kind == "kernel" else None
        if launch is None or getattr(launch, "gemm", False) and (
                getattr(launch, "native", None) is None or not SMALL_EPILOGUE_OUTPUTS):
            continue
        for s, (shape, dt) in zip(outs, _fresh_outputs(launch)):  # a GEMM's: its epilogue's
            if s is None or shape is None or any(is_symbolic(sympy.sympify(d)) for d in shape):
                continue
            sizes = tuple(int(resolve_static(d)) for d in shape)
            if math.prod(sizes) * dt.itemsize <= SMALL_OUTPUT_BYTES:
                strides, n = [], 1
                for d in reversed(sizes):  # torch's: a size-0 dim counts as 1
                    strides.append(n)
                    n *= max(d, 1)
                small[s] = (sizes, tuple(reversed(strides)))
    return small


def static_reuse(graph, program, kernels, pool_empty) -> dict[int, tuple]:
    """Kernel outputs whose buffers a later kernel may write into once they are dead,
    decided at compile time (as Inductor's wrapper reuses buffers): slot -> (shape, dtype).

    Only pooled outputs of kernels called inline (launcher.Launch: fresh contiguous
    buffers, no in-place writes), read only by views and such kernels, and neither they
    nor a view of them returned: nothing else can hold such a buffer once its last reader
    ran. Every other dead pooled buffer goes through the runtime check (refcounts)."""
    key, root = {}, {}  # candidate slot -> (shape, dtype); view slot -> candidate
    bad = set()
    for kind, name, fn, ins, outs, step in program:
        launch = getattr(kernels.get(name), "launch", None) if kind == "kernel" else None
        # readers that keep no reference to their inputs once they return: views, inline
        # native kernels, the GEMM tiles' torch calls and extern ops whose schema says
        # their results alias no input (fresh tensors; the compiled graph runs without
        # autograd recording: AOTAutograd's forward runs under no_grad)
        keeps = not (kind == "view" or (launch is not None and (
            REUSE_AFTER_TORCH_CALLS or not getattr(launch, "gemm", False)))
            or (kind == "extern" and REUSE_AFTER_TORCH_CALLS and _fresh_results(step)))
        for s in ins:
            r = root.get(s, s)
            if r in key and keeps:
                bad.add(r)
        if kind == "view" and ins and root.get(ins[0], ins[0]) in key:
            root[outs[0]] = root.get(ins[0], ins[0])
        if launch is None or name not in pool_empty or (
                getattr(launch, "gemm", False) and not REUSE_AFTER_TORCH_CALLS):
            continue
        for s, (shape, dt) in zip(outs, _fresh_outputs(launch)):
            if s is not None and shape is not None:
                key[s] = (tuple(sympy.sympify(d) for d in shape), dt)
    slots = dict(graph_slots(graph, program))
    for o in graph.outputs:
        if isinstance(o, str) and o in slots:
            bad.add(root.get(slots[o], slots[o]))
    return {s: k for s, k in key.items() if s not in bad}


def _fresh_outputs(launch) -> list[tuple]:
    """Per tile output: (shape, dtype) of the fresh contiguous buffer the generated code
    allocates for it, or (None, None): a GEMM's product (torch allocates it) or an
    epilogue output reshaped to the tile's shape."""
    native = getattr(launch, "native", None)
    if not getattr(launch, "gemm", False):
        return list(zip(launch.shapes, launch.dtypes))
    if native is None:
        return [(None, None)] * len(launch.shapes)
    out = []
    for kind, idx, dims in launch.getters:
        if kind == "epi" and (dims is None or same_shape(dims, launch.T)):
            out.append((native.shapes[idx], native.dtypes[idx]))
        else:
            out.append((None, None))
    return out


def _fresh_results(step) -> bool:
    """Whether an extern op's results are fresh tensors and it writes none of its
    arguments (an ATen overload whose schema has no alias annotation)."""
    schema = getattr(step.fn, "_schema", None)
    return schema is not None and not any(
        a.alias_info is not None for a in (*schema.arguments, *schema.returns))


def _linear_weights(graph, program, kernels, chains, interior) -> set[int]:
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


def _view(code: GraphCode, step, fn, args: str) -> str:
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


def _extern(code: GraphCode, step, closure, defs: list[str], args: str, names, slot) -> list[str]:
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
