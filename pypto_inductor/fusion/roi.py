"""The ROI model: roofline time of a kernel, and the score of a candidate merge.

t(kernel) = launch + max(global-memory bytes / bandwidth, flops / peak)
(the sum of the two terms on hardware whose memory traffic does not hide behind
compute: ``hw.memory_overlaps_compute``, False on the host)
roi_score = (t(producer) + t(consumer) - common) / (t(merged) - common)

A merge clears the planner's threshold when roi_score does, or (``ABSORB_POINTWISE``) when
it folds a pointwise kernel over the merged kernel's whole domain into the kernel reading it
and saves any time: nothing
that kernel computed is written any more (a write, a read-back and a launch saved, no op
computed twice). Next to a large kernel (a ReLU backward's ``le`` mask into BatchNorm's
backward sums) such a merge scores ~1.09 against the host's 1.1, so whether it fused
depended on the calibrated bandwidth.

where ``common`` is time both alternatives spend alike: the GEMM's compute on
hardware whose memory and compute terms add (the host), so a pass saved next to
a long GEMM is judged against the pass, not diluted by the GEMM.

On the host a matmul's bias add runs inside the GEMM (``hw.matmul_bias_in_gemm``):
it is not an epilogue pass. Hardware models may add terms (0/None on the host;
fitted for ascend-a2 in docs/ascend_calibration.md): ``ops x hw.op_us`` and
``hw.cube_epilogue_us`` (a matmul kernel with an epilogue) to the fixed cost, and
``domain elements / hw.vector_elems_per_s`` inside the max.

Sizes are evaluated once at the graph's example sizes (size hints), so the
planner's arithmetic is on ints; the symbolic forms live in the FusionTiles.
"""
from __future__ import annotations

import dataclasses

from ..hardware import HardwareModel
from ..ir import OpKind, TileGraph, TileOp, gemm_bias_add
from ..ops import flop_weight
from .capacity import sums_over_rows

_CHEAP_POWERS = (2, 3, 1, 0.5, -0.5, -1)
# Rows a column sum in a row kernel adds into one fp32 partial (eager's 16-row runs,
# column_order.SUM_BLOCK)
COLUMN_RUN = 16
# A merge absorbing a whole pointwise kernel over the merged domain (none of its values
# written any more) clears the threshold with any predicted saving (module docstring).
# False: by roi_score only.
ABSORB_POINTWISE = True


@dataclasses.dataclass(frozen=True)
class KernelCost:
    gm_bytes: int
    flops: int
    launches: int
    time_us: float
    bound: str = "launch"  # the largest roofline term: "memory", "compute" or "launch"
    gemm_us: float = 0.0  # the GEMM's compute term when it adds to the rest (see common_us)


