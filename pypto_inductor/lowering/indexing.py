"""Indexed reads and writes: embedding, index, gather, padding, scatter, index_put.

Reads become one canonical tile op, ``gather``: ``out[o] = src[s(o)]`` where each
source dim d is read either at an output coordinate (``source_dims[d] = k >= 0``:
output dim k) or at the value of index tensor j (``source_dims[d] = -1 - j``),
index j being aligned to the output dims ``index_dims[j]`` (size-1 dims
broadcast). Negative indices wrap when ``wrap`` (``index``), else they are out of
range (``embedding``, ``gather``); out-of-range indices raise as eager does.
A gather is elementwise over its output, so it fuses with what follows as a
prologue (embedding + position add + LayerNorm in one kernel); its source and
indices are read from memory (the planner does not fuse their producers into it).

``constant_pad_nd`` is a ``pad`` tile op (negative pads are slice views first),
``slice_scatter`` with step 1 a ``cat`` of its base's slices and the source.
Writes at data-dependent positions (``scatter``, ``scatter_add``,
``scatter_reduce``, ``index_put``, strided ``slice_scatter``) are tile ops that
never share a kernel (:data:`STANDALONE_OPS`): every value of their result may
depend on every element of the source. The exception is a scatter one element wide
along its dim (cross-entropy's backward), an elementwise ``where`` (:func:`_one_hot_scatter`).
"""
from __future__ import annotations

import sympy
import torch

from ..ir import OpKind, TensorSpec, TileOp
from ..sizes import is_symbolic
from .layout import may_be_empty, slice_start
from .registry import Unsupported, register_lowering

aten = torch.ops.aten

INDEX_DTYPES = (torch.int64, torch.int32)
# Tile ops writing at data-dependent positions: each runs as a kernel of its own.
STANDALONE_OPS = frozenset({"scatter", "scatter_add", "scatter_reduce", "index_put",
                            "slice_scatter"})
ONE_HOT_SCATTER = True  # see _one_hot_scatter; the benchmarks' switch for the "before" form


def _index(ctx, name, what: str) -> str:
    if not isinstance(name, str):
        raise Unsupported(f"{what} with a non-tensor index")
    dtype = ctx.spec(name).dtype
    if dtype not in INDEX_DTYPES:
        # bool/uint8 masks select a data-dependent number of elements
        raise Unsupported(f"{what} with {str(dtype)[6:]} indices")
    return name


def gather(ctx, src: str, indices: list[str], source_dims, index_dims, wrap: bool,
           check: str) -> str:
    """Emit a ``gather`` tile op (see the module docstring) with the node's result spec."""
    out = ctx.out_spec
    for j, (idx, dims) in enumerate(zip(indices, index_dims)):
        shape = ctx.spec(idx).shape
        if len(shape) != len(dims) or any(not (s == 1 or s == out.shape[k])
                                          for s, k in zip(shape, dims)):
            raise Unsupported(f"{check}: index {j} of shape {list(shape)} does not align with "
                              f"the result {list(out.shape)}")
    return ctx.emit("gather", OpKind.BROADCAST, (src, *indices), out,
                    source_dims=tuple(source_dims), index_dims=tuple(map(tuple, index_dims)),
                    wrap=wrap, check=check)


@register_lowering(aten.embedding)
def lower_embedding(ctx, weight, indices, padding_idx=-1, scale_grad_by_freq=False,
                    sparse=False):
    """weight[indices]: padding_idx and the rest only matter for the backward."""
    if len(ctx.spec(weight).shape) != 2:
        raise Unsupported("embedding of a weight that is not 2-D")
    n = len(ctx.spec(_index(ctx, indices, "embedding")).shape)
    return gather(ctx, weight, [indices], (-1, n), [tuple(range(n))], False, "embedding")


@register_lowering(aten.index_select)
def lower_index_select(ctx, x, dim, index):
    ndim = len(ctx.spec(x).shape)
    if ndim == 0 or len(ctx.spec(_index(ctx, index, "index_select")).shape) > 1:
        raise Unsupported("index_select of a 0-d tensor or with a multi-dim index")
    dim = int(dim) % ndim
    dims = [d if d != dim else -1 for d in range(ndim)]
    index_dims = [(dim,)] if ctx.spec(index).shape else [()]
    return gather(ctx, x, [index], dims, index_dims, False, "index_select")


