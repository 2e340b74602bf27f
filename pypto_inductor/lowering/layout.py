"""Layout lowerings: views (run zero-copy), clone and cat (materialise).

Every shape attribute is a tuple of sympy expressions; views never turn a
symbolic size into an int.
"""
from __future__ import annotations

import sympy
import torch

from ..ir import OpKind, TensorSpec, TileOp
from ..ops import OPS
from ..sizes import contiguous_strides, is_symbolic
from .graph import escapes, spec_of
from .registry import Unsupported, register_lowering

aten = torch.ops.aten
PERMUTED_GATHER = True  # see _permuted_producer; the benchmarks' switch for the "before" form
PERMUTED_POINTWISE = True  # the same for elementwise producers


def _view(ctx, op, x, **attrs):
    return ctx.emit(op, OpKind.LAYOUT, (x,), **attrs)


@register_lowering(aten.view, aten._unsafe_view, aten.reshape)
def lower_view(ctx, x, shape):
    return _reshape(ctx, x)


@register_lowering(aten.unsqueeze, aten.squeeze, aten.alias, aten.flatten, aten.unflatten)
def lower_reshape_like(ctx, x, *args, **kwargs):
    return _reshape(ctx, x)


def _reshape(ctx, x):
    """A row-major reshape; of an input laid out contiguously where eager's was not (a
    permuted gather, see _permuted_producer), contiguous too, so the kernels reading it are
    compiled for the layout it has."""
    out, spec = ctx.out_spec, ctx.spec(x)
    if PERMUTED_GATHER and isinstance(x, str) \
            and tuple(spec.stride) == contiguous_strides(spec.shape) \
            and tuple(out.stride) != contiguous_strides(out.shape) \
            and not escapes(ctx.node):  # returned: eager's strides
        out = ctx.new_spec(out.shape, out.dtype)
    return _view(ctx, "view", x, out=out, shape=out.shape)


@register_lowering(aten.permute)
def lower_permute(ctx, x, dims):
    ndim = len(ctx.spec(x).shape)
    dims = tuple(int(d) % ndim for d in dims)
    return _permuted_producer(ctx, x, dims) or _permute(ctx, x, dims)


def _permuted_producer(ctx, x, dims) -> str | None:
    """A permute of a gather or an elementwise op read by nothing else, as that op
    computing the permuted result, laid out contiguously.

    Both are elementwise over their output, so permuting them only renames dims: a gather's
    output dims say which source dim or index dim each reads; an elementwise op's operands
    (of the output's rank) are read through the same permute. T5's relative position bias,
    ``embedding(bucket[q, k], table[32, heads]).permute(2, 0, 1)``, then comes out
    [heads, q, k] in row-major order: the gather kernel runs rows of k instead of rows of
    ``heads`` (4) values. ATen's decomposition of ``where`` (the mask applied to that bias)
    computes in its operands' permuted layout, permutes back and copies: computed in the
    permuted order, its rows are contiguous instead of 4 values long, and the copy reads
    them in order. Only under such copies: other readers may want the permuted layout (a
    channels-last value permuted to NCHW for a convolution's backward)."""
    if not PERMUTED_GATHER or dims == tuple(range(len(dims))) or not isinstance(x, str):
        return None
    source = ctx.node.args[0]
    if len(getattr(source, "users", ())) != 1 or escapes(ctx.node):  # returned: eager's strides
        return None
    op = next((n for n in reversed(ctx.graph.nodes) if getattr(n, "name", None) == x), None)
    if getattr(op, "op", None) == "gather":
        inv = {m: k for k, m in enumerate(dims)}
        attrs = dict(op.attrs)
        attrs["source_dims"] = tuple(inv[k] if k >= 0 else k for k in op.attrs["source_dims"])
        attrs["index_dims"] = tuple(tuple(inv[k] for k in d) for d in op.attrs["index_dims"])
        args = op.args
    elif isinstance(op, TileOp) and _renames_dims(op) and PERMUTED_POINTWISE \
            and all(_contiguous_clone(u) for u in ctx.node.users) \
            and all(not isinstance(a, str) or len(ctx.spec(a).shape) in (0, len(dims))
                    for a in op.args):
        attrs = op.attrs
        args = tuple(_permute(ctx, a, dims) if isinstance(a, str) and ctx.spec(a).shape else a
                     for a in op.args)
    else:  # None, an extern op (no tile op), or an op whose permute is not a renaming
        return None
    ctx.maybe_unused.add(x)  # dropped unless something else reads it
    return ctx.emit(op.op, op.kind, args, ctx.new_spec(ctx.out_spec.shape, op.out.dtype),
                    **attrs)


