"""CompiledGraph: the callable AOTAutograd gets back.

It builds the plan's steps (one kernel per FusionTile, views zero-copy, extern ATen
ops eagerly), numbers the values in slots, plans when each intermediate dies (and
when a dead kernel output goes back to the buffer pool), and has
:mod:`.codegen.graph` write all of it out as one straight-line Python function, compiled
once: per call only that function runs (no step loop, no sympy).
"""
from __future__ import annotations

import dataclasses
import functools
import itertools
import statistics
import sys
import time
import warnings
import weakref
from typing import Callable

import sympy
import torch
from torch.utils._pytree import tree_leaves, tree_map

from .codegen import Kernel, Target, reference
from .codegen.cpp import alloc
from .config import Config
from .fusion import FusionPlan
from .ir import ExternOp, FusionTile, TensorSpec, TileOp, ValueRef
from .sizes import is_symbolic, numel, resolve_static, size_function
from .codegen.graph import buffers, compile_graph, graph_source, size_only_steps, \
    small_outputs, static_reuse


# A kernel with returned outputs takes its other outputs from the buffer pool when every
# returned one is small and static (CompiledGraph._compile_step)
POOL_BESIDE_SMALL_RETURNS = True


class KernelBuildError(RuntimeError):
    """A FusionTile's kernel could not be built (raised only with fallback='error')."""


class DeviceError(RuntimeError):
    """A compiled graph was called with tensors on a device its target does not run."""


def unsupported_device(gm, target: Target) -> str | None:
    """Why the ATen graph ``gm`` cannot run on ``target``: the first value (an input or an
    intermediate, from its FakeTensor) on a device the target does not run, or None.

    Such a graph runs eagerly as a whole (the backend's GraphNotLowerable path): eager
    gives ``meta`` tensors meta results, and a native kernel would read through their
    null data pointers. Dynamo guards every input's device, so a graph compiled for CPU
    tensors is never called with others through torch.compile."""
    devices = target.DEVICES
    for node in gm.graph.nodes:
        for v in tree_leaves(node.meta.get("val")):
            if isinstance(v, torch.Tensor):
                kind = v.device.type
                where = "input" if node.op == "placeholder" else "value"
                if kind == "meta":
                    return f"{where} {node.name} is a meta tensor (no data to compute on)"
                if devices is not None and kind not in devices:
                    return (f"{where} {node.name} is a {kind} tensor and the target runs "
                            f"{'/'.join(devices)} tensors only")
    return None


@dataclasses.dataclass(frozen=True)
class _Operand:  # a pytree leaf: the extern call's index-th tensor operand
    index: int


@dataclasses.dataclass(frozen=True)
class _Size:  # a pytree leaf: a size expression evaluated per call
    fn: Callable


