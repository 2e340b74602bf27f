"""FusionTile -> the source text of a pypto 0.2.0 tile kernel module.

pypto's frontend re-parses the decorated function's source with ``inspect``, so
a kernel is emitted as a whole module (``import pypto`` plus one
``@pypto.frontend.jit`` function) that the caller writes to a real ``.py`` file
and imports. Every tile input and output is an annotated parameter
``pypto.Tensor(shape, dtype)``; outputs are written with ``out[:] = ...``.

Shapes are static, at the graph's example sizes (``graph.hint``), unless the
tile's rows (the product of the domain's leading, kept dims) are a size
expression: then the kernel declares ``R = pypto.frontend.dynamic("R")`` and
annotates every row-spanning value ``(R, C)`` / ``(R, 1)``, and its body runs in
a ``pypto.loop`` over row tiles, on ``pypto.view``s of the inputs (with a
``valid_shape`` for the last, partial tile), storing with ``pypto.assemble``
(pypto fails on whole-tensor ops over a dynamic dim). One source serves every
size; :meth:`PyptoKernel.at_sizes` gives the same kernel at other example sizes.
Supported: elementwise/broadcast tiles and trailing (row) reductions whose
columns / reduced length are static. Dynamic columns, reductions over leading
dims and matmul tiles raise :class:`PyptoEmitError` saying so.

Vector FusionTiles are emitted over a 2-D view of their iteration domain, the
same (rows, cols) split the planner's tile shape uses: a domain D reducing its
trailing axes becomes (prod(kept axes), prod(reduced axes)) and every value of
the tile is declared as (R, C), a per-row (R, 1), a per-column (1, C) or a
scalar (1, 1) tensor. :class:`KernelParam` records each parameter's kernel
shape; a launcher reshapes the (contiguous) torch tensors to it. Matmul
FusionTiles keep their N-D shapes; epilogue operands are padded with leading 1s.

Compute dtype: fp32, or fp16 when the tile computes in fp16 (dtype_policy
"strict"); bf16 inputs are always upcast (pypto's vector unit has no bf16
arithmetic). Inputs are cast after load and outputs cast back on store.

A tile op with no pypto form raises :class:`PyptoEmitError` naming the op;
:func:`split_tile` then splits the tile at such ops into pypto sub-tiles (by
data dependence) with the ops between them run as extern ops, which the
simulator (``split_ops`` in the report) and the NPU target do.

This module holds the kernel structure: the errors, :class:`KernelParam` and
:class:`PyptoKernel`, the 2-D layout, the emitter that writes a kernel's
parameters, casts and stores, the rms_norm pattern match, and the entry points
(:func:`emit_tile`, :func:`emit_op`, :func:`single_op_tile`). The per-op pypto
forms live in :mod:`.pypto_ops`, registered into this module's op table.
"""
from __future__ import annotations

import dataclasses
import math
import re
from typing import Any, Callable

import sympy
import torch

from ..ir import FusionTile, OpKind, TensorSpec, TileGraph, TileOp

__all__ = ["PyptoEmitError", "KernelParam", "PyptoKernel", "emit_tile", "emit_op",
           "single_op_tile", "PYPTO_DTYPES", "supported_ops", "TileSplit", "split_tile",
           "unsupported_ops"]


class PyptoEmitError(ValueError):
    """A tile op (or a shape/dtype pattern) has no pypto form."""

    def __init__(self, op: str, reason: str = ""):
        self.op = op
        self.reason = reason
        super().__init__(f"{op} has no pypto form" + (f": {reason}" if reason else ""))


# torch dtype -> pypto dtype name (attribute of the pypto module).
PYPTO_DTYPES: dict[torch.dtype, str] = {
    torch.float32: "DT_FP32",
    torch.float16: "DT_FP16",
    torch.bfloat16: "DT_BF16",
    torch.int32: "DT_INT32",
    torch.int64: "DT_INT64",
    torch.int16: "DT_INT16",
    torch.int8: "DT_INT8",
    torch.uint8: "DT_UINT8",
    torch.bool: "DT_BOOL",
}


