"""The op-mapping table of the pypto emitter: one pypto form per canonical tile op.

Each handler takes the :class:`~.pypto_emit._Emitter` and a :class:`TileOp`,
appends the pypto statements computing the op to the kernel body, and returns
(identifier of the result, its dtype in the kernel). Handlers register into
:mod:`.pypto_emit`'s op table with ``@_register``: unary and binary arithmetic,
comparisons, where, clamp, activations (built from pypto primitives where pypto
has no costed form), cast, full, views, reductions, softmax and matmul.
"""
from __future__ import annotations

import math

import torch

from ..ir import TileOp
from .pypto_emit import PyptoEmitError, _Emitter, _literal, _prod, _register, _tensor_operands


def _float_out(em: _Emitter, op: TileOp) -> torch.dtype:
    return em.kernel_dtype(op.out)


_UNARY_DIRECT = {
    "abs": "abs", "neg": "neg", "exp": "exp", "expm1": "expm1", "log": "log",
    "log1p": "log1p", "log2": "log2", "log10": "log10", "sqrt": "sqrt", "rsqrt": "rsqrt",
    "sin": "sin", "cos": "cos", "sigmoid": "sigmoid", "relu": "relu", "reciprocal": "reciprocal",
    "floor": "floor", "ceil": "ceil", "round": "round", "trunc": "trunc", "sign": "sign",
}


def _unary(em: _Emitter, op: TileOp):
    (x,) = _tensor_operands(em, op)
    return em.tmp(f"pypto.{_UNARY_DIRECT[op.op]}({x})"), _float_out(em, op)


_register(*_UNARY_DIRECT)(_unary)


@_register("copy")
def _copy(em: _Emitter, op: TileOp):
    (x,) = _tensor_operands(em, op)
    return em.tmp(f"pypto.clone({x})"), em.dtype.get(op.args[0], _float_out(em, op))


def _commutative(fn: str):
    def emit(em: _Emitter, op: TileOp):
        a, b = _tensor_operands(em, op)
        if not em.is_tensor(op.args[0]):
            a, b = b, a
        return em.tmp(f"pypto.{fn}({a}, {b})"), _float_out(em, op)
    return emit


_register("add")(_commutative("add"))
_register("mul")(_commutative("mul"))
_register("maximum", "fmax")(_commutative("maximum"))
_register("minimum", "fmin")(_commutative("minimum"))


@_register("sub")
def _sub(em: _Emitter, op: TileOp):
    a, b = _tensor_operands(em, op)
    if not em.is_tensor(op.args[0]):  # c - x = (-x) + c
        return em.tmp(f"pypto.add(pypto.neg({b}), {a})"), _float_out(em, op)
    return em.tmp(f"pypto.sub({a}, {b})"), _float_out(em, op)


@_register("div")
def _div(em: _Emitter, op: TileOp):
    a, b = _tensor_operands(em, op)
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


@_register("pow")
def _pow(em: _Emitter, op: TileOp):
    a, b = _tensor_operands(em, op)
    if not em.is_tensor(op.args[0]):
        raise PyptoEmitError("pow", "a scalar base")
    exponent = op.args[1]
    if not em.is_tensor(exponent) and float(exponent) == 2.0:
        return em.tmp(f"pypto.mul({a}, {a})"), _float_out(em, op)
    if not em.is_tensor(exponent) and float(exponent) == 0.5:
        return em.tmp(f"pypto.sqrt({a})"), _float_out(em, op)
    return em.tmp(f"pypto.pow({a}, {b})"), _float_out(em, op)


def _compare(fn: str, swapped: str):
    def emit(em: _Emitter, op: TileOp):
        a, b = _tensor_operands(em, op)
        if not em.is_tensor(op.args[0]):
            a, b, name = b, a, swapped
        else:
            name = fn
        return em.tmp(f"pypto.{name}({a}, {b})"), torch.bool
    return emit


for _fn, _sw in (("eq", "eq"), ("ne", "ne"), ("lt", "gt"), ("le", "ge"), ("gt", "lt"), ("ge", "le")):
    _register(_fn)(_compare(_fn, _sw))


