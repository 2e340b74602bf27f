"""ATen FX graph -> TileGraph.

Each call_function node goes through its registered lowering; anything without
one (or whose lowering raises Unsupported, or that the user forced to eager)
becomes an ExternOp. Sizes stay sympy expressions taken from the FakeTensor
metadata: nothing here turns a symbolic size into a Python int.
"""
from __future__ import annotations

import operator
from typing import Any

import sympy
import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import optimization_hint
from torch.utils._pytree import tree_map

from ..config import Config
from . import conv as _conv  # noqa: F401  (registers the pypto_inductor::conv_fused op)
from ..ir import ExternOp, OpKind, SymSpec, TensorSpec, TileGraph, TileOp, ValueRef, op_name
from ..sizes import contiguous_strides, is_symbolic
from .registry import LOWERINGS, Unsupported

SUPPORTED_DTYPES = {
    torch.float32, torch.float16, torch.bfloat16, torch.float64,
    torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool,
}

# Calls whose result must not be computed by a kernel of ours.
_NONDETERMINISTIC_TAG = torch.Tag.nondeterministic_seeded


# Ops lowered as another op with the same arguments and result. lift_fresh_copy copies
# a tensor constant lifted into the graph (make_fx records it after applying the
# decomposition table, so the table cannot rewrite it).
_LOWERED_AS = {torch.ops.aten.lift_fresh_copy.default: torch.ops.aten.clone.default}
_LIFT = torch.ops.aten.lift_fresh_copy.default

# The reason of an extern op the user listed in fallback_ops.
FORCED = "forced by fallback_ops"


def fma_group(node: fx.Node) -> str:
    """The ATen op call an FX node computes part of: the decomposed op's call (AOTAutograd's
    ``original_aten`` with the call's autograd ``seq_nr``, or without autograd (seq_nr -1)
    the user's call it was traced from, ``source_fn_stack``) for a node of a decomposition
    (LayerNorm's mul and add, its backward's), else the node itself. Eager runs each call as
    one kernel, which may fuse a multiply and an add; between two calls it rounds."""
    orig, seq = node.meta.get("original_aten"), node.meta.get("seq_nr")
    if orig is None or str(orig) == str(node.target):
        return f"node:{node.name}"
    if seq is not None and seq >= 0:
        return f"{orig}#{seq}"
    stack = node.meta.get("source_fn_stack")
    if stack and isinstance(stack[-1], tuple):
        return f"{orig}@{stack[-1][0]}"
    return f"node:{node.name}"


class GraphNotLowerable(Exception):
    """The whole graph must run eagerly (e.g. a size symbol we cannot bind)."""


