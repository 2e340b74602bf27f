"""Composite ATen ops lowered through a decomposition traced at lowering time.

``nn.TransformerEncoderLayer`` in eval (no grad, batch_first) takes PyTorch's fast path,
one ``aten._transformer_encoder_layer_fwd`` call that Dynamo and AOTAutograd keep
whole. Its lowering traces :func:`encoder_layer` (the same math written with ATen ops,
as the fast path computes it) on the node's fake tensors with the backend's
decomposition table and lowers every traced node like a graph node: the layer
becomes matmuls, softmax and LayerNorm tiles that fuse as the slow path's would.
"""
from __future__ import annotations

import math

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils._pytree import tree_flatten, tree_unflatten

from ..config import parse_options
from .decompositions import decomposition_table
from .graph import lower_node
from .registry import Unsupported, register_lowering

aten = torch.ops.aten


def encoder_layer(src, embed_dim, num_heads, qkv_weight, qkv_bias, proj_weight, proj_bias,
                  use_gelu, norm_first, eps, norm_weight_1, norm_bias_1, norm_weight_2,
                  norm_bias_2, ffn_weight_1, ffn_bias_1, ffn_weight_2, ffn_bias_2, mask=None,
                  mask_type=None):
    """``_transformer_encoder_layer_fwd``: src [B, L, E] (batch first). A mask is read as
    the fast path does: nonzero (or True) masks a score out, and ``mask_type`` says its
    layout (0: [L, L], 1: key padding [B, L], else broadcast to [B, H, L, L]); a row
    with every score masked is NaN, as eager's."""
    batch, length, _ = src.shape
    head_dim = embed_dim // num_heads
    if mask is not None:
        mask = mask if mask.dtype == torch.bool else mask != 0
        if mask_type == 1:
            mask = mask.view(batch, 1, 1, length)

    def attention(x):
        qkv = F.linear(x, qkv_weight, qkv_bias).view(batch, length, 3, num_heads, head_dim)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)
        q = q / math.sqrt(head_dim)  # the fast path scales q (after its bias) before q @ k^T
        scores = q @ k.transpose(-2, -1)
        if mask is None:
            probs = torch.softmax(scores, dim=-1)
        else:
            probs = torch.softmax(scores.masked_fill(mask, float("-inf")), dim=-1)
        out = (probs @ v).transpose(1, 2).reshape(batch, length, embed_dim)
        return F.linear(out, proj_weight, proj_bias)

    def feed_forward(x):
        h = F.linear(x, ffn_weight_1, ffn_bias_1)
        return F.linear(F.gelu(h) if use_gelu else F.relu(h), ffn_weight_2, ffn_bias_2)

    def norm1(x):
        return F.layer_norm(x, (embed_dim,), norm_weight_1, norm_bias_1, eps)

    def norm2(x):
        return F.layer_norm(x, (embed_dim,), norm_weight_2, norm_bias_2, eps)

    if norm_first:
        x = src + attention(norm1(src))
        return x + feed_forward(norm2(x))
    x = norm1(src + attention(src))
    return norm2(x + feed_forward(x))


@register_lowering(aten._transformer_encoder_layer_fwd)
def lower_transformer_encoder_layer(ctx, src, *args, mask=None, mask_type=None):
    node = ctx.node
    fx_args = list(node.args) + [node.kwargs[k] for k in ("mask", "mask_type") if k in node.kwargs]
    values = [src, *args] + [v for k, v in (("mask", mask), ("mask_type", mask_type))
                             if k in node.kwargs]
    return inline(ctx, encoder_layer, fx_args, values)


