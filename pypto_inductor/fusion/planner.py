"""The fusion planner: TileGraph -> FusionPlan.

Every non-view tile op starts as its own group. Candidate merges are the
producer -> consumer edges between groups; each is checked for legality
(acyclic after merging, compatible iteration domains, dtype policy, on-chip
capacity) and scored by the ROI model. The best legal candidate whose score
clears the threshold is merged, its neighbours re-scored, until none is left
(greedy by benefit, as XLA's priority fusion). Every merge and every edge left
unfused at the end is recorded as a Decision with its reason and ROI.
"""
from __future__ import annotations

import dataclasses
import heapq

import torch

from ..config import Config
from ..hardware import HardwareModel
from ..ir import ExternOp, FusionTile, Node, OpKind, TileGraph, TileOp
from .capacity import TilePlan, domains_compatible, group_domain, plan_tile
from .roi import CostModel, RoiEstimate

_HALF = (torch.float16, torch.bfloat16)


@dataclasses.dataclass
class Decision:
    producer: str
    consumer: str
    fused: bool
    reason: str
    roi: RoiEstimate | None

    def to_dict(self) -> dict:
        return {"producer": self.producer, "consumer": self.consumer, "fused": self.fused,
                "reason": self.reason, "roi": self.roi.to_dict() if self.roi else None}


@dataclasses.dataclass
class FusionPlan:
    graph: TileGraph
    hardware: HardwareModel
    tiles: list[FusionTile]
    steps: list[FusionTile | TileOp | ExternOp]  # execution order; TileOps here are views/cat
    decisions: list[Decision]
    unfused_cost: dict  # {"kernels", "gm_bytes", "time_us"} with one kernel per op

    @property
    def externs(self) -> list[ExternOp]:
        return [s for s in self.steps if isinstance(s, ExternOp)]


def _float_dtypes(ops: list[TileOp], graph: TileGraph) -> set[torch.dtype]:
    dts = set()
    for op in ops:
        for name in op.inputs + [op.name]:
            dt = graph.specs[name].dtype
            if dt.is_floating_point:
                dts.add(dt)
    return dts


def compute_dtype(ops: list[TileOp], graph: TileGraph) -> str:
    dts = _float_dtypes(ops, graph)
    if not dts:
        dts = {graph.specs[ops[-1].name].dtype}
    if len(dts) == 1:
        (dt,) = dts
        name = str(dt).replace("torch.", "")
        return f"float32 (upcast from {name})" if dt in _HALF else name
    widest = torch.float64 if torch.float64 in dts else torch.float32
    narrow = sorted(str(d).replace("torch.", "") for d in dts if d in _HALF)
    return str(widest).replace("torch.", "") + (f" (upcast from {', '.join(narrow)})" if narrow else "")