def sym_expr(x: Any) -> Any:
    """The sympy expression of a SymInt/SymFloat; other values unchanged."""
    if isinstance(x, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return x.node.expr
    return x


def size_expr(x: Any) -> sympy.Expr:
    """A size (int or SymInt) as a sympy expression."""
    return sympy.sympify(sym_expr(x))


def spec_of(val: Any) -> TensorSpec | SymSpec | None:
    if isinstance(val, torch.Tensor):
        return TensorSpec(
            tuple(size_expr(s) for s in val.shape),
            tuple(size_expr(s) for s in val.stride()),
            val.dtype,
        )
    if isinstance(val, (torch.SymInt, int)) and not isinstance(val, bool):
        return SymSpec(size_expr(val))
    return None


class LoweringContext:
    """What a lowering function sees: emit() tile ops and look up value specs."""

    def __init__(self, graph: TileGraph):
        self.graph = graph
        self.node: fx.Node | None = None
        self.config = None  # the graph's Config (lower_graph)
        self._count = 0
        # 0-d constants (scalar_tensor, full(())) -> their Python value: pointwise
        # consumers take the literal, so masked_fill's -inf costs no kernel of its own
        self.scalar_constants: dict[str, bool | int | float] = {}
        # values a lowering stopped reading (an arange index become an affine read): their
        # tile ops, and those feeding only them, are dropped when nothing else reads them
        self.maybe_unused: set[str] = set()

    def spec(self, name: str) -> TensorSpec:
        return self.graph.specs[name]

    @property
    def aten_name(self) -> str:
        """The ATen op being lowered without namespace or overload, e.g. "add"."""
        return self.node.target.overloadpacket.__name__

    @property
    def out_spec(self) -> TensorSpec:
        return spec_of(self.node.meta["val"])

    def new_spec(self, shape, dtype) -> TensorSpec:
        shape = tuple(size_expr(s) for s in shape)
        return TensorSpec(shape, contiguous_strides(shape), dtype)

    def fresh(self, base: str) -> str:
        self._count += 1
        return f"{base}_t{self._count}"

    def emit(self, op: str, kind: OpKind, args, out: TensorSpec | None = None,
             name: str | None = None, **attrs) -> str:
        out = out or self.out_spec
        name = name or self.fresh(self.node.name)
        self.graph.specs[name] = out
        self.graph.nodes.append(
            TileOp(name, op, kind, tuple(args), out, attrs, op_name(self.node.target),
                   fma_group(self.node))
        )
        return name

    def pointwise(self, op: str, args, out: TensorSpec | None = None, **attrs) -> str:
        """An elementwise op; its kind is BROADCAST when an operand is broadcast."""
        out = out or self.out_spec
        args = tuple(self.scalar_constants.get(a, a) if isinstance(a, str) else a for a in args)
        broadcast = any(isinstance(a, str) and self.spec(a).shape != out.shape for a in args)
        kind = OpKind.BROADCAST if broadcast else OpKind.ELEMENTWISE
        return self.emit(op, kind, args, out, **attrs)


def _bind_symbols(graph: TileGraph, placeholders: list[fx.Node]) -> list[tuple[int, int | None]]:
    """For each size symbol, where to read it at run time: (arg index, dim or None)."""
    found: dict[sympy.Symbol, tuple[int, int | None]] = {}
    for i, ph in enumerate(placeholders):
        spec = graph.specs[graph.inputs[i]]
        if isinstance(spec, SymSpec) and isinstance(spec.expr, sympy.Symbol):
            found.setdefault(spec.expr, (i, None))
        elif isinstance(spec, TensorSpec):
            for d, size in enumerate(spec.shape):
                if isinstance(size, sympy.Symbol):
                    found.setdefault(size, (i, d))
    return found


def lower_graph(gm: fx.GraphModule, config: Config, name: str = "graph") -> TileGraph:
    graph = TileGraph(name=name, inputs=[], specs={}, nodes=[], outputs=[], size_hints={})
    ctx = LoweringContext(graph)
    ctx.config = config  # read by lowerings that differ per target (matmul.TINY_GEMMS)
    env: dict[fx.Node, Any] = {}  # fx node -> value name, tuple of names, or sympy expr
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]

    for node in gm.graph.nodes:
        val = node.meta.get("val")
        if node.op == "placeholder":
            spec = spec_of(val)
            if spec is None:
                raise GraphNotLowerable(
                    f"input {node.name} is neither a tensor nor a size ({type(val).__name__})")
            graph.inputs.append(node.name)
            graph.specs[node.name] = spec
            env[node] = node.name if isinstance(spec, TensorSpec) else spec.expr
        elif node.op == "get_attr":
            env[node] = _graph_attribute(graph, gm, node)
        elif node.op == "call_function":
            env[node] = lower_node(ctx, node, env, config)
        elif node.op == "output":
            graph.outputs = [_output_value(env, o) for o in node.args[0]]
        else:
            raise GraphNotLowerable(f"node {node.name} is an FX {node.op!r} node ({node.target}), "
                                    "which ATen graphs do not have")

    _drop_unused(graph, set(ctx.scalar_constants))
    _drop_dead_chains(graph, ctx.maybe_unused)
    bindings = _bind_symbols(graph, placeholders)
    free = set()
    for spec in graph.specs.values():
        exprs = spec.shape + spec.stride if isinstance(spec, TensorSpec) else (spec.expr,)
        for e in exprs:
            free |= sympy.sympify(e).free_symbols
    missing = free - set(bindings)
    if missing:
        raise GraphNotLowerable(f"size symbols {sorted(map(str, missing))} are not input sizes"
                                + _first_use(gm, missing))
    graph.symbol_bindings = dict(sorted(bindings.items(), key=lambda kv: kv[0].name))
    graph.size_hints = _size_hints(gm, graph.symbol_bindings)
    return graph