def inline(ctx, fn, fx_args, values, many: bool = False):
    """Trace ``fn`` on the FX node's arguments ``fx_args`` (fake tensors of its operands,
    ints, floats, lists of them) and lower each traced node into ``ctx.graph``; ``values``
    are the same arguments as the lowering got them (value names for tensors). Returns the
    result's value name (a tuple of them for a list result)."""
    outer = ctx.node
    leaves, spec = tree_flatten(fx_args)
    tensors = [a for a in leaves if isinstance(a, fx.Node)]
    fakes = [a.meta["val"] for a in tensors]

    def traced_fn(*tensor_values):
        it = iter(tensor_values)
        args = tree_unflatten([next(it) if isinstance(a, fx.Node) else a for a in leaves], spec)
        return fn(*args)

    try:
        gm = make_fx(traced_fn, decomposition_table=decomposition_table())(*fakes)
    except Exception as e:  # noqa: BLE001 - the op then runs eagerly, with the reason
        raise Unsupported(f"{outer.name}: tracing its decomposition failed: {e}") from e
    env: dict = {}
    placeholders = iter(v for a, v in zip(leaves, tree_flatten(values)[0])
                        if isinstance(a, fx.Node))
    config = parse_options(None)
    try:
        for node in gm.graph.nodes:
            if node.op == "placeholder":
                env[node] = next(placeholders)
            elif node.op == "call_function":
                node.name = f"{outer.name}_{node.name}"  # unique among the outer graph's
                env[node] = lower_node(ctx, node, env, config)
            elif node.op == "output":
                result = node.args[0]
                if isinstance(result, (list, tuple)) and len(result) == 1 and not many:
                    result = result[0]
                if isinstance(result, (list, tuple)):
                    return tuple(env[r] for r in result)
                return env[result]
            else:
                raise Unsupported(f"{outer.name}: its decomposition has a {node.op} node")
    finally:
        ctx.node = outer
    raise Unsupported(f"{outer.name}: its decomposition has no output")



# --- _foreach_* (the optimizers' multi-tensor path, foreach=True) -----------------------------
def _addcmul(x, t1, t2, value=1):
    return x + value * t1 * t2  # ATen's association: self + (value * t1) * t2


def _addcdiv(x, t1, t2, value=1):
    return x + value * t1 / t2


def _maximum(x, y):
    return torch.maximum(x, y) if isinstance(y, torch.Tensor) else torch.clamp_min(x, y)


def _minimum(x, y):
    return torch.minimum(x, y) if isinstance(y, torch.Tensor) else torch.clamp_max(x, y)


_FOREACH = {
    "add": torch.add, "sub": torch.sub, "mul": torch.mul, "div": torch.div,
    "pow": torch.pow, "maximum": _maximum, "minimum": _minimum,
    "clamp_min": torch.clamp_min, "clamp_max": torch.clamp_max, "lerp": torch.lerp,
    "addcmul": _addcmul, "addcdiv": _addcdiv, "copysign": torch.copysign,
    **{name: getattr(torch, name) for name in (
        "neg", "reciprocal", "sqrt", "rsqrt", "exp", "expm1", "log", "log1p", "log2",
        "log10", "abs", "sign", "sigmoid", "tanh", "sin", "cos", "tan", "asin", "acos",
        "atan", "sinh", "cosh", "erf", "erfc", "floor", "ceil", "round", "trunc", "frac")},
}


def _lower_foreach(ctx, *args, **kwargs):
    """out[i] = op(args[i] for list args, the same for others): each element lowered as the
    single-tensor op (its decomposition for addcmul, lerp, ...), fusing like any other."""
    node = ctx.node
    name = node.target.overloadpacket.__name__[len("_foreach_"):]
    if node.target._overloadname == "Tensor" and name in ("addcmul", "addcdiv"):
        raise Unsupported(f"_foreach_{name}.Tensor (per-tensor scalars in a tensor)")
    op = _FOREACH[name]
    lists = [a for a in node.args if isinstance(a, (list, tuple))]
    n = len(lists[0])
    fixed = dict(node.kwargs)

    def elementwise(*xs):
        return [op(*[x[i] if isinstance(x, (list, tuple)) else x for x in xs], **fixed)
                for i in range(n)]

    return inline(ctx, elementwise, list(node.args), list(args), many=True)


for _name in _FOREACH:
    _packet = getattr(aten, f"_foreach_{_name}", None)
    if _packet is not None:
        register_lowering(*[getattr(_packet, o) for o in _packet.overloads()
                            if "out" not in o])(_lower_foreach)