@register_lowering(aten.gather)
def lower_gather(ctx, x, dim, index, sparse_grad=False):
    ndim = len(ctx.spec(x).shape)
    if ndim == 0 or len(ctx.spec(_index(ctx, index, "gather")).shape) != ndim:
        raise Unsupported("gather of a 0-d tensor, or with an index of another rank")
    dim = int(dim) % ndim
    dims = [d if d != dim else -1 for d in range(ndim)]
    return gather(ctx, x, [index], dims, [tuple(range(ndim))], False, "gather")


@register_lowering(aten.index.Tensor, aten.index.Tensor_hacked_twin)
def lower_index(ctx, x, indices):
    """x[i0, None, i1, ...] (advanced indexing with integer tensors).

    The index tensors broadcast to one shape B. When the indexed dims are adjacent B
    replaces them in place, else B comes first and the other dims follow in order.
    """
    shape = ctx.spec(x).shape
    if len(indices) > len(shape):
        raise Unsupported("index with more indices than dims")
    positions = [d for d, i in enumerate(indices) if i is not None]
    if not positions:
        raise Unsupported("index without index tensors")
    tensors = [_index(ctx, indices[d], "index") for d in positions]
    rank = max(len(ctx.spec(t).shape) for t in tensors)
    adjacent = positions == list(range(positions[0], positions[-1] + 1))
    start = positions[0] if adjacent else 0
    source_dims, k = [], 0
    for d in range(len(shape)):
        if d in positions:
            source_dims.append(-1 - positions.index(d))
            continue
        if k == start:
            k += rank  # the broadcast index block
        source_dims.append(k)
        k += 1
    if len(ctx.out_spec.shape) != len(shape) - len(positions) + rank:
        raise Unsupported("index result of an unexpected rank")
    index_dims = []
    for t in tensors:
        r = len(ctx.spec(t).shape)
        index_dims.append(tuple(range(start + rank - r, start + rank)))
    # An index that is arange(0, size of its dim) along one of its dims reads the source at
    # that output coordinate: no index tensor to load, an affine read the kernel vectorises
    # (transformers' padding mask is attention_mask[arange(batch)[:, None, None, None],
    # arange(kv)[None, None, None, :]]: 120 us as a byte gather at 4 x 128 x 128).
    kept = []
    for j, (t, dims) in enumerate(zip(tensors, index_dims)):
        along = _arange_dim(ctx, t, shape[positions[j]])
        if along is None or dims[along] in source_dims:  # x[ar, ar]: one coordinate, twice
            kept.append(j)
        else:
            source_dims[positions[j]] = dims[along]
            ctx.maybe_unused.add(t)  # the arange and its views, when nothing else reads them
    if len(kept) < len(tensors):
        for d, j in enumerate(source_dims):
            if j < 0:
                source_dims[d] = -1 - kept.index(-1 - j)
        tensors = [tensors[j] for j in kept]
        index_dims = [index_dims[j] for j in kept]
        from .graph import escapes

        out = ctx.out_spec.shape
        if not tensors and source_dims == sorted(set(source_dims)) and all(
                out[k] == 1 for k in range(len(out)) if k not in source_dims) \
                and not escapes(ctx.node):
            # every dim read in order, size-1 dims between: a reshape (a view on any target);
            # a returned result stays a gather, a fresh tensor as eager's
            return ctx.emit("view", OpKind.LAYOUT, (x,), shape=out)
    return gather(ctx, x, tensors, source_dims, index_dims, True, "index")


def _arange_dim(ctx, name: str, size) -> int | None:
    """The dim along which the index ``name`` holds 0, 1, ..., size - 1 (size-1 dims
    elsewhere), when its tile ops say so (``arange(0, size)`` through views that add or
    remove size-1 dims and additions of 0); else None."""
    shape = ctx.spec(name).shape
    long = [q for q, s in enumerate(shape) if s != 1]
    if len(long) != 1 or shape[long[0]] != size:
        return None
    producers = {n.name: n for n in reversed(ctx.graph.nodes) if isinstance(n, TileOp)}
    node = producers.get(name)
    while node is not None:
        if node.op == "view" or (node.op == "add" and len(node.args) == 2
                                 and isinstance(node.args[0], str)
                                 and node.args[1] == 0 and not node.attrs):
            node = producers.get(node.args[0])
        elif node.op == "arange":
            a = node.attrs
            ok = a["start"] == 0 and a["step"] == 1 and a["end"] == size
            return long[0] if ok else None
        else:
            return None
    return None


