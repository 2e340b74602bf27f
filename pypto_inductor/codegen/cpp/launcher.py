"""The Python side of a native kernel call: the wrapper the runtime calls per tile.

:func:`native_kernel` wraps a compiled kernel function as a :class:`Kernel` whose
``fn`` is straight-line Python generated per kernel (:func:`wrapper_source`): it
looks up the input layout's metadata (sizes, strides and size symbols as ctypes
arrays, cached by the inputs' strides), allocates the outputs (:mod:`.alloc`, or
the runtime's buffer pool) and calls the kernel once, through the extension
(:mod:`.native_call`) or ctypes. Its :class:`Launch` hands the same pieces to the
graph's generated code (``codegen/graph``), which calls the kernel inline.
"""
from __future__ import annotations

import array
import ctypes
import dataclasses
import functools
from typing import Callable

import torch

from ...sizes import size_function
from .. import Kernel
from . import alloc, native_call
from .indexing import error_class
from .program import Program


def wrapper_source(n_in: int, n_out: int, extension: bool, writes: dict | None = None,
                   status: bool = False, status_returned: bool = False) -> str:
    """The Python wrapper of a native kernel with n_in inputs and n_out outputs, written
    out straight: no loops or comprehensions on the per-call path (each of those costs a
    frame in CPython 3.11, and most of a small kernel's budget is the wrapper). It calls
    the kernel through the extension (:mod:`.native_call`), or through ctypes with a
    pointer array kept per kernel (one per call in flight) and filled in place (cheaper
    than building one per call: docs/runtime_overhead.md). ``status``: the kernel scans
    indices and reports the first bad one in a status, ``status_returned``: as the
    extension's return value (:data:`STATUS_RETURN`), else in a tensor the wrapper makes."""
    writes = writes or {}  # copy_ outputs (indexing.DirectWrite): the input they write
    ins = [f"i{j}" for j in range(n_in)]
    status_returned = status and status_returned and extension
    outs = [f"o{j}" for j in range(n_out)] + (["status"] if status and not status_returned
                                              else [])
    key = ", ".join(["syms", *(f"{i}.stride()" for i in ins)])
    lines = ["def kernel(inputs, syms, empty=empty):",
             f"    {', '.join(ins)}{',' if n_in == 1 else ''} = inputs" if ins else "    pass",
             f"    meta = layouts.get(({key},))",
             "    if meta is None:",
             "        meta = layout(inputs, syms)"]
    for j, o in enumerate(outs):
        wr = writes.get(j)
        if wr is not None and wr.direct:  # written in place when the input is contiguous
            lines.append(f"    {o} = i{wr.input} if i{wr.input}.is_contiguous() else "
                         f"empty(meta[{2 + j}], dt{j})")
        else:
            lines.append(f"    {o} = empty(meta[{2 + j}], dt{j})")
    if status_returned:
        lines += [f"    code = call_status(address, ({''.join(f'{t}, ' for t in ins + outs)}), "
                  "meta[0], meta[1], threads())",
                  "    if code:", "        raise_index_error(code)"]
    elif extension:
        lines.append(f"    call(address, ({''.join(f'{t}, ' for t in ins + outs)}), meta[0], "
                     "meta[1], threads())")
    else:
        lines += ["    ptrs = spare.pop() if spare else Ptrs()",
                  *(f"    ptrs[{j}] = {t}.data_ptr()" for j, t in enumerate(ins + outs)),
                  "    fn(ptrs, meta[0], meta[1], threads())",
                  "    spare.append(ptrs)"]
    if status and not status_returned:  # an index out of range: the kernel stopped
        lines += ["    if status[0]:", "        raise_index_error(int(status[0]))"]
    results = list(outs[:n_out])
    for j, wr in writes.items():
        lines.append(f"    if {outs[j]} is not i{wr.input}:")
        lines.append(f"        i{wr.input}.copy_({outs[j]})")
        results[j] = f"i{wr.input}"
    lines.append(f"    return [{', '.join(results)}]")
    return "\n".join(lines) + "\n"


ARRAY_META = True  # the benchmark's "before" turns it off: ctypes arrays for the extension too
# An index-scanning kernel's status (indexing.index_prologue) as the extension call's return
# value (native_call's call_status: an int64 on the call's stack) rather than a one-element
# tensor allocated per call and read with .item() (two of them on the success path): a
# gather kernel such as an embedding's then costs what any kernel costs. Off: the tensor.
STATUS_RETURN = True
# A kernel writing into an input (copy_ outputs: BatchNorm's running statistics, 3 per BN
# in a training forward) gets a Launch too, its writes written out as the wrapper does
# them (Launch.source): the graph code calls it inline, no wrapper frame, input list,
# stride key and result list per call. Off: such kernels go through their wrapper.
INLINE_WRITES = True
assert array.array("q").itemsize == 8