@_register("logical_not")
def _logical_not(em: _Emitter, op: TileOp):
    (x,) = _tensor_operands(em, op)
    return em.tmp(f"pypto.logical_not({x})"), torch.bool


@_register("logical_and")
def _logical_and(em: _Emitter, op: TileOp):
    a, b = _tensor_operands(em, op)
    if not (em.is_tensor(op.args[0]) and em.is_tensor(op.args[1])):
        raise PyptoEmitError("logical_and", "a scalar operand")
    return em.tmp(f"pypto.logical_and({a}, {b})"), torch.bool


@_register("where")
def _where(em: _Emitter, op: TileOp):
    c, a, b = _tensor_operands(em, op)
    if not em.is_tensor(op.args[0]):
        raise PyptoEmitError("where", "a scalar condition")
    return em.tmp(f"pypto.where({c}, {a}, {b})"), _float_out(em, op)


@_register("clamp")
def _clamp(em: _Emitter, op: TileOp):
    (x,) = _tensor_operands(em, op)
    lo, hi = op.attrs.get("min"), op.attrs.get("max")
    r = x
    if lo is not None:
        r = em.tmp(f"pypto.maximum({r}, {em.arg(lo, op)})")
    if hi is not None:
        r = em.tmp(f"pypto.minimum({r}, {em.arg(hi, op)})")
    if r == x:
        r = em.tmp(f"pypto.clone({x})")
    return r, _float_out(em, op)


@_register("exp2")
def _exp2(em: _Emitter, op: TileOp):  # pypto's exp2 has no cost in the simulator's ISA
    (x,) = _tensor_operands(em, op)
    return em.tmp(f"pypto.exp(pypto.mul({x}, {math.log(2.0)!r}))"), _float_out(em, op)


@_register("leaky_relu")
def _leaky_relu(em: _Emitter, op: TileOp):  # pypto.lrelu has no cost in the simulator's ISA
    (x,) = _tensor_operands(em, op)
    slope = _literal(float(op.attrs["negative_slope"]))
    return em.tmp(f"pypto.where(pypto.gt({x}, 0.0), {x}, pypto.mul({x}, {slope}))"), \
        _float_out(em, op)


def _tanh_of(em: _Emitter, x: str) -> str:
    """tanh(x) = 1 - 2 / (exp(2x) + 1)."""
    e = em.tmp(f"pypto.exp(pypto.mul({x}, 2.0))")
    r = em.tmp(f"pypto.reciprocal(pypto.add({e}, 1.0))")
    return em.tmp(f"pypto.add(pypto.mul({r}, -2.0), 1.0)")


def _erf_of(em: _Emitter, x: str) -> str:
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


@_register("tanh")
def _tanh(em: _Emitter, op: TileOp):
    (x,) = _tensor_operands(em, op)
    return _tanh_of(em, x), _float_out(em, op)


@_register("erf")
def _erf(em: _Emitter, op: TileOp):
    (x,) = _tensor_operands(em, op)
    return _erf_of(em, x), _float_out(em, op)


@_register("silu")
def _silu(em: _Emitter, op: TileOp):
    (x,) = _tensor_operands(em, op)
    return em.tmp(f"pypto.mul({x}, pypto.sigmoid({x}))"), _float_out(em, op)


@_register("gelu")
def _gelu(em: _Emitter, op: TileOp):
    (x,) = _tensor_operands(em, op)
    if op.attrs.get("approximate", "none") == "tanh":
        x3 = em.tmp(f"pypto.mul(pypto.mul({x}, {x}), {x})")
        inner = em.tmp(f"pypto.mul(pypto.add(pypto.mul({x3}, 0.044715), {x}), "
                       f"{math.sqrt(2.0 / math.pi)!r})")
        th = _tanh_of(em, inner)
    else:
        th = _erf_of(em, em.tmp(f"pypto.mul({x}, {1.0 / math.sqrt(2.0)!r})"))
    return em.tmp(f"pypto.mul(pypto.mul({x}, 0.5), pypto.add({th}, 1.0))"), _float_out(em, op)


