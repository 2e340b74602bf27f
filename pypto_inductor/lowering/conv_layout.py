"""Training convolutions and max pooling channels-last (Inductor's ``layout_optimization``).

The pass runs on the torch-level FX graph Dynamo hands the backend, before AOTAutograd (as
:mod:`.conv` and :mod:`.attention` do), and only for a training graph (grad mode on and an
example input requiring grad: inference graphs get :mod:`.conv`'s fused chains, which are
channels-last already). Before each 2-D convolution's and max pooling's input it inserts
``x.contiguous(memory_format=torch.channels_last)``. Tracing the graph then decides the layout
of everything else:

- the first conversion of a chain copies (the stem's input); the convolution's output is
  channels-last (oneDNN keeps its input's format), the decomposed BatchNorm, ReLU, residual
  adds and pooling that follow keep it (ATen's pointwise ops take their input's layout), so
  every later conversion is already satisfied and traces to nothing: one conversion per chain;
- the weights stay as they are (NCHW parameters): ``aten.convolution`` with a channels-last
  input runs oneDNN channels-last and reorders the small weight itself, and AccumulateGrad
  gives the weight's gradient the parameter's layout;
- autograd differentiates the conversion (a clone: its gradient passes through), so the
  backward graph's ``convolution_backward`` and ``max_pool2d_with_indices_backward`` read
  channels-last gradients too. Max pooling's indices are per plane (``h * W + w``) in either
  memory format, so the backward scatters to the same positions.

Where it wins: oneDNN's channels-last convolutions skip the reorders it does around NCHW
ones, and ATen's channels-last max pooling vectorises over channels (the zoo ResNet's stem
pool: 1611 us NCHW against 261 us channels-last, forward). BatchNorm's statistics over a
channels-last activation are then column sums (channels innermost), which
``codegen/cpp/emit_columns.py`` runs natively.

``CHANNELS_LAST_TRAINING = False`` is the benchmark's "before" form (NCHW as traced).
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch._prims_common import is_channels_last_contiguous_or_false, is_contiguous_or_false
from torch.fx.experimental.symbolic_shapes import statically_known_true

CHANNELS_LAST_TRAINING = True
NHWC_KERNELS = True  # compute_channels_last's switch: off, channels-last values are written NCHW

_CONV = {torch.conv2d, F.conv2d}
_POOL = {F.max_pool2d, torch.max_pool2d, F.max_pool2d_with_indices}


def _val(a):
    return a.meta.get("example_value") if isinstance(a, fx.Node) else None


def _wants(node: fx.Node) -> bool:
    """A 2-D convolution or max pooling on a 4-D floating CPU input."""
    if node.op != "call_function" or node.target not in _CONV | _POOL or not node.args:
        return False
    xv = _val(node.args[0])
    return (isinstance(xv, torch.Tensor) and xv.dim() == 4 and xv.device.type == "cpu"
            and xv.dtype in (torch.float32, torch.bfloat16, torch.float16))


def use_channels_last(gm: fx.GraphModule, example_inputs) -> list[str]:
    """Insert the channels-last conversions into the training graph ``gm`` in place; the
    names of the ops whose input now is channels-last."""
    if not CHANNELS_LAST_TRAINING or not torch.is_grad_enabled() or not any(
            isinstance(t, torch.Tensor) and t.requires_grad for t in example_inputs):
        return []
    graph = gm.graph
    nodes = [n for n in graph.nodes if _wants(n)]
    if not any(n.target in _CONV for n in nodes):
        return []  # pooling alone: a conversion each way for one op
    for node in nodes:
        x = node.args[0]
        with graph.inserting_before(node):
            cl = graph.call_method("contiguous", (x,), {"memory_format": torch.channels_last})
        xv = _val(x)
        cl.meta["example_value"] = xv.contiguous(memory_format=torch.channels_last)
        node.replace_input_with(x, cl)
    graph.lint()
    gm.recompile()
    return [n.name for n in nodes]


def keep_eager_output_layouts(gm: fx.GraphModule) -> None:
    """Give the graph's outputs eager's memory format again after a layout pass (this one,
    :mod:`.patch_conv`, :mod:`.conv`'s channels-last chains): a feature map returned
    channels-last where eager's is contiguous breaks the caller's ``.view`` (Inductor's
    ``keep_output_stride`` does the same). Eager's layouts are the output values' example
    values, which the passes leave as traced; ``contiguous`` of a tensor already in that
    format traces to nothing."""
    graph = gm.graph
    out = graph.output_node()
    changed = False

    def restore(a):
        nonlocal changed
        v = _val(a)
        if not isinstance(v, torch.Tensor) or a.op == "placeholder":
            return a
        for fmt, known in ((torch.contiguous_format, is_contiguous_or_false),
                           (torch.channels_last, is_channels_last_contiguous_or_false)):
            if known(v) and (fmt is torch.contiguous_format or v.dim() == 4):
                with graph.inserting_before(out):
                    new = graph.call_method("contiguous", (a,), {"memory_format": fmt})
                new.meta["example_value"] = v
                changed = True
                return new
        return a

    out.args = fx.node.map_arg(out.args, restore)
    if changed:
        graph.lint()
        gm.recompile()


# ---- the ATen graphs: channels-last values computed in NHWC order --------------------------

_TO_NHWC, _TO_NCHW = [0, 2, 3, 1], [0, 3, 1, 2]
_aten = torch.ops.aten
_COPIES = {_aten.clone.default, _aten._to_copy.default}
_REDUCTIONS = {_aten.sum.dim_IntList, _aten.mean.dim, _aten.amax.default, _aten.amin.default,
               _aten.var_mean.correction, _aten.var.correction}


def _channels_last(v) -> bool:
    """A 4-D tensor laid out channels-last and not also contiguous (C or H*W of 1)."""
    if not isinstance(v, torch.Tensor) or v.dim() != 4:
        return False
    n, c, h, w = v.shape
    want = (c * h * w, 1, w * c, c)
    st = v.stride()
    if not all(statically_known_true(a == b) for a, b, d in zip(st, want, v.shape)
               if not statically_known_true(d == 1)):
        return False
    contiguous = (c * h * w, h * w, w, 1)
    return not all(statically_known_true(a == b) for a, b, d in zip(st, contiguous, v.shape)
                   if not statically_known_true(d == 1))


def compute_channels_last(gm: fx.GraphModule) -> int:
    """Rewrite the ATen graph ``gm`` in place so every pointwise op and reduction whose
    operand or result is channels-last runs on the NHWC view of it (``permute(0, 2, 3, 1)``,
    contiguous) and its result is the NCHW view back.

    Our kernels write their outputs contiguous in the order of their logical dims; without
    this a channels-last value (the FakeTensor's strides) would be written NCHW, and the
    convolutions and pooling reading it would run NCHW (and kernels compiled for the strides
    of the trace would read other strides). A permute of a permute back is the tensor
    itself, so a chain of pointwise ops has no view between its ops; the views are where the
    chain meets a convolution, pooling or the graph's inputs and outputs. BatchNorm's
    statistics over [N, H, W] become reductions over the outer dims of [N*H*W, C]: column
    sums. Returns the number of ops rewritten."""
    if not NHWC_KERNELS:
        return 0
    graph = gm.graph
    back: dict[fx.Node, fx.Node] = {}  # an NCHW view we made -> the NHWC tensor it views
    done = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
            continue
        val = node.meta.get("val")
        tensors = [a for a in node.args if isinstance(a, fx.Node)
                   and isinstance(a.meta.get("val"), torch.Tensor)]
        if node.target in _REDUCTIONS:
            if not tensors or tensors[0] is not node.args[0] \
                    or not _channels_last(node.args[0].meta["val"]):
                continue
            new = _reduction(graph, node, back)
        elif (torch.Tag.pointwise in node.target.tags or node.target in _COPIES) \
                and not node.target._schema.is_mutable and _channels_last(val) and tensors:
            new = _pointwise(graph, node, back)
        else:
            continue
        if new is not None:
            done += 1
    if done:
        graph.eliminate_dead_code()
        graph.lint()
        gm.recompile()
    return done


def _fake(target, args, kwargs):
    fake_args = fx.node.map_arg(args, lambda n: n.meta["val"])
    fake_kwargs = fx.node.map_arg(kwargs, lambda n: n.meta["val"])
    return target(*fake_args, **fake_kwargs)


def _call(graph, target, args, kwargs=None):
    kwargs = kwargs or {}
    node = graph.call_function(target, tuple(args), kwargs)
    node.meta["val"] = _fake(target, tuple(args), kwargs)
    return node


def _nhwc(graph, a: fx.Node, back: dict) -> fx.Node:
    """``a`` (rank <= 4, broadcasting against a 4-D value) as the NHWC view."""
    if a in back:
        return back[a]
    v = a.meta["val"]
    if v.dim() < 4:
        a = _call(graph, _aten.view.default, (a, [1] * (4 - v.dim()) + list(v.shape)))
    return _permute(graph, a, _TO_NHWC)


def _permute(graph, a: fx.Node, dims: list[int]) -> fx.Node:
    """``a.permute(dims)``; a view (reshape) where only dims of size 1 move, e.g. the
    BatchNorm statistics [1, C, 1, 1]: a view joins the kernels either side, a permute
    stops fusion (the statistics and the normalisation would be two kernels)."""
    v = a.meta["val"]
    big = [d for d in dims if not statically_known_true(v.shape[d] == 1)]
    if big == sorted(big) and v.is_contiguous():
        return _call(graph, _aten.view.default, (a, [v.shape[d] for d in dims]))
    return _call(graph, _aten.permute.default, (a, dims))


def _nchw(graph, node: fx.Node, new: fx.Node, back: dict) -> fx.Node:
    out = _permute(graph, new, _TO_NCHW)
    back[out] = new
    node.replace_all_uses_with(out)
    graph.erase_node(node)
    return out


def _pointwise(graph, node: fx.Node, back: dict):
    if any(isinstance(a.meta.get("val"), torch.Tensor) and a.meta["val"].dim() > 4
           for a in node.all_input_nodes):
        return None
    with graph.inserting_before(node):
        args = [(_nhwc(graph, a, back) if isinstance(a, fx.Node)
                 and isinstance(a.meta.get("val"), torch.Tensor) else a) for a in node.args]
        kwargs = dict(node.kwargs)
        if any(isinstance(v, fx.Node) for v in kwargs.values()):
            return None
        if "memory_format" in kwargs:  # the NHWC copy is a contiguous one
            kwargs["memory_format"] = torch.contiguous_format
        new = _call(graph, node.target, args, kwargs)
        return _nchw(graph, node, new, back)


def _reduction(graph, node: fx.Node, back: dict):
    x = node.args[0]
    dims = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
    keepdim = node.kwargs.get("keepdim", node.args[2] if len(node.args) > 2
                              and node.target is not _aten.var_mean.correction
                              and node.target is not _aten.var.correction else False)
    if dims is None or not isinstance(keepdim, bool):
        return None
    dims = [int(d) % 4 for d in dims]
    kept = [d for d in range(4) if d not in dims]
    at = sorted(_TO_NHWC.index(d) for d in kept)
    if at and at[-1] - at[0] != len(at) - 1:
        return None  # kept dims apart in NHWC (N and C of a mean over H, W): stays NCHW
    if not keepdim and kept != sorted(kept, key=_TO_NHWC.index):
        return None  # the kept dims would come out in another order
    with graph.inserting_before(node):
        args = [_nhwc(graph, x, back), sorted(_TO_NHWC.index(d) for d in dims),
                *node.args[2:]]
        new = _call(graph, node.target, args, dict(node.kwargs))
        if not keepdim:
            node.replace_all_uses_with(new)
            graph.erase_node(node)
            return new
        if isinstance(node.meta["val"], torch.Tensor):
            return _nchw(graph, node, new, back)
        outs = []  # var_mean: (var, mean), each permuted back
        for i in range(len(node.meta["val"])):
            item = _call(graph, operator.getitem, (new, i))
            outs.append(_permute(graph, item, _TO_NCHW))
            back[outs[-1]] = item
        for user in list(node.users):
            if user.target is operator.getitem:
                user.replace_all_uses_with(outs[user.args[1]])
                graph.erase_node(user)
        graph.erase_node(node)
        return new


__all__ = ["CHANNELS_LAST_TRAINING", "compute_channels_last", "use_channels_last"]