@dataclasses.dataclass(frozen=True)
class RoiEstimate:
    t_unfused_us: float
    t_fused_us: float
    bandwidth_saving_pct: float
    launch_overhead_reduction_pct: float
    l1_pressure_increase_pct: float
    common_us: float = 0.0  # time fused and unfused spend alike (a GEMM's compute)
    absorbs_pointwise: bool = False  # one of two kernels pointwise, none of its values written

    @property
    def saving_us(self) -> float:
        return self.t_unfused_us - self.t_fused_us

    def clears(self, threshold: float, absorb: bool = True) -> bool:
        """Whether the merge is worth taking: its roi_score reaches ``threshold``, or (with
        ``absorb``) it absorbs a pointwise kernel's whole pass and saves time
        (ABSORB_POINTWISE)."""
        return self.roi_score >= threshold or (absorb and self.absorbs_pointwise
                                               and self.saving_us > 0)

    @property
    def roi_score(self) -> float:
        fused = self.t_fused_us - self.common_us
        return (self.t_unfused_us - self.common_us) / fused if fused > 0 else 1.0

    def to_dict(self) -> dict:
        return {
            "bandwidth_saving_pct": round(self.bandwidth_saving_pct, 2),
            "launch_overhead_reduction_pct": round(self.launch_overhead_reduction_pct, 2),
            "l1_pressure_increase_pct": round(self.l1_pressure_increase_pct, 2),
            "roi_score": round(self.roi_score, 4),
            "t_unfused_us": round(self.t_unfused_us, 3),
            "t_fused_us": round(self.t_fused_us, 3),
            "common_us": round(self.common_us, 3),
            **({"absorbs_pointwise": True} if self.absorbs_pointwise else {}),
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
        self.op_flops = {id(op): self.flops(op) for op in graph.nodes if isinstance(op, TileOp)}
        self.op_elems = {id(op): self.elems(op) for op in graph.nodes if isinstance(op, TileOp)}

    def read_bytes(self, name: str) -> int:
        """Bytes a kernel reads for an input: an expanded view reads only its source."""
        producer = self.producers.get(name)
        if isinstance(producer, TileOp) and producer.op == "expand":
            return self.read_bytes(producer.args[0])
        return self.value_bytes.get(name, 0)

    def flops(self, op: TileOp) -> int:
        if op.kind is OpKind.LAYOUT:
            return 0
        if op.kind is OpKind.MATMUL:
            a = self.graph.specs[op.args[0]]
            return 2 * self.graph.hint(op.out.numel) * self.graph.hint(a.shape[-1])
        if op.kind is OpKind.REDUCTION:
            elems = self.graph.hint(self.graph.specs[op.args[0]].numel)
        else:
            elems = self.graph.hint(op.out.numel)
        if op.op == "pow" and op.args[-1] in _CHEAP_POWERS:
            return elems  # x*x, sqrt(x), 1/x, ...: what the kernels emit for these powers
        return elems * flop_weight(op.op)  # the op catalogue's cost (ops.py)

    def elems(self, op: TileOp) -> int:
        """Elements of the op's iteration domain (a reduction iterates over its input)."""
        if op.kind is OpKind.LAYOUT:
            return 0
        if op.kind is OpKind.REDUCTION:
            return self.graph.hint(self.graph.specs[op.args[0]].numel)
        return self.graph.hint(op.out.numel)

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
            if op.name in self.graph_outputs or op.op == "copy_"  # copy_: a write to an input
            or any(id(u) not in members for u in self.users.get(op.name, []))
        ]
        return inputs, outputs

    def input_bytes(self, ops: list[TileOp], inputs: list[str]) -> int:
        """Bytes the group reads: a gather's source only where it is read (at most one
        element per result element), a copy_'s destination not at all."""
        partial: dict[str, int] = {}  # input -> bytes read, for inputs read only so
        whole: set[str] = set()
        for op in ops:
            for i, name in enumerate(op.args):
                if not isinstance(name, str):
                    continue
                if op.op == "gather" and i == 0:
                    partial[name] = partial.get(name, 0) + self.graph.hint(
                        op.out.numel) * self.graph.specs[name].itemsize
                elif not (op.op == "copy_" and i == 0):
                    whole.add(name)
        total = 0
        for name in inputs:
            full = self.read_bytes(name)
            total += full if name in whole else min(full, partial.get(name, 0))
        return total

    def column_partial_bytes(self, sums: list[TileOp]) -> int:
        """Bytes a kernel writes and reads back for column sums ``sums`` over its rows:
        an fp32 partial per column per run of COLUMN_RUN rows (codegen/cpp row_column_sums)."""
        total = 0
        for op in sums:
            shape = self.graph.specs[op.args[0]].shape
            cols = self.graph.hint(shape[-1])
            rows = self.graph.hint(self.graph.specs[op.args[0]].numel) // max(cols, 1)
            total += 2 * 4 * cols * -(-rows // COLUMN_RUN)
        return total

    def kernel_cost(self, ops: list[TileOp]) -> KernelCost:
        if all(op.is_view for op in ops):
            return KernelCost(0, 0, 0, 0.0)  # a reshape between kernels is free
        inputs, outputs = self.boundary(ops)
        gm = self.input_bytes(ops, inputs) + sum(self.value_bytes[n] for n in outputs)
        if self.hw.column_sums_in_row_kernels:  # column sums over a kernel's rows
            gm += self.column_partial_bytes(sums_over_rows(ops, self.graph))
        flops = sum(self.op_flops[id(op)] for op in ops)
        cube = any(op.kind is OpKind.MATMUL for op in ops)
        bias = (gemm_bias_add(ops, self.graph.specs, outputs)
                if cube and self.hw.matmul_bias_in_gemm else None)
        epilogue = cube and any(op.kind is not OpKind.MATMUL and not op.is_view
                                and op is not bias for op in ops)
        if epilogue and self.hw.matmul_epilogue_reads_gm:  # the GEMM result, written and read
            gm += sum(2 * self.value_bytes[op.name] for op in ops if op.kind is OpKind.MATMUL)
        peak = self.hw.cube_flops_per_s if cube else self.hw.vector_flops_per_s
        memory_s = gm / self.hw.gm_bandwidth_bytes_per_s
        compute_s = flops / peak
        if self.hw.vector_elems_per_s:  # a pass over the iteration domain (see hardware.py)
            elems = max(self.op_elems[id(op)] for op in ops)
            compute_s = max(compute_s, elems / self.hw.vector_elems_per_s)
        seconds = (max(memory_s, compute_s) if self.hw.memory_overlaps_compute
                   else memory_s + compute_s)
        fixed = self.hw.launch_us
        if self.hw.op_us:
            fixed += self.hw.op_us * sum(1 for op in ops if not op.is_view)
        if epilogue and self.hw.cube_epilogue_us:
            fixed += self.hw.cube_epilogue_us
        bound = ("launch" if fixed > seconds * 1e6
                 else "memory" if memory_s >= compute_s else "compute")
        gemm_s = 0.0
        if cube and not self.hw.memory_overlaps_compute:
            gemm_s = sum(self.op_flops[id(op)] for op in ops if op.kind is OpKind.MATMUL) / peak
        return KernelCost(gm, flops, 1, fixed + seconds * 1e6, bound, gemm_s * 1e6)

    def merge_estimate(self, groups: list[list[TileOp]], footprints: list[int],
                       fused_footprint: int) -> RoiEstimate:
        parts = [self.kernel_cost(ops) for ops in groups]
        fused = self.kernel_cost([op for ops in groups for op in ops])
        unfused_bytes = sum(p.gm_bytes for p in parts)
        launches = sum(p.launches for p in parts)
        base = max(max(footprints), 1)
        merged = [op for ops in groups for op in ops]
        return RoiEstimate(
            t_unfused_us=sum(p.time_us for p in parts),
            t_fused_us=fused.time_us,
            bandwidth_saving_pct=100.0 * (unfused_bytes - fused.gm_bytes) / max(unfused_bytes, 1),
            launch_overhead_reduction_pct=100.0 * (launches - 1) / max(launches, 1),
            l1_pressure_increase_pct=100.0 * (fused_footprint - base) / base,
            common_us=min(sum(p.gemm_us for p in parts), fused.gemm_us),
            absorbs_pointwise=ABSORB_POINTWISE and len(groups) == 2
            and self.absorbed_pointwise(groups, merged) is not None,
        )

    def absorbed_pointwise(self, groups: list[list[TileOp]], merged: list[TileOp]):
        """The group of ``groups`` that is a pointwise kernel (injective ops and views) over
        the merged kernel's whole domain (a full pass, not a per-row value: LayerNorm
        backward's ``rstd / C`` absorbed into its row kernel measured slower on BERT) none
        of whose values the kernel of ``merged`` writes, or None."""
        _, written = self.boundary(merged)
        written = set(written)
        domain = max(self.op_elems[id(op)] for op in merged)
        for ops in groups:
            if all(op.kind.injective or op.is_view for op in ops) \
                    and not all(op.is_view for op in ops) \
                    and not any(op.name in written for op in ops) \
                    and max(self.op_elems[id(op)] for op in ops) == domain:
                return ops
        return None
