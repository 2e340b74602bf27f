"""The fusion planner: TileGraph -> FusionPlan.

Every non-view tile op starts as its own group. Candidate merges are the
producer -> consumer edges between groups and siblings (groups reading the
same value); a merge also takes every group on a path between its candidates,
so the result stays acyclic. Each is checked for legality (compatible
iteration domains, dtype policy, on-chip capacity) and scored by the ROI
model. Among the legal candidates whose score clears the threshold, the one
saving the most predicted time is merged and the rest re-scored, until none is
left (greedy by benefit, as XLA's priority fusion). Every merge and every
candidate left unfused at the end is recorded as a Decision with its reason
and ROI.
"""
from __future__ import annotations

import dataclasses
import heapq
import itertools

import torch

from ..config import Config
from ..hardware import HardwareModel
from ..ir import ExternOp, FusionTile, Node, OpKind, TileGraph, TileOp, gemm_bias_add
from ..lowering.indexing import STANDALONE_OPS
from .reach import GroupReach, bits, members as bit_members
from .capacity import (TilePlan, cat_part_ops, domains_compatible, group_domain, plan_tile,
                       pointwise_outputs, sums_over_rows)
from .roi import CostModel, RoiEstimate

_HALF = (torch.float16, torch.bfloat16)
MAX_GROUPS_PER_MERGE = 12  # bounds how much one merge may pull into a kernel
MAX_SIBLINGS = 8  # readers of one value considered pairwise
# The greedy loop re-evaluates only the candidates a merge can have changed, with closures
# from reach.GroupReach's bitsets (Planner._incremental_best); off: every candidate is
# evaluated again after each merge, closures searched (the same decisions, for A/B)
INCREMENTAL = True
# Producers of cat parts computed per part in the cat's kernel (False: as before, for A/Bs)
CAT_PARTS = True
# Column sums (bias / norm-weight gradients) computed by the row kernel over the same rows,
# where the hardware model's kernels can (False: as before, for A/Bs)
ROW_COLUMN_SUMS = True
# ... also by a matmul's epilogue (GELU backward's bias gradient) and by a pointwise kernel
# over a reshape of the sums' input (False: by row kernels only, as before, for A/Bs)
KERNEL_COLUMN_SUMS = True


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

    def extern_counts(self) -> dict[str, int]:
        """ATen op name -> how many of the plan's extern (eager) calls run it."""
        counts: dict[str, int] = {}
        for step in self.externs:
            counts[step.op_name] = counts.get(step.op_name, 0) + 1
        return counts


def _float_dtypes(ops: list[TileOp], graph: TileGraph) -> set[torch.dtype]:
    dts = set()
    for op in ops:
        for name in op.inputs + [op.name]:
            dt = graph.specs[name].dtype
            if dt.is_floating_point:
                dts.add(dt)
    return dts


def compute_dtype(ops: list[TileOp], graph: TileGraph, policy: str = "upcast") -> str:
    """The dtype a FusionTile computes in: half types upcast to fp32 unless strict."""
    dts = _float_dtypes(ops, graph)
    if not dts:
        dts = {graph.specs[ops[-1].name].dtype}
    if len(dts) == 1:
        (dt,) = dts
        name = str(dt).replace("torch.", "")
        return f"float32 (upcast from {name})" if dt in _HALF and policy == "upcast" else name
    widest = torch.float64 if torch.float64 in dts else torch.float32
    narrow = sorted(str(d).replace("torch.", "") for d in dts if d in _HALF)
    return str(widest).replace("torch.", "") + (f" (upcast from {', '.join(narrow)})" if narrow else "")


