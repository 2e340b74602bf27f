"""The reference target: each FusionTile's tile ops interpreted with torch.

It defines what every canonical tile op means, so it is the oracle for the
native targets and the fallback when no native kernel can be built.
"""
from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn.functional as F

from ..ir import FusionTile, OpKind, TensorSpec, TileGraph, TileOp, gemm_bias_add
from ..sizes import contains_symbol, is_symbolic, resolve_static, size_function
from . import Kernel, build_each

aten = torch.ops.aten


def _reduce(fn):
    def run(x, dims, keepdim, **kw):
        return fn(x, dim=list(dims), keepdim=keepdim, **kw) if x.dim() else fn(x, **kw)
    return run


def _mean(x, dims, keepdim, dtype, acc_dtype=None):
    """torch.mean; var_mean's mean (``acc_dtype``) sums in that wider dtype, as eager's."""
    if acc_dtype is not None and x.is_floating_point():
        return _reduce(torch.mean)(x.to(acc_dtype), dims, keepdim).to(dtype)
    return _reduce(torch.mean)(x, dims, keepdim, dtype=dtype)


def _var(x, dims, keepdim, correction, std=False):
    fn = torch.std if std else torch.var
    return fn(x, dim=list(dims) or None, correction=correction, keepdim=keepdim)


def _arg(fn):
    def run(x, dims, keepdim):
        if x.dtype == torch.bool:  # torch.argmax rejects bool; max.dim's index needs it
            x = x.to(torch.uint8)
        return fn(x, dim=dims[0] if dims else None, keepdim=keepdim)
    return run


def _prod(x, dims, keepdim, dtype):
    if len(dims) == x.dim():  # every dim (or a 0-d tensor)
        out = torch.prod(x, dtype=dtype)
        return out.reshape([1] * x.dim()) if keepdim else out
    out = x
    for d in sorted(dims, reverse=True):
        out = torch.prod(out, dim=d, keepdim=keepdim, dtype=dtype)
    return out


def _softmax(fn):
    def run(x, dims, keepdim, dtype):
        return fn(x, dims[0] if dims else 0, dtype=dtype)  # dims == () for a 0-d tensor
    return run


def _slice(x, dim, start, length, step):
    if step == 1:  # narrow: cheaper per call than the aten op
        return x.narrow(dim, start, length)
    return aten.slice(x, dim, start, start + length * step, step)


def _full(*, value, dtype, shape):
    return torch.full(shape, value, dtype=dtype)


# --- indexed reads and writes (lowering/indexing.py) ------------------------------------------
_OUT_OF_RANGE = {"gather": RuntimeError}  # the error eager raises; IndexError otherwise


def _gather(x, *indices, source_dims, index_dims, wrap, check, shape):
    """out[o] = x[s(o)]: source dim d read at output dim source_dims[d] (>= 0) or at index
    -1 - source_dims[d], aligned to the output dims index_dims[j]; negative indices wrap
    only when ``wrap``. Built as one advanced-indexing read with every source dim indexed."""
    n = len(shape)
    full = []
    for s in source_dims:
        view = [1] * n
        if s >= 0:
            view[s] = shape[s]
            full.append(torch.arange(shape[s]).view(view))
            continue
        index = indices[-1 - s]
        for e, k in enumerate(index_dims[-1 - s]):
            view[k] = index.shape[e]
        if not wrap and index.numel() and bool((index < 0).any()):
            raise _OUT_OF_RANGE.get(check, IndexError)(f"{check}: index out of range "
                                                        "(negative index)")
        full.append(index.reshape(view))
    try:
        return x[tuple(full)] if full else x.clone()
    except IndexError as e:
        raise _OUT_OF_RANGE.get(check, IndexError)(f"{check}: {e}") from None


def _pad(x, *, pads, value):
    flat = [int(p) for lo_hi in reversed(pads) for p in lo_hi]
    return torch.nn.functional.pad(x, flat, value=value)


def _scatter(x, index, src, *, dim, reduce):
    if reduce is None:
        return aten.scatter(x, dim, index, src)
    if isinstance(src, torch.Tensor):
        return aten.scatter.reduce(x, dim, index, src, reduce=reduce)
    return aten.scatter.value_reduce(x, dim, index, src, reduce=reduce)


def _index_put(x, values, *indices, positions, accumulate):
    full = [None] * (max(positions) + 1)
    for d, index in zip(positions, indices):
        full[d] = index
    if not isinstance(values, torch.Tensor):
        values = torch.tensor(values, dtype=x.dtype)
    return aten.index_put(x, full, values, accumulate)


def _copy_into(dst, src, *, mutates):
    """copy_: ``dst`` (a graph input) written in place; its value is ``dst``."""
    return dst.copy_(src) if isinstance(src, torch.Tensor) else dst.fill_(src)


_UNARY = ["abs", "neg", "exp", "exp2", "expm1", "log", "log1p", "log2", "log10", "sqrt",
          "rsqrt", "sin", "cos", "tan", "tanh", "asin", "acos", "atan", "sinh", "cosh",
          "asinh", "acosh", "atanh", "sigmoid", "relu", "erf", "erfc", "reciprocal", "floor",
          "ceil", "round", "trunc", "frac", "sign", "logical_not", "bitwise_not", "isnan",
          "isinf"]
