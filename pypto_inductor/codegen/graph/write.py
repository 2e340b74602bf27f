"""graph_source: the runtime's step list written out as one straight-line Python function.

The loop over the steps: kernels (inline native launches, GEMM torch calls with their
native epilogues, wrapper calls), views (aliases of compile-time layouts, view chains,
tensor method calls), extern ops; each intermediate deleted after its last reader and a
dead pooled buffer given back on the spot. The decisions it applies are made in the
package's other modules.
"""
from __future__ import annotations

import torch

from ..cpp import alloc
from ...sizes import is_symbolic
from . import keys, layouts, views
from .buffers import small_outputs, static_reuse, take_dead
from .keys import epilogue_key, layout_key
from .memo import memo_source
from .layouts import fix_extern, fix_inputs, fix_outputs, fix_products, fix_wrapped, fixed_view, reinterpret_source, \
    returned_views, same_spec
from .program import graph_slots, has_refs, slot_specs
from .source import GraphCode, extern_source, view_source
from .views import ViewChain, linear_weights, view_chains


def graph_source(graph, program, free_after, *, probe: int, cpu_only: bool, pool,
                 profile: bool, timings: dict, kernels: dict, pool_empty: set,
                 reused: dict | None = None, pool_start: bool = True,
                 saved_from: int | None = None, memo: set[int] = frozenset()
                 ) -> tuple[str, dict]:
    """(source of ``call(args)``, the objects it binds). See the module docstring.

    ``program``: (kind, name, fn, input slots, output slots, step) per step; slots number
    the inputs, then the constants, then each value a step defines. ``free_after``: per
    step, the slots whose last reader it is (to drop, and to give back to ``pool``).
    ``reused`` gets, per kernel output written into a dead buffer, that buffer's slot.
    ``saved_from``: a training forward's first output saved for the backward
    (:func:`returned_views`). ``memo``: the steps computed once per size symbols
    (:func:`.memo.size_only_steps`)."""
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
    chains = view_chains(graph, program) if views.COLLAPSE_VIEWS else {}
    interior = {s for chain in chains.values() for s in chain[1][:-1]}
    deferred: dict[int, tuple[list, list]] = {}  # chain tail slot -> frees/recycles held back
    order = {outs[0]: i for i, (kind, _, _, _, outs, _) in enumerate(program) if kind == "view"}
    last_tail: dict[int, int] = {}  # a chain's base -> the tail of its last chain
    for tail, (base, _, _, _) in chains.items():
        if order[tail] > order.get(last_tail.get(base), -1):
            last_tail[base] = tail
    made: set[int] = set()  # chain tails emitted so far
    linear = linear_weights(graph, program, kernels, chains, interior) if views.LINEAR_WEIGHTS \
        else set()
    dead: dict[tuple, list[str]] = {}  # (shape, dtype) -> dead buffers to write into
    # slot -> (sizes, strides, storage offset, dtype) known at compile time: static outputs
    # of kernels the generated code allocates (fresh, contiguous) and views of them
    fixed: dict[int, tuple] = {}
    aliased = returned_views(graph, program, saved_from) if layouts.REINTERPRET_VIEWS else None
    spec_of = slot_specs(graph, program)
    if aliased is not None:
        code.bound["reinterpret"] = layouts.reinterpret_tensor
    if aliased is not None and layouts.INPUT_LAYOUTS:  # see layouts.fix_inputs
        out += fix_inputs(code, fixed, graph, program, kernels, aliased, names, spec_of)
    first_step = len(out)
    # views of compile-time layouts not made until a reader needs the tensor: a native
    # kernel reads them as their root buffer and a byte offset (layouts.FOLD_VIEWS)
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
        out.append(reinterpret_source(names[s], names[root], lay, fixed[root]))

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
        # a kernel writing an input gets the tensor itself: it writes through its name
        if kind != "view" and (launch is None or getattr(launch, "gemm", False)
                               or getattr(launch, "writes", None)):
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
                    fix_products(fixed, outs, step, graph, aliased, launch)
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
                    reuse = take_dead(outs, static, dead, reused)
                    if small and alloc.empty_strided_cpu is not None:
                        code.bound.setdefault("empty_strided", alloc.empty_strided_cpu)
                    direct = {launch.getters[j][1]: small[s] for j, s in enumerate(outs)
                              if s in small and j not in reuse}
                    out += launch.source(k, [names[s] for s in ins], defs, code.size, empty,
                                         lin, {launch.getters[j][1]: v
                                               for j, v in reuse.items()}, fresh, direct,
                                         epilogue_key(code, k, launch, ins, names, fresh, fixed,
                                                      known, spec_of) if keys.SHORT_KEYS else None)
                    fix_outputs(fixed, outs, launch)
                    if reuse:
                        out.append(f"    del {', '.join(reuse.values())}")
            elif launch is not None:  # the native call written out (launcher.Launch)
                k = f"k{len(code.bound)}"
                code.bound.update(launch.bindings(k))
                code.bound.setdefault("native_call", launch.call)
                empty = ("pool_empty" if name in pool_empty
                         else code.bind("alloc", launch.empty))
                reuse = {} if i in memo else take_dead(outs, static, dead, reused)
                if "threads" not in code.bound:  # the thread count, read once per call
                    code.bound["threads"] = torch.get_num_threads
                    out.insert(first_step, "    nthreads = threads()")
                if alloc.empty_strided_cpu is not None:
                    code.bound.setdefault("empty_strided", alloc.empty_strided_cpu)
                direct = {j: small[s] for j, s in enumerate(outs)
                          if s in small and j not in reuse}
                start = len(out)
                offsets = [0] * (len(ins) + len(launch.dtypes))
                for j, s in enumerate(ins):  # a pending view: its root, from its offset
                    if s in pending:
                        root, lay = pending[s]
                        offsets[j] = (lay[2] - fixed[root][2]) * lay[3].itemsize
                out += launch.source(k, [names[pending[s][0]] if s in pending else names[s]
                                         for s in ins], defs, empty, reuse,
                                     [s in known for s in ins], direct,
                                     layout_key(code, ins, names, launch.shapes, fixed, known,
                                                spec_of) if keys.SHORT_KEYS else None,
                                     {j: code.constant("lay", (*fixed[s][0], *fixed[s][1]))
                                      for j, s in enumerate(ins) if s in fixed and keys.SHORT_KEYS},
                                     code.constant("offs", tuple(offsets)) if any(offsets)
                                     else None)
                if i in memo:  # launched on a miss only: see .memo
                    out[start:] = memo_source(code.bind("memo", {}), out[start:], defs)
                # a write's output is its input: of the input's strides, not fresh
                known.update(s for j, s in enumerate(outs) if s is not None
                             and j not in launch.writes)
                fix_outputs(fixed, outs, launch)
                if reuse:
                    out.append(f"    del {', '.join(reuse.values())}")
            else:
                call = f"{code.bind('kern', fn)}([{args}], syms)"
                out.append(f"    {''.join(d + ', ' for d in defs)}= {call}" if defs
                           else f"    {call}")
                if aliased is not None and layouts.WRAPPED_LAYOUTS:
                    fix_wrapped(fixed, outs, kernels.get(name), spec_of)
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
            lay = (fixed_view(fixed[base], fns) if aliased is not None and base in fixed
                   and outs[0] not in aliased and not sized else None)
            if lay is not None:  # the chain's layout, known now
                fixed[outs[0]] = lay
                if layouts.FOLD_VIEWS:
                    defer(outs[0], base, lay)
                else:
                    out.append(reinterpret_source(defs[0], b, lay, fixed[base]))
            else:
                if base in pending:
                    make(base)
                c = code.bind("chain", ViewChain(fns))
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
        elif kind == "view" and outs[0] in linear:  # the weight itself: see linear_weights
            if ins[0] in pending:
                make(ins[0])
            out.append(f"    {defs[0]} = {args}")
        elif kind == "view":
            lay = (fixed_view(fixed[ins[0]], [fn]) if aliased is not None
                   and not has_refs(step.attrs)
                   and len(ins) == 1 and ins[0] in fixed and outs[0] not in aliased else None)
            if lay is not None and layouts.FOLD_VIEWS:  # made when a reader needs the tensor
                fixed[outs[0]] = lay
                defer(outs[0], ins[0], lay)
            elif lay is not None:  # the view's layout, known now: no view call per call
                fixed[outs[0]] = lay
                out.append(reinterpret_source(defs[0], args, lay, fixed[ins[0]]))
            elif aliased is not None and outs[0] not in aliased and len(ins) == 1 \
                    and step.op == "view" and ins[0] not in pending \
                    and same_spec(spec_of.get(ins[0]), spec_of.get(outs[0])):
                out.append(f"    {defs[0]} = {args}")  # a reshape to its own shape
            else:
                for s in dict.fromkeys(ins):
                    if s in pending:
                        make(s)
                out.append(f"    {defs[0]} = {view_source(code, step, fn, args)}")
            if ins and ins[0] in known:
                known.add(outs[0])
        else:
            out += extern_source(code, step, fn, defs, args, names, slot)
            if aliased is not None and layouts.EXTERN_LAYOUTS:  # see layouts.fix_extern
                out += fix_extern(code, fixed, outs, names, spec_of, step, last_read, i)
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