class Planner:
    def __init__(self, graph: TileGraph, hw: HardwareModel, config: Config):
        self.graph = graph
        self.hw = hw
        self.config = config
        self.threshold = (config.roi_threshold if config.roi_threshold is not None
                          else hw.default_roi_threshold)
        # an explicit roi_threshold is the user's: no merge below it (roi.ABSORB_POINTWISE)
        self.absorb = config.roi_threshold is None
        self.cost = CostModel(graph, hw)
        self.column_sums = hw.column_sums_in_row_kernels and ROW_COLUMN_SUMS
        self.order = {id(n): i for i, n in enumerate(graph.nodes)}
        # Units: each schedulable thing. Fusable ops start in their own group.
        self.group_of: dict[int, int] = {}  # id(node) -> group id
        self.members: dict[int, list[Node]] = {}
        for i, node in enumerate(graph.nodes):
            self.group_of[id(node)] = i
            self.members[i] = [node]
        producers = self.producers = graph.producers()
        self.edges: list[tuple[Node, Node]] = []  # producer -> consumer, deduplicated
        seen = set()
        for node in graph.nodes:
            for name in node.inputs:
                p = producers.get(name)
                if p is not None and (id(p), id(node)) not in seen:
                    seen.add((id(p), id(node)))
                    self.edges.append((p, node))
        self.edges += _write_after_read_edges(graph, producers, seen)
        # Compute ops reading the same value, or views of it: sibling candidates (a shared
        # read saved, or one kernel call for two: attention's Q and K copies from the QKV
        # projection's output).
        def root(name: str) -> str:
            p = producers.get(name)
            while isinstance(p, TileOp) and p.is_view and p.inputs:
                name, p = p.inputs[0], producers.get(p.inputs[0])
            return name

        readers: dict[str, list[Node]] = {}
        for node in graph.nodes:
            if self.fusable(node) and not node.is_view:
                for name in dict.fromkeys(map(root, node.inputs)):
                    readers.setdefault(name, []).append(node)
        self.siblings = [r[:MAX_SIBLINGS] for r in readers.values() if len(r) > 1]
        self._tile_cache: dict[tuple, TilePlan] = {}
        self._eval_cache: dict[tuple, tuple] = {}
        self.version: dict[int, int] = {}  # bumped when a group's members change
        # The greedy loop asks these of every candidate in every iteration (planning GPT-2's
        # step: ~16000 candidates over ~160 merges), so they are kept per group and updated
        # by merge() rather than recomputed: which nodes are fusable, each group's first op
        # (its place in graph order), whether it is views only and the op that keeps it out
        # of kernels (None: fusable), and the edges between groups.
        self._fusable = {id(n) for n in graph.nodes if self.fusable(n)}
        self._first = {g: self.order[id(ms[0])] for g, ms in self.members.items()}
        self._kind: dict[int, tuple[bool, Node | None]] = {}  # group -> (view_only, blocker)
        self._succ, self._pred = self.rebuilt_group_edges()
        self._merges = 0  # merges so far: the version of the group edges
        self._topo = None  # (self._merges, topological index of the groups then)
        self.reach: GroupReach | None = None  # while run() keeps it (INCREMENTAL)

    # --- group helpers -------------------------------------------------------------
    def fusable(self, node: Node) -> bool:
        """Compute ops, reshapes (free inside a kernel: row-major order is kept), and cat
        where the hardware model's kernels take it (``hw.cat_in_kernels``)."""
        return isinstance(node, TileOp) and node.op not in STANDALONE_OPS and (
            node.kind is not OpKind.LAYOUT or node.op == "view"
            or (node.op == "cat" and self.hw.cat_in_kernels))

    def view_only(self, gid: int) -> bool:
        return self._group_kind(gid)[0]

    def _group_kind(self, gid: int) -> tuple[bool, Node | None]:
        """(whether the group is views only, its first op that cannot join a kernel or
        None), cached until the group changes."""
        kind = self._kind.get(gid)
        if kind is None:
            ms = self.members[gid]
            blocker = next((n for n in ms if id(n) not in self._fusable), None)
            views = all(isinstance(op, TileOp) and op.is_view for op in ms)
            kind = self._kind[gid] = (views, blocker)
        return kind

    def ops(self, gid: int) -> list[TileOp]:
        return self.members[gid]

    def tile_plan(self, ops: list[TileOp]) -> TilePlan:
        key = tuple(sorted(id(op) for op in ops))
        if key not in self._tile_cache:
            # gathers read where they are used iterate no domain of their own: last, so the
            # group's domain comes from the others (capacity.group_domain takes the first)
            members = {id(op) for op in ops}
            parts = self.cat_parts(ops)
            ordered = sorted(ops, key=lambda op: self.read_where_used(op, members)
                             or op.name in parts)
            self._tile_cache[key] = plan_tile(ordered, self.graph, self.hw,
                                              self.config.buffering)
        return self._tile_cache[key]

    def read_where_used(self, op: TileOp, members: set[int]) -> bool:
        """A gather whose result only pointwise ops among ``members`` read, each broadcasting
        it to a larger shape (a position embedding [1, S, D] added to [B, S, D]): a kernel
        reads it where it is used, so it has no iteration domain of its own there."""
        if op.op != "gather" or op.name in self.cost.graph_outputs:
            return False
        users = self.cost.users.get(op.name, [])
        small = tuple(op.out.shape)
        for user in users:
            big = tuple(user.out.shape) if isinstance(user, TileOp) else ()
            if id(user) not in members or not user.kind.injective \
                    or user.op in ("gather", "pad", "copy_") or len(small) > len(big) \
                    or self.graph.hint(op.out.numel) >= self.graph.hint(user.out.numel) \
                    or any(s != 1 and s != b for s, b in zip(small[::-1], big[::-1])):
                return False
        return bool(users)

    def group_edges(self) -> tuple[dict[int, set[int]], dict[int, set[int]]]:
        """(successors, predecessors) of every group, as merge() keeps them: read only."""
        return self._succ, self._pred

    def rebuilt_group_edges(self) -> tuple[dict[int, set[int]], dict[int, set[int]]]:
        """group_edges() computed anew from the op edges."""
        succ: dict[int, set[int]] = {g: set() for g in self.members}
        pred: dict[int, set[int]] = {g: set() for g in self.members}
        for p, c in self.edges:
            gp, gc = self.group_of[id(p)], self.group_of[id(c)]
            if gp != gc:
                succ[gp].add(gc)
                pred[gc].add(gp)
        return succ, pred

    @staticmethod
    def _reach(start: set[int], edges: dict[int, set[int]], keep=lambda g: True) -> set[int]:
        """Groups reachable from ``start`` (excluding it) along ``edges`` through groups
        ``keep`` accepts."""
        stack = [n for g in start for n in edges[g] if n not in start and keep(n)]
        seen = set(stack)
        while stack:
            for nxt in edges[stack.pop()]:
                if nxt not in seen and nxt not in start and keep(nxt):
                    seen.add(nxt)
                    stack.append(nxt)
        return seen

    def topological(self, succ, pred) -> dict[int, int] | None:
        """A topological index of the groups of this (succ, pred), computed once per merge
        (the greedy loop's iteration); None if the groups are not acyclic."""
        if self._topo is not None and self._topo[0] == self._merges:
            return self._topo[1]
        indeg = {g: len(pred[g]) for g in succ}
        ready = [g for g, d in indeg.items() if d == 0]
        index: dict[int, int] = {}
        while ready:
            g = ready.pop()
            index[g] = len(index)
            for n in succ[g]:
                indeg[n] -= 1
                if indeg[n] == 0:
                    ready.append(n)
        topo = index if len(index) == len(succ) else None
        self._topo = (self._merges, topo)
        return topo

    def closure(self, gids: list[int], succ, pred) -> list[int] | str:
        """The groups to merge so the result stays acyclic: ``gids`` plus every group
        on a path between two of them; or the reason that is impossible. A group on such
        a path lies before the last of them in topological order, so the forward search
        stops there, and the backward one stays among the groups the forward one found
        (planning GPT-2: the searches were half the planner's time)."""
        inside = set(gids)
        topo = None if self.reach is not None else self.topological(succ, pred)
        if self.reach is not None:
            between = set(bit_members(self.reach.between(gids)))
        elif topo is None:
            between = self._reach(inside, succ) & self._reach(inside, pred)
        else:
            hi = max(topo[g] for g in inside)
            after = self._reach(inside, succ, lambda g: topo[g] < hi)
            # those of them that reach back: a path from one of them to ``inside`` runs
            # through such groups only, so that search stays among them
            between = self._reach(inside, pred, after.__contains__) if after else after
        blocked = [g for g in between if self._group_kind(g)[1] is not None]
        if blocked:  # the first in graph order
            blocker = self._group_kind(min(blocked, key=self._first.__getitem__))[1]
            name = blocker.op_name if isinstance(blocker, ExternOp) else blocker.op
            return f"merging would create a cycle through {blocker.name} ({name}), which cannot join a kernel"
        if len(inside | between) > MAX_GROUPS_PER_MERGE:
            return f"merging would pull {len(inside | between)} kernels into one (limit {MAX_GROUPS_PER_MERGE})"
        return sorted(inside | between, key=self._first.__getitem__)

    def candidate(self, p: Node, c: Node, seen: list[int] | None = None) -> list[int] | None:
        """Groups a producer -> consumer edge would merge, producer first; ``seen``, when
        given, gets the groups the answer depends on.

        A standalone reshape between them is absorbed with them: on its own it
        gains nothing, but it must not stop its producer and consumer fusing.
        """
        if id(p) not in self._fusable or id(c) not in self._fusable:
            return None
        gids = [self.group_of[id(c)]]
        if seen is not None:
            seen.append(gids[0])
        if self.view_only(gids[0]):
            return None
        node = p
        while self.view_only(self.group_of[id(node)]):
            gids.append(self.group_of[id(node)])
            if seen is not None:
                seen.append(gids[-1])
            node = self.producers.get(node.args[0])
            if node is None or id(node) not in self._fusable:
                return None
        gids.append(self.group_of[id(node)])
        gids = list(dict.fromkeys(reversed(gids)))
        return gids if len(gids) > 1 else None

    # --- evaluation of one candidate ------------------------------------------------
    def evaluate(self, gids: list[int], succ, pred) -> tuple[str | None, RoiEstimate | None, list[int]]:
        """(reason the merge is illegal or None, ROI estimate, groups merged) for these groups."""
        closed = self.closure(gids, succ, pred)
        if isinstance(closed, str):
            return closed, None, gids
        # Everything but the closure depends only on the groups' members.
        key = tuple((g, self.version.get(g, 0)) for g in closed)
        if key not in self._eval_cache:
            self._eval_cache[key] = self._evaluate_members(closed)
        return (*self._eval_cache[key], closed)

    def _evaluate_members(self, gids: list[int]) -> tuple[str | None, RoiEstimate | None]:
        groups = [self.ops(g) for g in gids]
        merged = sorted((op for ops in groups for op in ops), key=lambda n: self.order[id(n)])
        defined = {op.name for op in merged}
        for op in merged:
            if op.kind is OpKind.MATMUL and any(a in defined for a in op.inputs):
                return "matmul prologue not fused: the cube unit reads its operands from GM", None
            if op.op == "gather" and any(self.computed_in(a, defined) for a in op.inputs):
                return "gather source or index not fused: an indexed read takes them from GM", None
        members = {id(op) for op in merged}
        parts = self.cat_parts(merged)
        why = self.cat_parts_illegal(merged, parts)
        if why:
            return why, None
        # gathers read where used and cat parts' producers: no iteration domain of their own
        free = {id(op) for op in merged
                if op.name in parts or self.read_where_used(op, members)}
        # casts and views of column sums a row kernel computes: stored after its last row
        finals = self.column_sum_finals(merged)
        free |= {id(op) for op in merged if op.name in finals}
        domain_groups = [g for g in ([op for op in ops if id(op) not in free] for ops in groups)
                         if g]
        acc = list(domain_groups[0])
        for ops in domain_groups[1:]:
            why = domains_compatible(group_domain(acc, self.graph), group_domain(ops, self.graph),
                                     pointwise_outputs(acc), pointwise_outputs(ops),
                                     self.column_sums)
            if why:
                return why, None
            acc += ops
        why = self.column_sums_read(merged)
        if why:
            return why, None
        why = self.cat_columns(merged)
        if why:
            return why, None
        if self.config.dtype_policy == "strict":
            dts = _float_dtypes(merged, self.graph)
            if len(dts) > 1:
                names = " -> ".join(sorted(str(d).replace("torch.", "") for d in dts))
                return f"dtype boundary {names} (dtype_policy='strict')", None
        plans = [self.tile_plan(ops) for ops in groups]
        fused = self.tile_plan(merged)
        roi = self.cost.merge_estimate(groups, [t.footprint_bytes for t in plans],
                                       fused.footprint_bytes)
        if not fused.fits:
            return (f"capacity: fused footprint {fused.footprint_bytes} B at tile "
                    f"{'x'.join(map(str, fused.tile_shape))} exceeds {fused.capacity_bytes} B"), roi
        return None, roi

    def row_column_sums(self, ops: list[TileOp]) -> list[TileOp]:
        """The column sums a kernel of these ops computes over its rows (capacity.
        row_column_sums): none unless the group's domain is a row reduction's, a pointwise
        kernel's (over a reshape of the sums' input) or a matmul's (its epilogue)."""
        return sums_over_rows(ops, self.graph) if self.column_sums else []

    def column_sum_finals(self, merged: list[TileOp]) -> set[str]:
        """Views and float casts of the column sums a row kernel of ``merged`` computes
        (through each other): only stored, the store rounding as the cast does."""
        final = {op.name for op in self.row_column_sums(merged)}
        out = set()
        for op in merged:  # in order
            if op.op in ("view", "cast") and op.out.dtype.is_floating_point \
                    and op.inputs and op.inputs[0] in final:
                final.add(op.name)
                out.add(op.name)
        return out

    def column_sums_read(self, merged: list[TileOp]) -> str | None:
        """A column sum in a row kernel is final only after the last row: nothing in the
        kernel may read it but views and float casts of it (column_sum_finals), and every
        other op has the row kernel's rows or elements."""
        sums = self.row_column_sums(merged)
        if not sums:
            return None
        final = {op.name for op in sums} | self.column_sum_finals(merged)
        dom = group_domain(merged, self.graph)
        if dom.kind != "row" and not KERNEL_COLUMN_SUMS:
            return (f"column sums in a {dom.kind} kernel are off "
                    f"(fusion.planner.KERNEL_COLUMN_SUMS)")
        sizes = {self.graph.hint(dom.numel), self.graph.hint(dom.numel * dom.rnumel)}
        cols = self.graph.hint(self.graph.specs[sums[0].args[0]].shape[-1])
        # a pointwise kernel computes its cats' parts per part (no domain of their own)
        parts = self.cat_parts(merged) if dom.kind == "pointwise" else set()
        for op in merged:
            if op.name in final:
                continue
            read = [a for a in op.inputs if a in final]
            if read:
                return (f"{op.name} ({op.op}) reads the column sum {read[0]}, which a row "
                        f"kernel has only after its last row")
            if op.name in parts:
                continue
            if op.kind is not OpKind.REDUCTION and not op.is_view \
                    and self.graph.hint(op.out.numel) not in sizes:
                return f"{op.name} ({op.op}) iterates neither the row kernel's rows nor elements"
            if dom.kind != "row" and op.kind is not OpKind.REDUCTION and op.out.shape \
                    and self.graph.hint(op.out.shape[-1]) != cols:
                # a pointwise kernel or matmul epilogue whose columns are the sums' columns
                return (f"{op.name} ({op.op}, last dim {self.graph.hint(op.out.shape[-1])}) "
                        f"does not have the column sums' {cols} columns")
        return self.epilogue_sums(merged, sums, final) if dom.kind == "matmul" else None

    def epilogue_sums(self, merged: list[TileOp], sums: list[TileOp], final: set[str]) -> str | None:
        """Column sums join a matmul's epilogue only where the epilogue is a pass anyway (an
        elementwise op besides the GEMM's bias add) and over values it computes: a sum of a
        tile input or of the bare product would make that pass only to read from memory
        what the column-sum kernel reads, one kernel call for another."""
        defined = {op.name for op in merged}
        for op in sums:
            if not self.computed_in(op.args[0], defined):
                return (f"{op.name} sums {op.args[0]}, which the matmul kernel reads from "
                        f"memory: its epilogue pass would save nothing")
        bias = gemm_bias_add(merged, self.graph.specs, self.cost.boundary(merged)[1])
        if not any(op.kind in (OpKind.ELEMENTWISE, OpKind.BROADCAST, OpKind.CAST)
                   and op is not bias and op.name not in final for op in merged):
            return "a matmul whose only epilogue is a column sum: its pass would save nothing"
        return None

    def cat_parts(self, ops: list[TileOp]) -> set[str]:
        """Ops of a would-be kernel computed only for cat parts (capacity.cat_part_ops):
        the kernel computes them per part, inside the cat's iteration domain."""
        if not CAT_PARTS or not any(op.op == "cat" for op in ops):
            return set()
        return cat_part_ops(ops, self.cost.boundary(ops)[1])

    def cat_parts_illegal(self, merged: list[TileOp], parts: set[str]) -> str | None:
        """Why a kernel cannot compute these cat parts' producers per part, or None: each
        has its cat's rank (the part's shape, the cat's dim split) and reads no value the
        kernel computes over its whole domain (codegen/cpp's lower_parts)."""
        if not parts:
            return None
        users: dict[str, list[TileOp]] = {}
        defined = {op.name: op for op in merged}
        for op in merged:
            for a in op.inputs:
                users.setdefault(a, []).append(op)
        for op in merged:
            if op.name not in parts:
                continue
            for a in op.inputs:
                while a in defined and defined[a].op == "view":
                    a = defined[a].args[0]
                if a in defined and a not in parts:
                    return (f"{op.name} ({op.op}) computes a cat part from {a}, which the "
                            f"kernel computes over its whole domain")
            stack, seen = [op], set()
            while stack:  # the cats this part's value reaches through other parts
                for u in users.get(stack.pop().name, []):
                    if u.name in seen:
                        continue
                    seen.add(u.name)
                    if u.op == "cat" and len(u.out.shape) != len(op.out.shape):
                        return (f"{op.name} ({op.op}, rank {len(op.out.shape)}) feeds a part of "
                                f"{u.name} (rank {len(u.out.shape)}): not the cat's rank")
                    if u.name in parts:
                        stack.append(u)
        return None

    def cat_columns(self, merged: list[TileOp]) -> str | None:
        """A cat along the last dim splits a kernel's column loop at its parts, so the ops
        iterating the same elements must have its last dim (a sibling of another shape,
        e.g. q's rotate_half next to k's rotary, would cut the columns elsewhere)."""
        hint = self.graph.hint
        for cat in merged:
            if cat.op != "cat" or cat.attrs["dim"] != len(cat.out.shape) - 1:
                continue
            numel, last = hint(cat.out.numel), hint(cat.out.shape[-1])
            for op in merged:
                if op.kind is not OpKind.REDUCTION and op.out.shape \
                        and hint(op.out.numel) == numel and hint(op.out.shape[-1]) != last:
                    return (f"cat {cat.name} along the last dim ({last}) and {op.name} (last dim "
                            f"{hint(op.out.shape[-1])}) would cut one kernel's columns apart")
        return None

    def computed_in(self, name: str, defined: set[str]) -> bool:
        """Whether ``name`` is computed by an op of ``defined``, seen through reshapes."""
        while name in defined:
            op = self.producers[name]
            if op.op != "view":
                return True
            name = op.args[0]
        return False

    # --- the greedy loop -------------------------------------------------------------
    def candidates(self):
        """(producer, consumer, groups) of every merge worth considering now: producer ->
        consumer edges, and siblings (two groups reading the same value)."""
        for p, c in self.edges:
            gids = self.candidate(p, c)
            if gids is not None:
                yield p, c, gids
        for readers in self.siblings:
            for a, b in itertools.combinations(readers, 2):
                ga, gb = self.group_of[id(a)], self.group_of[id(b)]
                if ga != gb:
                    yield a, b, [ga, gb]

    def run(self) -> list[Decision]:
        decisions: list[Decision] = []
        threshold = self.threshold
        topo = self.topological(*self.group_edges()) \
            if INCREMENTAL and self.config.fusion else None
        if topo is not None:
            self.reach = GroupReach(self._succ, topo)
            best_merge = self._incremental_best()
            best = best_merge(None)
        while self.config.fusion:
            if topo is None:
                succ, pred = self.group_edges()
                best = None
                for p, c, gids in self.candidates():
                    why, roi, closed = self.evaluate(gids, succ, pred)
                    if why is None and roi.clears(threshold, self.absorb):
                        if best is None or roi.saving_us > best[3].saving_us:
                            best = (p, c, closed, roi, len(closed) - len(gids))
            if best is None:
                break
            p, c, closed, roi, extra = best
            reason = f"fused: roi_score {roi.roi_score:.2f} >= {threshold}"
            if roi.roi_score < threshold:  # roi.clears: a pointwise kernel absorbed
                reason = (f"fused: roi_score {roi.roi_score:.2f} < {threshold}, but it absorbs "
                          f"a pointwise kernel (none of its values written), saving "
                          f"{roi.saving_us:.2f} us")
            if extra:
                reason += f" (with {extra} kernel(s) between them, to stay acyclic)"
            merged = [op for g in closed for op in self.members[g]]
            sums = self.row_column_sums(merged)
            if sums:
                kind = {"row": "a row kernel", "pointwise": "a pointwise kernel",
                        "matmul": "a matmul epilogue"}[group_domain(merged, self.graph).kind]
                reason += (f" ({kind} summing {len(sums)} column(s) over its rows: "
                           f"{self.cost.column_partial_bytes(sums)} B of column partials)")
            decisions.append(Decision(p.name, c.name, True, reason, roi))
            self.merge(closed)
            if topo is not None:
                best = best_merge(closed)
        return decisions + self.unfused_decisions()

    def _incremental_best(self):
        """The greedy loop's choice kept up to date across merges: ``best(merged)`` (None
        the first time, then the groups just merged) gives what scanning every candidate
        would, (producer, consumer, closure, roi, extra groups) or None. Each candidate's
        evaluation is kept with the groups it depends on (those it names, its closure, and
        for an edge the groups its search passed) and redone only when a merge took one of
        them or joined a group upstream of one of its groups to one downstream (a new path
        between them can change the closure): the same answers, the same order."""
        slots = [(p, c, False) for p, c in self.edges] + [
            (a, b, True) for readers in self.siblings
            for a, b in itertools.combinations(readers, 2)]
        state: list[tuple] = [()] * len(slots)  # (deps bits, gids bits, best entry or None)
        succ, pred = self.group_edges()
        threshold = self.threshold

        def refresh(i: int) -> None:
            p, c, sibling = slots[i]
            seen: list[int] = []
            if sibling:
                seen = [self.group_of[id(p)], self.group_of[id(c)]]
                gids = seen if seen[0] != seen[1] else None
            else:
                gids = self.candidate(p, c, seen)
            if gids is None:
                state[i] = (bits(seen), 0, None)
                return
            why, roi, closed = self.evaluate(gids, succ, pred)
            deps = bits(seen) | bits(gids) | self.reach.between(gids)
            entry = None
            if why is None and roi.clears(threshold, self.absorb):
                entry = (p, c, closed, roi, len(closed) - len(gids))
            state[i] = (deps, bits(gids), entry)

        def best(merged: list[int] | None):
            if merged is None:
                dirty = range(len(slots))
            else:
                gone, target = bits(merged), merged[-1]
                up, down = self.reach.anc[target], self.reach.desc[target]
                dirty = [i for i, (deps, gb, _) in enumerate(state)
                         if deps & gone or (gb & up and gb & down)]
            for i in dirty:
                refresh(i)
            chosen = None
            for _, _, entry in state:
                if entry is not None and (chosen is None
                                          or entry[3].saving_us > chosen[3].saving_us):
                    chosen = entry
            return chosen
        return best

    def merge(self, gids: list[int]) -> None:
        target = gids[-1]
        merged = sorted((n for g in gids for n in self.members[g]), key=lambda n: self.order[id(n)])
        for g in gids[:-1]:
            del self.members[g], self._first[g]
        self.version[target] = self.version.get(target, 0) + 1
        self.members[target] = merged
        for node in merged:
            self.group_of[id(node)] = target
        self._first[target] = self.order[id(merged[0])]
        for g in gids:
            self._kind.pop(g, None)
        # the group edges with the merged groups contracted into the target
        gone, succ, pred = set(gids), self._succ, self._pred
        after = set().union(*(succ.pop(g) for g in gids)) - gone
        before = set().union(*(pred.pop(g) for g in gids)) - gone
        for g in after:
            pred[g] -= gone
            pred[g].add(target)
        for g in before:
            succ[g] -= gone
            succ[g].add(target)
        succ[target], pred[target] = after, before
        self._merges += 1
        if self.reach is not None:
            self.reach.merge(gids, target)

    def unfused_decisions(self) -> list[Decision]:
        succ, pred = self.group_edges()
        out, seen = [], set()
        for p, c, gids in self.candidates():
            key = frozenset(gids)
            if key in seen:
                continue
            seen.add(key)
            why, roi, _ = self.evaluate(gids, succ, pred)
            if not self.config.fusion:
                why = "fusion disabled (fusion=False)"
            elif why is None:
                why = f"roi_score {roi.roi_score:.2f} < roi_threshold {self.threshold}"
                if roi.absorbs_pointwise and self.absorb:
                    why += " (it would absorb a pointwise kernel, but saves no time)"
            out.append(Decision(p.name, c.name, False, why, roi))
        return out

    # --- result ------------------------------------------------------------------------
    def schedule(self) -> list[int]:
        """Groups in a topological order, each as early as its first op allows."""
        succ, _ = self.group_edges()
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
            dtype=compute_dtype(ops, self.graph, self.config.dtype_policy), tile_shape=tp.tile_shape,
            footprint_expr=tp.footprint_expr, footprint_bytes=tp.footprint_bytes,
            capacity_bytes=tp.capacity_bytes, kind=kind, predicted_us=cost.time_us,
            gm_bytes=cost.gm_bytes, bound=cost.bound,
        )


    def tile_steps(self, index: int, ops: list[TileOp]) -> list:
        """The tile of ``ops``, then the reshapes of its outputs it need not store again: in
        a row kernel summing columns, a column sum may read a reshape of a value the kernel
        also stores (a LayerNorm backward's grad input, the bias gradient of the Linear
        before it); the kernel computes the reshape for the sum, and its other readers
        take it as a view of the stored value (a step after the tile)."""
        tile = self.make_tile(index, ops)
        if not self.row_column_sums(ops):
            return [tile]
        outs = set(tile.outputs)
        again = [op for op in ops if op.op == "view" and op.name in outs
                 and op.args[0] in outs and op.name not in self.cost.graph_outputs]
        if not again:
            return [tile]
        names = {op.name for op in again}
        return [dataclasses.replace(tile, outputs=[o for o in tile.outputs if o not in names]),
                *again]


