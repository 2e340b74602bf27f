"""The native CPU target: each FusionTile becomes one C++ function.

``build(tile, graph)`` analyses the tile into a small kernel program
(:class:`Program`: loads, ops, reductions, each at row or column level),
emits C++ for it (:mod:`.cpp_emit`), compiles it through the cached compiler
driver (:mod:`.cpp_build`) and returns ``kernel(inputs, syms) -> outputs``
calling it once through ctypes.

Iteration: a tile's domain D is split into rows (the outer dims, flattened,
run in parallel with OpenMP) and columns (the reduced trailing dims of a
reduction tile; for a pointwise tile the longest trailing run every input
reads contiguously or broadcast). Input sizes and strides are kernel arguments,
so dynamic sizes never recompile. Matmul tiles keep the GEMM on torch's BLAS
and run their elementwise epilogue as one native pass (:mod:`.cpp_matmul`).
Tiles outside the native slice (non-trailing reductions, argmax, cat, ...) run
the reference executor for that tile, without a warning; the kernel's
``native``/``reason`` attributes say so.
"""
from __future__ import annotations

import ctypes
import dataclasses
import warnings
from typing import Any

import sympy
import torch

from ..ir import FusionTile, OpKind, TileGraph, TileOp
from . import cpp_build, reference
from .sizes import is_symbolic, size_function

FLOATS = (torch.float32, torch.float16, torch.bfloat16)
INTS = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)
DTYPES = FLOATS + INTS + (torch.bool,)
SYMBOL = "pi_kernel"


class NotNative(Exception):
    """This tile is outside the native slice; the message says why."""


@dataclasses.dataclass(frozen=True)
class Lit:
    """A scalar operand: a Python number or a sympy size expression."""

    value: Any


@dataclasses.dataclass(eq=False)
class Node:
    id: int
    kind: str  # "load", "op" (a tile op), "expr" (internal float math), "reduce"
    level: str  # "row" (once per row) or "col" (per element)
    args: list  # Node | Lit
    dtype: torch.dtype | None  # the value's dtype (results are rounded to it); None = fp32 math
    attrs: dict
    shape: tuple | None = None


@dataclasses.dataclass(frozen=True)
class Access:
    """How an input is indexed: ``dims[d]`` is the input dim read for domain dim d (or None)."""

    input: int
    dims: tuple
    col: bool  # read per element (else once per row)


@dataclasses.dataclass
class Program:
    shape: tuple  # domain D (sympy)
    m: int  # number of trailing column dims
    reduction: bool
    nodes: list
    accesses: list
    input_specs: list
    outputs: list  # (Node, spec)
    fast: list  # per access: "unit", "bcast" or "strided" (expected column layout)
    symbols: list


def _compute_dtype(dt):
    return torch.float32 if dt in FLOATS else dt


