"""Multiplications and divisions by one, dropped from an ATen graph before lowering.

SDPA's math form (what AOTAutograd traces when the mask needs a gradient: T5's position
bias) scales q and k by ``sqrt(scale)`` each; with ``scale=1.0`` those are ``mul(x, 1.0)``:
two copy kernels forward, two backward, and the permuted k's copy saved for the backward
came out contiguous where the trace has it transposed, so the backward re-laid it out (a T5
attention block: ~75 us of ~1600). ``x * 1`` is ``x`` bit for bit (NaN, inf and -0.0
included), so readers of the product read ``x`` instead, as Inductor's no-op removal does.

A product is only dropped where that changes nothing else a caller sees:

- same shape, dtype and strides as ``x`` (readers were compiled for the trace's layout);
- when the product (or a view of it) is one of the graph's visible outputs, ``x`` must be
  storage this graph made and no other output holds: returning an input, or one buffer
  twice, would alias tensors eager returned separately (the outputs a training forward
  saves for its backward are not visible: aliasing an input there is what AOTAutograd
  saves anyway);
- not in graphs with a mutating op (a value read before and after a write differs).
"""
from __future__ import annotations

import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

from .cse import storage_of, storages_of

aten = torch.ops.aten
_ONE_OPS = {aten.mul.Tensor, aten.mul.Scalar, aten.div.Tensor, aten.div.Scalar}
ENABLED = True  # the benchmark's "before" switch


def _val(node):
    v = node.meta.get("val") if isinstance(node, fx.Node) else None
    return v if isinstance(v, torch.Tensor) else None


def _same_layout(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.dim() == b.dim() and all(
        statically_known_true(x == y) for x, y in (*zip(a.shape, b.shape),
                                                   *zip(a.stride(), b.stride())))


def drop_identity_ops(gm: fx.GraphModule, visible_outputs: int | None = None) -> int:
    """Drop ``gm``'s products and quotients by one in place; the graph's first
    ``visible_outputs`` outputs (all when None) are the caller's. Returns how many."""
    graph = gm.graph
    if not ENABLED or any(n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload)
                          and n.target._schema.is_mutable for n in graph.nodes):
        return 0
    out = graph.output_node().args[0]
    flat = list(out) if isinstance(out, (list, tuple)) else [out]
    visible = flat if visible_outputs is None else flat[:visible_outputs]
    # storages the visible outputs, and all outputs, hold (updated as products are dropped)
    shown, held, inputs = (storages_of(nodes) for nodes in (
        visible, flat, [n for n in graph.nodes if n.op == "placeholder"]))
    dropped = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target not in _ONE_OPS or len(node.args) != 2 \
                or node.kwargs:
            continue
        x, one = node.args
        v, xv = _val(node), _val(x)
        if v is None or xv is None or type(one) not in (int, float) or one != 1 \
                or not _same_layout(v, xv):
            continue
        mine, theirs = storage_of(node), storage_of(x)
        if mine is None or theirs is None:
            continue
        if mine in shown and (theirs in inputs or theirs in held):
            continue
        if mine in held:
            held.add(theirs)
        if mine in shown:
            shown.add(theirs)
        node.replace_all_uses_with(x)
        graph.erase_node(node)
        dropped += 1
    if dropped:
        graph.lint()
        gm.recompile()
    return dropped
