"""The op table of the pypto emitter: one pypto form per canonical tile op.

Each handler takes the kernel writer (:class:`Writer`: what
:class:`.writer.KernelWriter` offers the handlers) and a :class:`TileOp`, appends the pypto statements computing the op to the kernel
body, and returns (identifier of the result, its dtype in the kernel).
Handlers register into :data:`OPS` with ``@register``: unary and binary
arithmetic, comparisons, where, clamp, activations (built from pypto primitives
where pypto has no costed form), cast, full, views, reductions, softmax and
matmul. :func:`tensor_operands` brings a handler's operands to the compute
dtype and to shapes pypto broadcasts.
"""
from __future__ import annotations

import math
from typing import Any, Callable, Protocol

import sympy
import torch

from ...ir import FusionTile, TensorSpec, TileGraph, TileOp
from ...sizes import numel
from .kernel import KernelParam, PyptoEmitError, literal
from .layout import TileLayout


class Writer(Protocol):
    """What the op handlers and the column passes use of the kernel writer
    (:class:`.writer.KernelWriter`)."""

    tile: FusionTile
    graph: TileGraph
    layout: TileLayout
    compute: torch.dtype  # the tile's compute dtype for floats
    env: dict[str, str]  # value -> identifier in the kernel
    dtype: dict[str, torch.dtype]  # value -> dtype in the kernel
    shape: dict[str, tuple[int, ...]]  # value -> kernel shape
    lines: list[str]  # the kernel body so far
    row_means: dict  # (operand, dim) -> its row mean (ops._mean_of)

    def tmp(self, expr: str, hint: str = "t") -> str:
        """Append ``<new name> = expr``; returns the name."""

    def arg(self, a: Any, op: TileOp) -> str:
        """An operand as a kernel expression."""

    def is_tensor(self, a: Any) -> bool: ...

    def dt(self, torch_dtype: torch.dtype) -> str:
        """The pypto dtype expression of a torch dtype."""

    def kernel_dtype(self, spec: TensorSpec) -> torch.dtype: ...

    def hint(self, spec: TensorSpec) -> tuple[int, ...]: ...

    def load_input(self, value: str, p: KernelParam, col: tuple[str, str] | None = None) -> str:
        ...

    def store_expr(self, p: KernelParam, expr: str) -> str: ...

    def loop_store(self, expr: str, out: str, col: str | None = None) -> str: ...


# op name -> handler: (writer, op) -> (identifier of the result, its dtype in the kernel).
Handler = Callable[[Writer, TileOp], tuple[str, torch.dtype]]
OPS: dict[str, Handler] = {}


def register(*names: str):
    def deco(fn: Handler) -> Handler:
        for n in names:
            OPS[n] = fn
        return fn
    return deco


def supported_ops() -> list[str]:
    """Canonical tile ops the emitter has a pypto form for."""
    return sorted(OPS)


def tensor_operands(em: Writer, op: TileOp) -> list[str]:
    """Operands as kernel expressions; floating tensors brought to the compute dtype.

    pypto broadcasts one axis at a time: a (1, 1) operand of an op whose result is
    2-D in both axes is first expanded to (1, C).
    """
    out = []
    result = None
    if not em.layout.nd and sum(isinstance(a, str) for a in op.args) > 1:
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
            ident = em.tmp(f"pypto.expand_clone({ident}, [1, {em.layout.body_cols}])", "x")
        out.append(ident)
    return out


def _float_out(em: Writer, op: TileOp) -> torch.dtype:
    return em.kernel_dtype(op.out)


_UNARY_DIRECT = {
    "abs": "abs", "neg": "neg", "exp": "exp", "expm1": "expm1", "log": "log",
    "log1p": "log1p", "log2": "log2", "log10": "log10", "sqrt": "sqrt", "rsqrt": "rsqrt",
    "sin": "sin", "cos": "cos", "sigmoid": "sigmoid", "relu": "relu", "reciprocal": "reciprocal",
    "floor": "floor", "ceil": "ceil", "round": "round", "trunc": "trunc", "sign": "sign",
}


def _unary(em: Writer, op: TileOp):
    (x,) = tensor_operands(em, op)
    return em.tmp(f"pypto.{_UNARY_DIRECT[op.op]}({x})"), _float_out(em, op)


register(*_UNARY_DIRECT)(_unary)


@register("copy")
def _copy(em: Writer, op: TileOp):
    (x,) = tensor_operands(em, op)
    return em.tmp(f"pypto.clone({x})"), em.dtype.get(op.args[0], _float_out(em, op))


