"""Inference convolutions as one oneDNN call: conv2d -> eval BatchNorm -> residual add -> ReLU.

The pass runs on the torch-level FX graph Dynamo hands the backend, before AOTAutograd
(as :mod:`.attention` does), and only for an inference graph: grad mode off, or no
example input requiring grad. There a chain

    y = conv2d(x, w, b); y = batch_norm(y, mean, var, gamma, beta, training=False)
    [y = y + other]; [y = relu(y)]

whose intermediates are read by the next op only, becomes one ``pypto_inductor::conv_fused``
call. That op (an extern of the ATen graph, kept whole like SDPA):

- folds the BatchNorm into the convolution's weight and bias
  (``w' = w * gamma / sqrt(var + eps)``, ``b' = (b - mean) * gamma / sqrt(var + eps) + beta``),
  computed in float32 once and cached per call site with the weight prepacked into oneDNN's
  blocked layout, keyed by the six tensors (by identity) and their version counters, so an
  in-place update of a weight or a statistic (``load_state_dict``, ``copy_``) refolds: never
  a stale weight;
- calls oneDNN's ``mkldnn::_convolution_pointwise`` with the add and the ReLU as post-ops
  (Inductor's CPU path uses the same op), so conv, BN, add and ReLU are one pass; or, with
  a oneDNN install of our own, a primitive held per call site (codegen/cpp/onednn_conv.py: ATen's
  call sets up ~25 us of descriptors each time, as much as a small convolution runs);
- runs channels-last: a channels-last input needs no reorder in oneDNN and the output stays
  channels-last, so a chain of convolutions converts once, at the first (measured 1.1-1.6x
  on the zoo ResNet's shapes, see docs/benchmarks.md). What follows (pooling, pointwise tiles)
  reads it through its strides.

Training graphs (grad needed) are never touched: BatchNorm in training normalises with the
batch statistics and the weights get gradients, so folding would be wrong.
"""
from __future__ import annotations

import dataclasses
import operator
import weakref

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch.fx.experimental.symbolic_shapes import optimization_hint

_CONV = {torch.conv2d, F.conv2d}
_BN = {F.batch_norm, torch.batch_norm}
_ADD = {operator.add, operator.iadd, torch.add}
_RELU = {F.relu, torch.relu, torch.relu_, F.relu_}
_OP_NAME = "pypto_inductor::conv_fused"
ENABLED = True  # the benchmark's switch for the "before" form
# a global average pool of a fused chain's (channels-last) output reduces the NHWC view:
# the NCHW-order reduction strides by C through memory (pool + Linear head at 4x64x32x32,
# compiled: 377 -> 60 us; docs/benchmarks.md "Conv nets, eval: where the time goes")
POOL_NHWC = True
# the residual add and the ReLU as oneDNN post-ops (True) or left to the pointwise kernels
# after the convolution (False): the A/B of "post-ops cost more per call than a fused pass"
FUSE_ADD = True
FUSE_RELU = True
# a oneDNN primitive held per call site instead of ATen's per-call setup (codegen/cpp/onednn_conv.py;
# only with a oneDNN install of our own, else ATen's call): zoo ResNet forward 1.2-1.6x
DIRECT_ONEDNN = True
# The held-primitive factory: make(x, w, b, stride, padding, dilation, groups, act, has_add)
# -> callable(x, other) or None. A target's: the cpu target installs
# codegen/cpp/onednn_conv.make (lowering knows no target); None: ATen's call.
direct_conv = None
_POOL = {F.adaptive_avg_pool2d, torch._C._nn.adaptive_avg_pool2d}
_MEAN = {torch.mean, "mean"}


@dataclasses.dataclass(frozen=True)
class ConvCost:
    """What the rewrite saves, for the fusion report's ROI: memory traffic of the passes
    after the convolution, their launches, and the convolution's own flops (common)."""
    unfused_bytes: int
    fused_bytes: int
    launches_saved: int
    conv_flops: int


def _pair(v) -> list[int]:
    return [int(v)] * 2 if isinstance(v, int) else [int(e) for e in v]


@torch.library.custom_op(_OP_NAME, mutates_args=())
def conv_fused(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None,
               mean: torch.Tensor | None, var: torch.Tensor | None,
               gamma: torch.Tensor | None, beta: torch.Tensor | None, eps: float,
               other: torch.Tensor | None, stride: list[int], padding: list[int],
               dilation: list[int], groups: int, act: str, site: int) -> torch.Tensor:
    return run_conv_fused(x, w, b, mean, var, gamma, beta, eps, other, stride, padding,
                          dilation, groups, act, site)