class _Planner:
    def __init__(self, graph: TileGraph, hw: HardwareModel, config: Config):
        self.graph = graph
        self.hw = hw
        self.config = config
        self.cost = CostModel(graph, hw)
        self.order = {id(n): i for i, n in enumerate(graph.nodes)}
        # Units: each schedulable thing. Fusable ops start in their own group.
        self.group_of: dict[int, int] = {}  # id(node) -> group id
        self.members: dict[int, list[Node]] = {}
        for i, node in enumerate(graph.nodes):
            self.group_of[id(node)] = i
            self.members[i] = [node]
        producers = graph.producers()
        self.edges: list[tuple[Node, Node]] = []  # producer -> consumer, deduplicated
        seen = set()
        for node in graph.nodes:
            for name in node.inputs:
                p = producers.get(name)
                if p is not None and (id(p), id(node)) not in seen:
                    seen.add((id(p), id(node)))
                    self.edges.append((p, node))
        self._tile_cache: dict[tuple, TilePlan] = {}

    # --- group helpers -------------------------------------------------------------
    @staticmethod
    def fusable(node: Node) -> bool:
        return isinstance(node, TileOp) and node.kind is not OpKind.LAYOUT

    @staticmethod
    def is_kernel(node: Node) -> bool:
        """Tile ops that need a kernel: all but views (cat is a one-op kernel)."""
        return isinstance(node, TileOp) and not node.is_view

    def ops(self, gid: int) -> list[TileOp]:
        return self.members[gid]

    def tile_plan(self, ops: list[TileOp]) -> TilePlan:
        key = tuple(sorted(id(op) for op in ops))
        if key not in self._tile_cache:
            self._tile_cache[key] = plan_tile(ops, self.graph, self.hw, self.config.buffering)
        return self._tile_cache[key]

    def group_edges(self) -> dict[int, set[int]]:
        succ: dict[int, set[int]] = {g: set() for g in self.members}
        for p, c in self.edges:
            gp, gc = self.group_of[id(p)], self.group_of[id(c)]
            if gp != gc:
                succ[gp].add(gc)
        return succ

    def creates_cycle(self, gp: int, gc: int, succ: dict[int, set[int]]) -> bool:
        """Is gc reachable from gp through some third group?"""
        stack = [g for g in succ[gp] if g != gc]
        seen = set(stack)
        while stack:
            g = stack.pop()
            if g == gc:
                return True
            for nxt in succ[g]:
                if nxt not in seen:
                    seen.add(nxt)
                    stack.append(nxt)
        return False

    # --- evaluation of one candidate ------------------------------------------------
    def evaluate(self, gp: int, gc: int, succ) -> tuple[str | None, RoiEstimate | None]:
        """(reason it is illegal or None, ROI estimate) for merging gp into gc."""
        p_ops, c_ops = self.ops(gp), self.ops(gc)
        if self.creates_cycle(gp, gc, succ):
            return "merging would create a cycle (another kernel sits between them)", None
        dp, dc = group_domain(p_ops, self.graph), group_domain(c_ops, self.graph)
        if dc.matmul and not dp.matmul:
            return "matmul prologue not fused: the cube unit reads its operands from GM", None
        shapes = lambda ops: {op.out.shape for op in ops if op.kind is not OpKind.REDUCTION}
        why = domains_compatible(dp, dc, shapes(p_ops), shapes(c_ops))
        if why:
            return why, None
        if self.config.dtype_policy == "strict":
            dts = _float_dtypes(p_ops, self.graph) | _float_dtypes(c_ops, self.graph)
            if len(dts) > 1:
                names = " -> ".join(sorted(str(d).replace("torch.", "") for d in dts))
                return f"dtype boundary {names} (dtype_policy='strict')", None
        merged = p_ops + c_ops
        tp, tc, tf = self.tile_plan(p_ops), self.tile_plan(c_ops), self.tile_plan(merged)
        roi = self.cost.merge_estimate(p_ops, c_ops,
                                       (tp.footprint_bytes, tc.footprint_bytes, tf.footprint_bytes))
        if not tf.fits:
            return (f"capacity: fused footprint {tf.footprint_bytes} B at tile "
                    f"{'x'.join(map(str, tf.tile_shape))} exceeds {tf.capacity_bytes} B"), roi
        return None, roi

    # --- the greedy loop -------------------------------------------------------------
    def run(self) -> list[Decision]:
        decisions: list[Decision] = []
        threshold = self.config.roi_threshold
        while self.config.fusion:
            succ = self.group_edges()
            best = None
            for p, c in self.edges:
                gp, gc = self.group_of[id(p)], self.group_of[id(c)]
                if gp == gc or not (self.fusable(p) and self.fusable(c)):
                    continue
                why, roi = self.evaluate(gp, gc, succ)
                if why is None and roi.roi_score >= threshold:
                    if best is None or roi.roi_score > best[2].roi_score:
                        best = (p, c, roi)
            if best is None:
                break
            p, c, roi = best
            decisions.append(Decision(p.name, c.name, True,
                                      f"fused: roi_score {roi.roi_score:.2f} >= {threshold}", roi))
            self.merge(self.group_of[id(p)], self.group_of[id(c)])
        return decisions + self.unfused_decisions()

    def merge(self, gp: int, gc: int) -> None:
        merged = sorted(self.members[gp] + self.members[gc], key=lambda n: self.order[id(n)])
        self.members[gc] = merged
        del self.members[gp]
        for node in merged:
            self.group_of[id(node)] = gc

    def unfused_decisions(self) -> list[Decision]:
        succ = self.group_edges()
        out, seen = [], set()
        for p, c in self.edges:
            gp, gc = self.group_of[id(p)], self.group_of[id(c)]
            if gp == gc or not (self.fusable(p) and self.fusable(c)) or (gp, gc) in seen:
                continue
            seen.add((gp, gc))
            why, roi = self.evaluate(gp, gc, succ)
            if not self.config.fusion:
                why = "fusion disabled (fusion=False)"
            elif why is None:
                why = f"roi_score {roi.roi_score:.2f} < roi_threshold {self.config.roi_threshold}"
            out.append(Decision(p.name, c.name, False, why, roi))
        return out

    # --- result ------------------------------------------------------------------------
    def schedule(self) -> list[int]:
        """Groups in a topological order, each as early as its first op allows."""
        succ = self.group_edges()
        indeg = {g: 0 for g in self.members}
        for g, nexts in succ.items():
            for n in nexts:
                indeg[n] += 1
        first = {g: min(self.order[id(n)] for n in ms) for g, ms in self.members.items()}
        ready = sorted((first[g], g) for g, d in indeg.items() if d == 0)
        out = []
        heapq.heapify(ready)
        while ready:
            _, g = heapq.heappop(ready)
            out.append(g)
            for n in succ[g]:
                indeg[n] -= 1
                if indeg[n] == 0:
                    heapq.heappush(ready, (first[n], n))
        assert len(out) == len(self.members), "fusion produced a cyclic schedule"
        return out

    def make_tile(self, index: int, ops: list[TileOp]) -> FusionTile:
        inputs, outputs = self.cost.boundary(ops)
        tp = self.tile_plan(ops)
        cost = self.cost.kernel_cost(ops)
        kinds = {op.kind for op in ops}
        kind = next((k for k in (OpKind.MATMUL, OpKind.REDUCTION, OpKind.BROADCAST, OpKind.CAST)
                     if k in kinds), OpKind.ELEMENTWISE)
        label = "_".join(dict.fromkeys(op.op for op in ops))[:48]
        return FusionTile(
            name=f"{self.graph.name}_k{index}_{label}", ops=ops, inputs=inputs, outputs=outputs,
            dtype=compute_dtype(ops, self.graph), tile_shape=tp.tile_shape,
            footprint_expr=tp.footprint_expr, footprint_bytes=tp.footprint_bytes,
            capacity_bytes=tp.capacity_bytes, kind=kind, predicted_us=cost.time_us,
            gm_bytes=cost.gm_bytes,
        )


def plan_fusion(graph: TileGraph, hw: HardwareModel, config: Config) -> FusionPlan:
    planner = _Planner(graph, hw, config)
    decisions = planner.run()
    tiles, steps = [], []
    for gid in planner.schedule():
        ops = planner.members[gid]
        if len(ops) == 1 and not planner.is_kernel(ops[0]):
            steps.append(ops[0])  # a view or an extern op
            continue
        tile = planner.make_tile(len(tiles), ops)
        tiles.append(tile)
        steps.append(tile)
    single = [planner.cost.kernel_cost([op]) for op in graph.nodes if planner.is_kernel(op)]
    unfused = {"kernels": len(single), "gm_bytes": sum(c.gm_bytes for c in single),
               "time_us": sum(c.time_us for c in single)}
    return FusionPlan(graph, hw, tiles, steps, decisions, unfused)