def _commutative(fn: str):
    def emit(em: Writer, op: TileOp):
        a, b = tensor_operands(em, op)
        if not em.is_tensor(op.args[0]):
            a, b = b, a
        return em.tmp(f"pypto.{fn}({a}, {b})"), _float_out(em, op)
    return emit


register("mul")(_commutative("mul"))


@register("add")
def _add(em: Writer, op: TileOp):
    if op.attrs.get("alpha") is None:
        return _commutative("add")(em, op)
    a, b = tensor_operands(em, op)  # a + alpha * b: b is a tensor (lowering's alpha form)
    scaled = em.tmp(f"pypto.mul({b}, {float(op.attrs['alpha'])!r})")
    if not em.is_tensor(op.args[0]):
        return em.tmp(f"pypto.add({scaled}, {a})"), _float_out(em, op)
    return em.tmp(f"pypto.add({a}, {scaled})"), _float_out(em, op)


register("maximum", "fmax")(_commutative("maximum"))
register("minimum", "fmin")(_commutative("minimum"))


@register("sub")
def _sub(em: Writer, op: TileOp):
    a, b = tensor_operands(em, op)
    if op.attrs.get("alpha") is not None:  # a - alpha * b: b is a tensor
        b = em.tmp(f"pypto.mul({b}, {float(op.attrs['alpha'])!r})")
    if not em.is_tensor(op.args[0]):  # c - x = (-x) + c
        return em.tmp(f"pypto.add(pypto.neg({b}), {a})"), _float_out(em, op)
    return em.tmp(f"pypto.sub({a}, {b})"), _float_out(em, op)


@register("div")
def _div(em: Writer, op: TileOp):
    a, b = tensor_operands(em, op)
    if not em.is_tensor(op.args[0]):  # c / x = reciprocal(x) * c
        r = em.tmp(f"pypto.mul(pypto.reciprocal({b}), {a})")
    else:
        r = em.tmp(f"pypto.div({a}, {b})")
    mode = op.attrs.get("rounding_mode")
    if mode == "trunc":
        r = em.tmp(f"pypto.trunc({r})")
    elif mode == "floor":
        r = em.tmp(f"pypto.floor({r})")
    elif mode:
        raise PyptoEmitError("div", f"rounding_mode={mode!r}")
    return r, _float_out(em, op)


@register("pow")
def _pow(em: Writer, op: TileOp):
    a, b = tensor_operands(em, op)
    if not em.is_tensor(op.args[0]):
        raise PyptoEmitError("pow", "a scalar base")
    exponent = op.args[1]
    if not em.is_tensor(exponent) and float(exponent) == 2.0:
        return em.tmp(f"pypto.mul({a}, {a})"), _float_out(em, op)
    if not em.is_tensor(exponent) and float(exponent) == 0.5:
        return em.tmp(f"pypto.sqrt({a})"), _float_out(em, op)
    return em.tmp(f"pypto.pow({a}, {b})"), _float_out(em, op)


def _compare(fn: str, swapped: str):
    def emit(em: Writer, op: TileOp):
        if any(isinstance(x, float) and math.isinf(x) for x in op.args):
            # x == -inf (the safe softmax's all-masked rows): pypto's interpreter got half of a
            # T5 tile's such compares wrong, so the op runs eagerly
            raise PyptoEmitError(op.op, "a comparison with an infinite scalar")
        a, b = tensor_operands(em, op)
        if not em.is_tensor(op.args[0]):
            a, b, name = b, a, swapped
        else:
            name = fn
        return em.tmp(f"pypto.{name}({a}, {b})"), torch.bool
    return emit


for _fn, _sw in (("eq", "eq"), ("ne", "ne"), ("lt", "gt"), ("le", "ge"), ("gt", "lt"), ("ge", "le")):
    register(_fn)(_compare(_fn, _sw))


@register("logical_not")
def _logical_not(em: Writer, op: TileOp):
    (x,) = tensor_operands(em, op)
    return em.tmp(f"pypto.logical_not({x})"), torch.bool


@register("logical_and")
def _logical_and(em: Writer, op: TileOp):
    a, b = tensor_operands(em, op)
    if not (em.is_tensor(op.args[0]) and em.is_tensor(op.args[1])):
        raise PyptoEmitError("logical_and", "a scalar operand")
    return em.tmp(f"pypto.logical_and({a}, {b})"), torch.bool