def run_conv_fused(x, w, b, mean, var, gamma, beta, eps, other, stride, padding, dilation,
                   groups, act, site):
    """The op's body. The compiled graph calls this directly: a Python custom op's own
    dispatch costs ~50 us a call, as much as a small convolution."""
    hit = FOLDED.get(site)
    # the versions written out, not through _versions: this check runs every call (~10 a
    # ResNet forward), and the generator and call were half of its ~4 us
    if (hit is None or hit[0]() is not w or hit[1]() is not b or hit[2]() is not mean
            or hit[3]() is not var or hit[4]() is not gamma or hit[5]() is not beta
            or hit[6] != (w._version, None if b is None else b._version,
                          None if mean is None else mean._version,
                          None if var is None else var._version,
                          None if gamma is None else gamma._version,
                          None if beta is None else beta._version)
            or hit[7] != x.shape
            or (hit[11] is not None and hit[11].threads != torch.get_num_threads())):
        hit = _fold(site, x, w, b, mean, var, gamma, beta, eps, stride, padding, dilation,
                    groups, act, other is not None)
    if hit[11] is not None:  # takes x as it is
        if other is not None:
            other = other.contiguous(memory_format=torch.channels_last)
        return hit[11](x, other)
    x = x.contiguous(memory_format=torch.channels_last)
    w, b = hit[8], hit[9]
    if hit[10]:
        unary, binary = hit[10]  # the resolved overloads: no OpOverloadPacket dispatch
        if other is None:
            return unary(x, w, b, padding, stride, dilation, groups, act, [], "")
        other = other.contiguous(memory_format=torch.channels_last)
        if groups > 1:  # ATen's binary op falls back to add_relu here: no bfloat16 kernel
            y = unary(x, w, b, padding, stride, dilation, groups, "none", [], "")
            y.add_(other)
            return y.relu_() if act == "relu" else y
        return binary(x, other, w, b, padding, stride, dilation, groups, "add", 1.0,
                      None if act == "none" else act, [], "")
    y = F.conv2d(x, w, b, stride, padding, dilation, groups)
    if other is not None:
        y = y + other
    return torch.relu(y) if act == "relu" else y


run_conv_fused.__name__ = "pypto_inductor.conv_fused.default"  # the report's op name


@conv_fused.register_fake
def _(x, w, b, mean, var, gamma, beta, eps, other, stride, padding, dilation, groups, act,
      site):
    n, _, h, wd = x.shape
    kh, kw = w.shape[2], w.shape[3]
    oh = (h + 2 * padding[0] - dilation[0] * (kh - 1) - 1) // stride[0] + 1
    ow = (wd + 2 * padding[1] - dilation[1] * (kw - 1) - 1) // stride[1] + 1
    return x.new_empty((n, w.shape[0], oh, ow)).contiguous(memory_format=torch.channels_last)


def _onednn_ok(x: torch.Tensor, w: torch.Tensor) -> bool:
    return (torch.backends.mkldnn.is_available() and x.device.type == "cpu"
            and x.dtype in (torch.float32, torch.bfloat16) and w.dtype == x.dtype)


# call site -> (weak refs to w, b, mean, var, gamma, beta, their versions, input shape,
# folded weight, folded bias, oneDNN's (unary, binary) ops or None, the held primitive
# (direct_conv's) or None). The tensors are
# compared by identity through weak refs (a dead one gives None, never a match; nothing
# keeps a deleted model's parameters alive), and an in-place update (load_state_dict,
# copy_) bumps the version.
FOLDED: dict[int, tuple] = {}


def _none():
    return None


def _ref(t):
    return _none if t is None else weakref.ref(t)


def _versions(*ts) -> tuple:
    return tuple(None if t is None else t._version for t in ts)


