"""What the pypto emitter produces: a kernel module and the shapes of its parameters.

:class:`PyptoKernel` is one emitted ``@pypto.frontend.jit`` module (its whole
source text) plus a :class:`KernelParam` per parameter, inputs first then
outputs (the call order). A parameter records the kernel's shape of the value
(the 2-D or N-D form the kernel declares) and the value's own graph shape, so
a launcher can reshape torch tensors to it; a dynamic kernel also records the
kernel dims with the dynamic one named (``("R", 256)``) and the graph shape as
size expressions, which :meth:`PyptoKernel.at_sizes` evaluates at other sizes.

Also here: :class:`PyptoEmitError` (a tile op or shape pattern has no pypto
form), the torch -> pypto dtype table and the small formatting helpers every
emitter module shares. Nothing in this module knows about tiles or ops.
"""
from __future__ import annotations

import dataclasses
import math
import re
from typing import Any

import sympy
import torch

from ...sizes import numel

__all__ = ["PyptoEmitError", "PYPTO_DTYPES", "KernelParam", "PyptoKernel", "kernel_name"]


class PyptoEmitError(ValueError):
    """A tile op (or a shape/dtype pattern) has no pypto form."""

    def __init__(self, op: str, reason: str = ""):
        self.op = op
        self.reason = reason
        super().__init__(f"{op} has no pypto form" + (f": {reason}" if reason else ""))


# torch dtype -> pypto dtype name (attribute of the pypto module).
PYPTO_DTYPES: dict[torch.dtype, str] = {
    torch.float32: "DT_FP32",
    torch.float16: "DT_FP16",
    torch.bfloat16: "DT_BF16",
    torch.int32: "DT_INT32",
    torch.int64: "DT_INT64",
    torch.int16: "DT_INT16",
    torch.int8: "DT_INT8",
    torch.uint8: "DT_UINT8",
    torch.bool: "DT_BOOL",
}


@dataclasses.dataclass(frozen=True)
class KernelParam:
    ident: str  # the parameter's name in the kernel
    value: str  # the graph value it carries
    shape: tuple[int, ...]  # the kernel's (static) shape of it
    dtype: torch.dtype
    is_output: bool
    graph_shape: tuple[int, ...] = ()  # the value's own shape at the example sizes
    # Dynamic kernels: the kernel dims with the dynamic one named (e.g. ("R", 256)), and the
    # value's graph shape as sympy strings over the graph's size symbols; () when static.
    dims: tuple = ()
    graph_dims: tuple[str, ...] = ()
    # Both kernel dims dynamic, ("R", "C"): how many leading graph dims make the rows.
    row_dims: int | None = None
    # An input whose broadcast against the tile's domain has no 2-D form ([B, S] against a
    # [B, 1, S, S] domain): the launcher expands it to this (domain) shape first; () if not.
    expand: tuple[int, ...] = ()

    @property
    def dynamic(self) -> bool:
        return any(isinstance(d, str) for d in self.dims)

    def to_json(self) -> dict:
        d = {"ident": self.ident, "value": self.value, "shape": list(self.shape),
             "dtype": str(self.dtype).replace("torch.", ""), "is_output": self.is_output,
             "graph_shape": list(self.graph_shape)}
        if self.dims:
            d["dims"], d["graph_dims"] = list(self.dims), list(self.graph_dims)
        if self.row_dims is not None:
            d["row_dims"] = self.row_dims
        if self.expand:
            d["expand"] = list(self.expand)
        return d

    @classmethod
    def from_json(cls, d: dict) -> "KernelParam":
        return cls(d["ident"], d["value"], tuple(d["shape"]), getattr(torch, d["dtype"]),
                   d["is_output"], tuple(d["graph_shape"]), tuple(d.get("dims", ())),
                   tuple(d.get("graph_dims", ())), d.get("row_dims"), tuple(d.get("expand", ())))