@register("bitwise_and", "bitwise_or")
def _bitwise_bool(em: Writer, op: TileOp):
    """On bools (masks combined): logical and/or; ``True & m`` is ``m``, ``False | m`` is m."""
    if op.out.dtype != torch.bool:
        raise PyptoEmitError(op.op, f"on {op.out.dtype} (only bool masks)")
    keep = op.op == "bitwise_and"  # the scalar that leaves the other operand as it is
    tensors = [a for a in op.args if em.is_tensor(a)]
    scalars = [a for a in op.args if not em.is_tensor(a)]
    if scalars:
        if len(tensors) != 1 or bool(scalars[0]) != keep or \
                em.shape[tensors[0]] != em.layout.classify(op.out.shape, op.name):
            raise PyptoEmitError(op.op, "a scalar operand that is not the identity")
        return em.env[tensors[0]], torch.bool
    a, b = (em.env[x] for x in tensors)
    if keep:
        return em.tmp(f"pypto.logical_and({a}, {b})"), torch.bool
    na, nb = em.tmp(f"pypto.logical_not({a})"), em.tmp(f"pypto.logical_not({b})")
    return em.tmp(f"pypto.logical_not(pypto.logical_and({na}, {nb}))"), torch.bool


def row_gather(op: TileOp, graph: TileGraph, layout: TileLayout) -> bool:
    """An embedding lookup: ``out[..., h] = table[index[...], h]`` of a 2-D table whose rows
    the index picks, the output the tile's (static, 2-D) domain or broadcast to it."""
    a = op.attrs
    if op.op != "gather" or len(op.args) != 2 or layout.nd or layout.dynamic \
            or layout.cols_dynamic or layout.matmul is not None or layout.reduce_dim == 0:
        return False
    table, index = op.args
    n = len(op.out.shape)
    if not (isinstance(table, str) and isinstance(index, str)) or n < 2:
        return False
    ishape = tuple(graph.specs[index].shape)
    return (tuple(a["source_dims"]) == (-1, n - 1) and tuple(a["index_dims"]) == (
        tuple(range(n - 1)),) and len(graph.specs[table].shape) == 2
        and ishape == tuple(op.out.shape[:-1]) and layout.split == n - 1
        and len(layout.domain) == n and layout.expands_to_domain(op.out.shape))


def dim_gather(op: TileOp, graph: TileGraph, layout: TileLayout) -> bool:
    """``torch.gather(x, 1, index)`` of a 2-D ``x`` with a [N, k] index (the loss picking
    each row's target): ``out[i, j] = x[i, index[i, j]]``, the output the tile's domain
    (or a flat view of it); static layouts only."""
    if op.op != "gather" or len(op.args) != 2 or layout.nd or layout.dynamic \
            or layout.cols_dynamic or layout.matmul is not None:
        return False
    src, index = op.args
    if not (isinstance(src, str) and isinstance(index, str)):
        return False
    s, i = graph.specs[src].shape, graph.specs[index].shape
    return (len(s) == 2 and len(i) == 2 and tuple(op.out.shape) == tuple(i)
            and tuple(op.attrs["source_dims"]) == (0, -1)
            and tuple(map(tuple, op.attrs["index_dims"])) == ((0, 1),)
            and graph.hint(i[0]) == graph.hint(s[0]))


def row_gather_params(tile: FusionTile, graph: TileGraph, layout: TileLayout) -> dict:
    """value -> (kernel shape, launcher expand shape or ()) of the tables and indices of the
    tile's embedding lookups (:func:`row_gather`) that are tile inputs."""
    out: dict = {}
    try:
        gathers = [op for op in tile.ops if row_gather(op, graph, layout)]
    except Exception:  # noqa: BLE001 - a layout with no 2-D domain: no row gathers
        return out
    inputs = set(tile.inputs)
    for op in tile.ops:  # torch.gather along dim 1: source and index keep their own shapes
        try:
            if dim_gather(op, graph, layout) and set(op.args) <= inputs:
                for a in op.args:
                    out[a] = (tuple(graph.hint(x) for x in graph.specs[a].shape), ())
        except Exception:  # noqa: BLE001 - no 2-D domain
            pass
    for op in gathers:
        table, index = op.args
        if table not in inputs or index not in inputs:
            continue
        out[table] = (tuple(graph.hint(x) for x in graph.specs[table].shape), ())
        # indices of a broadcast lookup (positions [1, S] of a [B, S] batch) are expanded
        # by the launcher, so the lookup yields the domain's rows
        ishape = tuple(graph.hint(x) for x in graph.specs[index].shape)
        rows = tuple(layout.domain[:-1])
        out[index] = ((layout.rows,), rows if ishape != rows else ())
    return out