def _write_after_read_edges(graph: TileGraph, producers: dict, seen: set) -> list:
    """Edges (reader -> copy_) making every other reader of a mutated input, or of a view
    of it, run before the ``copy_`` that overwrites it (lowering/mutation.py)."""
    copies = [n for n in graph.nodes if isinstance(n, TileOp) and n.op == "copy_"]
    if not copies:
        return []
    readers: dict[str, list[Node]] = {}
    views: dict[str, list[str]] = {}
    for node in graph.nodes:
        for name in dict.fromkeys(node.inputs):
            readers.setdefault(name, []).append(node)
        if isinstance(node, TileOp) and node.is_view and node.inputs:
            views.setdefault(node.inputs[0], []).append(node.name)
    edges = []
    for copy in copies:
        aliases, stack = set(), [copy.attrs["mutates"]]
        while stack:
            name = stack.pop()
            if name not in aliases:
                aliases.add(name)
                stack += views.get(name, [])
        for name in aliases:
            for reader in readers.get(name, []):
                if reader is not copy and (id(reader), id(copy)) not in seen:
                    seen.add((id(reader), id(copy)))
                    edges.append((reader, copy))
    return edges


def plan_fusion(graph: TileGraph, hw: HardwareModel, config: Config) -> FusionPlan:
    planner = Planner(graph, hw, config)
    decisions = planner.run()
    tiles, steps = [], []
    for gid in planner.schedule():
        ops = planner.members[gid]
        if all(isinstance(n, ExternOp) or n.is_view for n in ops):
            steps.extend(ops)  # extern ops and standalone views run as they are
            continue
        tile, *views = planner.tile_steps(len(tiles), ops)
        if not tile.outputs:  # nothing reads what it computes (a copy_ is always an output)
            continue
        tiles.append(tile)
        steps += [tile, *views]
    single = [planner.cost.kernel_cost([op]) for op in graph.nodes
              if isinstance(op, TileOp) and not op.is_view]
    unfused = {"kernels": len(single), "gm_bytes": sum(c.gm_bytes for c in single),
               "time_us": sum(c.time_us for c in single)}
    return FusionPlan(graph, hw, tiles, steps, decisions, unfused)
