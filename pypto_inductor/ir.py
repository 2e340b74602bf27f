"""Tile IR: what lowering produces, the planner groups and codegen consumes.

A :class:`TileGraph` is a list of nodes in execution order. Each node is either
a :class:`TileOp` (one canonical tile operation of a known :class:`OpKind`) or an
:class:`ExternOp` (an ATen call run eagerly). Values are named; operands of a
TileOp are value names (``str``) or scalar constants (numbers or sympy
expressions over the graph's size symbols). Shapes and strides are sympy.

A :class:`FusionTile` is a group of TileOps that becomes one kernel.
"""
from __future__ import annotations

import dataclasses
import enum
from typing import Any, Callable, Union

import sympy
import torch

from .sizes import numel


class OpKind(enum.Enum):
    ELEMENTWISE = "elementwise"
    BROADCAST = "broadcast"  # elementwise with an operand broadcast to the output shape
    CAST = "cast"
    REDUCTION = "reduction"  # includes reduction + epilogue ops: softmax, log_softmax
    MATMUL = "matmul"  # "cube" work
    LAYOUT = "layout"  # views run zero-copy; cat materialises
    EXTERN = "extern"

    @property
    def injective(self) -> bool:
        """Elementwise, broadcast or cast: each output element from one element per input."""
        return self in (OpKind.ELEMENTWISE, OpKind.BROADCAST, OpKind.CAST)


Shape = tuple[sympy.Expr, ...]
Operand = Union[str, int, float, bool, sympy.Expr]


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    shape: Shape
    stride: Shape
    dtype: torch.dtype

    @property
    def numel(self) -> sympy.Expr:
        return numel(self.shape)

    @property
    def itemsize(self) -> int:
        return self.dtype.itemsize

    @property
    def nbytes(self) -> sympy.Expr:
        return self.numel * self.itemsize

    def __str__(self) -> str:
        dims = ", ".join(str(s) for s in self.shape)
        return f"{str(self.dtype).replace('torch.', '')}[{dims}]"


@dataclasses.dataclass(frozen=True)
class SymSpec:
    """A graph value that is a size (SymInt), not a tensor."""

    expr: sympy.Expr

    def __str__(self) -> str:
        return f"sym({self.expr})"


@dataclasses.dataclass
class TileOp:
    name: str  # the value this op defines
    op: str  # canonical tile op, e.g. "add", "exp", "sum", "matmul", "view"
    kind: OpKind
    args: tuple[Operand, ...]
    out: TensorSpec
    attrs: dict[str, Any] = dataclasses.field(default_factory=dict)
    source: str = ""  # the ATen op it came from, for reports
    # the one ATen op call it computes part of (codegen/cpp may fuse a mul and an add of one
    # group into an fma, as that op's own kernel does; never across groups)
    group: str = ""

    @property
    def inputs(self) -> list[str]:
        return [a for a in self.args if isinstance(a, str)]

    @property
    def is_view(self) -> bool:
        return self.kind is OpKind.LAYOUT and self.op != "cat"

    def __str__(self) -> str:
        args = ", ".join(_fmt_operand(a) for a in self.args)
        attrs = "".join(f", {k}={_fmt_attr(v)}" for k, v in self.attrs.items())
        return f"%{self.name}: {self.out} = {self.op}({args}{attrs})"


@dataclasses.dataclass(frozen=True)
class ValueRef:
    """A reference to a graph value inside an ExternOp's args."""

    name: str


@dataclasses.dataclass
class ExternOp:
    """An ATen call the backend runs eagerly (unsupported, forced, or random)."""

    name: str
    fn: Callable
    args: tuple  # pytree with ValueRef for graph values and sympy.Expr for sizes
    kwargs: dict
    outputs: list[str | None]  # values defined by the call (one per tuple element)
    specs: list[TensorSpec | None]
    reason: str
    tuple_result: bool = False

    @property
    def inputs(self) -> list[str]:
        leaves = torch.utils._pytree.tree_leaves((self.args, self.kwargs))
        return [x.name for x in leaves if isinstance(x, ValueRef)]

    @property
    def op_name(self) -> str:
        return op_name(self.fn)

    def __str__(self) -> str:
        outs = ", ".join(f"%{o}" for o in self.outputs if o) or "_"
        args = ", ".join(f"%{n}" for n in self.inputs)
        return f"{outs} = extern {self.op_name}({args})  # {self.reason}"


Node = Union[TileOp, ExternOp]