@dataclasses.dataclass
class PyptoKernel:
    name: str  # the jit function's name (and the module's stem)
    tile_name: str
    source: str  # the whole module
    params: list[KernelParam]  # inputs first, then outputs: the call order
    vec_tile: tuple[int, ...] | None
    cube_tile: tuple[tuple[int, int], ...] | None
    dynamic_dims: dict[str, str] = dataclasses.field(default_factory=dict)  # "R" -> "s0*s1"

    @property
    def dynamic(self) -> bool:
        return bool(self.dynamic_dims)

    def at_sizes(self, sizes: dict) -> "PyptoKernel":
        """The same kernel (same source) whose example shapes are at other sizes.

        ``sizes`` maps size symbols (or their names) to ints; only meaningful for a
        dynamic kernel: the simulator runs it on inputs of these shapes.
        """
        if not self.dynamic:
            raise ValueError(f"kernel {self.name} has static shapes")
        names = {str(k): int(v) for k, v in sizes.items()}

        def value(g: str) -> int:
            expr = sympy.sympify(g)
            missing = sorted(x.name for x in expr.free_symbols if x.name not in names)
            if missing:
                raise ValueError(f"kernel {self.name}: no size given for {missing}")
            return int(expr.subs({x: names[x.name] for x in expr.free_symbols}))
        params = []
        for p in self.params:
            if not p.dims:
                params.append(p)
                continue
            graph_shape = tuple(value(g) for g in p.graph_dims)
            shape = kernel_shape(p.dims, graph_shape, p.row_dims)
            params.append(dataclasses.replace(p, shape=shape, graph_shape=graph_shape))
        return dataclasses.replace(self, params=params)

    @property
    def inputs(self) -> list[KernelParam]:
        return [p for p in self.params if not p.is_output]

    @property
    def outputs(self) -> list[KernelParam]:
        return [p for p in self.params if p.is_output]

    def example_inputs(self, device: str | torch.device = "cpu") -> list[torch.Tensor]:
        """Zero tensors of every input's own (graph) shape, in call order."""
        return [torch.zeros(p.graph_shape, dtype=p.dtype, device=device) for p in self.inputs]

    def to_json(self) -> dict:
        return {"name": self.name, "tile_name": self.tile_name, "source": self.source,
                "params": [p.to_json() for p in self.params],
                "vec_tile": list(self.vec_tile) if self.vec_tile else None,
                "cube_tile": [list(x) for x in self.cube_tile] if self.cube_tile else None,
                "dynamic_dims": dict(self.dynamic_dims)}

    @classmethod
    def from_json(cls, d: dict) -> "PyptoKernel":
        return cls(d["name"], d["tile_name"], d["source"],
                   [KernelParam.from_json(p) for p in d["params"]],
                   tuple(d["vec_tile"]) if d["vec_tile"] else None,
                   tuple(tuple(x) for x in d["cube_tile"]) if d["cube_tile"] else None,
                   dict(d.get("dynamic_dims") or {}))


def kernel_shape(dims: tuple, graph_shape: tuple[int, ...], row_dims: int | None) -> tuple:
    """A parameter's kernel shape for a value of this graph shape: each named (dynamic)
    dim takes what the static ones leave; two named dims split at ``row_dims``."""
    named = [d for d in dims if isinstance(d, str)]
    if len(named) > 1:
        sizes = {named[0]: int(numel(graph_shape[:row_dims])),
                 named[1]: int(numel(graph_shape[row_dims:]))}
    else:
        static = int(numel([d for d in dims if not isinstance(d, str)]))
        sizes = {d: int(numel(graph_shape)) // static for d in named}
    return tuple(sizes[d] if isinstance(d, str) else d for d in dims)


def kernel_name(tile_name: str) -> str:
    """The jit function's (and module's) name for a FusionTile."""
    return "pto_" + ident(tile_name)


# --- helpers shared by the emitter modules -----------------------------------------------
def ident(name: str) -> str:
    """A Python identifier made from a value name."""
    return re.sub(r"\W", "_", name)


def literal(v: Any) -> str:
    """A Python float literal of a scalar operand (pypto's vector ops take floats)."""
    if isinstance(v, bool):
        return "1.0" if v else "0.0"
    if isinstance(v, int):
        return repr(float(v))
    if isinstance(v, float):
        if math.isinf(v):
            return "float('inf')" if v > 0 else "float('-inf')"
        if math.isnan(v):
            return "float('nan')"
        return repr(v)
    raise TypeError(v)
