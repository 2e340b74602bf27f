"""Graphs with data-dependent sizes, split where those sizes appear.

With ``capture_dynamic_output_shape_ops`` or ``capture_scalar_outputs`` (MoE routing's
``nonzero``, boolean-mask indexing, ``.item()`` used as a size), an ATen graph holds ops whose
result sizes are *unbacked* symbols (``u0``): known only once the op has run, so no input's
size binds them and the whole graph could not be compiled (it ran eagerly). Split the graph
after each op that binds such a symbol (``node.meta["unbacked_bindings"]``), that op running
eagerly in a part of its own: every later part then receives the data-dependent tensor (or
SymInt) as an input, whose sizes bind the symbols as any dynamic input size does, and is
compiled like any graph. The parts run in order from one function (torch's ``split_module``
passes the values between them).
"""
from __future__ import annotations

import torch.fx as fx
from torch.fx.passes.split_module import split_module


def binds_unbacked(node: fx.Node) -> bool:
    return node.op == "call_function" and bool(node.meta.get("unbacked_bindings"))


def split_at_unbacked(gm: fx.GraphModule) -> tuple[fx.GraphModule, set[str]] | None:
    """``gm`` split into parts (submodules ``submod_<k>`` of the returned module, in order), and
    the names of the parts that run eagerly (one op binding unbacked sizes each); None when
    no op of ``gm`` binds one."""
    if not any(binds_unbacked(n) for n in gm.graph.nodes):
        return None
    part, parts, eager = 0, {}, set()
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        if binds_unbacked(node):
            part += 1
            parts[node] = part
            eager.add(f"submod_{part}")
            part += 1
        else:
            parts[node] = part
    split = split_module(gm, None, lambda n: parts[n], keep_original_order=True)
    return split, eager
