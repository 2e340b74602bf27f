"""The kernel-source writer: one FusionTile -> the text of its pypto kernel module.

:class:`KernelWriter` walks a tile once: it declares a parameter per tile input
and output (kernel shapes from :class:`.TileLayout`), casts floating inputs to
the compute dtype on load, emits each op through the op table of
:mod:`.ops` (``x * rsqrt(mean(x^2) + eps)`` becomes one ``pypto.rms_norm``),
casts each output back on store, and assembles the module: docstring,
``import pypto``, ``RUN_MODE``, the tiling calls of :mod:`.tiling` and the
``@pypto.frontend.jit`` function. A tile with dynamic rows runs its body in the
row loop of :mod:`.rows`; one with dynamic columns (or reduced length)
runs its ops as the column passes of :mod:`.columns`.

Compute dtype: fp32, or fp16 when the tile computes in fp16 (dtype_policy
"strict"); bf16 inputs are always upcast (pypto's vector unit has no bf16
arithmetic); float64 is an error (pypto has no fp64 arithmetic). Matmul
operands stay in their own dtype (the cube reads fp16/bf16).
"""
from __future__ import annotations

import dataclasses
from typing import Any

import sympy
import torch

from ...hardware import HardwareModel, ascend_a2
from ...ir import FusionTile, TensorSpec, TileGraph, TileOp
from .columns import DIM as COLUMN_DIM
from .columns import ColumnPasses
from .columns import dims as column_dims
from .kernel import (PYPTO_DTYPES, KernelParam, PyptoEmitError, PyptoKernel, ident,
                           kernel_name, literal)
from .layout import TileLayout
from .ops import OPS, row_gather_params, tensor_operands
from .rows import DIM as ROW_DIM
from .rows import RowLoop, view
from .tiling import cube_tile, vec_operands, vec_tile


_MIN_VEC_COLS = 16  # 64 bytes of fp32: whole 32-byte blocks for every dtype up to 8 bytes


