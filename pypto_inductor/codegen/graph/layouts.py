"""Layouts known at compile time, and which views the graph code may write as aliases.

A static kernel output the generated code allocates (fresh, contiguous) or a GEMM's fresh
product has a layout known when the code is written; so has each view of it (found on a
meta tensor), which is then Inductor's ``reinterpret_tensor`` with the layout written out,
or no call at all (its base, where the layouts are the same; or, FOLD_VIEWS, its root
buffer and a byte offset for native kernels). Views AOTAutograd may regenerate or that
share a version counter with what the user sees stay real views (:func:`returned_views`).
"""
from __future__ import annotations

import sympy
import torch
from torch._prims_common import make_contiguous_strides_for

from ...ir import TensorSpec
from ...sizes import is_symbolic, resolve_static, same_shape
from .buffers import fresh_outputs, fresh_results
from .program import graph_slots


# Inductor's alias with given sizes, strides and offset increment: no dispatcher, no
# autograd view record (about 1 us against 2 for a view method or as_strided). The
# compiled graph records no autograd (AOTAutograd runs it under no_grad or with inputs
# that need no grad), and a view that is returned, or that a returned value is a view
# of, keeps the real view call (AOTAutograd regenerates aliased outputs from their base).
reinterpret_tensor = getattr(torch._C._dynamo.guards, "_reinterpret_tensor", None)
REINTERPRET_VIEWS = reinterpret_tensor is not None  # the benchmark's "before" turns it off
RETURNED_REINTERPRET = True  # likewise: a returned view of an intermediate (returned_views)
SAVED_REINTERPRET = True  # likewise: a forward's saved view of an intermediate (returned_views)
IDENTITY_VIEWS = True  # likewise: a view of its base's own layout is the base (reinterpret_source)
FOLD_VIEWS = True  # likewise: views of compile-time layouts read by native kernels as offsets
EXTERN_LAYOUTS = True  # likewise: an extern op's fresh outputs have their traced layouts (fix_extern)
INPUT_LAYOUTS = True  # likewise: inputs only read have their traced layouts (fix_inputs)
WRAPPED_LAYOUTS = True  # likewise: native kernels called through their wrapper (fix_wrapped)


def returned_views(graph, program, saved_from: int | None = None) -> set[int]:
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


def reinterpret_source(name: str, base: str, lay: tuple, of: tuple) -> str:
    """The line making ``name`` a view of layout ``lay`` of ``base`` (layout ``of``):
    ``base`` itself where the layouts are the same (a transpose of a transpose, a reshape
    to its own shape: no call, and a saved tensor no view for AOTAutograd to detach)."""
    if IDENTITY_VIEWS and lay[:3] == of[:3] and lay[3] == of[3]:
        return f"    {name} = {base}"
    return f"    {name} = reinterpret({base}, {lay[0]}, {lay[1]}, {lay[2] - of[2]})"


def fix_outputs(fixed: dict, outs, launch) -> None:
    """Record the compile-time layouts of a kernel's fresh static outputs."""
    for s, (shape, dt) in zip(outs, fresh_outputs(launch)):
        if s is None or shape is None or any(is_symbolic(sympy.sympify(d)) for d in shape):
            continue
        sizes = tuple(int(resolve_static(d)) for d in shape)
        fixed[s] = (sizes, make_contiguous_strides_for(sizes), 0, dt)


def fix_extern(code, fixed: dict, outs, names, spec_of, step, last_read, at: int) -> list[str]:
    """Record the layouts of an extern op's fresh static outputs (a convolution's, a
    pooling's) as traced (their FakeTensors' strides), as Inductor does: views of them
    become reinterprets or byte offsets for native kernels (FOLD_VIEWS), and the kernels
    reading them look up constant layout keys, no ``permute`` nor ``stride()`` per call.
    Lines checking the strides at run time: an output whose strides differ from the
    traced ones (an ATen kernel choosing another layout than its meta function) is copied
    into the traced layout, so the code written for it stays right."""
    if not fresh_results(step):
        return []
    lines = []
    for s in outs:
        spec = spec_of.get(s)
        if s is None or last_read.get(s, -1) <= at or not isinstance(spec, TensorSpec) \
                or any(is_symbolic(sympy.sympify(d)) for d in (*spec.shape, *spec.stride)):
            continue
        lines += _checked(code, fixed, s, spec, names[s])
    return lines