@dataclasses.dataclass(frozen=True)
class KernelParam:
    ident: str  # the parameter's name in the kernel
    value: str  # the graph value it carries
    shape: tuple[int, ...]  # the kernel's (static) shape of it
    dtype: torch.dtype
    is_output: bool
    graph_shape: tuple[int, ...] = ()  # the value's own shape at the example sizes
    # Dynamic kernels: the kernel dims with the dynamic one named (e.g. ("R", 256)), and the
    # value's graph shape as sympy strings over the graph's size symbols; () when static.
    dims: tuple = ()
    graph_dims: tuple[str, ...] = ()

    @property
    def dynamic(self) -> bool:
        return any(isinstance(d, str) for d in self.dims)

    def to_json(self) -> dict:
        d = {"ident": self.ident, "value": self.value, "shape": list(self.shape),
             "dtype": str(self.dtype).replace("torch.", ""), "is_output": self.is_output,
             "graph_shape": list(self.graph_shape)}
        if self.dims:
            d["dims"], d["graph_dims"] = list(self.dims), list(self.graph_dims)
        return d

    @classmethod
    def from_json(cls, d: dict) -> "KernelParam":
        return cls(d["ident"], d["value"], tuple(d["shape"]), getattr(torch, d["dtype"]),
                   d["is_output"], tuple(d["graph_shape"]), tuple(d.get("dims", ())),
                   tuple(d.get("graph_dims", ())))


@dataclasses.dataclass
class PyptoKernel:
    name: str  # the jit function's name (and the module's stem)
    tile_name: str
    source: str  # the whole module
    params: list[KernelParam]  # inputs first, then outputs: the call order
    vec_tile: tuple[int, ...] | None
    cube_tile: tuple[tuple[int, int], ...] | None
    dynamic_dims: dict[str, str] = dataclasses.field(default_factory=dict)  # "R" -> "s0*s1"

    @property
    def dynamic(self) -> bool:
        return bool(self.dynamic_dims)

    def at_sizes(self, sizes: dict) -> "PyptoKernel":
        """The same kernel (same source) whose example shapes are at other sizes.

        ``sizes`` maps size symbols (or their names) to ints; only meaningful for a
        dynamic kernel: the simulator runs it on inputs of these shapes.
        """
        if not self.dynamic:
            raise ValueError(f"kernel {self.name} has static shapes")
        names = {str(k): int(v) for k, v in sizes.items()}

        def value(g: str) -> int:
            expr = sympy.sympify(g)
            missing = sorted(x.name for x in expr.free_symbols if x.name not in names)
            if missing:
                raise ValueError(f"kernel {self.name}: no size given for {missing}")
            return int(expr.subs({x: names[x.name] for x in expr.free_symbols}))
        params = []
        for p in self.params:
            if not p.dims:
                params.append(p)
                continue
            graph_shape = tuple(value(g) for g in p.graph_dims)
            static = _prod([d for d in p.dims if not isinstance(d, str)])
            shape = tuple(_prod(graph_shape) // static if isinstance(d, str) else d
                          for d in p.dims)
            params.append(dataclasses.replace(p, shape=shape, graph_shape=graph_shape))
        return dataclasses.replace(self, params=params)

    @property
    def inputs(self) -> list[KernelParam]:
        return [p for p in self.params if not p.is_output]

    @property
    def outputs(self) -> list[KernelParam]:
        return [p for p in self.params if p.is_output]

    def example_inputs(self, device: str | torch.device = "cpu") -> list[torch.Tensor]:
        """Zero tensors of every input's own (graph) shape, in call order."""
        return [torch.zeros(p.graph_shape, dtype=p.dtype, device=device) for p in self.inputs]

    def to_json(self) -> dict:
        return {"name": self.name, "tile_name": self.tile_name, "source": self.source,
                "params": [p.to_json() for p in self.params],
                "vec_tile": list(self.vec_tile) if self.vec_tile else None,
                "cube_tile": [list(x) for x in self.cube_tile] if self.cube_tile else None,
                "dynamic_dims": dict(self.dynamic_dims)}

    @classmethod
    def from_json(cls, d: dict) -> "PyptoKernel":
        return cls(d["name"], d["tile_name"], d["source"],
                   [KernelParam.from_json(p) for p in d["params"]],
                   tuple(d["vec_tile"]) if d["vec_tile"] else None,
                   tuple(tuple(x) for x in d["cube_tile"]) if d["cube_tile"] else None,
                   dict(d.get("dynamic_dims") or {}))


def _ident(name: str) -> str:
    return re.sub(r"\W", "_", name)


def _prod(xs) -> int:
    return int(math.prod(xs)) if xs else 1


def _literal(v: Any) -> str:
    if isinstance(v, bool):
        return "1.0" if v else "0.0"
    if isinstance(v, int):
        return repr(float(v))
    if isinstance(v, float):
        if math.isinf(v):
            return "float('inf')" if v > 0 else "float('-inf')"
        if math.isnan(v):
            return "float('nan')"
        return repr(v)
    raise TypeError(v)