@register("gather")
def _gather(em: Writer, op: TileOp):
    """Embedding lookups (:func:`row_gather`): ``pypto.index_select`` of the table's rows,
    giving the domain's (rows, cols); ``torch.gather`` along dim 1 (:func:`dim_gather`):
    ``pypto.gather``."""
    if dim_gather(op, em.graph, em.layout):
        src, index = op.args
        out = em.layout.classify(op.out.shape, op.name)
        if em.shape.get(src) != em.hint(em.graph.specs[src]) or \
                em.shape.get(index) != em.hint(em.graph.specs[index]) or \
                int(numel(out)) != int(numel(em.shape[index])):
            raise PyptoEmitError("gather", "a gather whose operands are not tile inputs")
        idx = em.tmp(f"pypto.cast({em.env[index]}, pypto.DT_INT32)")
        x = em.tmp(f"pypto.gather({em.env[src]}, 1, {idx})")
        if tuple(out) != tuple(em.shape[index]):
            x = em.tmp(f"pypto.reshape({x}, {list(out)!r})")
        return x, em.dtype[src], tuple(out)
    if not row_gather(op, em.graph, em.layout) or em.shape.get(op.args[1]) != (em.layout.rows,):
        raise PyptoEmitError("gather", "other than an embedding lookup of tile inputs")
    table, index = (em.env[a] for a in op.args)
    idx = em.tmp(f"pypto.cast({index}, pypto.DT_INT32)")  # row numbers < 2^31
    kdt = em.dtype[op.args[0]]
    return em.tmp(f"pypto.index_select({table}, 0, {idx})"), kdt, \
        (em.layout.rows, em.layout.cols)


@register("cat")
def _cat(em: Writer, op: TileOp):
    """Along the last dim of the tile's (static, pointwise) domain: parts of its columns
    ((rows, c) each, :meth:`.TileLayout.place`) joined with ``pypto.concat``."""
    n = len(op.out.shape)
    dim = op.attrs["dim"] % n if n else 0
    parts = [a for a in op.args if em.is_tensor(a)]
    if dim != n - 1 or len(parts) != len(op.args) or len(parts) < 2:
        raise PyptoEmitError("cat", f"along dim {op.attrs['dim']} of {n} (only the last)")
    if not op.out.dtype.is_floating_point:  # pypto: "datatype is not within the supported range"
        raise PyptoEmitError("cat", f"of {op.out.dtype} tensors (floats only)")
    out = em.layout.classify(op.out.shape, op.name)
    shapes = [em.shape[a] for a in parts]
    if any(len(s) != 2 or s[0] != out[0] for s in shapes) or sum(s[1] for s in shapes) != out[1]:
        raise PyptoEmitError("cat", f"parts {shapes} of {list(out)}")
    xs = tensor_operands(em, op)
    return em.tmp(f"pypto.concat([{', '.join(xs)}], 1)"), _float_out(em, op)


@register("pad")
def _pad(em: Writer, op: TileOp):
    """A constant pad of the last dim (the loss's label shift ``pad(labels, (0, 1), -100)``)
    in a static pointwise tile: a ``full`` block of the padded shape with the input
    assembled into it at its column offset."""
    n = len(op.out.shape)
    pads = op.attrs["pads"]
    if any(lo != 0 or hi != 0 for lo, hi in pads[:-1]) or em.layout.dynamic \
            or em.layout.cols_dynamic or em.layout.nd:
        raise PyptoEmitError("pad", "other than of the last dim of a static tile")
    (x,) = tensor_operands(em, op)
    out = em.layout.classify(op.out.shape, op.name)
    left = int(pads[-1][0])
    src = em.shape[op.args[0]]
    if n == 0 or len(out) != 2 or len(src) != 2 or src[0] != out[0] \
            or src[1] + left > out[1]:
        raise PyptoEmitError("pad", f"of {list(src)} to {list(out)}")
    kdt = em.dtype[op.args[0]]
    if kdt == torch.bool:
        raise PyptoEmitError("pad", "of a bool tensor (pypto.full makes no bool)")
    value = op.attrs["value"]
    # pypto refuses a tensor both computed and assembled into ("mix assemble and common
    # operation for same output"): a fresh tensor gets the input and the fill blocks
    block = em.tmp(f"pypto.Tensor({list(out)!r}, {em.dt(kdt)})", "pad")
    em.lines.append(f"pypto.assemble({x}, [0, {left}], {block})")
    for start, width in ((0, left), (left + src[1], out[1] - left - src[1])):
        if width:
            shape = (out[0], width)
            fill = int_full(em, shape, int(value), kdt) if not kdt.is_floating_point else \
                em.tmp(f"pypto.full({list(shape)!r}, {literal(float(value))}, {em.dt(kdt)})")
            em.lines.append(f"pypto.assemble({fill}, [0, {start}], {block})")
    return block, kdt, tuple(out)


