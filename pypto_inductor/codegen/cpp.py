"""The native CPU target: each FusionTile becomes one C++ function.

``build(tile, graph)`` analyses the tile into a kernel program
(:mod:`.cpp_analysis`), emits C++ for it (:mod:`.cpp_emit`), compiles it
through the cached compiler driver (:mod:`.cpp_build`) and returns
``kernel(inputs, syms) -> outputs`` calling it once (:mod:`.native_call`, else ctypes).
``build_many(tiles, graph)`` does the same for all tiles of a graph, compiling
their functions together as a few shared libraries built concurrently (what the
runtime uses). Matmul tiles keep the GEMM on torch's BLAS and run their
elementwise epilogue as one native pass (:mod:`.cpp_matmul`). Tiles outside the
native slice (non-trailing reductions, float64, ...) run the reference executor for
that tile, without a warning; the kernel's ``native``/``reason`` attributes say
so. Large outputs are allocated with huge pages advised (:mod:`.host_alloc`).
"""
from __future__ import annotations

import ctypes
import dataclasses
import warnings
from typing import Any

import torch

from ..ir import FusionTile, OpKind, TileGraph
from . import cpp_build, host_alloc, native_call, reference
from .cpp_analysis import SYMBOL, NotNative, Program, analyse
from .cpp_indexing import error_class
from .sizes import size_function

__all__ = ["build", "build_many", "analyse", "generate_source", "NotNative", "Program", "SYMBOL"]

DEVICES = ("cpu",)  # the kernels read host memory (the runtime runs other devices eagerly)

# --- build ----------------------------------------------------------------------------
_warned_no_compiler = False


def _reference(tile, graph, reason: str):
    kernel = reference.build(tile, graph)
    kernel.native = False
    kernel.reason = reason
    return kernel


def generate_source(program: Program) -> str:
    from .cpp_emit import emit

    return emit(program)


def build(tile: FusionTile, graph: TileGraph):
    """kernel(inputs, syms) -> outputs: native C++ when the tile is in the slice."""
    prepared = _prepare(tile, graph)
    if not isinstance(prepared, _Pending):
        return prepared
    if not _have_compiler():
        return _reference(tile, graph, "no C++ compiler")
    fn = cpp_build.load(prepared.source, SYMBOL)  # raises on a compile error
    return prepared.finish(_native_kernel(fn, prepared.program))


def build_many(tiles: list, graph: TileGraph) -> list:
    """``build`` for all FusionTiles of a graph: a kernel, or the exception its build raised.

    The native tiles compile together: their sources become one translation unit (one
    prelude, each tile's function renamed ``pi_kernel_<index>``), split into at most
    ``cpp_build.jobs()`` chunks by source size that compile concurrently, one shared
    library per chunk. A chunk that fails to compile is rebuilt tile by tile, so only the
    tile at fault gets the error.
    """
    results: list = [None] * len(tiles)
    pending: list[tuple[int, _Pending]] = []
    for i, tile in enumerate(tiles):
        try:
            prepared = _prepare(tile, graph)
        except Exception as e:  # noqa: BLE001 - reported per tile by the runtime
            results[i] = e
            continue
        if isinstance(prepared, _Pending):
            pending.append((i, prepared))
        else:
            results[i] = prepared
    if pending and not _have_compiler():
        for i, _ in pending:
            results[i] = _reference(tiles[i], graph, "no C++ compiler")
        return results
    chunks = _chunks(pending, cpp_build.jobs())
    sources = [_library(chunk) for chunk in chunks]
    retry: list[tuple[int, _Pending]] = []
    for chunk, (_, symbols), lib in zip(chunks, sources, cpp_build.load_many(sources)):
        if isinstance(lib, Exception):
            if len(chunk) == 1:
                results[chunk[0][0]] = lib
            else:
                retry += chunk
            continue
        for (i, prepared), symbol in zip(chunk, symbols):
            results[i] = _finish(prepared, getattr(lib, symbol))
    if retry:  # isolate the tile(s) whose code does not compile
        libraries = cpp_build.load_many((p.source, (SYMBOL,)) for _, p in retry)
        for (i, prepared), lib in zip(retry, libraries):
            results[i] = lib if isinstance(lib, Exception) else \
                _finish(prepared, getattr(lib, SYMBOL))
    return results


