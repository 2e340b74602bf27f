"""Reductions and reduction + epilogue ops (softmax, log_softmax).

Every reduction tile op carries ``dims`` (sorted, non-negative) and ``keepdim``.
"""
from __future__ import annotations

import torch

from ..ir import OpKind
from ..sizes import is_symbolic
from .registry import Unsupported, register_lowering

aten = torch.ops.aten


def normalize_dims(dims, ndim: int) -> tuple[int, ...]:
    """Sorted non-negative reduction dims; None or [] mean all dims.

    A 0-d tensor has no dims to reduce: dim 0 / -1 (which ATen accepts for it)
    and "all dims" both become ``()``.
    """
    if dims is None or (isinstance(dims, (list, tuple)) and len(dims) == 0):
        return tuple(range(ndim))
    if isinstance(dims, int):
        dims = [dims]
    if ndim == 0:
        return ()
    return tuple(sorted({int(d) % ndim for d in dims}))


def _reduce(ctx, op, x, dims, keepdim, **attrs):
    ndim = len(ctx.spec(x).shape)
    return ctx.emit(op, OpKind.REDUCTION, (x,), dims=normalize_dims(dims, ndim),
                    keepdim=bool(keepdim), **attrs)


@register_lowering(aten.sum, aten.mean, aten.prod)
def lower_sum_mean(ctx, x, dims=None, keepdim=False, dtype=None):
    if ctx.aten_name == "prod" and isinstance(dims, (list, tuple)):
        raise Unsupported("prod over a dim list")
    if isinstance(dims, torch.dtype):  # sum.default(x, dtype)
        dims = None
    return _reduce(ctx, ctx.aten_name, x, dims, keepdim, dtype=ctx.out_spec.dtype)


@register_lowering(aten.amax, aten.amin, aten.logsumexp)
def lower_amax(ctx, x, dims=(), keepdim=False):
    return _reduce(ctx, ctx.aten_name, x, dims, keepdim)


@register_lowering(aten.any, aten.all)
def lower_any_all(ctx, x, dims=None, keepdim=False):
    return _reduce(ctx, ctx.aten_name, x, dims, keepdim)


@register_lowering(aten.argmax, aten.argmin)
def lower_argmax(ctx, x, dim=None, keepdim=False):
    spec = ctx.spec(x)
    if dim is None and len(spec.shape) > 1:
        # The index into the flattened tensor: argmax of a 1-D view, reshaped for keepdim.
        flat = ctx.emit("view", OpKind.LAYOUT, (x,), out=ctx.new_spec((spec.numel,), spec.dtype),
                        shape=(spec.numel,))
        if not keepdim:
            return _reduce(ctx, ctx.aten_name, flat, 0, False)
        index = _reduce(ctx, ctx.aten_name, flat, 0, False,
                        out=ctx.new_spec((), ctx.out_spec.dtype))
        return ctx.emit("view", OpKind.LAYOUT, (index,), shape=ctx.out_spec.shape)
    return _reduce(ctx, ctx.aten_name, x, 0 if dim is None else dim, keepdim)


@register_lowering(aten.max.default, aten.min.default)
def lower_max_all(ctx, x):
    """max(x) / min(x) with no dim: the extreme value over every element."""
    return _reduce(ctx, "amax" if ctx.aten_name == "max" else "amin", x, None, False)


@register_lowering(aten.max.dim, aten.min.dim)
def lower_max_dim(ctx, x, dim, keepdim=False):
    value_op, index_op = ("amax", "argmax") if ctx.aten_name == "max" else ("amin", "argmin")
    vals, idx = ctx.node.meta["val"]
    values = _reduce(ctx, value_op, x, dim, keepdim, out=ctx.new_spec(vals.shape, vals.dtype))
    return values, _reduce(ctx, index_op, x, dim, keepdim, out=ctx.new_spec(idx.shape, idx.dtype))