def _renames_dims(op: TileOp) -> bool:
    """An elementwise op or cast of tensor operands whose attributes name no dim (not pad,
    arange or an in-place copy_): permuting its result permutes its operands."""
    info = OPS.get(op.op)
    return info is not None and info.kind in (OpKind.ELEMENTWISE, OpKind.CAST) \
        and bool(info.arity) and op.op != "copy_"


def _contiguous_clone(node) -> bool:
    fmt = node.kwargs.get("memory_format")
    return node.target == aten.clone.default and fmt in (None, torch.contiguous_format)


@register_lowering(aten.transpose, aten.t)
def lower_transpose(ctx, x, dim0=0, dim1=1):
    ndim = len(ctx.spec(x).shape)
    dims = list(range(ndim))
    if ndim >= 2:
        d0, d1 = int(dim0) % ndim, int(dim1) % ndim
        dims[d0], dims[d1] = dims[d1], dims[d0]
    return _permute(ctx, x, dims)


@register_lowering(aten.expand)
def lower_expand(ctx, x, shape, implicit=False):
    if tuple(ctx.spec(x).shape) == tuple(ctx.out_spec.shape):
        # expanding nothing (transformers' mask.expand(batch, -1, q, kv)): a view, which
        # fuses with its producer and consumers where an expand stops them
        return _view(ctx, "view", x, shape=ctx.out_spec.shape)
    return _view(ctx, "expand", x, shape=ctx.out_spec.shape)


@register_lowering(aten.as_strided)
def lower_as_strided(ctx, x, size, stride, storage_offset=None):
    """Only the restriding that moves no element: the input's sizes, and its own strides on
    every dim longer than 1 (AOTAutograd adds one to give a keepdim reduction of a
    channels-last tensor eager's strides). Any other as_strided reads raw storage."""
    src, out = ctx.node.args[0].meta.get("val"), ctx.node.meta["val"]
    if _contiguous_cover(src, out, storage_offset):  # a reshape (the restriding's backward)
        return _view(ctx, "view", x, shape=ctx.out_spec.shape)
    dims = () if src is None else (*src.shape, *src.stride(), *out.shape, *out.stride())
    if (src is None or not all(isinstance(d, int) for d in dims) or storage_offset
            or src.storage_offset() != 0 or tuple(src.shape) != tuple(out.shape)
            or any(n != 1 and a != b for n, a, b in zip(out.shape, src.stride(), out.stride()))):
        raise Unsupported("as_strided that moves elements (reads raw storage): no tile form")
    return _view(ctx, "view", x, shape=ctx.out_spec.shape)


def _contiguous_cover(src, out, storage_offset) -> bool:
    """Whether ``out`` (static) lays every element of the contiguous ``src`` out contiguously
    from offset 0: the as_strided is a reshape."""
    return (src is not None and not storage_offset and src.storage_offset() == 0
            and all(isinstance(d, int) for d in (*src.shape, *src.stride(), *out.shape,
                                                 *out.stride()))
            and src.is_contiguous() and out.is_contiguous() and src.numel() == out.numel())


@register_lowering(aten.as_strided_scatter)
def lower_as_strided_scatter(ctx, base, src, size, stride, storage_offset=None):
    """Only the scatter that overwrites all of a contiguous ``base`` contiguously (the
    backward of AOTAutograd's restriding of a channels-last keepdim mean, which writes the
    gradient into zeros of the same numel): ``src`` reshaped to ``base``'s shape."""
    b, v = ctx.node.args[0].meta.get("val"), ctx.node.args[1].meta.get("val")
    if b is None or v is None or not _contiguous_cover(b, v, storage_offset) \
            or tuple(v.stride()) != tuple(int(e) for e in stride) \
            or tuple(v.shape) != tuple(int(e) for e in size):
        raise Unsupported("as_strided_scatter of part of its base: no tile form")
    return ctx.pointwise("copy", (_view(ctx, "view", src, out=ctx.new_spec(
        ctx.out_spec.shape, ctx.out_spec.dtype), shape=ctx.out_spec.shape),))


