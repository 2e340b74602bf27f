"""The native CPU target: each FusionTile becomes one C++ function.

``build(tile, graph)`` analyses the tile into a kernel program
(:mod:`.analysis`, :mod:`.program`), writes C++ for it (:mod:`.emit_rows`, or
:mod:`.emit_columns` for a column reduction; the op table and value helpers in
:mod:`.ops`, the math in :mod:`.prelude`), compiles it through the cached
compiler driver (:mod:`.compiler`) and returns a :class:`Kernel` calling it once
per call (:mod:`.launcher`; through :mod:`.native_call`, else ctypes).
``build_many(tiles, graph)`` does the same for all tiles of a graph, compiling
their functions together as a few shared libraries built concurrently (what the
runtime uses). Matmul tiles keep the GEMM on torch's BLAS and run their
elementwise epilogue as one native pass (:mod:`.matmul`); an accumulating
``index_put`` (embedding's backward) is one shared native loop (:mod:`.index_put`). Tiles outside the
native slice (float64, a reshape the analysis cannot follow, ...) run the
reference executor for that tile, without a warning; the kernel's
``native``/``reason`` say so. Large outputs are allocated with huge pages
advised (:mod:`.alloc`). :mod:`.calibrate` holds the kernels the host
calibration times.
"""
from __future__ import annotations

import dataclasses
import functools
import warnings
from typing import Callable

import torch

from ...ir import FusionTile, OpKind, TileGraph
from .. import Kernel, reference
from ...lowering import conv as conv_lowering
from ...lowering.graph import run_and_save_rng_state_flat
from . import attention, attention_backward, compiler, index_put, matmul, onednn_conv, pooling
from .analysis import analyse
from .emit_columns import ColumnEmitter
from .emit_mixed import MixedEmitter
from .emit_rows import RowEmitter
from .launcher import native_kernel
from .ops import EmitError, NotEmittable, current_op
from .program import SYMBOL, NotNative, Program

__all__ = ["build", "build_many", "check_available", "analyse", "generate_source", "NotNative",
           "Program", "SYMBOL"]

DEVICES = ("cpu",)  # the kernels read host memory (the runtime runs other devices eagerly)

# --- build ----------------------------------------------------------------------------
warned_no_compiler = False  # the missing compiler is reported once per process
# Tiles of a graph whose C++ is the same (ResNet's BatchNorms of one width: 93 tiles of a
# training step, 42 distinct sources) compile once: one function in the library, bound by
# each (build_many). Switch: the benchmark's "before".
DEDUPE_KERNELS = True
# Counters, for tests and reports: native tiles build_many bound, functions it compiled
# (or loaded) for them.
stats = {"tiles": 0, "functions": 0}


def check_available() -> None:
    """The cpu target runs anywhere: without a C++ compiler, its tiles run the reference
    executor (with one warning)."""


# extern ATen op -> binder(step, specs) -> (callable or None, why): what this target runs
# instead of the op's ATen kernel (runtime.CompiledGraph._bind_extern asks at compile time)
NATIVE_EXTERNS = {attention.ATEN_FORWARD: attention.bind_forward,
                  attention_backward.ATEN_BACKWARD: attention_backward.bind,
                  pooling.ATEN_FORWARD: pooling.bind_forward,
                  pooling.ATEN_BACKWARD: pooling.bind_backward}


# Activation checkpointing wraps each random op in RNG-state ops (lowering/graph.py): the
# forward's run_and_save_rng_state (as lowering's run_and_save_rng_state_flat) and the
# backward's run_with_rng_state around an op with a native kernel (SDPA) run that kernel
# where the op's binder takes it. Those binders take no dropout: the native kernels draw no
# random numbers, so the state is still saved for the replay, which needs none.
def _bind_rng_saved(step, specs):
    return _bind_inner(step, 0, specs, _state_then)


def _bind_rng_replay(step, specs):
    return _bind_inner(step, 1, specs, _without_state)


def _bind_inner(step, at: int, specs, wrap):
    binder = NATIVE_EXTERNS.get(step.args[at])
    if binder is None:
        return None
    fn, why = binder(dataclasses.replace(step, fn=step.args[at], args=step.args[at + 1:]), specs)
    return (None, why) if fn is None else (functools.partial(wrap, fn), why)