@register_lowering(aten.constant_pad_nd)
def lower_constant_pad_nd(ctx, x, pad, value=0):
    """A ``pad`` tile op: ``pads[d] = (before, after)`` per dim, filled with ``value``;
    negative constant pads crop first (slice views), so they are >= 0 unless they are
    size arguments of unknown sign (which pad or crop as F.pad does)."""
    spec = ctx.spec(x)
    ndim = len(spec.shape)
    if len(pad) % 2 or len(pad) // 2 > ndim:
        raise Unsupported("constant_pad_nd with a malformed pad list")
    pads = [(sympy.Integer(0), sympy.Integer(0))] * ndim
    for i in range(len(pad) // 2):
        pads[ndim - 1 - i] = (sympy.sympify(pad[2 * i]), sympy.sympify(pad[2 * i + 1]))
    if any(not (p.is_number or p.is_integer) for pair in pads for p in pair):
        raise Unsupported("constant_pad_nd with non-integer pads")
    for d, (lo, hi) in enumerate(pads):
        if lo.is_number and hi.is_number and (lo < 0 or hi < 0):
            x = _crop(ctx, x, d, max(-int(lo), 0), max(-int(hi), 0))
            pads[d] = (sympy.Integer(max(int(lo), 0)), sympy.Integer(max(int(hi), 0)))
        # pads of unknown sign (size arguments): kept, F.pad's semantics for either sign
    if all(lo == 0 and hi == 0 for lo, hi in pads):
        return ctx.pointwise("copy", (x,))
    return ctx.emit("pad", OpKind.BROADCAST, (x,), pads=tuple(pads), value=value)


def _crop(ctx, x, dim, before, after):
    spec = ctx.spec(x)
    if not before and not after:
        return x
    length = spec.shape[dim] - before - after
    shape = spec.shape[:dim] + (length,) + spec.shape[dim + 1:]
    out = TensorSpec(shape, spec.stride, spec.dtype)
    return ctx.emit("slice", OpKind.LAYOUT, (x,), out=out, dim=dim, start=sympy.Integer(before),
                    length=length, step=1)


@register_lowering(aten.slice_scatter)
def lower_slice_scatter(ctx, x, src, dim=0, start=None, end=None, step=1):
    """x with x[dim][start:end:step] = src. With step 1: cat(x[:start], src, x[end:]),
    the parts of x being slice views (read in place by the cat's kernel)."""
    spec = ctx.spec(x)
    ndim = len(spec.shape)
    dim = int(dim) % ndim
    size = spec.shape[dim]
    length = ctx.spec(src).shape[dim]
    start = slice_start(ctx, start, end, size, length, step)
    # a part that is empty only at run time would be read out of its tensor by the cat's
    # select (both parts of a row are loaded): the generic op then
    if int(step) != 1 or ctx.spec(src).dtype != spec.dtype or any(
            is_symbolic(n) and may_be_empty(ctx, n) for n in (start, size - start - length)):
        return ctx.emit("slice_scatter", OpKind.BROADCAST, (x, src), dim=dim, start=start,
                        end=size if end is None else end, step=int(step))
    parts = []
    for lo, n in ((sympy.Integer(0), start), (start, None), (start + length, size - start - length)):
        if n is None:
            parts.append(src)
            continue
        if n == 0:
            continue
        shape = spec.shape[:dim] + (n,) + spec.shape[dim + 1:]
        parts.append(ctx.emit("slice", OpKind.LAYOUT, (x,),
                              out=TensorSpec(shape, spec.stride, spec.dtype),
                              dim=dim, start=lo, length=n, step=1))
    if len(parts) == 1:
        return ctx.pointwise("copy", (src,), out=ctx.out_spec)
    return ctx.emit("cat", OpKind.LAYOUT, tuple(parts), dim=dim)


# --- writes at data-dependent positions: kernels of their own -------------------------------
def _scalar_or_name(ctx, v):
    return ctx.scalar_constants.get(v, v) if isinstance(v, str) else v


def _one_hot_scatter(ctx, x, dim: int, index: str, src):
    """``scatter(x, dim, index, src)`` whose index is one element wide along ``dim`` and
    spans x on every other dim (cross-entropy's backward: ``scatter(zeros, 1, target, -1)``)
    as ``where(arange == index, src, x)``: elementwise, so it fuses with the ``full`` before
    it and the softmax gradient after it instead of running as a kernel of its own. The
    index goes through a bounds-checked ``gather`` of the arange first, so an index out of
    range raises as eager's scatter does. None when the scatter is not of that form."""
    xs, ix = ctx.spec(x), ctx.spec(index)
    ndim = len(xs.shape)
    if ndim == 0 or len(ix.shape) != ndim or ix.shape[dim] != 1 or xs.shape[dim] == 1 \
            or any(ix.shape[d] != xs.shape[d] for d in range(ndim) if d != dim):
        return None
    n = xs.shape[dim]
    if not n.is_number:
        return None
    if isinstance(src, str):
        if ctx.spec(src).shape != ix.shape or ctx.spec(src).dtype != xs.dtype:
            return None  # a larger src is read only at the index's positions
    elif isinstance(src, float) and not xs.dtype.is_floating_point:
        return None  # the value's conversion to an integer x: left to ATen
    elif xs.dtype == torch.bool and not isinstance(src, bool):
        return None  # where(bool x, 1) would promote to int64: left to ATen
    elif not isinstance(src, (bool, int, float)):
        return None
    ar = ctx.emit("arange", OpKind.ELEMENTWISE, (), out=ctx.new_spec((int(n),), torch.int64),
                  start=0, end=int(n), step=1, dtype=torch.int64)
    checked = ctx.emit("gather", OpKind.BROADCAST, (ar, index),
                       out=ctx.new_spec(ix.shape, torch.int64), source_dims=(-1,),
                       index_dims=(tuple(range(ndim)),), wrap=False, check="scatter")
    iota_shape = tuple(int(n) if d == dim else 1 for d in range(ndim))
    iota = ctx.emit("view", OpKind.LAYOUT, (ar,), out=ctx.new_spec(iota_shape, torch.int64),
                    shape=iota_shape)
    hit = ctx.pointwise("eq", (iota, checked), out=ctx.new_spec(xs.shape, torch.bool))
    return ctx.pointwise("where", (hit, src, x))


@register_lowering(aten.scatter)
def lower_scatter(ctx, x, dim, index, src, *, reduce=None):
    ndim = len(ctx.spec(x).shape)
    dim = int(dim) % max(ndim, 1)
    src = _scalar_or_name(ctx, src)
    if reduce is None and ONE_HOT_SCATTER:
        one_hot = _one_hot_scatter(ctx, x, dim, _index(ctx, index, "scatter"), src)
        if one_hot is not None:
            return one_hot
    return ctx.emit("scatter", OpKind.BROADCAST, (x, _index(ctx, index, "scatter"), src),
                    dim=dim, reduce=reduce)


@register_lowering(aten.scatter_add)
def lower_scatter_add(ctx, x, dim, index, src):
    ndim = len(ctx.spec(x).shape)
    return ctx.emit("scatter_add", OpKind.BROADCAST, (x, _index(ctx, index, "scatter_add"), src),
                    dim=int(dim) % max(ndim, 1))


@register_lowering(aten.scatter_reduce.two)
def lower_scatter_reduce(ctx, x, dim, index, src, reduce, *, include_self=True):
    ndim = len(ctx.spec(x).shape)
    return ctx.emit("scatter_reduce", OpKind.BROADCAST,
                    (x, _index(ctx, index, "scatter_reduce"), src),
                    dim=int(dim) % max(ndim, 1), reduce=reduce, include_self=bool(include_self))


@register_lowering(aten.index_put, aten.index_put.hacked_twin)
def lower_index_put(ctx, x, indices, values, accumulate=False):
    """x with x[indices] = values (or += with accumulate); operands (x, values, *tensors),
    ``positions`` the dims the index tensors index."""
    positions = tuple(d for d, i in enumerate(indices) if i is not None)
    if not positions:
        raise Unsupported("index_put without index tensors")
    for d in positions:
        if not isinstance(indices[d], str) or ctx.spec(indices[d]).dtype not in INDEX_DTYPES \
                + (torch.bool, torch.uint8):
            raise Unsupported("index_put with an index that is not an integer or bool tensor")
    values = _scalar_or_name(ctx, values)
    return ctx.emit("index_put", OpKind.BROADCAST, (x, values, *[indices[d] for d in positions]),
                    positions=positions, accumulate=bool(accumulate))