def fix_inputs(code, fixed: dict, graph, program, kernels, aliased, names, spec_of) -> list[str]:
    """fix_extern for the graph's inputs that it only reads (a training backward's saved
    activations, BatchNorm's weights): each one read by a view or an inline native kernel,
    of a static traced layout, whose readers (through views) are views, inline native
    kernels, GEMM calls or extern ops writing no argument, and that no returned value is
    or views. Their strides are checked once per call; an input of other strides is read
    from a copy in the traced layout (the graph writes none of them and returns no view of
    them, so nobody sees the difference)."""
    ok, seen = {}, {}  # input slot -> still a candidate; view slot -> its input's slot
    n_in = len(graph.inputs)
    for s in range(n_in):
        spec = spec_of.get(s)
        ok[s] = isinstance(spec, TensorSpec) and s not in aliased and not any(
            is_symbolic(sympy.sympify(d)) for d in (*spec.shape, *spec.stride))
    useful = set()
    for kind, name, fn, ins, outs, step in program:
        launch = getattr(kernels.get(name), "launch", None) if kind == "kernel" else None
        reads = {seen.get(s, s) for s in ins if seen.get(s, s) < n_in}
        if kind == "view":
            for o in outs:
                if o is not None and reads:
                    seen[o] = next(iter(reads)) if len(reads) == 1 else n_in  # n_in: none
            if len(reads) > 1 or any(o in aliased for o in outs):
                for r in reads:
                    ok[r] = False
            useful |= reads
        elif launch is not None:
            if not getattr(launch, "gemm", False):
                useful |= reads
            for wr in getattr(launch, "writes", {}).values():  # written: not only read
                r = seen.get(ins[wr.input], ins[wr.input])
                if r < n_in:
                    ok[r] = False
        elif not (kind == "extern" and fresh_results(step)):
            for r in reads:
                ok[r] = False
    lines = []
    for s in range(n_in):
        if not ok[s] or s not in useful:
            continue
        spec = spec_of[s]
        lines += _checked(code, fixed, s, spec, names[s])
    return lines


def _checked(code, fixed: dict, s: int, spec, v: str) -> list[str]:
    """Slot ``s`` known to have its traced static layout (``fixed``), and the lines that
    make it so: a stride check, and a copy on a mismatch."""
    sizes = tuple(int(resolve_static(d)) for d in spec.shape)
    strides = tuple(int(resolve_static(d)) for d in spec.stride)
    fixed[s] = (sizes, strides, 0, spec.dtype)
    code.bound.setdefault("relayout", relayout)
    return [f"    if {v}.stride() != {strides}:",
            f"        {v} = relayout({v}, {sizes}, {strides})"]


def relayout(t: torch.Tensor, sizes, strides) -> torch.Tensor:
    """``t`` copied into a fresh tensor of the given sizes and strides (fix_extern)."""
    return torch.empty_strided(sizes, strides, dtype=t.dtype, device=t.device).copy_(t)


def fix_wrapped(fixed: dict, outs, kernel, spec_of) -> None:
    """fix_outputs for a native kernel called through its wrapper (launcher.wrapper_source:
    one writing into an input, BatchNorm's running statistics, with launcher.INLINE_WRITES
    off; any without the extension): each static output but
    those written into an input is the wrapper's fresh contiguous ``empty``."""
    program = getattr(kernel, "program", None)
    if kernel is None or kernel.launch is not None or not kernel.native \
            or not kernel.takes_allocator or not hasattr(program, "writes"):
        return
    for j, s in enumerate(outs):
        spec = spec_of.get(s)
        if s is None or j in program.writes or not isinstance(spec, TensorSpec) \
                or any(is_symbolic(sympy.sympify(d)) for d in spec.shape):
            continue
        sizes = tuple(int(resolve_static(d)) for d in spec.shape)
        fixed[s] = (sizes, make_contiguous_strides_for(sizes), 0, spec.dtype)


def fix_products(fixed: dict, outs, step, graph, aliased, launch) -> None:
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


def fixed_view(base: tuple, fns) -> tuple | None:
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


def same_spec(a, b) -> bool:
    """Whether two values' specs have the same shape and dtype (a reshape from one to the
    other is the tensor itself to any reader but an aliasing check)."""
    return a is not None and b is not None and hasattr(a, "shape") and hasattr(b, "shape") \
        and a.dtype == b.dtype and len(a.shape) == len(b.shape) and same_shape(a.shape, b.shape)