def int_full(em: Writer, shape, value: int, dtype: torch.dtype) -> str:
    """An integer constant tensor; pypto 0.2.0's codegen has no 64-bit full ("unsupported
    type ... int64_t"), so a 64-bit one is made in int32 (the value fits) and cast."""
    if dtype in (torch.int64,) and -2**31 <= value < 2**31:
        x = em.tmp(f"pypto.full({list(shape)!r}, {value}, pypto.DT_INT32)")
        return em.tmp(f"pypto.cast({x}, {em.dt(dtype)})")
    if dtype == torch.int64:
        raise PyptoEmitError("full", f"an int64 constant {value} beyond int32")
    return em.tmp(f"pypto.full({list(shape)!r}, {value}, {em.dt(dtype)})")


@register("arange")
def _arange(em: Writer, op: TileOp):
    """``pypto.arange`` (1-D), reshaped to the value's kernel shape when it is a row or a
    column of it ((1, n) or (n, 1)); static sizes only."""
    if em.layout.dynamic or em.layout.cols_dynamic:
        raise PyptoEmitError("arange", "in a tile with dynamic sizes")
    a = op.attrs
    start, end, step = (em.graph.hint(a[k]) if isinstance(a[k], sympy.Basic) else a[k]
                        for k in ("start", "end", "step"))
    shape = em.layout.classify(op.out.shape, op.name)
    n = int(numel(em.hint(op.out)))
    if int(numel(shape)) != n or len(shape) != 2 or 1 not in shape:
        raise PyptoEmitError("arange", f"of {n} values in the kernel shape {list(shape)}")
    kdt = em.kernel_dtype(op.out)
    floating = kdt.is_floating_point or any(isinstance(x, float) for x in (start, end, step))
    fmt = (lambda x: repr(float(x))) if floating else (lambda x: str(int(x)))
    x = em.tmp(f"pypto.arange({fmt(start)}, {fmt(end)}, {fmt(step)})")
    x = em.tmp(f"pypto.reshape({x}, {list(shape)!r})")
    return em.tmp(f"pypto.cast({x}, {em.dt(kdt)})"), kdt


@register("where")
def _where(em: Writer, op: TileOp):
    c, a, b = tensor_operands(em, op)
    if not em.is_tensor(op.args[0]):
        raise PyptoEmitError("where", "a scalar condition")
    if not op.out.dtype.is_floating_point:
        # an integer where (labels != -100): pypto's WHERE takes a scalar of the tensor's
        # dtype, so a scalar branch becomes a full tensor of the kernel shape
        shape = em.layout.body_shape(*em.layout.place(op.out.shape, op.name))
        a, b = (x if em.is_tensor(arg) else int_full(em, shape, int(arg), op.out.dtype)
                for x, arg in ((a, op.args[1]), (b, op.args[2])))
    return em.tmp(f"pypto.where({c}, {a}, {b})"), _float_out(em, op)


@register("clamp")
def _clamp(em: Writer, op: TileOp):
    (x,) = tensor_operands(em, op)
    lo, hi = op.attrs.get("min"), op.attrs.get("max")
    r = x
    if lo is not None:
        r = em.tmp(f"pypto.maximum({r}, {em.arg(lo, op)})")
    if hi is not None:
        r = em.tmp(f"pypto.minimum({r}, {em.arg(hi, op)})")
    if r == x:
        r = em.tmp(f"pypto.clone({x})")
    return r, _float_out(em, op)


@register("exp2")
def _exp2(em: Writer, op: TileOp):  # pypto's exp2 has no cost in the simulator's ISA
    (x,) = tensor_operands(em, op)
    return em.tmp(f"pypto.exp(pypto.mul({x}, {math.log(2.0)!r}))"), _float_out(em, op)


@register("leaky_relu")
def _leaky_relu(em: Writer, op: TileOp):  # pypto.lrelu has no cost in the simulator's ISA
    (x,) = tensor_operands(em, op)
    slope = literal(float(op.attrs["negative_slope"]))
    return em.tmp(f"pypto.where(pypto.gt({x}, 0.0), {x}, pypto.mul({x}, {slope}))"), \
        _float_out(em, op)


def _tanh_of(em: Writer, x: str) -> str:
    """tanh(x) = 1 - 2 / (exp(2x) + 1)."""
    e = em.tmp(f"pypto.exp(pypto.mul({x}, 2.0))")
    r = em.tmp(f"pypto.reciprocal(pypto.add({e}, 1.0))")
    return em.tmp(f"pypto.add(pypto.mul({r}, -2.0), 1.0)")