_BINARY = ["add", "sub", "mul", "pow", "maximum", "minimum", "eq", "ne", "lt", "le", "gt",
           "ge", "logical_and", "logical_or", "logical_xor", "bitwise_and", "bitwise_or",
           "bitwise_xor", "atan2", "remainder", "fmod", "copysign", "fmax", "fmin", "hypot"]

_NUMBER_OPS = frozenset(_UNARY + _BINARY)

# Binary ops with no Scalar overload for their second operand.
_TENSOR_ONLY = {"maximum", "minimum", "atan2", "fmax", "fmin", "hypot", "logical_and",
                "logical_or", "logical_xor"}


_OPMATH = {torch.float16: torch.float32, torch.bfloat16: torch.float32}


def _number_operands(name: str, out_dtype: torch.dtype | None = None):
    """aten.<name> taking a Python number (a folded 0-d constant) where it has no Scalar
    overload (a unary op's operand, a binary op's first operand, or _TENSOR_ONLY) as a
    0-d tensor. A plain 0-d tensor takes part in type promotion as a tensor, not as the
    number it stands for (-1.5 - a 0-d bfloat16 tensor is bfloat16; torch.tensor(-1.5)
    minus it is float32: fuzz seed 30738), so the number becomes a tensor of the dtype
    eager computes the op in (the result's ``out_dtype``, float32 for a half type) and
    the result is rounded to ``out_dtype`` once, as eager's opmath; a bool result (a
    comparison) keeps torch's default dtype for the number."""
    fn = getattr(aten, name)
    wrap = range(2) if name in _TENSOR_ONLY else range(1)
    cast = out_dtype is not None and out_dtype != torch.bool
    compute = _OPMATH.get(out_dtype, out_dtype) if cast else None

    def run(*args, **kwargs):  # kwargs: add/sub's alpha
        if any(isinstance(args[i], (bool, int, float)) for i in wrap if i < len(args)):
            args = [torch.tensor(a, dtype=compute) if i in wrap and isinstance(a, (bool, int, float))
                    else a for i, a in enumerate(args)]
            out = fn(*args, **kwargs)
            return out.to(out_dtype) if cast and out.dtype != out_dtype else out
        return fn(*args, **kwargs)
    return run


# Canonical tile op -> torch implementation. Operands positional, attrs as keywords.
REFERENCE: dict[str, Callable[..., Any]] = {
    **{name: _number_operands(name) for name in _UNARY + _BINARY},
    "div": lambda a, b, rounding_mode=None: aten.div(a, b, rounding_mode=rounding_mode)
    if rounding_mode else aten.div(a, b),
    "silu": F.silu, "mish": F.mish, "hardswish": F.hardswish, "hardsigmoid": F.hardsigmoid,
    "gelu": lambda x, approximate, strided=False: F.gelu(x, approximate=approximate),
    "leaky_relu": lambda x, negative_slope: F.leaky_relu(x, negative_slope),
    "softplus": lambda x, beta, threshold: F.softplus(x, beta, threshold),
    "elu": lambda x, alpha, scale, input_scale: aten.elu(x, alpha, scale, input_scale),
    "clamp": lambda x, min, max: torch.clamp(x, min, max),
    "where": lambda c, a, b: torch.where(c if isinstance(c, torch.Tensor) else torch.tensor(c),
                                         a, b),  # a folded condition is a Python bool
    "copy": lambda x: x.clone(memory_format=torch.contiguous_format),
    "cast": lambda x, dtype: x.to(dtype),
    "full": _full,
    "sum": _reduce(torch.sum), "mean": _mean, "prod": _prod,
    "amax": lambda x, dims, keepdim: torch.amax(x, list(dims), keepdim),
    "amin": lambda x, dims, keepdim: torch.amin(x, list(dims), keepdim),
    "logsumexp": lambda x, dims, keepdim: torch.logsumexp(x, list(dims), keepdim),
    "any": lambda x, dims, keepdim: aten.any.dims(x, list(dims), keepdim),
    "all": lambda x, dims, keepdim: aten.all.dims(x, list(dims), keepdim),
    "var": _var, "std": lambda x, dims, keepdim, correction: _var(x, dims, keepdim, correction, True),
    "argmax": _arg(torch.argmax), "argmin": _arg(torch.argmin),
    "softmax": _softmax(torch.softmax), "log_softmax": _softmax(torch.log_softmax),
    "matmul": torch.matmul,
    "view": lambda x, shape: x.reshape(shape),
    "permute": lambda x, dims: x.permute(dims),
    "expand": lambda x, shape: x.expand(shape),
    "slice": _slice,
    "select": lambda x, dim, index: x.select(dim, index),
    "cat": lambda *xs, dim: torch.cat(xs, dim),
    "gather": _gather,
    "pad": _pad,
    "arange": lambda *, start, end, step, dtype: torch.arange(start, end, step, dtype=dtype),
    "copy_": _copy_into,
    "scatter": _scatter,
    "scatter_add": lambda x, index, src, *, dim: aten.scatter_add(x, dim, index, src),
    "scatter_reduce": lambda x, index, src, *, dim, reduce, include_self: aten.scatter_reduce(
        x, dim, index, src, reduce, include_self=include_self),
    "index_put": _index_put,
    "slice_scatter": lambda x, src, *, dim, start, end, step: aten.slice_scatter(
        x, src, dim, start, end, step),
}