def _graph_attribute(graph: TileGraph, gm: fx.GraphModule, node: fx.Node):
    """A get_attr node: a tensor constant becomes a graph constant (a value the runtime
    holds and hands to kernels like an input); anything else (the subgraphs of a
    higher-order op) is passed as it is to the extern op that uses it."""
    value = gm
    for part in node.target.split("."):
        value = getattr(value, part)
    if isinstance(value, torch.Tensor):
        graph.specs[node.name] = spec_of(value)
        graph.constants[node.name] = value
        return node.name
    return value


def _first_use(gm: fx.GraphModule, symbols: set) -> str:
    """', first in node X (op)': the first node whose value has one of ``symbols``."""
    for node in gm.graph.nodes:
        spec = spec_of(node.meta.get("val"))
        if spec is None:
            continue
        exprs = spec.shape + spec.stride if isinstance(spec, TensorSpec) else (spec.expr,)
        if any(sympy.sympify(e).free_symbols & symbols for e in exprs):
            what = op_name(node.target) if node.op == "call_function" else node.op
            return f", first in node {node.name} ({what})"
    return ""


def _drop_unused(graph: TileGraph, names: set[str]) -> None:
    """Remove the tile ops defining ``names`` that nothing reads any more."""
    used = {o for o in graph.outputs if isinstance(o, str)}
    for node in graph.nodes:
        used.update(node.inputs)
    graph.nodes = [n for n in graph.nodes if not (isinstance(n, TileOp) and n.name in names
                                                  and n.name not in used)]


def _drop_dead_chains(graph: TileGraph, names: set[str]) -> None:
    """Remove the tile ops defining ``names`` that nothing reads, then those that only fed
    them (pure tile ops: views, pointwise, arange), transitively."""
    producers = {n.name: n for n in graph.nodes if isinstance(n, TileOp)}
    while names:
        before = len(graph.nodes)
        _drop_unused(graph, names)
        if len(graph.nodes) == before:
            return
        kept = {n.name for n in graph.nodes if isinstance(n, TileOp)}
        dropped = [producers[m] for m in names if m in producers and m not in kept]
        names = {a for n in dropped for a in n.inputs if a in kept}


def _size_hints(gm: fx.GraphModule, bindings) -> dict[sympy.Symbol, int]:
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    hints = {}
    for sym, (i, d) in bindings.items():
        val = placeholders[i].meta["val"]
        size = val if d is None else val.shape[d]
        hints[sym] = int(optimization_hint(size))
    return hints


def _output_value(env, o):
    if o is None:
        return None
    if isinstance(o, fx.Node):
        return env[o]
    return sym_expr(o)


def lower_node(ctx: LoweringContext, node: fx.Node, env, config: Config):
    target = node.target
    if target is operator.getitem:
        base, index = node.args
        return env[base][index]
    val = node.meta.get("val")
    if isinstance(val, (torch.SymInt, int)) and not isinstance(val, bool):
        return size_expr(val)  # size arithmetic: recomputed from the input sizes at run time
    if isinstance(val, torch.SymBool):
        # a size predicate (the argument of a runtime size assert): printed like a size
        return sym_expr(val)
    if isinstance(val, torch.SymFloat):
        # float size arithmetic (var's backward scale 2 / (numel - correction), a dynamic
        # correction): also a size expression, printed with sym_float / FloatTrueDiv
        e = sym_expr(val)
        return e if is_symbolic(e) else float(e)
    if target is _RUN_AND_SAVE_RNG:
        # activation checkpointing: the forward saves the RNG state before a random op
        # (SDPA: its dropout) that the backward recomputes with run_with_rng_state; the
        # node has no "val", and its result nests the op's tuple: one extern step
        # returning them flat, then nested back for the graph's getitems
        state, result = _fake_value(node)
        nested = isinstance(result, (tuple, list))
        names = _extern(ctx, node, env, EAGER_BY_CHOICE[target], fn=run_and_save_rng_state_flat,
                        val=(state, *result) if nested else (state, result))
        return (names[0], names[1:]) if nested else names
    if isinstance(target, torch._ops.HigherOrderOperator):
        reason = EAGER_BY_CHOICE.get(target, "higher-order op: runs eagerly, calling its subgraphs")
        return _extern(ctx, node, env, reason,
                       val=node.meta["val"] if "val" in node.meta else _fake_value(node))
    if not isinstance(target, torch._ops.OpOverload):
        return _extern(ctx, node, env, f"{op_name(target)} is not an ATen op")
    if target is _LIFT and isinstance(node.args[0], fx.Node) \
            and node.args[0].op == "get_attr" and not escapes(node):
        # the graph only reads the lifted constant (ATen graphs here are functional):
        # read the constant itself instead of a copy of it
        return env[node.args[0]]
    target = _LOWERED_AS.get(target, target)

    reason = _why_extern(node, target, config)
    if reason is None:
        args = tree_map(lambda a: env[a] if isinstance(a, fx.Node) else sym_expr(a), node.args)
        kwargs = tree_map(lambda a: env[a] if isinstance(a, fx.Node) else sym_expr(a),
                          dict(node.kwargs))
        mark = len(ctx.graph.nodes)
        ctx.node = node
        try:
            return _name_result(ctx, mark, node, LOWERINGS[target](ctx, *args, **kwargs))
        except Unsupported as e:
            del ctx.graph.nodes[mark:]
            reason = str(e)
    return _extern(ctx, node, env, reason)