def _erf_of(em: Writer, x: str) -> str:
    """erf by Abramowitz & Stegun 7.1.26 (|error| < 1.5e-7)."""
    ax = em.tmp(f"pypto.abs({x})")
    t = em.tmp(f"pypto.reciprocal(pypto.add(pypto.mul({ax}, 0.3275911), 1.0))")
    poly = em.tmp(f"pypto.add(pypto.mul({t}, 1.061405429), -1.453152027)")
    for c in (1.421413741, -0.284496736, 0.254829592):
        poly = em.tmp(f"pypto.add(pypto.mul({poly}, {t}), {c!r})")
    poly = em.tmp(f"pypto.mul({poly}, {t})")
    e = em.tmp(f"pypto.exp(pypto.neg(pypto.mul({ax}, {ax})))")
    y = em.tmp(f"pypto.add(pypto.neg(pypto.mul({poly}, {e})), 1.0)")
    return em.tmp(f"pypto.mul({y}, pypto.sign({x}))")


@register("tanh")
def _tanh(em: Writer, op: TileOp):
    (x,) = tensor_operands(em, op)
    return _tanh_of(em, x), _float_out(em, op)


@register("erf")
def _erf(em: Writer, op: TileOp):
    (x,) = tensor_operands(em, op)
    return _erf_of(em, x), _float_out(em, op)


@register("silu")
def _silu(em: Writer, op: TileOp):
    (x,) = tensor_operands(em, op)
    return em.tmp(f"pypto.mul({x}, pypto.sigmoid({x}))"), _float_out(em, op)


@register("gelu")
def _gelu(em: Writer, op: TileOp):
    (x,) = tensor_operands(em, op)
    if op.attrs.get("approximate", "none") == "tanh":
        x3 = em.tmp(f"pypto.mul(pypto.mul({x}, {x}), {x})")
        inner = em.tmp(f"pypto.mul(pypto.add(pypto.mul({x3}, 0.044715), {x}), "
                       f"{math.sqrt(2.0 / math.pi)!r})")
        th = _tanh_of(em, inner)
    else:
        th = _erf_of(em, em.tmp(f"pypto.mul({x}, {1.0 / math.sqrt(2.0)!r})"))
    return em.tmp(f"pypto.mul(pypto.mul({x}, 0.5), pypto.add({th}, 1.0))"), _float_out(em, op)


@register("hardsigmoid")
def _hardsigmoid(em: Writer, op: TileOp):
    (x,) = tensor_operands(em, op)
    y = em.tmp(f"pypto.add(pypto.mul({x}, {1.0 / 6.0!r}), 0.5)")
    return em.tmp(f"pypto.minimum(pypto.maximum({y}, 0.0), 1.0)"), _float_out(em, op)


@register("hardswish")
def _hardswish(em: Writer, op: TileOp):
    (x,) = tensor_operands(em, op)
    y = em.tmp(f"pypto.minimum(pypto.maximum(pypto.add({x}, 3.0), 0.0), 6.0)")
    return em.tmp(f"pypto.mul(pypto.mul({x}, {y}), {1.0 / 6.0!r})"), _float_out(em, op)


def _softplus_of(em: Writer, x: str, beta: float, threshold: float) -> str:
    bx = em.tmp(f"pypto.mul({x}, {beta!r})")
    sp = em.tmp(f"pypto.mul(pypto.log1p(pypto.exp({bx})), {1.0 / beta!r})")
    return em.tmp(f"pypto.where(pypto.gt({bx}, {threshold!r}), {x}, {sp})")


@register("softplus")
def _softplus(em: Writer, op: TileOp):
    (x,) = tensor_operands(em, op)
    return _softplus_of(em, x, float(op.attrs["beta"]), float(op.attrs["threshold"])), \
        _float_out(em, op)


@register("mish")
def _mish(em: Writer, op: TileOp):
    (x,) = tensor_operands(em, op)
    th = _tanh_of(em, _softplus_of(em, x, 1.0, 20.0))
    return em.tmp(f"pypto.mul({x}, {th})"), _float_out(em, op)


@register("elu")
def _elu(em: Writer, op: TileOp):
    (x,) = tensor_operands(em, op)
    alpha, scale = float(op.attrs["alpha"]), float(op.attrs["scale"])
    input_scale = float(op.attrs["input_scale"])
    neg = em.tmp(f"pypto.mul(pypto.expm1(pypto.mul({x}, {input_scale!r})), {alpha * scale!r})")
    return em.tmp(f"pypto.where(pypto.gt({x}, 0.0), pypto.mul({x}, {scale!r}), {neg})"), \
        _float_out(em, op)