def _fold(site, x, w, b, mean, var, gamma, beta, eps, stride, padding, dilation, groups,
          act="none", has_add=False):
    """(weight, bias) with the BatchNorm folded in, the weight prepacked into oneDNN's
    blocked layout for ``x``'s shape when oneDNN runs it (or held in a primitive of our
    own, :data:`direct_conv`); filed under ``site``."""
    onednn = _onednn_ok(x, w)
    with torch.no_grad():
        fw, fb = w, b
        if mean is not None:
            scale = torch.rsqrt(var.float() + eps)
            if gamma is not None:
                scale = scale * gamma.float()
            shift = -mean.float() * scale
            if b is not None:
                shift = shift + b.float() * scale
            if beta is not None:
                shift = shift + beta.float()
            fw = (w.float() * scale.reshape(-1, 1, 1, 1)).to(w.dtype)
            fb = shift.to(w.dtype)
        direct = None
        if onednn and DIRECT_ONEDNN and direct_conv is not None:
            direct = direct_conv(x, fw, fb, stride, padding, dilation, groups, act,
                                 has_add)  # holds its own packed weight
        if onednn and direct is None:
            fw = torch._C._nn.mkldnn_reorder_conv2d_weight(
                fw.contiguous().to_mkldnn(), padding, stride, dilation, groups, list(x.shape))
        elif not onednn:
            fw = fw.contiguous(memory_format=torch.channels_last)
    hit = (*(_ref(t) for t in (w, b, mean, var, gamma, beta)),
           _versions(w, b, mean, var, gamma, beta), x.shape, fw, fb,
           (torch.ops.mkldnn._convolution_pointwise.default,
            torch.ops.mkldnn._convolution_pointwise.binary) if onednn else None, direct)
    FOLDED[site] = hit
    return hit


_sites = iter(range(1 << 62))


def node_arg(node: fx.Node, i: int, name: str, default):
    """Argument i of node, by position or by keyword name."""
    if len(node.args) > i:
        return node.args[i]
    return node.kwargs.get(name, default)


def _only_user(node: fx.Node) -> fx.Node | None:
    users = list(node.users)
    return users[0] if len(users) == 1 else None


def _is_const(a) -> bool:
    """A graph input (parameter/buffer) or absent: what the fold may treat as constant."""
    return a is None or (isinstance(a, fx.Node) and a.op == "placeholder")


def _val(a):
    return a.meta.get("example_value") if isinstance(a, fx.Node) else None


def rewrite_convolutions(gm: fx.GraphModule, example_inputs) -> list[tuple[str, str, str, "ConvCost"]]:
    """Rewrite the inference conv chains of ``gm`` in place; (first, last, reason, cost) per chain
    (the backend reports each as a fusion decision)."""
    graph = gm.graph
    if not ENABLED:
        return []
    if torch.is_grad_enabled() and any(
            isinstance(t, torch.Tensor) and t.requires_grad for t in example_inputs):
        return []  # a training graph: BatchNorm stats and weights are not constants
    if any(n.op == "call_function" and n.target is torch._C._set_grad_enabled
           for n in graph.nodes):
        return []
    decisions = []
    for conv in list(graph.nodes):
        if conv.op != "call_function" or conv.target not in _CONV:
            continue
        d = _rewrite_one(graph, conv)
        if d is not None:
            decisions.append(d)
    if decisions and POOL_NHWC:
        for node in list(graph.nodes):
            _rewrite_global_pool(graph, node)
    if decisions:
        graph.lint()
        gm.recompile()
    return decisions