def escapes(node: fx.Node) -> bool:
    """Whether the graph returns ``node``'s value or a view of it."""
    stack = [node]
    while stack:
        for user in stack.pop().users:
            if user.op == "output":
                return True
            if user.target is operator.getitem or (
                    isinstance(user.target, torch._ops.OpOverload) and user.target.is_view):
                stack.append(user)
    return False


def _name_result(ctx: LoweringContext, mark: int, node: fx.Node, result):
    """Name the op defining a node's single result after the node (readable IR)."""
    new_ops = ctx.graph.nodes[mark:]
    if not (isinstance(result, str) and new_ops and new_ops[-1].name == result):
        return result
    if node.name in ctx.graph.specs:
        return result
    op = new_ops[-1]
    ctx.graph.specs[node.name] = ctx.graph.specs.pop(op.name)
    if op.name in ctx.scalar_constants:
        ctx.scalar_constants[node.name] = ctx.scalar_constants.pop(op.name)
    op.name = node.name
    return node.name


# Ops whose own ATen kernel is the implementation we choose: extern by design, not for want
# of a lowering. The report gives these reasons (docs/models.md lists them per model).
_aten = torch.ops.aten
_SDPA_WHOLE = ("SDPA's fused CPU kernel, kept whole (as Inductor does): its backward reads the "
               "logsumexp the forward saves, which decomposing it changed (wrong gradients); "
               "the cpu target runs it with its native flash kernel where it qualifies "
               "(codegen/cpp/attention.py; the report's extern_native says which ran)")
EAGER_BY_CHOICE = {
    _aten._scaled_dot_product_flash_attention_for_cpu.default:
        _SDPA_WHOLE + "; with dropout it draws what eager draws",
    _aten._scaled_dot_product_flash_attention_for_cpu_backward.default:
        "the backward of SDPA's fused CPU kernel (the forward is kept whole); the cpu target "
        "runs it with its native kernel where it qualifies (codegen/cpp/attention_backward.py)",
    _aten.convolution.default: "convolution: the oneDNN/GEMM kernel eager uses; no tile form",
    _aten.convolution_backward.default:
        "convolution backward: the oneDNN/GEMM kernels eager uses; no tile form",
    torch.ops.higher_order.run_and_save_rng_state:
        "activation checkpointing's RNG state saved before a random op (SDPA: its dropout), "
        "which runs eagerly: the backward replays it from that state",
    torch.ops.higher_order.run_with_rng_state:
        "activation checkpointing's replay of a random op from the forward's RNG state",
    torch.ops.pypto_inductor.conv_fused.default:
        "inference conv chain (lowering/conv.py): one oneDNN convolution with the BatchNorm "
        "folded into its weights and the add/ReLU as post-ops",
    _aten.max_pool2d_with_indices.default:
        "window op (as convolution): no window tile; the cpu target runs its native kernel "
        "where it qualifies (codegen/cpp/pooling.py)",
    _aten.max_pool2d_with_indices_backward.default:
        "window op (as convolution): no window tile; the cpu target runs its native kernel "
        "where it qualifies (codegen/cpp/pooling.py)",
}