@dataclasses.dataclass
class TileGraph:
    name: str
    inputs: list[str]  # one per graph argument, in order
    specs: dict[str, TensorSpec | SymSpec]  # every value's spec
    nodes: list[Node]
    outputs: list[Any]  # value names, None, or sympy expressions (size outputs)
    size_hints: dict[sympy.Symbol, int]  # example value of every size symbol
    # Where each size symbol is read at run time: (argument index, dim or None for a SymInt).
    symbol_bindings: dict[sympy.Symbol, tuple[int, int | None]] = dataclasses.field(
        default_factory=dict)
    # Tensor constants of the graph (FX get_attr, e.g. a lifted torch.tensor([...])):
    # values like inputs, which the runtime holds instead of receiving them.
    constants: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)

    @property
    def symbols(self) -> list[sympy.Symbol]:
        return list(self.symbol_bindings)

    def producers(self) -> dict[str, Node]:
        out: dict[str, Node] = {}
        for node in self.nodes:
            for name in _defined(node):
                out[name] = node
        return out

    def users(self) -> dict[str, list[Node]]:
        out: dict[str, list[Node]] = {}
        for node in self.nodes:
            for name in node.inputs:
                out.setdefault(name, []).append(node)
        return out

    def output_names(self) -> set[str]:
        return {o for o in self.outputs if isinstance(o, str)}

    def hint(self, expr: Any) -> int:
        """The example-size value of a sympy size expression."""
        # a static size needs no subs (planning a GPT-2 step asks ~6000 times)
        if isinstance(expr, (int, float, sympy.Number)):
            return int(expr)
        return int(sympy.sympify(expr).subs(self.size_hints))

    def __str__(self) -> str:
        lines = [f"graph {self.name}({', '.join('%' + i for i in self.inputs)}):"]
        lines += [f"  %{c}: {self.specs[c]} = constant" for c in self.constants]
        lines += [f"  {node}" for node in self.nodes]
        lines.append(f"  return ({', '.join(_fmt_operand(o) for o in self.outputs)})")
        return "\n".join(lines)


def _defined(node: Node) -> list[str]:
    if isinstance(node, TileOp):
        return [node.name]
    return [o for o in node.outputs if o]


@dataclasses.dataclass
class FusionTile:
    """A group of TileOps compiled into one kernel."""

    name: str
    ops: list[TileOp]
    inputs: list[str]  # values read from global memory
    outputs: list[str]  # values written to global memory
    dtype: str  # compute dtype, e.g. "float32" or "float32 (upcast from float16)"
    tile_shape: tuple[int, ...]
    footprint_expr: sympy.Expr  # bytes, over the tile shape symbols and size symbols
    footprint_bytes: int  # at the chosen tile and example sizes
    capacity_bytes: int
    kind: OpKind
    predicted_us: float = 0.0
    gm_bytes: int = 0
    bound: str = "launch"  # the roofline's largest term: "memory", "compute" or "launch"

    @property
    def op_names(self) -> list[str]:
        return [op.op for op in self.ops]

    def pto_text(self, specs: dict[str, TensorSpec]) -> str:
        """A PTO-IR-like listing: inputs, the tile loop, the ops, the stores."""
        lines = [f"kernel {self.name}  // {self.kind.value}, compute {self.dtype}"]
        for name in self.inputs:
            lines.append(f"  in  %{name}: {specs[name]}")
        for name in self.outputs:
            lines.append(f"  out %{name}: {specs[name]}")
        tile = "x".join(str(t) for t in self.tile_shape)
        lines.append(f"  // footprint {self.footprint_expr} = {self.footprint_bytes} B"
                     f" <= {self.capacity_bytes} B")
        lines.append(f"  for tile in tiles({tile}):  // parallel")
        for name in self.inputs:
            lines.append(f"    %{name}.t = load %{name}[tile]")
        for op in self.ops:
            lines.append(f"    {op}")
        for name in self.outputs:
            lines.append(f"    store %{name}[tile] <- %{name}")
        return "\n".join(lines)


def gemm_bias_add(ops: list[TileOp], specs: dict, outputs) -> TileOp | None:
    """The op of ``ops`` a GEMM can apply as its bias (torch.addmm / baddbmm), or None.

    That is an ``add`` of the group's one 2-D or 3-D matmul result and a value from
    outside the group of the same dtype that broadcasts to the result, when nothing
    else reads the bare product (``outputs``: the values the group writes out).
    """
    mms = [op for op in ops if op.kind is OpKind.MATMUL]
    if len(mms) != 1 or mms[0].op != "matmul" or mms[0].name in outputs:
        return None
    mm = mms[0]
    shape = tuple(mm.out.shape)
    if len(shape) not in (2, 3) or any(len(specs[a].shape) != len(shape) for a in mm.args):
        return None
    users = [op for op in ops if mm.name in op.args]
    if len(users) != 1 or users[0].op != "add" or users[0].attrs or len(users[0].args) != 2:
        return None
    add = users[0]
    bias = add.args[1] if add.args[0] == mm.name else add.args[0]
    if not isinstance(bias, str) or bias == mm.name or any(op.name == bias for op in ops):
        return None
    spec = specs[bias]
    trailing = tuple(spec.shape)[::-1]
    if spec.dtype != mm.out.dtype or add.out.dtype != mm.out.dtype \
            or len(trailing) > len(shape) or tuple(add.out.shape) != shape:
        return None
    if any(b != 1 and b != s for b, s in zip(trailing, shape[::-1])):
        return None
    return add


def op_name(fn: Any) -> str:
    """'aten.gelu.default' for torch.ops.aten.gelu.default; str() otherwise."""
    if isinstance(fn, torch._ops.OpOverload):
        return f"{fn.namespace}.{fn._schema.name.split('::')[-1]}.{fn._overloadname}"
    if isinstance(fn, torch._ops.HigherOrderOperator):
        return f"higher_order.{fn.name()}"
    return getattr(fn, "__name__", str(fn))


def _fmt_operand(a: Any) -> str:
    if isinstance(a, str):
        return f"%{a}"
    if isinstance(a, (list, tuple)):
        return "[" + ", ".join(_fmt_operand(x) for x in a) + "]"
    if isinstance(a, torch.dtype):
        return str(a).replace("torch.", "")
    return str(a)


def _fmt_attr(a: Any) -> str:
    return repr(a) if isinstance(a, str) else _fmt_operand(a)