class _Analyser:
    def __init__(self, tile: FusionTile, graph: TileGraph):
        self.tile, self.graph = tile, graph
        self.nodes: list[Node] = []
        self.env: dict[str, Node] = {}
        self.accesses: dict[tuple, int] = {}
        self.access_list: list[Access] = []
        self.loads: dict[tuple, Node] = {}
        self.slot = {name: i for i, name in enumerate(tile.inputs)}

    # --- nodes -------------------------------------------------------------------
    def node(self, kind, level, args, vdtype, shape=None, /, **attrs) -> Node:
        n = Node(len(self.nodes), kind, level, list(args), vdtype, attrs, shape)
        self.nodes.append(n)
        return n

    def expr(self, level, fmt, *args) -> Node:
        return self.node("expr", level, args, None, fmt=fmt)

    def reduce(self, red, x: Node, acc_dtype=None) -> Node:
        return self.node("reduce", "row", [x], acc_dtype, red=red)

    # --- contexts ------------------------------------------------------------------
    def context(self, shape) -> str:
        if shape == self.D:
            return "col"
        if self.m_red and shape == self.keep:
            return "keep"
        if self.m_red and shape == self.drop:
            return "drop"
        raise NotNative(f"a value of shape {list(shape)} does not fit the tile domain {list(self.D)}")

    def load(self, name: str, ctx: str) -> Node:
        spec = self.graph.specs[name]
        n, q = len(self.D), len(spec.shape)
        target = self.drop if ctx == "drop" else self.D
        if q > len(target):
            raise NotNative(f"input {name} has more dims than its use")
        shift = len(target) - q
        dims = [None] * n
        for j in range(q):
            t = j + shift  # dim of the target shape
            d = t if ctx != "drop" else self.outer[t]
            if ctx == "keep" and d >= n - self.m and spec.shape[j] != 1:
                raise NotNative(f"input {name} is not constant along the reduced dims")
            dims[d] = j
        if ctx != "col":
            dims = [x if d < n - self.m else None for d, x in enumerate(dims)]
        access = Access(self.slot[name], tuple(dims), ctx == "col")
        if access not in self.accesses:
            self.accesses[access] = len(self.access_list)
            self.access_list.append(access)
        key = (name, access)
        if key not in self.loads:
            level = "col" if ctx == "col" else "row"
            self.loads[key] = self.node("load", level, [], spec.dtype, spec.shape,
                                        access=self.accesses[access])
        return self.loads[key]

    def operand(self, a, ctx: str, out_shape):
        if not isinstance(a, str):
            if isinstance(a, (bool, int, float)) or is_symbolic(a) or isinstance(a, sympy.Number):
                return Lit(a)
            raise NotNative(f"operand {a!r} is not a tensor or scalar")
        if a not in self.env:
            return self.load(a, ctx)
        v = self.env[a]
        if v.level == "col" and ctx != "col":
            raise NotNative("a per-row value depends on a per-element one")
        if v.level == "row":
            aligned = (1,) * (len(out_shape) - len(v.shape)) + tuple(v.shape)
            if len(aligned) != len(out_shape):
                raise NotNative("per-row operand of higher rank")
            n = len(out_shape)
            for d, (q, p) in enumerate(zip(aligned, out_shape)):
                col_dim = ctx == "col" and d >= n - self.m
                if (col_dim and q != 1) or (not col_dim and q != p):
                    raise NotNative(f"per-row value of shape {list(v.shape)} broadcast to "
                                    f"{list(out_shape)}")
        return v

    # --- the tile -------------------------------------------------------------------
    def run(self) -> Program:
        from ..fusion.capacity import group_domain

        tile, graph = self.tile, self.graph
        if tile.kind not in (OpKind.ELEMENTWISE, OpKind.BROADCAST, OpKind.CAST,
                             OpKind.REDUCTION):
            raise NotNative(f"{tile.kind.value} tiles are not native yet")
        for name in list(tile.inputs) + [op.name for op in tile.ops]:
            dt = graph.specs[name].dtype
            if dt not in DTYPES:
                raise NotNative(f"dtype {dt} is not in the native slice")
        dom = group_domain(tile.ops, graph)
        self.D = tuple(dom.shape)
        n = len(self.D)
        axes = tuple(dom.reduce_axes)
        self.m_red = len(axes)
        if axes and axes != tuple(range(n - len(axes), n)):
            raise NotNative(f"reduction over dims {list(axes)} is not over the innermost dims")
        self.m = len(axes)
        self.outer = list(range(n - self.m))
        self.keep = tuple(1 if d in axes else s for d, s in enumerate(self.D))
        self.drop = tuple(s for d, s in enumerate(self.D) if d not in axes)
        for op in tile.ops:
            self.env[op.name] = self.lower(op)
        outputs = [(self.env[name], graph.specs[name]) for name in tile.outputs]
        m = self.m if axes else self.pointwise_columns()
        return Program(self.D, m, bool(axes), self.nodes, self.access_list,
                       [graph.specs[i] for i in tile.inputs], outputs,
                       [self.classify(a, m) for a in self.access_list], graph.symbols)

    def pointwise_columns(self) -> int:
        n = len(self.D)
        for m in range(n, 1, -1):
            if all(not a.col or self.classify(a, m) != "strided" for a in self.access_list):
                return m
        return min(n, 1)

    def classify(self, a: Access, m: int) -> str:
        """The expected layout of an access over the m trailing dims, from the size hints."""
        if not a.col:
            return "bcast"
        spec = self.graph.specs[self.tile.inputs[a.input]]
        hint = self.graph.hint
        n = len(self.D)
        unit = bcast = True
        contiguous = 1
        for d in range(n - 1, n - m - 1, -1):
            size = hint(self.D[d])
            j = a.dims[d]
            es = 0 if j is None or hint(spec.shape[j]) == 1 else hint(spec.stride[j])
            if size != 1:
                unit &= es == contiguous
                bcast &= es == 0
            contiguous *= size
        return "unit" if unit else "bcast" if bcast else "strided"

    def lower(self, op: TileOp) -> Node:
        ctx = self.context(tuple(op.out.shape))
        if op.kind is OpKind.REDUCTION:
            return self.lower_reduction(op, ctx)
        if op.kind not in (OpKind.ELEMENTWISE, OpKind.BROADCAST, OpKind.CAST):
            raise NotNative(f"{op.op} ({op.kind.value}) is not native yet")
        from .cpp_emit import OPS

        if op.op not in OPS:
            raise NotNative(f"tile op {op.op} is not native yet")
        if op.op == "div" and op.attrs.get("rounding_mode"):
            raise NotNative("div with a rounding mode is not native yet")
        args = [self.operand(a, ctx, op.out.shape) for a in op.args]
        common = self.common_dtype(op, args)
        level = "col" if ctx == "col" else "row"
        return self.node("op", level, args, op.out.dtype, op.out.shape, op=op.op,
                         common=common, **op.attrs)

    def common_dtype(self, op: TileOp, args) -> torch.dtype:
        """The dtype operands are converted to before the op computes (torch promotion)."""
        if op.op in ("cast", "full"):
            return op.out.dtype
        if op.op == "where":
            args = args[1:]
        vals = []
        for a in args:
            if isinstance(a, Lit):
                v = a.value
                vals.append(v if isinstance(v, (bool, int, float)) else
                            (1.0 if isinstance(v, sympy.Float) else 1))
            else:
                dt = a.dtype or torch.float32
                vals.append(torch.empty((1,) * len(a.shape or ()), dtype=dt, device="meta"))
        tensors = [v for v in vals if isinstance(v, torch.Tensor)]
        if not tensors:
            return op.out.dtype
        common = tensors[0].dtype
        if len(vals) > 1:
            common = torch.result_type(vals[0], vals[1]) if len(vals) == 2 else op.out.dtype
        if op.out.dtype.is_floating_point and not common.is_floating_point:
            common = op.out.dtype
        if op.op in ("logical_and", "logical_or", "logical_xor", "logical_not"):
            common = torch.bool
        if op.op.startswith("bitwise") and common.is_floating_point:
            raise NotNative(f"{op.op} on {common}")
        if common not in DTYPES:
            raise NotNative(f"computing {op.op} in {common} is not native")
        return common

    def lower_reduction(self, op: TileOp, ctx: str) -> Node:
        name = op.op
        dims = tuple(op.attrs.get("dims", ()))
        src = op.args[0]
        if dims != tuple(range(len(self.D) - self.m, len(self.D))):
            raise NotNative(f"{name} over dims {list(dims)} differs from the tile's reduction")
        if tuple(self.graph.specs[src].shape) != self.D:
            raise NotNative(f"{name} input shape differs from the tile domain")
        x = self.operand(src, "col", self.D)
        out = op.out.dtype
        level = "col" if name in ("softmax", "log_softmax") else "row"
        if (level == "col") != (ctx == "col"):
            raise NotNative(f"{name} output shape does not fit the tile domain")
        if out not in FLOATS and name not in ("sum", "amax", "amin"):
            raise NotNative(f"{name} in {out} is not native yet")
        if name == "sum":
            acc = _compute_dtype(out)
            x = self.node("op", "col", [x], acc, self.D, op="copy", common=acc) \
                if acc != x.dtype else x
            return self.round(self.reduce("sum", x, acc), out, op)
        if name in ("amax", "amin"):
            return self.round(self.reduce(name[1:], x, _compute_dtype(x.dtype)), out, op)
        if name == "mean":
            return self.round(self.expr("row", "({0} / (float)C)", self.reduce("sum", x)), out, op)
        if name in ("var", "std"):
            mean = self.expr("row", "({0} / (float)C)", self.reduce("sum", x))
            dev = self.expr("col", "({0} - {1})", x, mean)
            ss = self.reduce("sum", self.expr("col", "({0} * {0})", dev))
            corr = float(op.attrs.get("correction", 1.0))
            fmt = f"({{0}} / (float)std::max<double>((double)C - {corr!r}, 0.0))"
            v = self.expr("row", fmt, ss)
            return self.round(self.expr("row", "std::sqrt({0})", v) if name == "std" else v,
                              out, op)
        if name in ("softmax", "log_softmax", "logsumexp"):
            mx = self.reduce("max", x)
            if name == "logsumexp":
                safe = self.expr("row", "(std::isinf({0}) ? 0.0f : {0})", mx)
                s = self.reduce("sum", self.expr("col", "pi_exp({0} - {1})", x, safe))
                return self.round(self.expr("row", "(std::log({0}) + {1})", s, safe), out, op)
            shifted = self.expr("col", "({0} - {1})", x, mx)
            e = self.expr("col", "pi_exp({0})", shifted)
            s = self.reduce("sum", e)
            if name == "softmax":
                return self.round(self.expr("col", "({0} / {1})", e, s), out, op)
            logs = self.expr("row", "std::log({0})", s)
            return self.round(self.expr("col", "({0} - {1})", shifted, logs), out, op)
        raise NotNative(f"reduction {name} is not native yet")

    def round(self, v: Node, dtype, op: TileOp) -> Node:
        """The value as the op's result: rounded to its dtype."""
        return self.node("op", v.level, [v], dtype, op.out.shape, op="copy",
                         common=v.dtype or torch.float32)