# Our own custom ops, called as their Python body: skips the dispatcher's ~50 us per call.
DIRECT_CALLS = {torch.ops.pypto_inductor.conv_fused.default: _conv.run_conv_fused}


def _why_extern(node: fx.Node, target, config: Config) -> str | None:
    name = op_name(target)
    if config.forced_fallback(name):
        return FORCED
    if target in EAGER_BY_CHOICE and target not in LOWERINGS:
        return EAGER_BY_CHOICE[target]
    if _NONDETERMINISTIC_TAG in target.tags:
        # the table keeps random ops whole (lowering/decompositions.py), so this is the
        # op eager calls, drawing from the same generator state in the same order
        return "random op: no kernel of ours draws random numbers; its own ATen kernel " \
               "runs eagerly and draws what eager draws"
    if target not in LOWERINGS:
        return "no lowering registered"
    for v in _tensor_vals(node):
        if v.dtype not in SUPPORTED_DTYPES:
            return f"dtype {v.dtype} not supported"
    return None


def _tensor_vals(node: fx.Node):
    vals = [node.meta.get("val")]
    vals += [a.meta.get("val") for a in node.all_input_nodes]
    for v in vals:
        for leaf in torch.utils._pytree.tree_leaves(v):
            if isinstance(leaf, torch.Tensor):
                yield leaf


_RUN_AND_SAVE_RNG = torch.ops.higher_order.run_and_save_rng_state


def run_and_save_rng_state_flat(op, *args, **kwargs):
    """``run_and_save_rng_state`` with the op's tuple result flattened into its own."""
    state, result = _RUN_AND_SAVE_RNG(op, *args, **kwargs)
    return (state, *result) if isinstance(result, (tuple, list)) else (state, result)


def _fake_value(node: fx.Node):
    """A node's result on fake tensors, for the higher-order ops AOTAutograd's partitioner
    inserts without a "val" (the RNG replay of activation checkpointing)."""
    args, kwargs = tree_map(lambda a: a.meta.get("val") if isinstance(a, fx.Node) else a,
                            (node.args, dict(node.kwargs)))
    fake_mode = torch._guards.detect_fake_mode(torch.utils._pytree.tree_leaves((args, kwargs)))
    if fake_mode is None:
        raise GraphNotLowerable(f"{node.name} ({op_name(node.target)}) has no traced value")
    with fake_mode:
        return node.target(*args, **kwargs)


def _extern(ctx: LoweringContext, node: fx.Node, env, reason: str, fn=None, val=None):
    graph = ctx.graph

    def ref(a):
        if isinstance(a, fx.Node):
            v = env[a]
            return ValueRef(v) if isinstance(v, str) else v
        return sym_expr(a)

    args = tree_map(ref, node.args)
    kwargs = tree_map(ref, dict(node.kwargs))
    val = node.meta.get("val") if val is None else val
    if node.users and isinstance(val, (float, torch.SymFloat)):
        # an extern's result is a tensor slot: a number the graph reads would reach its
        # readers as None (a silent wrong default), so the graph runs eagerly instead
        # (symbolic conditions, SymBool, feed only run-time asserts)
        raise GraphNotLowerable(f"{node.name} ({reason}) gives a {type(val).__name__} "
                                "the graph reads")
    if isinstance(val, (tuple, list)):
        outputs = [f"{node.name}_{i}" if isinstance(v, torch.Tensor) else None
                   for i, v in enumerate(val)]
        specs = [spec_of(v) if isinstance(v, torch.Tensor) else None for v in val]
        tuple_result = True
    else:
        outputs = [node.name] if isinstance(val, torch.Tensor) else [None]
        specs = [spec_of(val)] if isinstance(val, torch.Tensor) else [None]
        tuple_result = False
    for o, s in zip(outputs, specs):
        if o:
            graph.specs[o] = s
    fn = fn or DIRECT_CALLS.get(node.target, node.target)
    graph.nodes.append(ExternOp(node.name, fn, args, kwargs, outputs, specs,
                                reason, tuple_result))
    return tuple(outputs) if tuple_result else outputs[0]