@register("view", "expand", "permute", "slice", "select")
def _layout(em: Writer, op: TileOp):
    """A view inside a tile is free when both sides have the same kernel layout."""
    src = op.args[0]
    out_shape = em.hint(op.out)
    if not isinstance(src, str):
        raise PyptoEmitError(op.op, "of a constant")
    try:
        same = em.layout.classify(op.out.shape, op.name) == em.shape[src]
    except PyptoEmitError:
        same = False
    if op.op in ("slice", "select", "permute") and numel(out_shape) != numel(em.shape[src]):
        same = False
    if op.op == "permute":  # only moves of size-1 dims keep the element order
        dims = [d for d in op.attrs.get("dims", ()) if em.graph.hint(op.out.shape[list(
            op.attrs["dims"]).index(d)]) != 1]
        same = same and dims == sorted(dims)
    if not same:
        raise PyptoEmitError(op.op, f"{list(em.shape[src])} -> {list(out_shape)} changes the "
                             "tile's 2-D layout")
    return em.env[src], em.dtype[src]


@register("cast")
def _cast(em: Writer, op: TileOp):
    (x,) = [em.arg(a, op) for a in op.args]
    target = op.attrs["dtype"]
    src = em.dtype[op.args[0]]
    if target.is_floating_point:  # floats live in the compute dtype inside the kernel
        if src == em.compute:
            return x, em.compute
        return em.tmp(f"pypto.cast({x}, {em.dt(em.compute)})"), em.compute
    if target == torch.bool and src != torch.bool:
        # torch: any nonzero is True; pypto's cast rounds first (0.3 -> False). Integers are
        # compared in fp32 (pypto's compare takes no integer scalar; no nonzero int is 0.0)
        if not src.is_floating_point:
            x = em.tmp(f"pypto.cast({x}, {em.dt(torch.float32)})")
        return em.tmp(f"pypto.ne({x}, 0.0)"), torch.bool
    if src.is_floating_point:
        # torch truncates toward zero; pypto's default cast rounds to nearest (found by the
        # interpreter: (x * 10).to(int32) was off by one in half of its elements)
        return em.tmp(f"pypto.cast({x}, {em.dt(target)}, pypto.CastMode.CAST_TRUNC)"), target
    return em.tmp(f"pypto.cast({x}, {em.dt(target)})"), target


@register("full")
def _full(em: Writer, op: TileOp):
    shape = em.layout.body_shape(*em.layout.place(op.out.shape, op.name))
    kdt = em.kernel_dtype(op.out)
    if kdt == torch.bool:  # pypto 0.2.0's codegen: "unsupported type, dstDtypeStr: bool"
        raise PyptoEmitError("full", "pypto.full cannot make a bool tensor")
    value = op.attrs["value"]
    if not kdt.is_floating_point:
        return int_full(em, shape, int(value), kdt), kdt
    return em.tmp(f"pypto.full({list(shape)!r}, {literal(float(value))}, {em.dt(kdt)})"), kdt


# reductions: always over the kernel's reduce dim, keepdim in the kernel -------------------
def check_reduction(em: Writer, op: TileOp) -> None:
    """A reduction must reduce the tile's domain over the tile's reduced axes."""
    layout = em.layout
    symbolic_shapes = layout.dynamic or layout.cols_dynamic
    shape = tuple(em.graph.specs[op.args[0]].shape)
    if not symbolic_shapes:
        shape = em.hint(em.graph.specs[op.args[0]])
    domain = layout.sym_domain if symbolic_shapes else layout.domain
    if layout.matmul is not None or shape != domain \
            or tuple(op.attrs["dims"]) != layout.reduce_axes:
        raise PyptoEmitError(op.op, f"reduction over dims {list(op.attrs['dims'])} of "
                             f"{list(shape)} differs from the tile's domain")


def _reduce_setup(em: Writer, op: TileOp) -> tuple[str, int, int]:
    layout = em.layout
    check_reduction(em, op)
    (x,) = tensor_operands(em, op)
    dim = layout.reduce_dim
    n = layout.cols if dim == 1 else layout.rows
    return x, dim, n


def _reduction(fn: str):
    def emit(em: Writer, op: TileOp):
        x, dim, _ = _reduce_setup(em, op)
        return em.tmp(f"pypto.{fn}({x}, {dim}, True)"), _float_out(em, op)
    return emit


@register("sum")
def _sum(em: Writer, op: TileOp):
    x, dim, _ = _reduce_setup(em, op)
    src = em.dtype.get(op.args[0]) if isinstance(op.args[0], str) else None
    if src is not None and not src.is_floating_point:
        # pypto sums a bool tile as a bool (a count of 32 came out as 1): count in fp32
        x = em.tmp(f"pypto.cast({x}, {em.dt(torch.float32)})")
        out = _float_out(em, op)  # an integer count stays fp32 here, cast on use / store
        return em.tmp(f"pypto.sum({x}, {dim}, True)"), (out if out.is_floating_point
                                                         else torch.float32)
    return em.tmp(f"pypto.sum({x}, {dim}, True)"), _float_out(em, op)


