"""Matmul lowerings. addmm/baddbmm become matmul + epilogue ops the planner may fuse."""
from __future__ import annotations

import math

import torch

from ..ir import OpKind
from ..sizes import is_symbolic
from .registry import Unsupported, register_lowering

aten = torch.ops.aten

# A 2-D float GEMM of static shapes with at most TINY_GEMM_MACS multiply-adds (a ResNet's
# classifier head, [4,32] x [32,10], and its two backward products) becomes a broadcast
# multiply and a sum: one small native kernel, fused with its neighbours where the planner
# can (the cpu target on the host only). MKL's call for it costs 2 us warm but 45-80 us in a training step, whose
# convolutions have evicted MKL's code and data (docs/benchmarks.md). Off: a GEMM tile.
TINY_GEMMS = True
TINY_GEMM_MACS = 2048


def _tiny(ctx, a, b) -> bool:
    cfg = ctx.config  # the host CPU's cold-MKL problem: an NPU's cube unit does GEMMs
    if cfg is None or cfg.target != "cpu" or cfg.hardware_name != "host":
        return False
    sa, sb = ctx.spec(a), ctx.spec(b)
    if not TINY_GEMMS or len(sa.shape) != 2 or len(sb.shape) != 2 or sa.dtype != sb.dtype \
            or sa.dtype not in (torch.float32, torch.float64):
        return False
    dims = (*sa.shape, sb.shape[1])
    return not any(is_symbolic(d) for d in dims) and math.prod(int(d) for d in dims) <= TINY_GEMM_MACS


def _tiny_mm(a, b):
    return (a.unsqueeze(2) * b.unsqueeze(0)).sum(1)


def _tiny_addmm(bias, a, b):
    return bias + _tiny_mm(a, b)


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
    if out_dtype is None and _tiny(ctx, a, b):
        from .composite import inline  # composite imports the lowering graph
        return inline(ctx, _tiny_mm, list(ctx.node.args[:2]), [a, b])
    return _matmul(ctx, a, b, out=ctx.out_spec)


@register_lowering(aten.addmm, aten.baddbmm)
def lower_addmm(ctx, bias, a, b, out_dtype=None, *, beta=1, alpha=1):
    _check_out_dtype(ctx, a, out_dtype)
    if out_dtype is None and alpha == 1 and beta == 1 and _tiny(ctx, a, b):
        from .composite import inline
        return inline(ctx, _tiny_addmm, list(ctx.node.args[:3]), [bias, a, b])
    product = _matmul(ctx, a, b)
    if alpha != 1:
        product = ctx.pointwise("mul", (product, alpha), out=ctx.spec(product))
    if beta == 0:
        return product
    if beta != 1:
        bias = ctx.pointwise("mul", (bias, beta), out=ctx.spec(bias))
    return ctx.pointwise("add", (product, bias))
