"""Compile-time buffer planning of the graph code: which kernel outputs are allocated
directly (small static ones, :func:`small_outputs`) and which dead buffers later kernels
write into (:func:`static_reuse`), as Inductor's wrapper reuses buffers; every other dead
pooled output goes back to the buffer pool through the runtime's refcount check.
"""
from __future__ import annotations

import math

import sympy

from ..cpp import alloc
from ...sizes import is_symbolic, resolve_static, same_shape
from .program import graph_slots


REUSE_AFTER_TORCH_CALLS = True  # likewise: static_reuse through GEMM / extern readers
SMALL_EPILOGUE_OUTPUTS = True  # likewise: small_outputs of GEMM tiles' native epilogues

# A pooled output of at most this many bytes and a static shape is allocated directly and
# dropped when dead: glibc serves such chunks from its caches in about 0.5 us, against
# 1.3 us for the pool's round trip (lock, dict, and the refcount check before giving it
# back). The pool pays off for large buffers (fresh pages, glibc sorting big chunks:
# docs/runtime_overhead.md); a batch-1 decode step's activations are a few hundred bytes.
SMALL_OUTPUT_BYTES = 64 << 10


def take_dead(outs, static, dead, reused) -> dict[int, str]:
    """output index -> a dead buffer (its variable) of the output's shape and dtype that
    the kernel writes into (static_reuse)."""
    reuse = {}
    for j, s in enumerate(outs):
        if s in static and dead.get(static[s]):
            reuse[j] = dead[static[s]].pop()
            if reused is not None:
                reused[s] = int(reuse[j][3:])  # buf<slot>
    return reuse


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
        for s, (shape, dt) in zip(outs, fresh_outputs(launch)):  # a GEMM's: its epilogue's
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
        # (a kernel writing an input returns that input: it keeps it)
        keeps = not (kind == "view" or (launch is not None and not getattr(
            launch, "writes", None) and (REUSE_AFTER_TORCH_CALLS or not getattr(launch, "gemm", False)))
            or (kind == "extern" and REUSE_AFTER_TORCH_CALLS and fresh_results(step)))
        for s in ins:
            r = root.get(s, s)
            if r in key and keeps:
                bad.add(r)
        if kind == "view" and ins and root.get(ins[0], ins[0]) in key:
            root[outs[0]] = root.get(ins[0], ins[0])
        if launch is None or name not in pool_empty or (
                getattr(launch, "gemm", False) and not REUSE_AFTER_TORCH_CALLS):
            continue
        for s, (shape, dt) in zip(outs, fresh_outputs(launch)):
            if s is not None and shape is not None:
                key[s] = (tuple(sympy.sympify(d) for d in shape), dt)
    slots = dict(graph_slots(graph, program))
    for o in graph.outputs:
        if isinstance(o, str) and o in slots:
            bad.add(root.get(slots[o], slots[o]))
    return {s: k for s, k in key.items() if s not in bad}


def fresh_outputs(launch) -> list[tuple]:
    """Per tile output: (shape, dtype) of the fresh contiguous buffer the generated code
    allocates for it, or (None, None): a GEMM's product (torch allocates it), an
    epilogue output reshaped to the tile's shape, or a write's output (the input itself:
    launcher.Launch.writes)."""
    native = getattr(launch, "native", None)
    if not getattr(launch, "gemm", False):
        return [(None, None) if j in launch.writes else (shape, dt)
                for j, (shape, dt) in enumerate(zip(launch.shapes, launch.dtypes))]
    if native is None:
        return [(None, None)] * len(launch.shapes)
    out = []
    for kind, idx, dims in launch.getters:
        if kind == "epi" and (dims is None or same_shape(dims, launch.T)):
            out.append((native.shapes[idx], native.dtypes[idx]))
        else:
            out.append((None, None))
    return out


def fresh_results(step) -> bool:
    """Whether an extern op's results are fresh tensors and it writes none of its
    arguments (an ATen overload whose schema has no alias annotation)."""
    schema = getattr(step.fn, "_schema", None)
    return schema is not None and not any(
        a.alias_info is not None for a in (*schema.arguments, *schema.returns))
