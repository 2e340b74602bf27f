"""Matmul lowerings. addmm/baddbmm become matmul + epilogue ops the planner may fuse."""
from __future__ import annotations

import torch

from ..ir import OpKind
from .registry import Unsupported, register_lowering

aten = torch.ops.aten


def _matmul(ctx, a, b, out=None):
    sa, sb = ctx.spec(a), ctx.spec(b)
    if sa.dtype != sb.dtype or not sa.dtype.is_floating_point:
        raise Unsupported(f"matmul of {sa.dtype} x {sb.dtype}")
    if out is None:
        shape = sa.shape[:-1] + sb.shape[-1:]
        out = ctx.new_spec(shape, sa.dtype)
    return ctx.emit("matmul", OpKind.MATMUL, (a, b), out=out)


def _check_out_dtype(ctx, a, out_dtype):
    """The .dtype overloads (e.g. mm.dtype) accumulate into another output dtype."""
    if out_dtype is not None and out_dtype != ctx.spec(a).dtype:
        raise Unsupported(f"matmul with out_dtype {out_dtype}")


@register_lowering(aten.mm, aten.bmm)
def lower_mm(ctx, a, b, out_dtype=None):
    _check_out_dtype(ctx, a, out_dtype)
    return _matmul(ctx, a, b, out=ctx.out_spec)


@register_lowering(aten.addmm, aten.baddbmm)
def lower_addmm(ctx, bias, a, b, out_dtype=None, *, beta=1, alpha=1):
    _check_out_dtype(ctx, a, out_dtype)
    product = _matmul(ctx, a, b)
    if alpha != 1:
        product = ctx.pointwise("mul", (product, alpha), out=ctx.spec(product))
    if beta == 0:
        return product
    if beta != 1:
        bias = ctx.pointwise("mul", (bias, beta), out=ctx.spec(bias))
    return ctx.pointwise("add", (product, bias))