@dataclasses.dataclass
class _Pending:
    """A native tile whose C++ is written but not compiled yet."""

    program: Program
    source: str
    finish: Any  # native kernel -> the tile's kernel


class _NoCompiler(Exception):
    pass


def _have_compiler() -> bool:
    global _warned_no_compiler
    if cpp_build.find_compiler() is not None:
        return True
    if not _warned_no_compiler:
        _warned_no_compiler = True
        why = cpp_build.cxx_problem()  # a $CXX that does not work: said here, once
        warnings.warn("pypto_inductor: no C++ compiler found (" + (f"{why}; " if why else "")
                      + "set CXX or install g++); the cpu target runs the reference executor",
                      stacklevel=5)
    return False


def _identity(kernel):
    return kernel


def _prepare(tile: FusionTile, graph: TileGraph):
    """The tile's kernel when it needs no compile (the reference executor outside the native
    slice, a one-op matmul), else a :class:`_Pending` with its C++ source."""
    try:
        if tile.kind is OpKind.MATMUL:
            from . import cpp_matmul

            planned = cpp_matmul.plan(tile, graph)
            _, _, sub, sub_graph, _, _ = planned
            if sub is None:
                return cpp_matmul.assemble(tile, graph, planned, None)
            program = analyse(sub, sub_graph)
            return _Pending(program, generate_source(program),
                            lambda epi: cpp_matmul.assemble(tile, graph, planned, epi))
        program = analyse(tile, graph)
        return _Pending(program, generate_source(program), _identity)
    except NotNative as e:
        return _reference(tile, graph, str(e))
    except Exception as e:  # noqa: BLE001 - a bug in analysis or emission: say where
        raise TileBuildError(f"writing C++ for {tile.name} ({' '.join(tile.op_names)}) failed: "
                             f"{type(e).__name__}: {e}") from e


class TileBuildError(RuntimeError):
    """Analysing or writing a tile's C++ failed: names the tile, its ops and the error."""


def _finish(prepared: _Pending, fn):
    try:
        return prepared.finish(_native_kernel(fn, prepared.program))
    except Exception as e:  # noqa: BLE001 - reported per tile by the runtime
        return e


_HEAD = f'extern "C" void {SYMBOL}('  # where a tile's function starts in its source


def _chunks(pending: list, jobs: int) -> list[list]:
    """``pending`` in at most ``jobs`` chunks of similar source size (largest first into the
    smallest chunk); tiles whose sources have different preludes (or no ``_HEAD``) never
    share a chunk."""
    groups: dict = {}
    for item in pending:
        src = item[1].source
        head = src[:src.index(_HEAD)] if src.count(_HEAD) == 1 else object()
        groups.setdefault(head, []).append(item)
    chunks = []
    for group in groups.values():
        bins: list[list] = [[] for _ in range(max(1, min(jobs, len(group))))]
        sizes = [0] * len(bins)
        for item in sorted(group, key=lambda it: -len(it[1].source)):
            k = sizes.index(min(sizes))
            bins[k].append(item)
            sizes[k] += len(item[1].source)
        chunks += [sorted(b, key=lambda it: it[0]) for b in bins]
    return sorted(chunks, key=lambda c: c[0][0])


def _library(chunk: list) -> tuple[str, tuple]:
    """(source, symbols) of one shared library holding the chunk's tiles."""
    if len(chunk) == 1 and chunk[0][1].source.count(_HEAD) != 1:
        return chunk[0][1].source, (SYMBOL,)
    head, bodies, symbols = None, [], []
    for i, prepared in chunk:
        src = prepared.source
        at = src.index(_HEAD)
        head = src[:at] if head is None else head
        symbol = f"{SYMBOL}_{i}"
        bodies.append(f'extern "C" void {symbol}(' + src[at + len(_HEAD):])
        symbols.append(symbol)
    return head + "\n".join(bodies), tuple(symbols)


def _build_native(tile: FusionTile, graph: TileGraph):
    """The native kernel of a pointwise/reduction tile; raises NotNative or _NoCompiler."""
    program = analyse(tile, graph)
    if not _have_compiler():
        raise _NoCompiler()
    fn = cpp_build.load(generate_source(program), SYMBOL)  # raises on a compile error
    return _native_kernel(fn, program)