# --- iteration domain: how each value of the tile is laid out in the kernel -----------
class _Layout:
    """Kernel shapes of a tile's values (2-D for vector tiles, N-D for matmul tiles)."""

    def __init__(self, tile: FusionTile, graph: TileGraph):
        self.graph = graph
        self.hint = lambda shape: tuple(graph.hint(s) for s in shape)
        self.matmul = next((op for op in tile.ops if op.kind is OpKind.MATMUL), None)
        reductions = [op for op in tile.ops if op.kind is OpKind.REDUCTION]
        self.roles: dict[str, tuple[int, ...]] = {}
        self.dynamic = False  # rows are a size expression: a pypto.loop over row tiles
        self.rows_expr = None
        if self.matmul is not None:
            self.sym_domain = tuple(self.matmul.out.shape)
            self.domain = self.hint(self.matmul.out.shape)
            self.reduce_axes: tuple[int, ...] = ()
            self.reduce_dim = None
            if any(_symbolic(x) for x in self.sym_domain) or any(
                    _symbolic(x) for a in self.matmul.args[:2] if isinstance(a, str)
                    for x in graph.specs[a].shape):
                raise PyptoEmitError(self.matmul.op, "dynamic sizes are not supported yet in "
                                     "matmul tiles (only elementwise/broadcast and row reductions)")
            return
        if reductions:
            red = reductions[0]
            self.sym_domain = tuple(graph.specs[red.args[0]].shape)
            self.reduce_axes = tuple(red.attrs["dims"])
        else:
            shapes = [tuple(op.out.shape) for op in tile.ops]
            self.sym_domain = max(shapes, key=lambda s: (_prod(self.hint(s)), len(s)))
            self.reduce_axes = ()
        self.domain = self.hint(self.sym_domain)
        d, a = self.domain, self.reduce_axes
        n = len(d)
        if not a:
            split, self.reduce_dim = max(n - 1, 0), None
        elif a == tuple(range(n - len(a), n)):
            split, self.reduce_dim = n - len(a), 1
        elif a == tuple(range(len(a))):
            split, self.reduce_dim = len(a), 0
        else:
            raise PyptoEmitError(reductions[0].op, f"reduction over dims {list(a)} of {list(d)} "
                                 "is neither leading nor trailing")
        self.split = split
        self.rows, self.cols = _prod(d[:split]), _prod(d[split:])
        rows_expr = sympy.Mul(*self.sym_domain[:split]) if split else sympy.Integer(1)
        cols_expr = sympy.Mul(*self.sym_domain[split:]) if split < n else sympy.Integer(1)
        what = (reductions[0] if reductions else tile.ops[0]).op
        if self.reduce_dim == 0 and (_symbolic(rows_expr) or _symbolic(cols_expr)):
            raise PyptoEmitError(what, f"a reduction over a leading extent ({rows_expr}) with "
                                 "dynamic sizes is not supported yet")
        if _symbolic(cols_expr):
            kind = "reduced" if self.reduce_dim == 1 else "column"
            raise PyptoEmitError(what, f"a dynamic {kind} extent ({cols_expr}) is not supported "
                                 "yet: dynamic sizes must be in the leading (row) dims, the "
                                 "trailing ones static")
        if _symbolic(rows_expr):
            self.dynamic, self.rows_expr = True, rows_expr
        self.body_rows = self.rows  # rows of the values the body computes (a row tile if dynamic)

    # vector tiles --------------------------------------------------------------------
    def reduced(self) -> tuple[int, int]:
        return (self.rows, 1) if self.reduce_dim == 1 else (1, self.cols)

    def classify(self, shape: tuple, what: str) -> tuple[int, ...]:
        """The kernel shape (at the example sizes) of a value of this (symbolic) shape.

        Static tiles compare example sizes; dynamic tiles compare the size
        expressions, so an example size that happens to equal a static one is
        not taken for it.
        """
        if self.dynamic:
            d, shape = self.sym_domain, tuple(sympy.sympify(s) for s in shape)
        else:
            d, shape = self.domain, self.hint(shape)
        if self.matmul is not None:
            if len(shape) > len(d):
                raise PyptoEmitError(what, f"shape {list(shape)} has more dims than {list(d)}")
            return (1,) * (len(d) - len(shape)) + tuple(shape)
        if tuple(shape) == d:
            return (self.rows, self.cols)
        if len(shape) > len(d):
            raise PyptoEmitError(what, f"shape {list(shape)} has more dims than the domain {list(d)}")
        padded = (1,) * (len(d) - len(shape)) + tuple(shape)
        rows_p, cols_p = padded[:self.split], padded[self.split:]
        rows_match, cols_match = rows_p == d[:self.split], cols_p == d[self.split:]
        rows_one, cols_one = all(s == 1 for s in rows_p), all(s == 1 for s in cols_p)
        if rows_match and cols_match:
            return (self.rows, self.cols)
        if rows_one and cols_match:
            return (1, self.cols)
        if rows_match and cols_one:
            return (self.rows, 1)
        if rows_one and cols_one:
            return (1, 1)
        if self.reduce_axes:  # a reduced value without keepdim, e.g. [B, S] of [B, S, H]
            kept = tuple(s for i, s in enumerate(d) if i not in self.reduce_axes)
            if tuple(shape) == kept:
                return self.reduced()
        raise PyptoEmitError(what, f"broadcast of {list(shape)} against the tile domain "
                             f"{list(d)} has no 2-D form")

    def has_rows(self, kshape: tuple[int, ...]) -> bool:
        """Whether a value of this kernel shape spans the (dynamic) rows."""
        return self.dynamic and kshape[0] == self.rows

    def body_shape(self, kshape: tuple[int, ...]) -> tuple[int, ...]:
        """The shape of such a value inside the kernel body (one row tile if dynamic)."""
        return (self.body_rows,) + tuple(kshape[1:]) if self.has_rows(kshape) else tuple(kshape)

    def vec_tile(self, tile_shape: tuple[int, ...]) -> tuple[int, ...]:
        """pypto vector tile shape from the planner's (rows, cols), clamped to the domain."""
        if self.matmul is not None:
            tm, tn = tile_shape[0], tile_shape[1]
            lead = (1,) * (len(self.domain) - 2)
            return lead + (min(tm, self.domain[-2]), min(tn, self.domain[-1]))
        t_rows = tile_shape[0] if tile_shape else 1
        t_cols = tile_shape[1] if len(tile_shape) > 1 else self.cols
        if self.reduce_dim == 0:  # the planner's cols span the reduced (here leading) extent
            t_rows, t_cols = t_cols, t_rows
        # Dynamic rows: the row tile does not depend on the example size (a loop covers any).
        t_rows = max(1, t_rows if self.dynamic else min(t_rows, self.rows))
        t_cols = max(1, min(t_cols, self.cols))
        # pypto 0.2.0 fails to place a vector tile beyond a third of UB (measured: 64x256
        # fp32 compiles, 128x256 does not); shrink rows, then columns.
        budget = _ub_bytes() // 3
        while t_rows * t_cols * 4 > budget and (t_rows > 1 or t_cols > 8):
            if t_rows > 1:
                t_rows = (t_rows + 1) // 2
            else:
                t_cols //= 2
        if t_cols < self.cols:  # keep a row of the tile 32-byte aligned
            t_cols = max(8, t_cols - t_cols % 8)
        return (t_rows, t_cols)