class KernelWriter:
    """Writes one FusionTile's kernel; the op handlers call its helpers."""

    def __init__(self, tile: FusionTile, graph: TileGraph, hw: HardwareModel, shrink: int = 0):
        self.tile, self.graph, self.hw = tile, graph, hw
        self.layout = TileLayout(tile, graph)
        self.lines: list[str] = []
        self.env: dict[str, str] = {}  # value -> identifier in the kernel
        self.dtype: dict[str, torch.dtype] = {}  # value -> dtype in the kernel
        self.shape: dict[str, tuple[int, ...]] = {}  # value -> kernel shape
        self._n = 0
        self.row_means: dict[tuple[str, int], str] = {}  # (operand, dim) -> its row mean
        self._used: set[str] = set()  # parameter names
        self._input_idents: set[str] = set()  # kernel names of the loaded inputs
        self._expand: dict[str, tuple[int, ...]] = {}  # inputs the launcher expands first
        self._row_gather = row_gather_params(tile, graph, self.layout)
        floats = {graph.specs[n].dtype for op in tile.ops for n in op.inputs + [op.name]
                  if graph.specs[n].dtype.is_floating_point}
        if torch.float64 in floats:
            raise PyptoEmitError(tile.ops[0].op, "float64 (pypto has no fp64 arithmetic)")
        strict_half = tile.dtype == "float16"
        self.compute = torch.float16 if strict_half else torch.float32
        self.vec = vec_tile(self.layout, tuple(tile.tile_shape), hw, vec_operands(tile), shrink)
        if self.vec and self.vec[-1] < _MIN_VEC_COLS:
            # pypto needs a UB tile row of whole 32-byte blocks ("tile shape not set" for a
            # (2, 2) fp32 tile: a classifier's logits); a tile past the tensor's end is fine
            self.vec = tuple(self.vec[:-1]) + (_MIN_VEC_COLS,)
        if self.vec and any(op.op == "pad" for op in tile.ops):
            # pad's assembles are framework ops: pypto checks their tile row is whole 32-byte
            # blocks ("FwkOp tile shape's last dim is not aligned", a [2, 17] int64 pad)
            item = max(graph.specs[n].dtype.itemsize for op in tile.ops
                       for n in op.inputs + [op.name])
            step = max(32 // item, 1)
            self.vec = tuple(self.vec[:-1]) + (-(-self.vec[-1] // step) * step,)
        self.loop = None  # dynamic rows: the loop over row tiles
        self.columns = None  # dynamic columns: passes over column chunks
        if self.layout.dynamic:
            self.loop = RowLoop(self.layout.rows_expr, self.vec[0])
            self.layout.body_rows = self.vec[0]  # the loop's row tile
        if self.layout.cols_dynamic:
            self.columns = ColumnPasses(self, self.vec[1])
            self.layout.body_cols = self.vec[1]  # the loops' column chunk
        self.dynamic = bool(self.loop or self.columns)

    # helpers for the op handlers ---------------------------------------------------------
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
            return literal(a)
        raise PyptoEmitError(op.op, f"operand {a!r}")

    def is_tensor(self, a: Any) -> bool:
        return isinstance(a, str)

    def dt(self, torch_dtype: torch.dtype) -> str:
        if torch_dtype not in PYPTO_DTYPES:
            raise PyptoEmitError(str(torch_dtype), "dtype has no pypto equivalent")
        return f"pypto.{PYPTO_DTYPES[torch_dtype]}"

    def kernel_dtype(self, spec: TensorSpec) -> torch.dtype:
        return self.compute if spec.dtype.is_floating_point else spec.dtype

    def hint(self, spec: TensorSpec) -> tuple[int, ...]:
        """A value's own shape at the example sizes."""
        return tuple(self.graph.hint(s) for s in spec.shape)

    # the kernel ----------------------------------------------------------------------------
    def write(self, name: str, run_mode: str) -> PyptoKernel:
        params = self._inputs()
        outputs = self._outputs()
        params += outputs
        if self.columns:
            self.columns.emit(outputs)
        else:
            self._ops()
        self._stores(outputs)
        head = [f"pypto.set_vec_tile_shapes({', '.join(map(str, self.vec))})"]
        cube = self._cube_tile()
        if cube is not None:
            head.append("pypto.set_cube_tile_shapes("
                        + ", ".join(f"[{a}, {b}]" for a, b in cube) + ")")
        body = head + (self.loop.wrap(self.lines) if self.loop else self.lines)
        source = self._module(name, run_mode, params, body)
        dynamic_dims = dict(self.loop.dynamic_dims()) if self.loop else {}
        if self.columns:
            dynamic_dims[COLUMN_DIM] = str(self.layout.cols_expr)
        return PyptoKernel(name, self.tile.name, source, params, self.vec, cube, dynamic_dims)

    def _param(self, prefix: str, value: str, shape: tuple[int, ...], spans: bool,
               is_output: bool) -> KernelParam:
        base = f"{prefix}_{ident(value)}"
        name, i = base, 1
        while name in self._used:
            i += 1
            name = f"{base}_{i}"
        self._used.add(name)
        spec = self.graph.specs[value]
        extra = {}
        if self.dynamic:
            dims = RowLoop.dims(shape, spans)
            if self.columns:
                dims = column_dims(dims, self.layout.spans_cols(shape))
            extra = dict(dims=dims, graph_dims=tuple(str(sympy.sympify(x)) for x in spec.shape))
            if all(isinstance(d, str) for d in dims[:2]):  # (R, C): where the rows end
                extra["row_dims"] = len(spec.shape) - (len(self.layout.sym_domain)
                                                       - self.layout.split)
        if value in self._expand and not is_output:
            extra["expand"] = self._expand[value]
        return KernelParam(name, value, shape, spec.dtype, is_output, self.hint(spec), **extra)

    def _place(self, value: str, is_input: bool) -> tuple[tuple[int, ...], bool]:
        """A value's kernel shape and whether it spans the dynamic rows."""
        if is_input and self.layout.is_matmul_operand(value):
            return self.layout.operand_place(value)
        shape = self.graph.specs[value].shape
        if is_input and value in self._row_gather:  # an embedding's table or its indices
            kshape, expand = self._row_gather[value]
            if expand:
                self._expand[value] = expand
            return kshape, False
        try:
            return self.layout.place(shape, value)
        except PyptoEmitError:
            if not (is_input and self.layout.expands_to_domain(shape)):
                raise
            # the launcher expands it to the domain (a mask [B, S] of [B, 1, S, S] scores)
            self._expand[value] = tuple(self.layout.domain)
            return (self.layout.rows, self.layout.cols), False

    def _inputs(self) -> list[KernelParam]:
        params = []
        for value in self.tile.inputs:
            shape, spans = self._place(value, is_input=True)
            p = self._param("in", value, shape, spans, False)
            params.append(p)
            self.shape[value] = shape
            if self.columns and self.layout.spans_cols(shape):
                self.columns.defer_input(value, p)  # loaded per column chunk
            else:
                self.env[value] = self.load_input(value, p)
        return params

    def load_input(self, value: str, p: KernelParam, col: tuple[str, str] | None = None) -> str:
        """An input in the kernel body: its row tile / column chunk, in the compute dtype."""
        spec = self.graph.specs[value]
        name = p.ident
        spans_rows = bool(p.dims) and p.dims[0] == ROW_DIM
        if spans_rows or col:
            body = self.layout.body_shape(p.shape, spans_rows)
            name = self.tmp(view(name, body, ("r0", "rn") if spans_rows else None, col), "v")
        self._input_idents.add(name)
        kdt = self.kernel_dtype(spec)
        if kdt != spec.dtype and not self.layout.is_matmul_operand(value):
            name = self.tmp(f"pypto.cast({name}, {self.dt(kdt)})", "x")
        else:
            kdt = spec.dtype
        self.dtype[value] = kdt
        return name

    def _outputs(self) -> list[KernelParam]:
        params = []
        for value in self.tile.outputs:
            shape, spans = self._place(value, is_input=False)
            if self.loop and not spans:
                own = list(self.graph.specs[value].shape)
                raise PyptoEmitError(value, f"an output of shape {own} that does not span the "
                                     "dynamic rows is not supported yet")
            params.append(self._param("out", value, shape, spans, True))
        return params

    def _ops(self) -> None:
        fused_norms, skipped = match_rms_norm(self.tile, self)
        for op in self.tile.ops:
            if op.name in skipped:
                continue
            if op.name in fused_norms:
                x, eps = fused_norms[op.name]
                (xi,) = tensor_operands(self, dataclasses.replace(op, args=(x,)))
                name, kdt = self.tmp(f"pypto.rms_norm({xi}, None, {eps!r})"), self.compute
                shape = []
            else:
                handler = OPS.get(op.op)
                if handler is None:
                    raise PyptoEmitError(op.op)
                name, kdt, *shape = handler(self, op)  # a handler may give the kernel shape
            self.env[op.name], self.dtype[op.name] = name, kdt
            self.shape[op.name] = shape[0] if shape else self.layout.classify(op.out.shape,
                                                                               op.name)

    def store_expr(self, p: KernelParam, expr: str) -> str:
        """An output's value brought to its dtype (a copy if it is an input's view)."""
        if self.dtype[p.value] != p.dtype:
            return f"pypto.cast({expr}, {self.dt(p.dtype)})"
        if expr in self._input_idents:  # an output that is a view of an input: copy it
            return f"pypto.clone({expr})"
        return expr

    def loop_store(self, expr: str, out: str, col: str | None = None) -> str:
        """Store into an output: this row tile and/or column chunk of it, or all of it."""
        if self.loop:
            return self.loop.store(expr, out, col or "0")
        if col:
            return f"pypto.assemble({expr}, [0, {col}], {out})"
        return f"{out}[:] = {expr}"

    def _stores(self, outputs: list[KernelParam]) -> None:
        for p in outputs:
            if self.columns and (self.layout.spans_cols(p.shape)
                                 or p.ident in self.columns.stored):
                continue  # stored chunk by chunk in the last column pass, or already
            self.lines.append(self.loop_store(self.store_expr(p, self.env[p.value]), p.ident))

    def _cube_tile(self) -> tuple[tuple[int, int], ...] | None:
        mm = self.layout.matmul
        if mm is None:
            return None
        a = self.graph.specs[mm.args[0]]
        a_shape = self.hint(a)
        # A dynamic kernel's matmul runs on one row tile of A at a time.
        m = self.vec[0] if self.loop else a_shape[-2]
        k = a_shape[-1]
        n = self.layout.domain[-1]
        return cube_tile(tuple(self.tile.tile_shape), m, n, k, a.itemsize, self.hw)

    def _module(self, name: str, run_mode: str, params: list[KernelParam],
                body: list[str]) -> str:
        def annotation(p: KernelParam) -> str:
            dims = p.dims or p.shape
            text = ", ".join(str(d) for d in dims)
            return f"({text},)" if len(dims) == 1 else f"({text})"
        sig = ",\n".join(f"    {p.ident}: pypto.Tensor({annotation(p)}, {self.dt(p.dtype)})"
                         for p in params)
        ops_doc = " -> ".join(op.op for op in self.tile.ops)
        sizes = "; ".join(x.describe() for x in (self.loop, self.columns) if x) \
            or "static shapes at the example sizes"
        decl = "".join(x.declaration() for x in (self.loop, self.columns) if x)
        body_text = "\n".join("    " + line for line in body)
        return (
            f'"""pypto kernel for FusionTile {self.tile.name} (generated by pypto_inductor).\n\n'
            f"ops: {ops_doc}\n"
            f"compute dtype: {str(self.compute).replace('torch.', '')}; {sizes}\n\"\"\"\n"
            "import pypto\n\n"
            f"RUN_MODE = pypto.RunMode.{run_mode}\n{decl}\n\n"
            "@pypto.frontend.jit(runtime_options={\"run_mode\": RUN_MODE})\n"
            f"def {name}(\n{sig},\n):\n{body_text}\n"
        )


def match_rms_norm(tile: FusionTile, em: KernelWriter) -> tuple[dict[str, tuple[str, float]], set]:
    """x * rsqrt(mean(x^2, -1) + eps) inside the tile -> pypto.rms_norm(x, None, eps).

    Matches only when the intermediates are used by nothing else and are not
    tile outputs (a training graph saves the rsqrt for backward: no match).
    Returns ({final mul: (x, eps)}, names of the ops it replaces).
    """
    if em.layout.matmul is not None or em.layout.reduce_dim != 1 or em.layout.cols_dynamic:
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


def emit_tile(tile: FusionTile, graph: TileGraph, run_mode: str = "SIM",
              hw: HardwareModel | None = None, shrink: int = 0) -> PyptoKernel:
    """The pypto kernel module of one FusionTile; raises PyptoEmitError naming the op.

    ``hw``: the device's hardware model for the tiling (default: Ascend A2, the device
    pypto 0.2.0 compiles for); ``shrink``: halve the vector tile that many more times
    (a retry after pypto rejected it)."""
    if run_mode not in ("SIM", "NPU"):
        raise ValueError(f"run_mode must be 'SIM' or 'NPU', got {run_mode!r}")
    if not tile.ops:
        raise PyptoEmitError(tile.name, "an empty FusionTile")
    return KernelWriter(tile, graph, hw or ascend_a2(), shrink).write(kernel_name(tile.name),
                                                                      run_mode)