def _state_then(fn, op, *args, **kwargs):
    return (torch.get_rng_state(), *fn(*args, **kwargs))


def _without_state(fn, state, op, *args, **kwargs):
    return fn(*args, **kwargs)


NATIVE_EXTERNS[run_and_save_rng_state_flat] = _bind_rng_saved
NATIVE_EXTERNS[torch.ops.higher_order.run_with_rng_state] = _bind_rng_replay


# inference convolutions as oneDNN primitives held per call site (with a oneDNN install)
conv_lowering.direct_conv = onednn_conv.make


def native_extern(step, graph: TileGraph):
    """(callable, why) to run an extern op with instead of its ATen kernel, (None, why not)
    when this call's operands do not qualify, or None when the op has no native kernel
    here (:data:`NATIVE_EXTERNS`: SDPA's flash forward and backward, 2-D max pooling)."""
    binder = NATIVE_EXTERNS.get(step.fn)
    return None if binder is None else binder(step, graph.specs)


def _reference(tile: FusionTile, graph: TileGraph, reason: str) -> Kernel:
    return dataclasses.replace(reference.build(tile, graph), native=False, reason=reason)


def generate_source(program: Program) -> str:
    """The C++ source of a kernel program (rows, or a column reduction's blocks)."""
    try:
        if program.mixed:
            return MixedEmitter(program).source()
        if program.transposed:
            return ColumnEmitter(program).source()
        return RowEmitter(program).source()
    except NotEmittable as e:
        raise NotNative(str(e)) from e
    except Exception as e:  # a bug here: say which tile op the kernel failed on
        raise EmitError(f"C++ emitter failed on {current_op[0] or 'the tile'}: "
                        f"{type(e).__name__}: {e}") from e


def build(tile: FusionTile, graph: TileGraph) -> Kernel:
    """The tile's kernel: native C++ when the tile is in the slice."""
    prepared = _prepare(tile, graph)
    if not isinstance(prepared, Pending):
        return prepared
    if not _have_compiler():
        return _reference(tile, graph, "no C++ compiler")
    fn = compiler.load(prepared.source, SYMBOL)  # raises on a compile error
    return prepared.finish(native_kernel(fn, prepared.program))


def build_many(tiles: list, graph: TileGraph) -> list:
    """``build`` for all FusionTiles of a graph: a kernel, or the exception its build raised.

    The native tiles compile together: their sources become one translation unit (one
    prelude, each tile's function renamed ``pi_kernel_<index>``), split into at most
    ``compiler.jobs()`` chunks by source size that compile concurrently, one shared
    library per chunk; tiles with the same source share one function (DEDUPE_KERNELS).
    A chunk that fails to compile is rebuilt tile by tile, so only the tile at fault gets
    the error.
    """
    results: list = [None] * len(tiles)
    pending: list[tuple[int, Pending]] = []
    for i, tile in enumerate(tiles):
        try:
            prepared = _prepare(tile, graph)
        except Exception as e:  # noqa: BLE001 - reported per tile by the runtime
            results[i] = e
            continue
        if isinstance(prepared, Pending):
            pending.append((i, prepared))
        else:
            results[i] = prepared
    if pending and not _have_compiler():
        for i, _ in pending:
            results[i] = _reference(tiles[i], graph, "no C++ compiler")
        return results
    # tiles sharing a source: the first compiles, the others bind its function
    same: dict[int, list] = {}  # index of the first tile with a source -> the others
    first: dict[str, int] = {}
    for i, prepared in pending:
        k = first.setdefault(prepared.source, i) if DEDUPE_KERNELS else i
        same.setdefault(k, []).append((i, prepared))
    unique = [(i, p) for i, p in pending if i in same]
    stats["tiles"] += len(pending)
    stats["functions"] += len(unique)
    chunks = plan_chunks(unique, compiler.jobs())
    sources = [library_source(chunk) for chunk in chunks]
    retry: list[tuple[int, Pending]] = []
    for chunk, (_, symbols), lib in zip(chunks, sources, compiler.load_many(sources)):
        if isinstance(lib, Exception):
            if len(chunk) == 1:
                for i, _ in same[chunk[0][0]]:
                    results[i] = lib
            else:
                retry += chunk
            continue
        for (k, _), symbol in zip(chunk, symbols):
            for i, prepared in same[k]:
                results[i] = _finish(prepared, getattr(lib, symbol))
    if retry:  # isolate the tile(s) whose code does not compile
        libraries = compiler.load_many((p.source, (SYMBOL,)) for _, p in retry)
        for (k, _), lib in zip(retry, libraries):
            for i, prepared in same[k]:
                results[i] = lib if isinstance(lib, Exception) else \
                    _finish(prepared, getattr(lib, SYMBOL))
    return results


