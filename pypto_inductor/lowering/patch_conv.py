"""Patchifying convolutions as one GEMM over patches (ViT, DeiT, CLIP and Swin patch embeddings,
ConvNeXt's stem).

A 2-D convolution whose stride equals its kernel, with no padding, dilation 1 and one group,
reads every input pixel at most once: output pixel (i, j) is the patch
``x[:, :, i*kh:(i+1)*kh, j*kw:(j+1)*kw]`` dotted with each filter. So it is a linear layer over
the patches (the pass runs on the torch-level FX graph, before AOTAutograd, like
:mod:`.conv_layout`)::

    patches = x[..., :Hp*kh, :Wp*kw].reshape(N, C, Hp, kh, Wp, kw)
               .permute(0, 2, 4, 1, 3, 5).reshape(N*Hp*Wp, C*kh*kw)
    y = linear(patches, w.reshape(O, C*kh*kw), b).reshape(N, Hp, Wp, O).permute(0, 3, 1, 2)

Why: oneDNN runs these as a general convolution (the zoo ViT's [4,3,64,64] 8x8/8 patch
embedding, one thread: 120-150 us forward, 180-200 us for the weight gradient; a channels-last
training graph also copies the input once more), where the GEMM is 79 us and the weight
gradient one more GEMM over the saved patches (~70 us). The patch gather is a copy the tile
kernels fuse. ``y`` comes out channels-last strided, as oneDNN's output would, and ViT's
``flatten(2).transpose(1, 2)`` of it is then the GEMM's own [N, Hp*Wp, O] layout, no copy.
Autograd differentiates the rewrite: the input's gradient (when it needs one) is a GEMM and
the inverse permutation.

Only C, H and W need be static (the batch may be symbolic: the reshapes take -1 there).
``ENABLED = False`` is the benchmark's "before" form.
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx
import torch.nn.functional as F

from .conv import node_arg

ENABLED = True

_CONV = {torch.conv2d, F.conv2d}


def _pair(v) -> tuple | None:
    v = tuple(v) if isinstance(v, (tuple, list)) else (v, v)
    return v if len(v) == 2 and all(type(e) is int for e in v) else None


def _patch_shape(conv: fx.Node) -> tuple[int, ...] | None:
    """(N or -1, C, H, W, O, kh, kw) of a patchifying convolution, or None."""
    x, w = conv.args[0], node_arg(conv, 1, "weight", None)
    xv = x.meta.get("example_value") if isinstance(x, fx.Node) else None
    wv = w.meta.get("example_value") if isinstance(w, fx.Node) else None
    if not (isinstance(xv, torch.Tensor) and isinstance(wv, torch.Tensor)) or xv.dim() != 4 \
            or wv.dim() != 4 or xv.device.type != "cpu" or xv.dtype != wv.dtype \
            or xv.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return None
    stride, padding = _pair(node_arg(conv, 3, "stride", 1)), _pair(node_arg(conv, 4, "padding", 0))
    dilation, groups = _pair(node_arg(conv, 5, "dilation", 1)), node_arg(conv, 6, "groups", 1)
    shape = (*xv.shape[1:], *wv.shape)
    if not all(type(e) is int for e in shape) or groups != 1 or padding != (0, 0) \
            or dilation != (1, 1):
        return None
    c, h, wd, o, wc, kh, kw = shape
    if stride != (kh, kw) or wc != c or h < kh or wd < kw or kh * kw == 1:
        return None  # a 1x1 convolution is a GEMM to oneDNN already
    n = xv.shape[0]  # -1 for a symbolic batch (Dynamo specializes 0 and 1)
    return n if type(n) is int else -1, c, h, wd, o, kh, kw


def patchify_convolutions(gm: fx.GraphModule) -> list[tuple[str, str, str, None]]:
    """Rewrite ``gm``'s patchifying convolutions as GEMMs, in place; (name, name, reason, None)
    per convolution (the backend reports each as a decision, as :mod:`.conv`'s chains)."""
    if not ENABLED:
        return []
    graph, done = gm.graph, []
    for conv in list(graph.nodes):
        if conv.op != "call_function" or conv.target not in _CONV:
            continue
        shape = _patch_shape(conv)
        if shape is None:
            continue
        n, c, h, wd, o, kh, kw = shape
        hp, wp = h // kh, wd // kw
        x, w, b = conv.args[0], node_arg(conv, 1, "weight", None), node_arg(conv, 2, "bias", None)
        with graph.inserting_before(conv):
            if (hp * kh, wp * kw) != (h, wd):  # the convolution skips the remainder
                x = _call(graph, "call_function", operator.getitem,
                          x, (Ellipsis, slice(0, hp * kh), slice(0, wp * kw)))
            p = _call(graph, "call_method", "reshape", x, n, c, hp, kh, wp, kw)
            p = _call(graph, "call_method", "permute", p, 0, 2, 4, 1, 3, 5)
            p = _call(graph, "call_method", "reshape", p, n * hp * wp if n > 0 else -1, c * kh * kw)
            wm = _call(graph, "call_method", "reshape", w, o, c * kh * kw)
            y = _call(graph, "call_function", F.linear, p, wm, b)
            y = _call(graph, "call_method", "reshape", y, n, hp, wp, o)
            y = _call(graph, "call_method", "permute", y, 0, 3, 1, 2)
        y.meta["example_value"] = conv.meta["example_value"]  # eager's, as later values' are
        conv.replace_all_uses_with(y)
        graph.erase_node(conv)
        done.append((conv.name, conv.name, f"patchifying convolution (stride = kernel "
                     f"{kh}x{kw}): one GEMM over the {hp}x{wp} patches", None))
    if done:
        graph.lint()
        gm.recompile()
    return done


def _call(graph: fx.Graph, op: str, target, *args) -> fx.Node:
    """A new node, with its example value (later passes read them) from its inputs' values."""
    node = graph.create_node(op, target, args)
    vals = [a.meta["example_value"] if isinstance(a, fx.Node) else a for a in args]
    fn = getattr(torch.Tensor, target) if op == "call_method" else target
    node.meta["example_value"] = fn(*vals)
    return node