def analyse(tile: FusionTile, graph: TileGraph) -> Program:
    return _Analyser(tile, graph).run()


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
    if tile.kind is OpKind.MATMUL:
        from . import cpp_matmul

        try:
            return cpp_matmul.build(tile, graph, _build_native)
        except NotNative as e:
            return _reference(tile, graph, str(e))
        except _NoCompiler:
            return _reference(tile, graph, "no C++ compiler")
    try:
        return _build_native(tile, graph)
    except NotNative as e:
        return _reference(tile, graph, str(e))
    except _NoCompiler:
        return _reference(tile, graph, "no C++ compiler")


class _NoCompiler(Exception):
    pass


def _build_native(tile: FusionTile, graph: TileGraph):
    """The native kernel of a pointwise/reduction tile; raises NotNative or _NoCompiler."""
    global _warned_no_compiler
    program = analyse(tile, graph)
    if cpp_build.find_compiler() is None:
        if not _warned_no_compiler:
            _warned_no_compiler = True
            warnings.warn("pypto_inductor: no C++ compiler found (set CXX or install g++); "
                          "the cpu target runs the reference executor", stacklevel=4)
        raise _NoCompiler()
    fn = cpp_build.load(generate_source(program), SYMBOL)  # raises on a compile error
    return _native_kernel(fn, program)