def _rewrite_one(graph: fx.Graph, conv: fx.Node) -> tuple[str, str, str, "ConvCost"] | None:
    x, w = conv.args[0], node_arg(conv, 1, "weight", None)
    b = node_arg(conv, 2, "bias", None)
    stride, padding = node_arg(conv, 3, "stride", 1), node_arg(conv, 4, "padding", 0)
    dilation, groups = node_arg(conv, 5, "dilation", 1), node_arg(conv, 6, "groups", 1)
    xv, wv = _val(x), _val(w)
    ints = [e for v in (stride, padding, dilation) for e in (v if isinstance(v, (tuple, list))
                                                             else [v])]
    if (not all(isinstance(e, int) for e in ints) or not isinstance(groups, int)
            or xv is None or wv is None
            or xv.dim() != 4 or wv.dim() != 4 or not _is_const(w) or not _is_const(b)):
        return None
    chain, bn, other, act = [conv], None, None, "none"
    nxt = _only_user(conv)
    if (nxt is not None and nxt.target in _BN and nxt.args[0] is conv
            and node_arg(nxt, 5, "training", True) is False):
        bn_args = [node_arg(nxt, i, k, None) for i, k in
                   ((1, "running_mean"), (2, "running_var"), (3, "weight"), (4, "bias"))]
        eps = node_arg(nxt, 7, "eps", 1e-5)  # a graph input when Dynamo made it symbolic
        if (bn_args[0] is not None and bn_args[1] is not None and all(map(_is_const, bn_args))
                and isinstance(eps, (int, float))):
            bn = bn_args + [float(eps)]
            chain.append(nxt)
            nxt = _only_user(nxt)
    if (FUSE_ADD and nxt is not None and nxt.target in _ADD and len(nxt.args) == 2
            and not nxt.kwargs):
        a, c = nxt.args
        o = c if a is chain[-1] else a if c is chain[-1] else None
        ov, yv = _val(o), _val(chain[-1])
        if (o is not None and o is not chain[-1] and ov is not None and yv is not None
                and isinstance(ov, torch.Tensor) and ov.shape == yv.shape
                and ov.dtype == yv.dtype):
            other = o
            chain.append(nxt)
            nxt = _only_user(nxt)
    if FUSE_RELU and nxt is not None and nxt.target in _RELU and nxt.args[0] is chain[-1]:
        act = "relu"
        chain.append(nxt)
    if len(chain) == 1:
        return None
    last = chain[-1]
    with graph.inserting_before(last):
        mean, var, gamma, beta, eps = bn if bn else (None, None, None, None, 1e-5)
        new = graph.call_function(torch.ops.pypto_inductor.conv_fused.default, (
            x, w, b, mean, var, gamma, beta, eps, other, _pair(stride), _pair(padding),
            _pair(dilation), groups, act, next(_sites)))
    if "example_value" in last.meta:
        new.meta["example_value"] = last.meta["example_value"]
    last.replace_all_uses_with(new)
    for n in reversed(chain):
        graph.erase_node(n)
    names = " -> ".join(n.name for n in chain)
    yv = _val(conv)
    out_bytes = optimization_hint(yv.numel(), fallback=1 << 16) * yv.element_size()
    flops = 2 * out_bytes // yv.element_size() * optimization_hint(wv[0].numel(), fallback=1)
    # bytes each form moves: unfused, every op after the convolution is a pass over its
    # output (read + write; the add reads two); fused, the conv writes once (+ reads other)
    n_add = int(other is not None)
    unfused = out_bytes * (1 + 2 * (bn is not None) + 3 * n_add + 2 * (act != "none"))
    fused = out_bytes * (1 + n_add)
    cost = ConvCost(unfused, fused, len(chain) - 1, flops)
    return (chain[0].name, chain[-1].name,
                    f"inference conv chain {names}: one oneDNN convolution "
                    f"({'BatchNorm folded into the weights, ' if bn else ''}"
                    f"{'residual add and ' if other is not None else ''}{act} as post-ops,"
                    " channels-last)", cost)


def _global_pool_keepdim(node: fx.Node) -> bool | None:
    """Whether ``node`` is a global average pool over H and W of a 4-D tensor keeping them as
    1x1 (adaptive_avg_pool2d(x, 1), mean(x, (2, 3), keepdim=True)), dropping them (mean
    without keepdim), or None: not such a pool."""
    if node.op == "call_function" and node.target in _POOL:
        size = node_arg(node, 1, "output_size", None)
        return True if size in (1, (1, 1), [1, 1]) and len(node.args) <= 2 else None
    if (node.target in _MEAN and node.op in ("call_function", "call_method")
            and node_arg(node, 3, "dtype", None) is None):
        dims = node_arg(node, 1, "dim", None)
        dims = [dims] if isinstance(dims, int) else dims
        if (isinstance(dims, (tuple, list)) and len(dims) == 2
                and all(isinstance(d, int) for d in dims)
                and sorted(d % 4 for d in dims) == [2, 3]):
            keepdim = node_arg(node, 2, "keepdim", False)
            return keepdim if isinstance(keepdim, bool) else None
    return None


def _rewrite_global_pool(graph: fx.Graph, node: fx.Node) -> None:
    """A global average pool of a fused chain's output as a mean over the middle dims of
    its NHWC view (contiguous, as oneDNN wrote it)."""
    y = node.args[0] if node.args else None
    if not (isinstance(y, fx.Node) and y.op == "call_function"
            and y.target is torch.ops.pypto_inductor.conv_fused.default):
        return
    keepdim = _global_pool_keepdim(node)
    if keepdim is None:
        return
    with graph.inserting_before(node):
        nhwc = graph.call_function(torch.permute, (y, (0, 2, 3, 1)))
        new = graph.call_function(torch.mean, (nhwc, (1, 2)))
        if keepdim:
            new = graph.call_function(torch.unsqueeze, (new, -1))
            new = graph.call_function(torch.unsqueeze, (new, -1))
    if "example_value" in node.meta:
        new.meta["example_value"] = node.meta["example_value"]
    node.replace_all_uses_with(new)
    graph.erase_node(node)


__all__ = ["conv_fused", "rewrite_convolutions"]
