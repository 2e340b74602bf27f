"""Common subexpressions of an inference ATen graph, merged before lowering.

Two calls of one ATen op on the same arguments compute the same value (the two SDPA
layers' identical bool -> float mask conversions). Left alone: random ops (each draws its
own numbers), graphs with a mutating op (a value read before and after a write differs),
and nodes whose storage an output holds, so no two outputs share storage where eager's
did not. Scalars are compared with their types (``x * 1`` and ``x * 1.0`` differ).

Our own pass rather than torch's ``fx_graph_cse``: that one imports Inductor's pattern
matcher (0.4 s of CPU at a process's first compile, warm starts included).
"""
from __future__ import annotations

import torch
import torch.fx as fx
from torch.multiprocessing.reductions import StorageWeakRef


def _key(value):
    """A hashable, type-exact form of an argument (nodes by identity)."""
    if isinstance(value, fx.Node):
        return value
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, tuple(_key(v) for v in value))
    if isinstance(value, dict):
        return ("dict", tuple(sorted((k, _key(v)) for k, v in value.items())))
    if isinstance(value, float):
        return ("float", repr(value))  # 0.0 and -0.0 differ; nan equals nan
    return (type(value).__name__, value)


def storage_of(node: fx.Node):
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor):
        try:
            return StorageWeakRef(val.untyped_storage())
        except (NotImplementedError, RuntimeError):
            return None
    return None


def storages_of(nodes) -> set:
    """The storages of the tensor-valued nodes among ``nodes`` (a set without None: a
    StorageWeakRef compared with None raises)."""
    return {s for s in map(storage_of, (n for n in nodes if isinstance(n, fx.Node)))
            if s is not None}


def cse(gm: fx.GraphModule) -> fx.GraphModule:
    """``gm`` with identical pure ATen calls merged (a new module; ``gm`` unchanged), or
    ``gm`` itself when it mutates anything."""
    nodes = list(gm.graph.nodes)
    ops = [n for n in nodes if n.op == "call_function"
           and isinstance(n.target, torch._ops.OpOverload)]
    if any(n.target._schema.is_mutable for n in ops):
        return gm
    output = nodes[-1]
    out_storages = storages_of(output.all_input_nodes)
    graph = fx.Graph(owning_module=gm)
    env: dict[fx.Node, fx.Node] = {}
    seen: dict = {}
    for node in nodes:
        key = None
        if (isinstance(node.target, torch._ops.OpOverload) and node.op == "call_function"
                and torch.Tag.nondeterministic_seeded not in node.target.tags
                and node not in output.all_input_nodes
                and storage_of(node) not in out_storages):
            args = fx.map_arg((node.args, node.kwargs), lambda a: env[a])
            try:
                key = (node.target, _key(args))
                hash(key)
            except TypeError:  # an argument that does not hash: not merged
                key = None
            if key is not None and key in seen:
                env[node] = seen[key]
                continue
        env[node] = graph.node_copy(node, lambda a: env[a])
        if key is not None:
            seen[key] = env[node]
    return fx.GraphModule(gm, graph)