def native_kernel(fn, program: Program) -> Kernel:
    """The tile's Kernel calling the compiled function ``fn`` of ``program``."""
    # No argtypes: the arguments are ctypes arrays and an int already, and ctypes' per-call
    # conversion through argtypes costs more than the call (docs/runtime_overhead.md).
    fn.restype = None
    shapes = [size_function(tuple(spec.shape), program.symbols) for _, spec in program.outputs]
    n_in, n_out = len(program.input_specs), len(shapes)
    dtypes = [spec.dtype for _, spec in program.outputs]
    checks = program.checks
    if checks:  # the status of the index scan (indexing.index_prologue)
        shapes.append(lambda syms: (1,))
        dtypes.append(torch.int64)

    def raise_index_error(code: int):
        check = checks[code - 1]
        raise error_class(check.error)(check.message)

    Ptrs = ctypes.c_void_p * max(n_in + len(shapes), 1)
    call = native_call.extension_call()
    call_status = native_call.extension_call_status() if checks and STATUS_RETURN else None
    if call is not None and ARRAY_META:
        # the extension takes the arrays' addresses: array.array's, made in well under a
        # microsecond where a ctypes array of 48 values takes 15 (a layout miss: each new
        # cache length of a decode step, for a kernel whose shapes hold it)
        def Meta(*values):
            return array.array("q", values or (0,))
        Syms = Meta

        def ref(a):
            return a.buffer_info()[0]
    else:  # ctypes arrays: ctypes takes them as they are, the extension by address
        Meta = ctypes.c_int64 * max(sum(2 * len(s.shape) for s in program.input_specs), 1)
        Syms = ctypes.c_int64 * max(len(program.symbols), 1)
        ref = ctypes.addressof if call is not None else (lambda a: a)

    # (syms, input strides) -> (metadata, syms, output shapes..., the arrays kept alive);
    # input shapes are functions of the size symbols, so strides and syms identify them
    layouts: dict = {}

    def layout(inputs: list, syms: tuple, key: tuple | None = None, into: dict = layouts) -> tuple:
        values = []
        for t in inputs:  # a tensor, or its sizes and strides known at compile time
            values += t if type(t) is tuple else (*t.shape, *t.stride())
        arrays = (Meta(*values), Syms(*syms))
        entry = (ref(arrays[0]), ref(arrays[1]), *[tuple(f(syms)) for f in shapes], arrays)
        if len(into) >= 256:
            into.pop(next(iter(into)))
        into[(syms, *[t.stride() for t in inputs]) if key is None else key] = entry
        return entry

    scope = {"layouts": layouts, "layout": layout, "spare": [], "Ptrs": Ptrs, "fn": fn,
             "call": call, "address": ctypes.cast(fn, ctypes.c_void_p).value,
             "threads": torch.get_num_threads, "empty": alloc.empty,
             "raise_index_error": raise_index_error, "call_status": call_status,
             **{f"dt{j}": dt for j, dt in enumerate(dtypes)}}
    # our own template, no user text
    exec(wrapper_source(n_in, n_out, call is not None, program.writes, bool(checks),  # noqa: S102
                        call_status is not None), scope)
    launch = None
    if call is not None and (INLINE_WRITES or not program.writes):
        # the graph code's entries, under its own keys (Launch.source): they do not hold
        # the symbols' array (the call gets the symbols' tuple)
        inline: dict = {}
        launch = Launch(inline, functools.partial(layout, into=inline), call, scope["address"],
                        tuple(dtypes), alloc.empty,
                        tuple(tuple(spec.shape) for _, spec in program.outputs),
                        raise_index_error if checks else None, call_status,
                        dict(program.writes))
    # kernel(inputs, syms, empty): outputs from the runtime's BufferPool
    return Kernel(scope["kernel"], native=True, takes_allocator=True, program=program,
                  launch=launch)