_MATMULS = {aten.mm.default, aten.bmm.default}
_VIEWS = {aten.view.default, aten._unsafe_view.default, aten.reshape.default}


@register_lowering(aten.clone)
def lower_clone(ctx, x, memory_format=None):
    """A copy; one that only feeds matmuls (through views) may write a transposed layout.

    ``q @ k.transpose(-2, -1)`` becomes expand -> clone -> view -> bmm: the clone makes
    the transposed K contiguous, a strided read of every element. BLAS takes a transposed
    operand as it is, so when the input's unit stride is on its second-to-last dim the
    copy writes the last two dims swapped (contiguous rows read and written) and hands
    the matmul a transposed view, provided every reshape on the way stays a view.
    """
    spec = ctx.spec(x)
    n = len(spec.shape)
    if n < 2 or spec.stride[-2] != 1 or spec.stride[-1] == 1 \
            or not all(isinstance(s, (int, sympy.Integer)) for s in spec.shape):
        return ctx.pointwise("copy", (x,))
    swap = (*range(n - 2), n - 1, n - 2)
    shape = tuple(spec.shape[d] for d in swap)
    written = torch.empty([int(s) for s in shape], device="meta").transpose(-2, -1)
    if not _feeds_matmuls_as_views(ctx.node, written):
        return ctx.pointwise("copy", (x,))
    inner = ctx.pointwise("copy", (_permute(ctx, x, swap),), out=ctx.new_spec(shape, spec.dtype))
    return _permute(ctx, inner, swap)


def _permute(ctx, x, dims):
    """The permuted view, strided as its input is here (a permuted producer's result is
    contiguous where eager's was not: eager's strides would send its readers down the
    strided path)."""
    spec = ctx.spec(x)
    out = TensorSpec(tuple(spec.shape[d] for d in dims), tuple(spec.stride[d] for d in dims),
                     spec.dtype)
    return _view(ctx, "permute", x, out=out, dims=tuple(dims))


def _feeds_matmuls_as_views(node, value) -> bool:
    """Every use of ``node`` (whose result would be laid out as the meta tensor ``value``)
    is an mm/bmm operand BLAS reads in place, directly or through reshapes that stay
    views of that layout."""
    if not node.users:
        return False
    for user in node.users:
        if user.target in _VIEWS:
            try:
                viewed = value.view([int(s) for s in user.args[1]])
            except (RuntimeError, ValueError, TypeError):  # would copy, or a symbolic size
                return False
            if not _feeds_matmuls_as_views(user, viewed):
                return False
        elif user.target not in _MATMULS or 1 not in value.stride()[-2:]:
            return False
    return True


@register_lowering(aten.slice.Tensor)
def lower_slice(ctx, x, dim=0, start=None, end=None, step=1):
    in_shape = ctx.spec(x).shape
    dim = int(dim) % len(in_shape)
    size = in_shape[dim]
    if int(step) <= 0:
        raise Unsupported("slice with a non-positive step")
    # The output length is known from the metadata; keep start and length symbolic.
    length = ctx.out_spec.shape[dim]
    return _view(ctx, "slice", x, dim=dim, start=slice_start(ctx, start, end, size, length, step),
                 length=length, step=int(step))


def slice_start(ctx, start, end, size, length, step=1):
    """Where ``x[start:end:step]`` along a dim of ``size`` starts, ``length`` long (traced).
    A symbolic start that may be negative by the trace's value ranges (``x[:, -k:]`` for
    an int input ``k``) counts from the end when it is, which only the trace knew: a slice
    to the end (step 1) starts at ``size - length``."""
    start = sympy.Integer(0) if start is None else start
    if not is_symbolic(start) or start.is_nonnegative or _lower_bound(ctx, start) >= 0:
        return clamp_index(start, size)
    if int(step) == 1 and (end is None or (not is_symbolic(end) and int(end) >= 2 ** 62)):
        return size - length
    raise Unsupported(f"a slice starting at {start}, which may be negative")


def may_be_empty(ctx, length) -> bool:
    """Whether a ``length`` may be 0 at run time (by the trace's value ranges)."""
    return _lower_bound(ctx, length) < 1


