"""The ROI model: roofline time of a kernel, and the score of a candidate merge.

t(kernel) = launch + max(global-memory bytes / bandwidth, flops / peak)
roi_score = (t(producer) + t(consumer)) / t(merged)

Sizes are evaluated once at the graph's example sizes (size hints), so the
planner's arithmetic is on ints; the symbolic forms live in the FusionTiles.
"""
from __future__ import annotations

import dataclasses

from ..hardware import HardwareModel
from ..ir import OpKind, TileGraph, TileOp

# Relative cost, in flops per element, of ops heavier than one add.
_TRANSCENDENTAL = {
    "exp": 8, "exp2": 8, "expm1": 8, "log": 8, "log1p": 8, "log2": 8, "log10": 8,
    "sin": 8, "cos": 8, "tan": 10, "tanh": 10, "sigmoid": 10, "silu": 10, "gelu": 14,
    "erf": 10, "erfc": 10, "pow": 10, "softplus": 12, "mish": 20, "elu": 10,
    "rsqrt": 4, "sqrt": 4, "div": 4, "reciprocal": 4, "softmax": 12, "log_softmax": 12,
    "logsumexp": 12, "var": 4, "std": 5, "atan2": 12, "asin": 10, "acos": 10, "atan": 10,
    "sinh": 10, "cosh": 10, "asinh": 10, "acosh": 10, "atanh": 10, "hypot": 6,
}


@dataclasses.dataclass(frozen=True)
class KernelCost:
    gm_bytes: int
    flops: int
    launches: int
    time_us: float


@dataclasses.dataclass(frozen=True)
class RoiEstimate:
    t_unfused_us: float
    t_fused_us: float
    bandwidth_saving_pct: float
    launch_overhead_reduction_pct: float
    l1_pressure_increase_pct: float

    @property
    def roi_score(self) -> float:
        return self.t_unfused_us / self.t_fused_us if self.t_fused_us > 0 else 1.0

    def to_dict(self) -> dict:
        return {
            "bandwidth_saving_pct": round(self.bandwidth_saving_pct, 2),
            "launch_overhead_reduction_pct": round(self.launch_overhead_reduction_pct, 2),
            "l1_pressure_increase_pct": round(self.l1_pressure_increase_pct, 2),
            "roi_score": round(self.roi_score, 4),
            "t_unfused_us": round(self.t_unfused_us, 3),
            "t_fused_us": round(self.t_fused_us, 3),
        }


class CostModel:
    """Roofline costs of groups of TileOps of one graph at its example sizes."""

    def __init__(self, graph: TileGraph, hw: HardwareModel):
        self.graph = graph
        self.hw = hw
        self.producers = graph.producers()
        self.users = graph.users()
        self.graph_outputs = graph.output_names()
        self.value_bytes = {
            name: graph.hint(spec.nbytes) for name, spec in graph.specs.items()
            if hasattr(spec, "nbytes")
        }

    def read_bytes(self, name: str) -> int:
        """Bytes a kernel reads for an input: an expanded view reads only its source."""
        producer = self.producers.get(name)
        if isinstance(producer, TileOp) and producer.op == "expand":
            return self.read_bytes(producer.args[0])
        return self.value_bytes.get(name, 0)

    def flops(self, op: TileOp) -> int:
        if op.kind is OpKind.MATMUL:
            a = self.graph.specs[op.args[0]]
            return 2 * self.graph.hint(op.out.numel) * self.graph.hint(a.shape[-1])
        if op.kind is OpKind.REDUCTION:
            elems = self.graph.hint(self.graph.specs[op.args[0]].numel)
        else:
            elems = self.graph.hint(op.out.numel)
        return elems * _TRANSCENDENTAL.get(op.op, 1)

    def boundary(self, ops: list[TileOp]) -> tuple[list[str], list[str]]:
        """(values read from GM, values written to GM) of a group of ops."""
        defined = {op.name for op in ops}
        members = {id(op) for op in ops}
        inputs: list[str] = []
        for op in ops:
            for name in op.inputs:
                if name not in defined and name not in inputs:
                    inputs.append(name)
        outputs = [
            op.name for op in ops
            if op.name in self.graph_outputs
            or any(id(u) not in members for u in self.users.get(op.name, []))
        ]
        return inputs, outputs

    def kernel_cost(self, ops: list[TileOp]) -> KernelCost:
        inputs, outputs = self.boundary(ops)
        gm = sum(self.read_bytes(n) for n in inputs) + sum(self.value_bytes[n] for n in outputs)
        flops = sum(self.flops(op) for op in ops)
        cube = any(op.kind is OpKind.MATMUL for op in ops)
        peak = self.hw.cube_flops_per_s if cube else self.hw.vector_flops_per_s
        seconds = max(gm / self.hw.gm_bandwidth_bytes_per_s, flops / peak)
        return KernelCost(gm, flops, 1, self.hw.launch_us + seconds * 1e6)

    def merge_estimate(self, producer: list[TileOp], consumer: list[TileOp],
                       footprints: tuple[int, int, int]) -> RoiEstimate:
        p, c = self.kernel_cost(producer), self.kernel_cost(consumer)
        f = self.kernel_cost(producer + consumer)
        unfused_bytes = p.gm_bytes + c.gm_bytes
        fp_p, fp_c, fp_f = footprints
        base = max(fp_p, fp_c, 1)
        return RoiEstimate(
            t_unfused_us=p.time_us + c.time_us,
            t_fused_us=f.time_us,
            bandwidth_saving_pct=100.0 * (unfused_bytes - f.gm_bytes) / max(unfused_bytes, 1),
            launch_overhead_reduction_pct=50.0,  # two launches become one
            l1_pressure_increase_pct=100.0 * (fp_f - base) / base,
        )