def _symbolic(x: Any) -> bool:
    return isinstance(x, sympy.Basic) and bool(x.free_symbols)


def _ub_bytes() -> int:
    from ..hardware import ascend_a2

    return int(ascend_a2().vector_capacity_bytes)


def _cube_tile(tile_shape: tuple[int, ...], m: int, n: int, k: int,
               itemsize: int) -> tuple[tuple[int, int], ...]:
    """pypto cube tiles ([L0, L1] per m, k, n) from the planner's (tm, tn, tk).

    Rounded to the cube unit's 16x16 fractals and shrunk until the double-buffered
    L0A (tm x tk), L0B (tk x tn) and L0C (tm x tn fp32) tiles fit the A2 model.
    """
    from ..hardware import ascend_a2

    details = dict(ascend_a2().details)
    l0a, l0b, l0c = (int(details.get(key, default)) for key, default in
                     (("l0a_bytes", 65536), ("l0b_bytes", 65536), ("l0c_bytes", 131072)))

    def fit(t: int, extent: int) -> int:
        t = min(t, extent)
        return max(16, -(-t // 16) * 16)
    tm, tn, tk = (tuple(tile_shape) + (128, 128, 128))[:3]
    tm, tn, tk = fit(tm, m), fit(tn, n), fit(tk, k)
    while 2 * tm * tk * itemsize > l0a and (tk > 16 or tm > 16):
        if tk >= tm and tk > 16:
            tk //= 2
        else:
            tm //= 2
    while 2 * tk * tn * itemsize > l0b and tn > 16:
        tn //= 2
    while 2 * tm * tn * 4 > l0c and tn > 16:
        tn //= 2
    tm, tn, tk = (max(16, x - x % 16) for x in (tm, tn, tk))
    return ((tm, tm), (tk, tk), (tn, tn))


# --- op emission -----------------------------------------------------------------------
class _Emitter:
    def __init__(self, tile: FusionTile, graph: TileGraph):
        self.tile, self.graph = tile, graph
        self.layout = _Layout(tile, graph)
        self.lines: list[str] = []
        self.env: dict[str, str] = {}  # value -> identifier in the kernel
        self.dtype: dict[str, torch.dtype] = {}  # value -> dtype in the kernel
        self.shape: dict[str, tuple[int, ...]] = {}  # value -> kernel shape
        self._n = 0
        floats = {graph.specs[n].dtype for op in tile.ops for n in op.inputs + [op.name]
                  if graph.specs[n].dtype.is_floating_point}
        if torch.float64 in floats:
            raise PyptoEmitError(tile.ops[0].op, "float64 (pypto has no fp64 arithmetic)")
        strict_half = tile.dtype == "float16"
        self.compute = torch.float16 if strict_half else torch.float32

    # helpers ------------------------------------------------------------------------------
    def tmp(self, expr: str, hint: str = "t") -> str:
        self._n += 1
        name = f"{hint}{self._n}"
        self.lines.append(f"{name} = {expr}")
        return name

    def arg(self, a: Any, op: TileOp) -> str:
        if isinstance(a, str):
            return self.env[a]
        if isinstance(a, sympy.Basic):
            a = self.graph.hint(a) if a.free_symbols else (
                int(a) if a.is_Integer else float(a))
        if isinstance(a, (bool, int, float)):
            return _literal(a)
        raise PyptoEmitError(op.op, f"operand {a!r}")

    def is_tensor(self, a: Any) -> bool:
        return isinstance(a, str)

    def dt(self, torch_dtype: torch.dtype) -> str:
        if torch_dtype not in PYPTO_DTYPES:
            raise PyptoEmitError(str(torch_dtype), "dtype has no pypto equivalent")
        return f"pypto.{PYPTO_DTYPES[torch_dtype]}"

    def kernel_dtype(self, spec: TensorSpec) -> torch.dtype:
        return self.compute if spec.dtype.is_floating_point else spec.dtype

    # the body ------------------------------------------------------------------------------
    def emit(self, kernel_name: str, run_mode: str) -> PyptoKernel:
        tile, graph, layout = self.tile, self.graph, self.layout
        params: list[KernelParam] = []
        used = set()

        def pname(prefix: str, value: str) -> str:
            base = f"{prefix}_{_ident(value)}"
            name, i = base, 1
            while name in used:
                i += 1
                name = f"{base}_{i}"
            used.add(name)
            return name

        dyn = layout.dynamic
        if dyn:
            vec = layout.vec_tile(tile.tile_shape)
            layout.body_rows = vec[0]  # the loop's row tile

        def param(prefix: str, value: str, spec: TensorSpec, shape, is_output: bool):
            extra = {}
            if dyn:
                dims = ("R",) + tuple(shape[1:]) if layout.has_rows(shape) else tuple(shape)
                extra = dict(dims=dims, graph_dims=tuple(str(sympy.sympify(x))
                                                         for x in spec.shape))
            return KernelParam(pname(prefix, value), value, shape, spec.dtype, is_output,
                               self.hint(spec), **extra)

        input_idents = set()
        for value in tile.inputs:
            spec = graph.specs[value]
            shape = self._value_shape(value, spec, is_input=True)
            p = param("in", value, spec, shape, False)
            params.append(p)
            ident = p.ident
            if dyn and layout.has_rows(shape):  # this row tile of the input
                body = list(layout.body_shape(shape))
                ident = self.tmp(f"pypto.view({ident}, {body!r}, [r0, 0], valid_shape=[rn, "
                                 f"{body[1]}])", "v")
            input_idents.add(ident)
            kdt = self.kernel_dtype(spec)
            if kdt != spec.dtype and not self._is_matmul_operand(value):
                ident = self.tmp(f"pypto.cast({ident}, {self.dt(kdt)})", "x")
            else:
                kdt = spec.dtype
            self.env[value], self.dtype[value], self.shape[value] = ident, kdt, shape
        for value in tile.outputs:
            spec = graph.specs[value]
            shape = self._value_shape(value, spec, is_input=False)
            if dyn and not layout.has_rows(shape):
                raise PyptoEmitError(value, f"an output of shape {list(spec.shape)} that does "
                                     "not span the dynamic rows is not supported yet")
            params.append(param("out", value, spec, shape, True))
        fused_norms, skipped = _match_rms_norm(tile, self)
        for op in tile.ops:
            if op.name in skipped:
                continue
            if op.name in fused_norms:
                x, eps = fused_norms[op.name]
                (xi,) = _tensor_operands(self, dataclasses.replace(op, args=(x,)))
                ident, kdt = self.tmp(f"pypto.rms_norm({xi}, None, {eps!r})"), self.compute
                self.env[op.name], self.dtype[op.name] = ident, kdt
                self.shape[op.name] = self._value_shape(op.name, op.out, is_input=False)
                continue
            handler = _OPS.get(op.op)
            if handler is None:
                raise PyptoEmitError(op.op)
            ident, kdt = handler(self, op)
            self.env[op.name], self.dtype[op.name] = ident, kdt
            self.shape[op.name] = self._value_shape(op.name, op.out, is_input=False)
        for p in params:
            if not p.is_output:
                continue
            ident = self.env[p.value]
            if self.dtype[p.value] != p.dtype:
                ident = f"pypto.cast({ident}, {self.dt(p.dtype)})"
            elif ident in input_idents:  # an output that is a view of an input: copy it
                ident = f"pypto.clone({ident})"
            if dyn:  # this row tile of the output
                self.lines.append(f"pypto.assemble({ident}, [r0, 0], {p.ident})")
            else:
                self.lines.append(f"{p.ident}[:] = {ident}")

        vec = layout.vec_tile(tile.tile_shape)
        cube = None
        head = [f"pypto.set_vec_tile_shapes({', '.join(map(str, vec))})"]
        if dyn:
            # pypto fails on whole-tensor ops over a dynamic dim ("shape size must be <=
            # INT32_MAX"): the body runs once per row tile, on views of the inputs.
            tr = vec[0]
            head += [f"for i in pypto.loop((R + {tr - 1}) // {tr}):",
                     f"    r0 = i * {tr}",
                     f"    rn = pypto.min(r0 + {tr}, R) - r0"]
            self.lines = ["    " + line for line in self.lines]
        if layout.matmul is not None:
            a_shape = self.hint(graph.specs[layout.matmul.args[0]])
            m, k = a_shape[-2], a_shape[-1]
            n = layout.domain[-1]
            itemsize = graph.specs[layout.matmul.args[0]].itemsize
            cube = _cube_tile(tuple(tile.tile_shape), m, n, k, itemsize)
            head.append("pypto.set_cube_tile_shapes("
                        + ", ".join(f"[{a}, {b}]" for a, b in cube) + ")")
        def annotation(p: KernelParam) -> str:
            dims = ", ".join(str(d) for d in (p.dims or p.shape))
            return f"({dims},)" if len(p.dims or p.shape) == 1 else f"({dims})"
        sig = ",\n".join(f"    {p.ident}: pypto.Tensor({annotation(p)}, {self.dt(p.dtype)})"
                         for p in params)
        body = "\n".join("    " + line for line in head + self.lines)
        ops_doc = " -> ".join(op.op for op in tile.ops)
        sizes = (f"dynamic rows R = {layout.rows_expr}, in row tiles of {vec[0]}" if dyn
                 else "static shapes at the example sizes")
        dyn_decl = 'R = pypto.frontend.dynamic("R")\n' if dyn else ""
        source = (
            f'"""pypto kernel for FusionTile {tile.name} (generated by pypto_inductor).\n\n'
            f"ops: {ops_doc}\n"
            f"compute dtype: {str(self.compute).replace('torch.', '')}; {sizes}\n\"\"\"\n"
            "import pypto\n\n"
            f"RUN_MODE = pypto.RunMode.{run_mode}\n{dyn_decl}\n\n"
            "@pypto.frontend.jit(runtime_options={\"run_mode\": RUN_MODE})\n"
            f"def {kernel_name}(\n{sig},\n):\n{body}\n"
        )
        return PyptoKernel(kernel_name, tile.name, source, params, vec, cube,
                           {"R": str(layout.rows_expr)} if dyn else {})

    def hint(self, spec: TensorSpec) -> tuple[int, ...]:
        """A value's own shape at the example sizes."""
        return tuple(self.graph.hint(s) for s in spec.shape)

    def _is_matmul_operand(self, value: str) -> bool:
        mm = self.layout.matmul
        return mm is not None and value in mm.args[:2]

    def _value_shape(self, value: str, spec: TensorSpec, is_input: bool) -> tuple[int, ...]:
        if self._is_matmul_operand(value) and is_input:
            return self.hint(spec)
        return self.layout.classify(spec.shape, value)


def _match_rms_norm(tile: FusionTile, em: "_Emitter") -> tuple[dict[str, tuple[str, float]], set]:
    """x * rsqrt(mean(x^2, -1) + eps) inside the tile -> pypto.rms_norm(x, None, eps).

    Matches only when the intermediates are used by nothing else and are not
    tile outputs (a training graph saves the rsqrt for backward: no match).
    Returns ({final mul: (x, eps)}, names of the ops it replaces).
    """
    if em.layout.matmul is not None or em.layout.reduce_dim != 1:
        return {}, set()
    by_name = {op.name: op for op in tile.ops}
    users: dict[str, list[TileOp]] = {}
    for op in tile.ops:
        for a in op.inputs:
            users.setdefault(a, []).append(op)
    outputs = set(tile.outputs)

    def private(name: str, user: TileOp) -> bool:
        return name in by_name and name not in outputs and users.get(name) == [user]

    found: dict[str, tuple[str, float]] = {}
    skipped: set[str] = set()
    for mul in tile.ops:
        if mul.op != "mul" or len(mul.inputs) != 2:
            continue
        for x, r in (mul.args, mul.args[::-1]):
            rs = by_name.get(r)
            if rs is None or rs.op != "rsqrt" or not private(r, mul):
                continue
            add = by_name.get(rs.args[0])
            if add is None or add.op != "add" or not private(add.name, rs):
                continue
            mean_name, eps = add.args
            if isinstance(eps, str):
                mean_name, eps = eps, mean_name
            mean = by_name.get(mean_name) if isinstance(mean_name, str) else None
            if mean is None or mean.op != "mean" or isinstance(eps, str) \
                    or not private(mean.name, add) or not mean.attrs.get("keepdim"):
                continue
            sq = by_name.get(mean.args[0])
            if sq is None or not private(sq.name, mean):
                continue
            square = (sq.op == "pow" and sq.args[0] == x and not isinstance(sq.args[1], str)
                      and float(sq.args[1]) == 2.0) or (sq.op == "mul" and sq.args == (x, x))
            if square:
                found[mul.name] = (x, float(eps))
                skipped |= {sq.name, mean.name, add.name, rs.name}
                break
    return found, skipped


# The op table: op name -> handler, filled by @_register in .pypto_ops.
# Each handler: (emitter, op) -> (identifier of the result, its dtype in the kernel).
Handler = Callable[[_Emitter, TileOp], tuple[str, torch.dtype]]
_OPS: dict[str, Handler] = {}


def _register(*names: str):
    def deco(fn: Handler) -> Handler:
        for n in names:
            _OPS[n] = fn
        return fn
    return deco


def supported_ops() -> list[str]:
    """Canonical tile ops the emitter has a pypto form for."""
    return sorted(_OPS)


# Shared by the op handlers and the rms_norm fusion in _Emitter.emit.
def _tensor_operands(em: _Emitter, op: TileOp) -> list[str]:
    """Operands as kernel expressions; floating tensors brought to the compute dtype.

    pypto broadcasts one axis at a time: a (1, 1) operand of an op whose result is
    2-D in both axes is first expanded to (1, C).
    """
    out = []
    result = None
    if em.layout.matmul is None and sum(isinstance(a, str) for a in op.args) > 1:
        try:
            result = em.layout.classify(op.out.shape, op.name)
        except PyptoEmitError:
            result = None
    for a in op.args:
        if isinstance(a, str) and em.dtype[a] != em.compute and em.dtype[a].is_floating_point \
                and op.out.dtype.is_floating_point:
            ident = em.tmp(f"pypto.cast({em.env[a]}, {em.dt(em.compute)})", "x")
        else:
            ident = em.arg(a, op)
        if isinstance(a, str) and result is not None and em.shape.get(a) == (1, 1) \
                and result[0] > 1 and result[1] > 1:
            ident = em.tmp(f"pypto.expand_clone({ident}, [1, {result[1]}])", "x")
        out.append(ident)
    return out


# --- entry points ----------------------------------------------------------------------------
def kernel_name(tile_name: str) -> str:
    return "pto_" + _ident(tile_name)


def emit_tile(tile: FusionTile, graph: TileGraph, run_mode: str = "SIM") -> PyptoKernel:
    """The pypto kernel module of one FusionTile; raises PyptoEmitError naming the op."""
    if run_mode not in ("SIM", "NPU"):
        raise ValueError(f"run_mode must be 'SIM' or 'NPU', got {run_mode!r}")
    if not tile.ops:
        raise PyptoEmitError(tile.name, "an empty FusionTile")
    return _Emitter(tile, graph).emit(kernel_name(tile.name), run_mode)


def single_op_tile(op: TileOp, graph: TileGraph, tile_shape: tuple[int, ...],
                   hw=None, buffering: int = 2) -> FusionTile:
    """A one-op FusionTile for ``op`` (its own kernel in the unfused variant).

    The tile shape is the planner's choice for the op alone when the hardware
    model is given, else ``tile_shape`` (the fused tile's).
    """
    inputs = list(dict.fromkeys(op.inputs))
    shape, footprint, capacity = tuple(tile_shape), 0, 0
    if hw is not None:
        try:
            from ..fusion.capacity import plan_tile

            tp = plan_tile([op], graph, hw, buffering)
            shape, footprint, capacity = tuple(tp.tile_shape), tp.footprint_bytes, tp.capacity_bytes
        except Exception:  # noqa: BLE001 - the fused tile's shape is a fine fallback
            pass
    from ..fusion.planner import compute_dtype

    return FusionTile(name=f"{op.name}_{op.op}", ops=[op], inputs=inputs, outputs=[op.name],
                      dtype=compute_dtype([op], graph), tile_shape=shape,
                      footprint_expr=sympy.Integer(footprint), footprint_bytes=footprint,
                      capacity_bytes=capacity, kind=op.kind)


@dataclasses.dataclass
class TileSplit:
    """A FusionTile split at its ops with no pypto form.

    ``steps`` run in order: ("pypto", sub-FusionTile) kernels and ("extern", TileOp)
    ops run eagerly; ``split_ops`` are those TileOps, ``reasons`` (op name -> text) why.
    """

    tile: FusionTile
    steps: list[tuple[str, Any]]
    split_ops: list[TileOp]
    reasons: dict[str, str]

    @property
    def parts(self) -> list[FusionTile]:
        return [x for kind, x in self.steps if kind == "pypto"]


def unsupported_ops(tile: FusionTile, graph: TileGraph) -> dict[str, str]:
    """op name -> why, for every op of the tile that has no pypto form on its own."""
    out = {}
    for op in tile.ops:
        if op.op not in _OPS:
            out[op.name] = str(PyptoEmitError(op.op))
            continue
        try:
            emit_tile(single_op_tile(op, graph, tile.tile_shape), graph)
        except PyptoEmitError as e:
            out[op.name] = str(e)
    return out


def split_tile(tile: FusionTile, graph: TileGraph) -> TileSplit | None:
    """Split ``tile`` at its ops with no pypto form; None when every op has one.

    Each remaining op gets a level: the most split ops on any path to it inside
    the tile. Levels never decrease along a path, so the ops of one level form a
    sub-tile no split op sits inside (no cycle through an extern op); the steps
    run level by level: the level's pypto kernel, then the split ops it feeds.
    A split op's level is that of its inputs; the ops after it are one higher.
    """
    reasons = unsupported_ops(tile, graph)
    if not reasons:
        return None
    level: dict[str, int] = {}  # value produced in the tile -> level of its readers
    op_level: dict[str, int] = {}
    for op in tile.ops:
        lv = max((level[a] for a in op.inputs if a in level), default=0)
        op_level[op.name] = lv
        level[op.name] = lv + 1 if op.name in reasons else lv
    readers: dict[str, set[str]] = {}
    for op in tile.ops:
        for a in op.inputs:
            readers.setdefault(a, set()).add(op.name)
    steps: list[tuple[str, Any]] = []
    for lv in range(max(op_level.values()) + 1):
        ops = [op for op in tile.ops if op_level[op.name] == lv and op.name not in reasons]
        if ops:
            names = {op.name for op in ops}
            inputs = list(dict.fromkeys(a for op in ops for a in op.inputs if a not in names))
            outputs = [op.name for op in ops if op.name in tile.outputs
                       or readers.get(op.name, set()) - names]
            part = dataclasses.replace(
                tile, name=f"{tile.name}_part{lv}", ops=ops, inputs=inputs, outputs=outputs,
                kind=next((o.kind for o in ops if o.kind is OpKind.MATMUL),
                          next((o.kind for o in ops if o.kind is OpKind.REDUCTION), ops[0].kind)))
            steps.append(("pypto", part))
        steps += [("extern", op) for op in tile.ops
                  if op_level[op.name] == lv and op.name in reasons]
    split = [op for op in tile.ops if op.name in reasons]
    return TileSplit(tile, steps, split, reasons)


def emit_op(op: TileOp, graph: TileGraph, tile_shape: tuple[int, ...] = (64, 256), hw=None,
            buffering: int = 2, run_mode: str = "SIM") -> PyptoKernel:
    """The pypto kernel of one tile op on its own."""
    return emit_tile(single_op_tile(op, graph, tile_shape, hw, buffering), graph, run_mode)


# Imported last, for its @_register side effect: pypto_ops imports this module's names.
from . import pypto_ops  # noqa: E402,F401