def _lower_bound(ctx, expr):
    """The least value of a size expression over the trace's value ranges (-inf: unknown)."""
    if not is_symbolic(expr):
        return int(expr)
    env = getattr(getattr(ctx.node.meta.get("val"), "fake_mode", None), "shape_env", None)
    try:
        return env.bound_sympy(expr).lower
    except Exception:  # noqa: BLE001 - no shape env, or an expression it cannot bound
        return -sympy.oo


def clamp_index(index, size):
    if isinstance(index, (int, sympy.Integer)) and int(index) < 0:
        return sympy.Max(size + index, 0)
    if isinstance(index, (int, sympy.Integer)) and not isinstance(size, sympy.Integer):
        return sympy.Min(index, size)
    if isinstance(index, (int, sympy.Integer)):
        return sympy.Integer(min(int(index), int(size)))
    return index


@register_lowering(aten.select.int)
def lower_select(ctx, x, dim, index):
    in_shape = ctx.spec(x).shape
    dim = int(dim) % len(in_shape)
    if isinstance(index, (int, sympy.Integer)) and int(index) < 0:
        index = in_shape[dim] + index
    return _view(ctx, "select", x, dim=dim, index=index)


@register_lowering(aten.split.Tensor, aten.split_with_sizes)
def lower_split(ctx, x, split, dim=0):
    in_shape = ctx.spec(x).shape
    dim = int(dim) % len(in_shape)
    outs, start = [], sympy.Integer(0)
    for val in ctx.node.meta["val"]:
        spec = spec_of(val)  # a view's own strides, which its readers' layouts rely on
        length = spec.shape[dim]
        outs.append(_view(ctx, "slice", x, out=spec, dim=dim, start=start, length=length, step=1))
        start = start + length
    return tuple(outs)


@register_lowering(aten.unbind)
def lower_unbind(ctx, x, dim=0):
    in_shape = ctx.spec(x).shape
    dim = int(dim) % len(in_shape)
    return tuple(
        _view(ctx, "select", x, out=spec_of(v), dim=dim, index=i)
        for i, v in enumerate(ctx.node.meta["val"])
    )


@register_lowering(aten.cat)
def lower_cat(ctx, tensors, dim=0):
    out = ctx.out_spec
    dim = int(dim) % len(out.shape)
    # ATen skips legacy 1-D empty inputs; if every input is one, the result is one too. Parts
    # empty along the cat dim add nothing (an empty KV cache before the first token).
    parts = [t for t in tensors if ctx.spec(t).shape != (0,)
             and not (len(ctx.spec(t).shape) == len(out.shape) and ctx.spec(t).shape[dim] == 0)]
    parts = [_cast(ctx, t, out.dtype) for t in parts or tensors[:1]]  # cat promotes dtypes
    if len(parts) == 1 and ctx.spec(parts[0]).shape == out.shape:
        return ctx.pointwise("copy", (parts[0],))
    return ctx.emit("cat", OpKind.LAYOUT, tuple(parts), dim=dim)


def _cast(ctx, x, dtype):
    spec = ctx.spec(x)
    if spec.dtype == dtype:
        return x
    return ctx.emit("cast", OpKind.CAST, (x,), out=ctx.new_spec(spec.shape, dtype), dtype=dtype)


@register_lowering(aten.repeat)
def lower_repeat(ctx, x, repeats):
    """x tiled ``repeats`` times: x viewed as [1, s0, 1, s1, ...], expanded to
    [r0, s0, r1, s1, ...], copied, and viewed as [r0 * s0, r1 * s1, ...]."""
    from .mutation import expanded

    spec = ctx.spec(x)
    repeats = [sympy.sympify(r) for r in repeats]
    shape = (sympy.Integer(1),) * (len(repeats) - len(spec.shape)) + tuple(spec.shape)
    if len(repeats) < len(spec.shape):
        raise Unsupported("repeat with fewer repeats than dims")
    split = tuple(s for size in shape for s in (sympy.Integer(1), size))
    tiled = tuple(s for r, size in zip(repeats, shape) for s in (r, size))
    unsqueezed = _view(ctx, "view", x, out=ctx.new_spec(split, spec.dtype), shape=split)
    wide = _view(ctx, "expand", unsqueezed, out=expanded(ctx.spec(unsqueezed), tiled),
                 shape=tiled)
    copied = ctx.pointwise("copy", (wide,), out=ctx.new_spec(tiled, spec.dtype))
    return _view(ctx, "view", copied, shape=ctx.out_spec.shape)