@_register("hardsigmoid")
def _hardsigmoid(em: _Emitter, op: TileOp):
    (x,) = _tensor_operands(em, op)
    y = em.tmp(f"pypto.add(pypto.mul({x}, {1.0 / 6.0!r}), 0.5)")
    return em.tmp(f"pypto.minimum(pypto.maximum({y}, 0.0), 1.0)"), _float_out(em, op)


@_register("hardswish")
def _hardswish(em: _Emitter, op: TileOp):
    (x,) = _tensor_operands(em, op)
    y = em.tmp(f"pypto.minimum(pypto.maximum(pypto.add({x}, 3.0), 0.0), 6.0)")
    return em.tmp(f"pypto.mul(pypto.mul({x}, {y}), {1.0 / 6.0!r})"), _float_out(em, op)


def _softplus_of(em: _Emitter, x: str, beta: float, threshold: float) -> str:
    bx = em.tmp(f"pypto.mul({x}, {beta!r})")
    sp = em.tmp(f"pypto.mul(pypto.log1p(pypto.exp({bx})), {1.0 / beta!r})")
    return em.tmp(f"pypto.where(pypto.gt({bx}, {threshold!r}), {x}, {sp})")


@_register("softplus")
def _softplus(em: _Emitter, op: TileOp):
    (x,) = _tensor_operands(em, op)
    return _softplus_of(em, x, float(op.attrs["beta"]), float(op.attrs["threshold"])), \
        _float_out(em, op)


@_register("mish")
def _mish(em: _Emitter, op: TileOp):
    (x,) = _tensor_operands(em, op)
    th = _tanh_of(em, _softplus_of(em, x, 1.0, 20.0))
    return em.tmp(f"pypto.mul({x}, {th})"), _float_out(em, op)


@_register("elu")
def _elu(em: _Emitter, op: TileOp):
    (x,) = _tensor_operands(em, op)
    alpha, scale = float(op.attrs["alpha"]), float(op.attrs["scale"])
    input_scale = float(op.attrs["input_scale"])
    neg = em.tmp(f"pypto.mul(pypto.expm1(pypto.mul({x}, {input_scale!r})), {alpha * scale!r})")
    return em.tmp(f"pypto.where(pypto.gt({x}, 0.0), pypto.mul({x}, {scale!r}), {neg})"), \
        _float_out(em, op)


@_register("view", "expand", "permute", "slice", "select")
def _layout(em: _Emitter, op: TileOp):
    """A view inside a tile is free when both sides have the same kernel layout."""
    src = op.args[0]
    out_shape = em.hint(op.out)
    if not isinstance(src, str):
        raise PyptoEmitError(op.op, "of a constant")
    try:
        same = em.layout.classify(op.out.shape, op.name) == em.shape[src]
    except PyptoEmitError:
        same = False
    if op.op in ("slice", "select", "permute") and _prod(out_shape) != _prod(em.shape[src]):
        same = False
    if op.op == "permute":  # only moves of size-1 dims keep the element order
        dims = [d for d in op.attrs.get("dims", ()) if em.graph.hint(op.out.shape[list(
            op.attrs["dims"]).index(d)]) != 1]
        same = same and dims == sorted(dims)
    if not same:
        raise PyptoEmitError(op.op, f"{list(em.shape[src])} -> {list(out_shape)} changes the "
                             "tile's 2-D layout")
    return em.env[src], em.dtype[src]


@_register("cast")
def _cast(em: _Emitter, op: TileOp):
    (x,) = [em.arg(a, op) for a in op.args]
    target = op.attrs["dtype"]
    if target.is_floating_point:  # floats live in the compute dtype inside the kernel
        if em.dtype[op.args[0]] == em.compute:
            return x, em.compute
        return em.tmp(f"pypto.cast({x}, {em.dt(em.compute)})"), em.compute
    return em.tmp(f"pypto.cast({x}, {em.dt(target)})"), target