def _wrapper_source(n_in: int, n_out: int, extension: bool, writes: dict | None = None,
                    status: bool = False) -> str:
    """The Python wrapper of a native kernel with n_in inputs and n_out outputs, written
    out straight: no loops or comprehensions on the per-call path (each of those costs a
    frame and a few hundred ns in CPython 3.11, and most of a small kernel's budget is the
    wrapper). It calls the kernel through the extension (:mod:`.native_call`), or through
    ctypes with a pointer array kept per kernel (one per call in flight) and filled in
    place: 1.0 us against 2.2 us to build one from 6 pointers."""
    writes = writes or {}  # copy_ outputs (cpp_indexing.DirectWrite): the input they write
    ins = [f"i{j}" for j in range(n_in)]
    outs = [f"o{j}" for j in range(n_out)] + (["status"] if status else [])
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
    if extension:
        lines.append(f"    call(address, ({''.join(f'{t}, ' for t in ins + outs)}), meta[0], "
                     "meta[1], threads())")
    else:
        lines += ["    ptrs = spare.pop() if spare else Ptrs()",
                  *(f"    ptrs[{j}] = {t}.data_ptr()" for j, t in enumerate(ins + outs)),
                  "    fn(ptrs, meta[0], meta[1], threads())",
                  "    spare.append(ptrs)"]
    if status:  # an index out of range: the kernel stopped before reading through it
        lines += ["    if status[0]:", "        raise_index_error(int(status[0]))"]
    results = list(outs[:n_out])
    for j, wr in writes.items():
        lines.append(f"    if {outs[j]} is not i{wr.input}:")
        lines.append(f"        i{wr.input}.copy_({outs[j]})")
        results[j] = f"i{wr.input}"
    lines.append(f"    return [{', '.join(results)}]")
    return "\n".join(lines) + "\n"


def _native_kernel(fn, program: Program):
    # No argtypes: the arguments are ctypes arrays and an int already, and ctypes' per-call
    # conversion through argtypes costs more than the call (docs/runtime_overhead.md).
    fn.restype = None
    shapes = [size_function(tuple(spec.shape), program.symbols) for _, spec in program.outputs]
    n_in, n_out = len(program.input_specs), len(shapes)
    dtypes = [spec.dtype for _, spec in program.outputs]
    checks = program.checks
    if checks:  # the status of the index scan (cpp_indexing.index_prologue)
        shapes.append(lambda syms: (1,))
        dtypes.append(torch.int64)

    def raise_index_error(code: int):
        check = checks[code - 1]
        raise error_class(check.error)(check.message)

    Ptrs = ctypes.c_void_p * max(n_in + len(shapes), 1)
    Meta = ctypes.c_int64 * max(sum(2 * len(s.shape) for s in program.input_specs), 1)
    Syms = ctypes.c_int64 * max(len(program.symbols), 1)
    call = native_call.extension_call()
    ref = ctypes.addressof if call is not None else _identity  # how the call takes arrays

    # (syms, input strides) -> (metadata, syms, output shapes..., the arrays kept alive);
    # input shapes are functions of the size symbols, so strides and syms identify them
    layouts: dict = {}

    def layout(inputs: list, syms: tuple) -> tuple:
        arrays = (Meta(*[v for t in inputs for v in (*t.shape, *t.stride())]), Syms(*syms))
        entry = (ref(arrays[0]), ref(arrays[1]), *[tuple(f(syms)) for f in shapes], arrays)
        if len(layouts) >= 256:
            layouts.pop(next(iter(layouts)))
        layouts[(syms, *[t.stride() for t in inputs])] = entry
        return entry

    scope = {"layouts": layouts, "layout": layout, "spare": [], "Ptrs": Ptrs, "fn": fn,
             "call": call, "address": ctypes.cast(fn, ctypes.c_void_p).value,
             "threads": torch.get_num_threads, "empty": host_alloc.empty,
             "raise_index_error": raise_index_error,
             **{f"dt{j}": dt for j, dt in enumerate(dtypes)}}
    # our own template, no user text
    exec(_wrapper_source(n_in, n_out, call is not None, program.writes, bool(checks)),  # noqa: S102
         scope)
    kernel = scope["kernel"]
    kernel.native = True
    kernel.reason = None
    kernel.takes_allocator = True  # kernel(inputs, syms, empty): the runtime's BufferPool
    kernel.program = program
    return kernel