@register_lowering(aten.var, aten.std, aten.var_mean, aten.std_mean)
def lower_var(ctx, x, dims=None, unbiased=None, keepdim=False, *, correction=None):
    # var.correction(x, dims, *, correction, keepdim), var.dim(x, dims, unbiased, keepdim)
    if isinstance(dims, bool):  # var.default(x, unbiased)
        dims, unbiased = None, dims
    if correction is None:
        correction = 1 if unbiased is None or unbiased else 0
    spread = "std" if ctx.aten_name.startswith("std") else "var"
    if is_symbolic(correction):  # a dynamic correction: the ATen op runs with its value
        raise Unsupported("var/std with a correction known only at run time")
    val = ctx.node.meta["val"]
    if not ctx.aten_name.endswith("_mean"):
        return _reduce(ctx, spread, x, dims, keepdim, correction=float(correction))
    out = ctx.new_spec(val[0].shape, val[0].dtype)
    var = _reduce(ctx, spread, x, dims, keepdim, out=out, correction=float(correction))
    # eager's var_mean accumulates the mean in double (Welford), torch.mean in the dtype:
    # near the float max only the former stays finite
    mean = _reduce(ctx, "mean", x, dims, keepdim, out=out, dtype=out.dtype,
                   acc_dtype=torch.float64)
    return var, mean


@register_lowering(aten._softmax, aten._log_softmax)
def lower_softmax(ctx, x, dim, half_to_float=False):
    ndim = len(ctx.spec(x).shape)
    op = "softmax" if ctx.aten_name == "_softmax" else "log_softmax"
    return ctx.emit(op, OpKind.REDUCTION, (x,), dims=normalize_dims(dim, ndim), keepdim=True,
                    dtype=ctx.out_spec.dtype)


# A scan along a dim of at most this many static elements is lowered as a masked sum
# (n^2 products per scanned row); a longer or symbolic one runs ATen's cumsum.
CUMSUM_MAX = 1024


@register_lowering(aten.cumsum)
def lower_cumsum(ctx, x, dim, *, dtype=None):
    """cumsum as out[.., i, ..] = sum_j x[.., j, ..] * (j <= i): x viewed with a size-1 dim
    before ``dim``, a where over the [n, n] triangle from two aranges, and a sum over the
    j dim. Integer scans (position ids from a mask) are exact; float sums differ from
    eager's sequential scan by rounding, as any reordered sum."""
    spec, out = ctx.spec(x), ctx.out_spec
    ndim = len(spec.shape)
    if ndim == 0:
        return ctx.emit("cast", OpKind.CAST, (x,), dtype=out.dtype) \
            if out.dtype != spec.dtype else ctx.pointwise("copy", (x,))
    dim = int(dim) % ndim
    n = spec.shape[dim]
    if not n.is_number or int(n) > CUMSUM_MAX:
        raise Unsupported(f"cumsum along a dim of {n} elements (lowered up to {CUMSUM_MAX})")
    n, after = int(n), ndim - dim - 1
    if out.dtype != spec.dtype:
        x = ctx.emit("cast", OpKind.CAST, (x,), out=ctx.new_spec(spec.shape, out.dtype),
                     dtype=out.dtype)
    rows = tuple(spec.shape[:dim]) + (1, n) + tuple(spec.shape[dim + 1:])
    xv = ctx.emit("view", OpKind.LAYOUT, (x,), out=ctx.new_spec(rows, out.dtype), shape=rows)
    i_shape, j_shape = (n, 1) + (1,) * after, (1, n) + (1,) * after
    ar = ctx.emit("arange", OpKind.ELEMENTWISE, (), out=ctx.new_spec((n,), torch.int64),
                  start=0, end=n, step=1, dtype=torch.int64)
    i = ctx.emit("view", OpKind.LAYOUT, (ar,), out=ctx.new_spec(i_shape, torch.int64),
                 shape=i_shape)
    j = ctx.emit("view", OpKind.LAYOUT, (ar,), out=ctx.new_spec(j_shape, torch.int64),
                 shape=j_shape)
    tri = ctx.pointwise("le", (j, i), out=ctx.new_spec((n, n) + (1,) * after, torch.bool))
    full = tuple(spec.shape[:dim]) + (n, n) + tuple(spec.shape[dim + 1:])
    masked = ctx.pointwise("where", (tri, xv, 0), out=ctx.new_spec(full, out.dtype))
    return ctx.emit("sum", OpKind.REDUCTION, (masked,), out=out, dims=(dim + 1,),
                    keepdim=False, dtype=out.dtype)