class CompiledGraph:
    """Runs a FusionPlan; called as ``compiled(args)`` with a list it empties (boxed)."""

    def __init__(self, plan: FusionPlan, target: Target, config: Config,
                 eager: Callable | None = None, saved_from: int | None = None):
        self.plan = plan
        self.config = config
        self.eager = eager  # the graph's ATen module: runs calls with tensors on other devices
        graph = plan.graph
        # a cheap per-call probe of the first tensor input's device (Dynamo guards all of
        # them; this catches a direct call with tensors the kernels cannot read)
        devices = target.DEVICES
        self._probe = next((i for i, n in enumerate(graph.inputs)
                            if isinstance(graph.specs.get(n), TensorSpec)), -1)
        self._cpu_only = devices == ("cpu",)
        self._devices = devices
        self.bindings = list(graph.symbol_bindings.values())
        self.slot: dict[str, int] = {}
        for name in graph.inputs:
            self.slot[name] = len(self.slot)
        self.num_inputs = len(graph.inputs)
        for name in graph.constants:  # slots right after the inputs, filled on every call
            self.slot[name] = len(self.slot)
        self.constants = list(graph.constants.values())
        self.kernel_fallbacks: dict[str, str] = {}  # tile name -> why it runs eagerly
        # tile name -> {"native": bool, "reason": why not} for targets that say
        self.kernel_native: dict[str, dict] = {}
        self.kernels: dict[str, Kernel] = {}  # tile name -> its kernel record
        self.timings: dict[str, list[float]] = {}
        self._built: dict | None = None  # tile name -> kernel or error, from target.build_many
        self.pool = alloc.POOL if config.keep_buffers and _use_count else None
        self.pooled: set[int] = set()  # slots written by kernels allocating from the pool
        self.pool_empty: set[str] = set()  # tiles whose outputs come from the pool
        # extern op -> {"native": bool, "reason": str} where the target has a native kernel
        # for it (cpu: codegen/cpp's NATIVE_EXTERNS) and says which one runs
        self.extern_native: dict[str, dict] = {}
        steps = [self._bind_extern(s, target) if isinstance(s, ExternOp) else s
                 for s in plan.steps]
        self.program = [(*self._compile_step(step, target), step) for step in steps]
        # kernels of the size symbols alone: kept per sizes, so never pooled (graph.memo)
        self.memo = size_only_steps(graph, self.program, self.kernels)
        for i in self.memo:
            self.pool_empty.discard(self.program[i][1])
            self.pooled.difference_update(self.program[i][4])
        self._free_after = self._liveness()
        reused: dict[int, int] = {}
        # small static outputs never go to the pool (codegen/graph/buffers.small_outputs)
        self._small = (small_outputs(self.program, self.kernels, self.pool_empty)
                       if self.pool is not None else {})
        for kind, name, _, _, outs, step in self.program:  # only if the code allocates them
            if name in self.pool_empty and any(  # directly (write.py's ``direct``)
                    n in graph.outputs and s not in self._small
                    for n, s in zip(step.outputs, outs)):
                self.pool_empty.discard(name)
        sized = self._pool_sized()
        self.source, bound = graph_source(
            graph, self.program, self._free_after, probe=self._probe,
            cpu_only=self._cpu_only, pool=self.pool, profile=config.profile,
            timings=self.timings, kernels=self.kernels, pool_empty=self.pool_empty,
            reused=reused, pool_start=sized, saved_from=saved_from, memo=self.memo)
        scope = {"other_device": self._other_device, "perf_counter": time.perf_counter,
                 "getrefcount": _getrefcount, "use_count": _use_count,
                 "ALONE_REFS": _ALONE_REFS, "ALONE_USES": _ALONE_USES}
        if self.pool is not None:
            self._pool_peak = self._pooled_peak(reused)
            self._pool_syms = None
            self._pool_token = next(_pool_tokens)
            weakref.finalize(self, self.pool.release, self._pool_token)
            if not sized:  # the reservation is the same for every call: made once
                self.pool.reserve(self._pool_token, self._pool_peak(()))
            scope.update(pool_start=self._pool_start, pool_give=self.pool.give)
        self._call = compile_graph(graph.name, self.source, bound, scope)

    # --- build ---------------------------------------------------------------------
    def _define(self, names) -> list[int]:
        out = []
        for name in names:
            if name is None:
                out.append(None)
                continue
            self.slot[name] = len(self.slot)
            out.append(self.slot[name])
        return out

    def _bind_extern(self, step: ExternOp, target: Target) -> ExternOp:
        """The extern step with the target's native kernel in place of its ATen op, when
        the target has one and the operands qualify (the choice and why: extern_native)."""
        choose = getattr(target, "native_extern", None)
        choice = choose(step, self.plan.graph) if choose is not None else None
        if choice is None:
            return step
        fn, reason = choice
        self.extern_native[step.name] = {"native": fn is not None, "reason": reason}
        return step if fn is None else dataclasses.replace(step, fn=fn)

    def _compile_step(self, step, target: Target):
        graph = self.plan.graph
        symbols = graph.symbols
        if isinstance(step, FusionTile):
            kernel = self.kernels[step.name] = self._build_kernel(step, target)
            fn = kernel.fn  # called directly: no frame of the Kernel record per call
            ins = [self.slot[n] for n in step.inputs]
            outs = self._define(step.outputs)
            if self.pool is not None and kernel.takes_allocator \
                    and not (kernel.launch is None and self._small_outputs(step)):
                writes = getattr(kernel.program, "writes", None) or {}  # outputs: inputs
                self.pooled.update(s for j, s in enumerate(outs) if s is not None
                                   and j not in writes)
                # a kernel whose output is returned allocates afresh: taking a pooled
                # buffer there would hand it to the caller and leave a later kernel a miss;
                # unless each returned output is small and static (the generated code then
                # allocates it directly, buffers.small_outputs): BatchNorm backward's [C]
                # weight grad must not make its 1 MiB input grad a fresh buffer per call
                returned = set(step.outputs) & set(graph.outputs)
                if not returned or (POOL_BESIDE_SMALL_RETURNS and kernel.launch is not None
                                    and not getattr(kernel.launch, "gemm", False)
                                    and alloc.empty_strided_cpu is not None
                                    and self._small_outputs(step, returned)):
                    fn = functools.partial(fn, empty=self.pool.empty)
                    self.pool_empty.add(step.name)
            return ("kernel", step.name, fn, ins, outs)
        if isinstance(step, TileOp):  # a view: zero-copy through torch, one result
            ins = [self.slot[n] for n in step.inputs]
            return ("view", step.name, reference.op_runner(step, symbols), ins,
                    self._define([step.name]))
        assert isinstance(step, ExternOp)
        return self._compile_extern(step, symbols)

    def _small_outputs(self, tile: FusionTile, names=None) -> bool:
        """Whether every output of the tile has a static shape of at most
        buffers.SMALL_OUTPUT_BYTES: a kernel called through its wrapper (a GEMM with a
        native epilogue) then allocates them itself, no pool round trip and refcount check
        (inline kernels: buffers.small_outputs)."""
        specs = [self.plan.graph.specs[n] for n in tile.outputs if n is not None
                 and (names is None or n in names)]
        return all(not is_symbolic(numel(sp.shape)) and
                   int(numel(sp.shape)) * sp.dtype.itemsize <= buffers.SMALL_OUTPUT_BYTES
                   for sp in specs)

    def _build_kernel(self, tile: FusionTile, target: Target) -> Kernel:
        graph = self.plan.graph
        if self._built is None:  # the first tile: build all of them at once
            self._built = {}
            tiles = [s for s in self.plan.steps if isinstance(s, FusionTile)]
            try:
                self._built = dict(zip([t.name for t in tiles], target.build_many(tiles, graph)))
            except Exception:  # noqa: BLE001 - build them one by one below
                pass
        try:
            kernel = self._built.pop(tile.name, None) or target.build(tile, graph)
            if isinstance(kernel, Exception):
                raise kernel
            if kernel.native is not None:
                self.kernel_native[tile.name] = {"native": kernel.native, "reason": kernel.reason}
            return kernel
        except Exception as e:  # noqa: BLE001 - any build failure falls back to eager
            if self.config.fallback == "error":
                raise KernelBuildError(f"building kernel {tile.name} failed: "
                                       f"{type(e).__name__}: {e}") from e
            warnings.warn(f"pypto_inductor: kernel {tile.name} failed to build "
                          f"({type(e).__name__}: {e}); "
                          "its ops run eagerly", stacklevel=2)
            self.kernel_fallbacks[tile.name] = f"{type(e).__name__}: {e}"
            return reference.build(tile, graph)

    def _compile_extern(self, step: ExternOp, symbols):
        reads: list[int] = []

        def mark(x):
            if isinstance(x, ValueRef):
                reads.append(self.slot[x.name])
                return _Operand(len(reads) - 1)
            if is_symbolic(x):
                return _Size(size_function(x, symbols))
            return resolve_static(x)

        args, kwargs = tree_map(mark, (step.args, step.kwargs))
        fn, tuple_result = step.fn, step.tuple_result

        def call(vals, syms):
            def fill(x):
                if isinstance(x, _Operand):
                    return vals[x.index]
                return x.fn(syms) if isinstance(x, _Size) else x
            result = fn(*tree_map(fill, args), **tree_map(fill, kwargs))
            return list(result) if tuple_result else [result]

        return ("extern", step.name, call, reads, self._define(step.outputs))

    def _liveness(self) -> list[tuple[list[int], list[int]]]:
        """For each step, the slots whose last reader it is (graph outputs stay): those
        to drop, and those whose buffer may go back to the pool."""
        keep = {self.slot[o] for o in self.plan.graph.outputs if isinstance(o, str)}
        last: dict[int, int] = {}
        base: dict[int, int] = {}  # a view's slot -> the pooled slot it aliases
        for i, (kind, _, _, ins, outs, _) in enumerate(self.program):
            for s in ins:
                last[s] = i
                if s in base:  # a pooled buffer lives as long as its views
                    last[base[s]] = i
            if kind == "view" and ins and (ins[0] in self.pooled or ins[0] in base):
                base.update((o, base.get(ins[0], ins[0])) for o in outs if o is not None)
        free: list[tuple[list[int], list[int]]] = [([], []) for _ in self.program]
        for s, i in last.items():
            if s not in keep:
                free[i][s in self.pooled].append(s)
        return free

    def _pooled_peak(self, reused: dict[int, int]) -> Callable[[tuple], int]:
        """syms -> the most bytes of pooled kernel outputs alive at once in a call: what
        the pool may hold for this graph. A kernel output lives from its step to its last
        reader's; one the generated code keeps for a later kernel's output (codegen/graph's
        static reuse) until the call returns; one written into such a kept buffer
        (``reused``) allocates nothing."""
        graph = self.plan.graph
        static = static_reuse(graph, self.program, self.kernels, self.pool_empty)
        size: dict[int, object] = {}  # a pooled buffer's slot -> its bytes
        returned = set(graph.outputs)  # a returned output never goes back to the pool
        live, totals = sympy.Integer(0), []
        for (kind, _, _, _, outs, step), (_, recycle) in zip(self.program, self._free_after):
            if kind == "kernel":
                for name, s in zip(step.outputs, outs):
                    if s in self.pooled and s not in reused and name not in returned \
                            and s not in self._small:
                        spec = graph.specs[name]
                        size[s] = numel(spec.shape) * spec.dtype.itemsize
                        live += size[s]
                if any(s in size for s in outs):
                    totals.append(live)
            for s in recycle:
                if s in size and s not in static:
                    live -= size[s]
        if not totals:
            return lambda syms: 0
        fn = size_function(tuple(totals), graph.symbols)
        return lambda syms: int(max(fn(syms)))

    def _pool_sized(self) -> bool:
        """Whether a pooled output's size depends on the size symbols (then the pool's
        reservation follows them per call: ``pool_start``)."""
        graph = self.plan.graph
        returned = set(graph.outputs)
        for kind, _, _, _, outs, step in self.program:
            if kind == "kernel":
                for name, s in zip(step.outputs, outs):
                    if s in self.pooled and s not in self._small and name not in returned \
                            and is_symbolic(numel(graph.specs[name].shape)):
                        return True
        return False

    def _pool_start(self, syms: tuple) -> None:
        """Called before each run: the pool's reservation follows the graph's sizes."""
        if syms != self._pool_syms:
            self.pool.reserve(self._pool_token, self._pool_peak(syms))
            self._pool_syms = syms

    # --- run -----------------------------------------------------------------------
    # AOTAutograd's boxed convention: __call__ takes the argument list and the generated
    # code empties it, so an input (a saved activation in a backward graph) is freed after
    # its last use here, not when the whole graph returns (docs/memory.md)
    def __call__(self, args: list) -> list:
        return self._call(args)

    @property
    def call(self) -> Callable[[list], list]:
        """The generated function, boxed as :meth:`__call__` (the backend hands it to
        AOTAutograd: no frame of this object's per call)."""
        return self._call

    def _other_device(self, args) -> list:
        if self.eager is not None:
            return list(self.eager(*args))
        runs = "/".join(self._devices) if self._devices else "non-meta"
        raise DeviceError(f"graph {self.plan.graph.name} runs {runs} tensors; it was called "
                          f"with a {args[self._probe].device.type} tensor")

    def measured_us(self) -> dict[str, float]:
        return {name: statistics.median(t) for name, t in self.timings.items() if t}


# A pooled buffer goes back only when no other Python reference (the same tensor object
# in another variable, say an extern op that returned its input) and no other tensor (a
# view) holds it: the next call overwrites it. The counts of a lone tensor are probed with
# the very expressions the generated code (codegen/graph) runs on a local variable, so they
# hold whatever the interpreter's refcounting does.
_pool_tokens = itertools.count()
_getrefcount = sys.getrefcount
_use_count = getattr(torch._C, "_storage_Use_Count", None)


def _alone_counts() -> tuple[int, int]:
    def probe(empty):
        buf0 = empty(1)
        return _getrefcount(buf0), _use_count(buf0.untyped_storage()._cdata)
    return probe(torch.empty)


_ALONE_REFS, _ALONE_USES = _alone_counts() if _use_count else (None, None)  # no pool then