@_register("full")
def _full(em: _Emitter, op: TileOp):
    shape = em.layout.body_shape(em.layout.classify(op.out.shape, op.name))
    kdt = em.kernel_dtype(op.out)
    value = op.attrs["value"]
    value = _literal(float(value)) if kdt.is_floating_point else str(int(value))
    return em.tmp(f"pypto.full({list(shape)!r}, {value}, {em.dt(kdt)})"), kdt


# reductions: always over the kernel's reduce dim, keepdim in the kernel -------------------
def _reduce_setup(em: _Emitter, op: TileOp) -> tuple[str, int, int]:
    layout = em.layout
    shape = tuple(em.graph.specs[op.args[0]].shape)
    if not layout.dynamic:
        shape = em.hint(em.graph.specs[op.args[0]])
    domain = layout.sym_domain if layout.dynamic else layout.domain
    if layout.matmul is not None or shape != domain \
            or tuple(op.attrs["dims"]) != layout.reduce_axes:
        raise PyptoEmitError(op.op, f"reduction over dims {list(op.attrs['dims'])} of "
                             f"{list(shape)} differs from the tile's domain")
    (x,) = _tensor_operands(em, op)
    dim = layout.reduce_dim
    n = layout.cols if dim == 1 else layout.rows
    return x, dim, n


def _reduction(fn: str):
    def emit(em: _Emitter, op: TileOp):
        x, dim, _ = _reduce_setup(em, op)
        return em.tmp(f"pypto.{fn}({x}, {dim}, True)"), _float_out(em, op)
    return emit


_register("sum")(_reduction("sum"))
_register("amax")(_reduction("amax"))
_register("amin")(_reduction("amin"))
_register("prod")(_reduction("prod"))


def _mean_of(em: _Emitter, x: str, dim: int, n: int) -> str:
    return em.tmp(f"pypto.mul(pypto.sum({x}, {dim}, True), {1.0 / n!r})")


@_register("mean")
def _mean(em: _Emitter, op: TileOp):
    x, dim, n = _reduce_setup(em, op)
    return _mean_of(em, x, dim, n), _float_out(em, op)


def _var_of(em: _Emitter, op: TileOp) -> str:
    x, dim, n = _reduce_setup(em, op)
    mean = _mean_of(em, x, dim, n)
    dx = em.tmp(f"pypto.sub({x}, {mean})")
    denom = max(n - float(op.attrs.get("correction", 1.0)), 0.0)
    scale = 1.0 / denom if denom else float("inf")
    return em.tmp(f"pypto.mul(pypto.sum(pypto.mul({dx}, {dx}), {dim}, True), {_literal(scale)})")


@_register("var")
def _var(em: _Emitter, op: TileOp):
    return _var_of(em, op), _float_out(em, op)


@_register("std")
def _std(em: _Emitter, op: TileOp):
    return em.tmp(f"pypto.sqrt({_var_of(em, op)})"), _float_out(em, op)


@_register("logsumexp")
def _logsumexp(em: _Emitter, op: TileOp):
    x, dim, _ = _reduce_setup(em, op)
    mx = em.tmp(f"pypto.amax({x}, {dim}, True)")
    s = em.tmp(f"pypto.sum(pypto.exp(pypto.sub({x}, {mx})), {dim}, True)")
    return em.tmp(f"pypto.add(pypto.log({s}), {mx})"), _float_out(em, op)


@_register("softmax")
def _softmax(em: _Emitter, op: TileOp):
    x, dim, _ = _reduce_setup(em, op)
    return em.tmp(f"pypto.softmax({x}, {dim})"), _float_out(em, op)


@_register("log_softmax")
def _log_softmax(em: _Emitter, op: TileOp):
    x, dim, _ = _reduce_setup(em, op)
    mx = em.tmp(f"pypto.amax({x}, {dim}, True)")
    s = em.tmp(f"pypto.sub({x}, {mx})")
    lse = em.tmp(f"pypto.log(pypto.sum(pypto.exp({s}), {dim}, True))")
    return em.tmp(f"pypto.sub({s}, {lse})"), _float_out(em, op)


@_register("matmul")
def _matmul(em: _Emitter, op: TileOp):
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