@dataclasses.dataclass
class Pending:
    """A native tile whose C++ is written but not compiled yet."""

    program: Program
    source: str
    finish: Callable[[Kernel], Kernel]  # native kernel -> the tile's kernel


def _have_compiler() -> bool:
    global warned_no_compiler
    if compiler.find_compiler() is not None:
        return True
    if not warned_no_compiler:
        warned_no_compiler = True
        why = compiler.cxx_problem()  # a $CXX that does not work: said here, once
        warnings.warn("pypto_inductor: no C++ compiler found (" + (f"{why}; " if why else "")
                      + "set CXX or install g++); the cpu target runs the reference executor",
                      stacklevel=5)
    return False


def _prepare(tile: FusionTile, graph: TileGraph):
    """The tile's kernel when it needs no compile (the reference executor outside the native
    slice, a one-op matmul), else a :class:`Pending` with its C++ source."""
    try:
        if index_put.eligible(tile, graph):  # a data-dependent write: its own loop
            return index_put.build(tile, graph)
        if tile.kind is OpKind.MATMUL:
            planned = matmul.plan(tile, graph)
            _, _, sub, sub_graph, *_ = planned
            if sub is None:
                return matmul.assemble(tile, graph, planned, None)
            program = analyse(sub, sub_graph)
            return Pending(program, generate_source(program),
                           lambda epi: matmul.assemble(tile, graph, planned, epi))
        program = analyse(tile, graph)
        return Pending(program, generate_source(program), lambda kernel: kernel)
    except NotNative as e:
        return _reference(tile, graph, str(e))
    except Exception as e:  # noqa: BLE001 - a bug in analysis or emission: say where
        raise TileBuildError(f"writing C++ for {tile.name} ({' '.join(tile.op_names)}) failed: "
                             f"{type(e).__name__}: {e}") from e


class TileBuildError(RuntimeError):
    """Analysing or writing a tile's C++ failed: names the tile, its ops and the error."""


def _finish(prepared: Pending, fn):
    try:
        return prepared.finish(native_kernel(fn, prepared.program))
    except Exception as e:  # noqa: BLE001 - reported per tile by the runtime
        return e


HEAD = f'extern "C" void {SYMBOL}('  # where a tile's function starts in its source


def plan_chunks(pending: list, jobs: int) -> list[list]:
    """``pending`` in at most ``jobs`` chunks of similar source size (largest first into the
    smallest chunk); tiles whose sources have different preludes (or no ``HEAD``) never
    share a chunk."""
    groups: dict = {}
    for item in pending:
        src = item[1].source
        head = src[:src.index(HEAD)] if src.count(HEAD) == 1 else object()
        groups.setdefault(head, []).append(item)
    out = []
    for group in groups.values():
        bins: list[list] = [[] for _ in range(max(1, min(jobs, len(group))))]
        sizes = [0] * len(bins)
        for item in sorted(group, key=lambda it: -len(it[1].source)):
            k = sizes.index(min(sizes))
            bins[k].append(item)
            sizes[k] += len(item[1].source)
        out += [sorted(b, key=lambda it: it[0]) for b in bins]
    return sorted(out, key=lambda c: c[0][0])


def library_source(chunk: list) -> tuple[str, tuple]:
    """(source, symbols) of one shared library holding the chunk's tiles."""
    if len(chunk) == 1 and chunk[0][1].source.count(HEAD) != 1:
        return chunk[0][1].source, (SYMBOL,)
    head, bodies, symbols = None, [], []
    for i, prepared in chunk:
        src = prepared.source
        at = src.index(HEAD)
        head = src[:at] if head is None else head
        symbol = f"{SYMBOL}_{i}"
        bodies.append(f'extern "C" void {symbol}(' + src[at + len(HEAD):])
        symbols.append(symbol)
    return head + "\n".join(bodies), tuple(symbols)