register("amax")(_reduction("amax"))
register("amin")(_reduction("amin"))
# No "prod": pypto.prod emits ROWPROD_SINGLE, which pypto 0.2.0's simulator rejects
# ("No pipe type corresponding to opcode"), so a prod splits its FusionTile.


def _mean_of(em: Writer, x: str, dim: int, n: int) -> str:
    """The row mean of ``x``, computed once per kernel (var and mean of one tile share it).

    var_mean's mean carries ``acc_dtype`` (eager accumulates it in double, which the NPU
    does not have): in a tile with such a mean it is the sum of x/n, finite wherever the
    mean is (|sum x/n| <= max |x|), where the sum of x overflows near the float max; under
    the strict fp16 policy that sum runs in fp32. Otherwise the sum of x times 1/n."""
    key = (x, dim)
    if key not in em.row_means:
        wide = any(op.op == "mean" and op.attrs.get("acc_dtype") is not None
                   for op in em.tile.ops)
        if not wide:
            em.row_means[key] = em.tmp(f"pypto.mul(pypto.sum({x}, {dim}, True), {1.0 / n!r})")
        elif em.compute == torch.float32:
            em.row_means[key] = em.tmp(f"pypto.sum(pypto.mul({x}, {1.0 / n!r}), {dim}, True)")
        else:
            x32 = em.tmp(f"pypto.cast({x}, {em.dt(torch.float32)})")
            m = em.tmp(f"pypto.sum(pypto.mul({x32}, {1.0 / n!r}), {dim}, True)")
            em.row_means[key] = em.tmp(f"pypto.cast({m}, {em.dt(em.compute)})")
    return em.row_means[key]


@register("mean")
def _mean(em: Writer, op: TileOp):
    x, dim, n = _reduce_setup(em, op)
    return _mean_of(em, x, dim, n), _float_out(em, op)


def _var_of(em: Writer, op: TileOp) -> str:
    x, dim, n = _reduce_setup(em, op)
    mean = _mean_of(em, x, dim, n)
    dx = em.tmp(f"pypto.sub({x}, {mean})")
    denom = max(n - float(op.attrs.get("correction", 1.0)), 0.0)
    scale = 1.0 / denom if denom else float("inf")
    return em.tmp(f"pypto.mul(pypto.sum(pypto.mul({dx}, {dx}), {dim}, True), {literal(scale)})")


@register("var")
def _var(em: Writer, op: TileOp):
    return _var_of(em, op), _float_out(em, op)


@register("std")
def _std(em: Writer, op: TileOp):
    return em.tmp(f"pypto.sqrt({_var_of(em, op)})"), _float_out(em, op)


@register("logsumexp")
def _logsumexp(em: Writer, op: TileOp):
    x, dim, _ = _reduce_setup(em, op)
    mx = em.tmp(f"pypto.amax({x}, {dim}, True)")
    s = em.tmp(f"pypto.sum(pypto.exp(pypto.sub({x}, {mx})), {dim}, True)")
    return em.tmp(f"pypto.add(pypto.log({s}), {mx})"), _float_out(em, op)


@register("softmax")
def _softmax(em: Writer, op: TileOp):
    x, dim, _ = _reduce_setup(em, op)
    return em.tmp(f"pypto.softmax({x}, {dim})"), _float_out(em, op)


@register("log_softmax")
def _log_softmax(em: Writer, op: TileOp):
    x, dim, _ = _reduce_setup(em, op)
    mx = em.tmp(f"pypto.amax({x}, {dim}, True)")
    s = em.tmp(f"pypto.sub({x}, {mx})")
    lse = em.tmp(f"pypto.log(pypto.sum(pypto.exp({s}), {dim}, True))")
    return em.tmp(f"pypto.sub({s}, {lse})"), _float_out(em, op)


@register("matmul")
def _matmul(em: Writer, op: TileOp):
    a, b = (em.env[x] for x in op.args[:2])
    da, db = em.dtype[op.args[0]], em.dtype[op.args[1]]
    if da != db or not da.is_floating_point:
        raise PyptoEmitError("matmul", f"operands {da} x {db}")
    sa = em.graph.specs[op.args[0]].shape
    sb = em.graph.specs[op.args[1]].shape
    if len(sa) != len(sb) or len(sa) not in (2, 3, 4):
        raise PyptoEmitError("matmul", f"operand ranks {len(sa)} and {len(sb)}")
    # The cube accumulates in fp32; the epilogue then runs in the compute dtype.
    return em.tmp(f"pypto.matmul({a}, {b}, {em.dt(em.compute)})"), em.compute