def _native_kernel(fn, program: Program):
    fn.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(ctypes.c_int64),
                   ctypes.POINTER(ctypes.c_int64), ctypes.c_int]
    fn.restype = None
    alloc = [(size_function(tuple(spec.shape), program.symbols), spec.dtype)
             for _, spec in program.outputs]
    n_ptr = len(program.input_specs) + len(alloc)
    n_meta = sum(2 * len(s.shape) for s in program.input_specs)
    Ptrs = ctypes.c_void_p * max(n_ptr, 1)
    Meta = ctypes.c_int64 * max(n_meta, 1)
    Syms = ctypes.c_int64 * max(len(program.symbols), 1)
    empty, threads = torch.empty, torch.get_num_threads

    arrays: dict = {}  # sizes/strides/syms -> the ctypes arrays already built for them

    def kernel(inputs: list, syms: tuple) -> list:
        outs = [empty(f(syms), dtype=dt) for f, dt in alloc]
        key = (syms, *[(t.shape, t.stride()) for t in inputs])
        args = arrays.get(key)
        if args is None:
            meta = [v for t in inputs for v in (*t.shape, *t.stride())]
            args = arrays[key] = (Meta(*meta), Syms(*syms))
            if len(arrays) > 256:
                arrays.pop(next(iter(arrays)))
        ptrs = Ptrs(*[t.data_ptr() for t in inputs], *[o.data_ptr() for o in outs])
        fn(ptrs, args[0], args[1], threads())
        return outs

    kernel.native = True
    kernel.reason = None
    kernel.program = program
    return kernel