@dataclasses.dataclass(frozen=True)
class Launch:
    """The pieces of a kernel's wrapper, for the graph's generated code to call the kernel
    inline (codegen/graph): the same statements as :func:`wrapper_source` writes for the
    extension, without the wrapper's frame, its input list and its result list."""

    layouts: dict  # the generated code's key -> (meta address, syms address, out shapes...)
    layout: Callable  # layout(inputs, syms, key): makes and caches the entry on a miss
    call: Callable  # native_call's extension function
    address: int  # the compiled function's address
    dtypes: tuple  # the outputs' dtypes
    empty: Callable  # the allocator when the runtime's pool does not serve the outputs
    shapes: tuple  # the outputs' shapes (sizes, sympy where symbolic)
    # raise_index_error(code) when the kernel scans indices (its last buffer is the status,
    # nonzero when an index was out of range: the kernel stopped before reading through it)
    index_error: Callable | None = None
    # native_call's call_status: the status is the call's return value, no tensor
    # (STATUS_RETURN); None: the status is the kernel's last tensor
    call_status: Callable | None = None
    # output index -> indexing.DirectWrite: a copy_ output, written into that input (by the
    # kernel itself when the input is contiguous and the write is direct, else copied into
    # it after the call); the output is then the input (wrapper_source's semantics)
    writes: dict = dataclasses.field(default_factory=dict)

    def source(self, k: str, ins: list[str], outs: list[str], empty: str,
               reuse: dict[int, str] | None = None, known: list[bool] | None = None,
               direct: dict[int, tuple] | None = None, key: str | None = None,
               fixed: dict[int, str] | None = None,
               offsets: str | None = None) -> list[str]:
        """Lines calling the kernel; ``k`` prefixes the names bound for it (``{k}_layouts``
        and so on: :meth:`bindings`), ``outs`` name its outputs (``_`` for unused);
        ``reuse``: output index -> a dead buffer of its shape and dtype to write into;
        ``known``: per input, whether the size symbols alone fix its strides (a native
        kernel's output, or a view of one): None stands for them in the layout key (the
        wrapper's own keys never hold None, so the two never collide); ``direct``: output
        index -> (sizes, strides) of a small static output allocated with them written out
        (``empty_strided``, bound by the caller: graph.buffers.small_outputs), as is the status;
        ``key``: the layout key's source, what the entry depends on (graph.keys.layout_key;
        by default the size symbols and the strides of the inputs not ``known``). The
        kernel gets the symbols' tuple, not the entry's array; ``fixed``: input index ->
        the name of its sizes + strides (a tuple known at compile time), what a miss reads
        instead of the tensor's; ``offsets``: the name of a tuple of byte offsets, one per
        tensor (inputs, outputs, status), where an input is a view passed as its base.
        A write's output (``writes``) is its input, as in :func:`wrapper_source`: never
        in ``reuse`` or ``direct``, and its input is passed as the tensor itself."""
        reuse, known, direct = reuse or {}, known or [False] * len(ins), dict(direct or {})
        fixed = fixed or {}
        if key is None:
            key = "(" + ", ".join(["syms", *("None" if kn else f"{i}.stride()"
                                             for i, kn in zip(ins, known))]) + ",)"
        tmp = [o if o != "_" else f"{k}_out{j}" for j, o in enumerate(outs)]
        check, call = [], "native_call("
        if self.index_error is not None and self.call_status is not None:
            call = "status = native_call_status("
            check = ["    if status:", f"        {k}_index_error(status)"]
        elif self.index_error is not None:
            tmp.append(f"{k}_status")
            if alloc.empty_strided_cpu is not None:  # dropped after the call: never pooled
                direct[len(outs)] = ((1,), (1,))
            outs = [*outs, "_"]
            check = [f"    if {k}_status.item():",
                     f"        {k}_index_error({k}_status.item())"]
        const = key.isidentifier() or key.isdigit()  # no need for a variable
        allocs = [f"    {o} = {reuse[j]}" if j in reuse else
                  f"    {o} = empty_strided({direct[j][0]}, {direct[j][1]}, {k}_dt{j})"
                  if j in direct else
                  f"    {o} = {empty}(meta[{2 + j}], {k}_dt{j})" for j, o in enumerate(tmp)]
        written = []  # a write's output: the input itself, written into or copied into
        for j, wr in self.writes.items():
            assert j not in reuse and j not in direct, "a write's output is its input"
            dst = ins[wr.input]
            if wr.direct:
                allocs[j] = (f"    {tmp[j]} = {dst} if {dst}.is_contiguous() else "
                             f"{empty}(meta[{2 + j}], {k}_dt{j})")
            written += [f"    if {tmp[j]} is not {dst}:", f"        {dst}.copy_({tmp[j]})",
                        *([f"        {tmp[j]} = {dst}"] if outs[j] != "_" else [])]
        return [*([] if const else [f"    key = {key}"]),
                f"    meta = {k}_layouts.get({key if const else 'key'})",
                "    if meta is None:",
                f"        meta = {k}_layout([{', '.join(fixed.get(j, i) for j, i in enumerate(ins))}], "
                f"syms, {key if const else 'key'})",
                *allocs,
                f"    {call}{k}_address, ({''.join(f'{t}, ' for t in ins + tmp)}), "
                f"meta[0], syms, nthreads{'' if offsets is None else ', ' + offsets})",
                *check,
                *written,
                *([f"    del {', '.join(t for t, o in zip(tmp, outs) if o == '_')}"]
                  if "_" in outs else [])]

    def bindings(self, k: str) -> dict:
        return {f"{k}_layouts": self.layouts, f"{k}_layout": self.layout,
                f"{k}_address": self.address, f"{k}_index_error": self.index_error,
                **({"native_call_status": self.call_status} if self.call_status else {}),
                **{f"{k}_dt{j}": dt for j, dt in enumerate(self.dtypes)}}