def op_runner(op: TileOp, symbols) -> Callable[[list, tuple], Any]:
    """f(operand_values, syms) -> result for one tile op; sizes resolved per call."""
    fn = _number_operands(op.op, op.out.dtype) if op.op in _NUMBER_OPS else REFERENCE[op.op]
    attrs = dict(op.attrs)
    if op.op in ("full", "gather"):
        attrs["shape"] = op.out.shape
    keys = tuple(attrs)
    get_values = size_function(tuple(attrs.values()), symbols)
    if not contains_symbol(tuple(attrs.values())):  # static attributes: keywords made once
        kwargs = dict(zip(keys, get_values(())))
        return lambda values, syms: fn(*values, **kwargs)

    def run(values: list, syms: tuple):
        return fn(*values, **dict(zip(keys, get_values(syms))))

    return run


DEVICES = None  # torch runs the ops on any device


def check_available() -> None:
    """The reference target runs wherever torch does."""


def _in_strides(t, stride: tuple):
    """``t``, or a copy of it in ``stride`` where a dim of more than one element differs."""
    if not isinstance(t, torch.Tensor) or len(stride) != t.dim() or all(
            n <= 1 or a == b for n, a, b in zip(t.shape, t.stride(), stride)):
        return t
    if any(n > 1 and b == 0 for n, b in zip(t.shape, stride)):  # an expand's: no copy
        return t
    out = torch.empty_strided(t.shape, stride, dtype=t.dtype, device=t.device)
    return out.copy_(t)


def build(tile: FusionTile, graph: TileGraph) -> Kernel:
    """kernel(inputs, syms) -> outputs, running the tile's ops one by one with torch."""
    symbols = graph.symbols
    slots = {name: i for i, name in enumerate(tile.inputs)}
    program = []
    # a GEMM's bias add runs as torch.addmm / baddbmm, as the cpu target and eager's linear
    # do: one rounding of product + bias (float16 rounds the bare product otherwise)
    bias_add = gemm_bias_add(tile.ops, graph.specs, tile.outputs) \
        if tile.kind is OpKind.MATMUL else None
    mm = next(op for op in tile.ops if op.kind is OpKind.MATMUL) if bias_add else None
    for op in tile.ops:
        if op is mm:  # computed by the bias add (nothing else reads it)
            slots[op.name] = len(slots)
            program.append((lambda vals, syms: None, []))
            continue
        if op is bias_add:
            bias = next(a for a in op.args if a != mm.name)
            gemm = torch.addmm if len(mm.out.shape) == 2 else torch.baddbmm
            slots[op.name] = len(slots)
            program.append((lambda vals, syms, gemm=gemm: gemm(*vals),
                            [(0, slots[bias]), (0, slots[mm.args[0]]), (0, slots[mm.args[1]])]))
            continue
        operands = []
        for a in op.args:
            if isinstance(a, str):
                operands.append((0, slots[a]))
            elif is_symbolic(a):
                operands.append((1, size_function(a, symbols)))
            else:
                operands.append((2, resolve_static(a)))
        slots[op.name] = len(slots)
        program.append((op_runner(op, symbols), operands))
    out_slots = [slots[n] for n in tile.outputs]
    # Each output in the strides the graph declares (FakeTensor's), as a native kernel's
    # contiguous outputs are: torch's op may lay its result out otherwise (copysign of a
    # transposed input follows the input where the dynamic-shape trace says contiguous),
    # and AOTAutograd regenerates an output's aliases with as_strided on those strides
    # (fuzz seed 32653: a flattened view of such an output read the wrong elements).
    strides = [size_function(graph.specs[n].stride, symbols)
               if isinstance(graph.specs.get(n), TensorSpec) else None for n in tile.outputs]
    written = {op.name for op in tile.ops if op.op == "copy_"}  # in place: the input itself
    restride = [(j, f) for j, (n, f) in enumerate(zip(tile.outputs, strides))
                if f is not None and n not in written]

    def kernel(inputs: list, syms: tuple) -> list:
        env = list(inputs)
        for run, operands in program:
            vals = [env[x] if k == 0 else (x(syms) if k == 1 else x) for k, x in operands]
            env.append(run(vals, syms))
        outs = [env[i] for i in out_slots]
        for j, f in restride:
            outs[j] = _in_strides(outs[j], f(syms))
        return outs

    return Kernel(kernel)


def build_many(tiles: list[FusionTile], graph: TileGraph) -> list:
    return build_each(build, tiles, graph)
