"""Mutations: ``copy_`` into graph inputs, and the functional ``copy``.

With ``keep_inference_input_mutations=True`` AOTAutograd ends a graph that mutates
an input (a BatchNorm running stat, an optimizer's parameters and moments, a
user's ``x.add_(1)``) with ``copy_(input, new_value)``. That becomes the tile op
``copy_(dst, src)`` (attr ``mutates=dst``): elementwise over ``dst``, writing
``src`` (broadcast and cast to ``dst``) into it in place; its value is ``dst``.
It fuses like any elementwise op, so the kernel computing the new value writes it
straight into the input where the target can (see ``codegen/cpp_analysis.py``),
and the planner runs every other reader of ``dst`` before it.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from ..ir import OpKind, TensorSpec
from ..sizes import contiguous_strides
from .registry import Unsupported, register_lowering

aten = torch.ops.aten


def _aliases(node: fx.Node) -> list[fx.Node]:
    """``node`` and every FX value that is a view of it (transitively)."""
    out, stack = [], [node]
    while stack:
        n = stack.pop()
        out.append(n)
        for user in n.users:
            target = user.target
            if isinstance(target, torch._ops.OpOverload) and target._schema.returns \
                    and target._schema.returns[0].alias_info is not None \
                    and not target._schema.returns[0].alias_info.is_write:
                stack.append(user)
    return out


@register_lowering(aten.copy_.default)
def lower_copy_(ctx, dst, src, non_blocking=False):
    node = ctx.node
    target = node.args[0]
    if not isinstance(target, fx.Node) or target.op != "placeholder":
        raise Unsupported("copy_ into a value that is not a graph input")
    for alias in _aliases(target):
        for user in alias.users:
            if user is not node and node < user:
                # it would read the new value: our kernels order readers before the write
                raise Unsupported(f"copy_ into {target.name}, which {user.name} reads after")
    return ctx.pointwise("copy_", (dst, src), out=ctx.spec(dst), mutates=dst)


@register_lowering(aten.copy.default)
def lower_copy(ctx, x, src, non_blocking=False):
    """copy(x, src): src broadcast to x's shape and cast to its dtype, a new tensor."""
    out = ctx.out_spec
    from .graph import escapes  # graph imports the lowerings
    if escapes(ctx.node) and tuple(out.stride) != tuple(contiguous_strides(out.shape)):
        # eager's copy keeps x's strides; a returned view of it (x.copy_(y); return
        # x.expand(...)) is an alias of the input x, which AOTAutograd regenerates as
        # x.as_strided(<this result's sizes and strides>) when it cannot replay the
        # view (a symbolic size): a contiguous result would read past x's elements
        raise Unsupported("copy of a strided tensor returned as a view: eager's layout")
    src = ctx.scalar_constants.get(src, src) if isinstance(src, str) else src
    if not isinstance(src, str):
        return ctx.emit("full", OpKind.ELEMENTWISE, (), value=src, dtype=out.dtype)
    spec = ctx.spec(src)
    if spec.shape != out.shape:
        src = ctx.emit("expand", OpKind.LAYOUT, (src,), out=expanded(spec, out.shape),
                       shape=out.shape)
    if spec.dtype != out.dtype:
        return ctx.emit("cast", OpKind.CAST, (src,), dtype=out.dtype)
    return ctx.pointwise("copy", (src,))


def expanded(spec: TensorSpec, shape) -> TensorSpec:
    """The spec of ``spec`` expanded to ``shape`` (broadcast dims get stride 0)."""
    lead = len(shape) - len(spec.shape)
    strides = []
    for k, size in enumerate(shape):
        d = k - lead
        same = d >= 0 and spec.shape[d] == size
        strides.append(spec.stride[d] if same else 0)
    return TensorSpec(tuple(shape), tuple(strides), spec.dtype)
