"""FusionReport: what was fused, what was not, and why, per compiled graph.

The data model (:class:`GraphReport`, :class:`FusionReport`) and its renderers:
a text table, JSON and HTML (:mod:`.html`: the tile graph's picture from
:mod:`.graph`, matplotlib charts from :mod:`.charts`). The backend publishes a
GraphReport for every graph it compiles (:func:`publish`): to :func:`collect`
blocks (what ``pypto_inductor.report(model, *inputs)`` in :mod:`..api` uses) and, with
``options={"report_path": p}``, to the file ``p``.
"""
from __future__ import annotations

import contextlib
import json
import logging
from pathlib import Path

from tabulate import tabulate

from ..config import Config
from ..fusion.roi import CostModel
from ..hardware import HardwareModel
from . import graph as _graph

log = logging.getLogger(__name__)


class GraphReport:
    """The report of one compiled graph: its plan and what happened at build time."""

    def __init__(self, name: str, plan=None, compiled=None, eager_reason: str | None = None,
                 num_ops: int = 0, target: str = "", hardware=None):
        self.name = name
        self.plan = plan
        self.compiled = compiled
        self.eager_reason = eager_reason
        self._num_ops = num_ops
        self.target = target or (compiled.config.target if compiled else "")
        self.hardware = hardware or (plan.hardware if plan else None)
        # tile name -> codegen.pypto.sim.TileSimulation, with options={"simulate": True}
        self.simulation: dict | None = None
        # SDPA calls as pypto flash-attention kernels (codegen.pypto.attention), when simulated
        self.attention: list[dict] | None = None

    @classmethod
    def eager(cls, name: str, reason: str, gm) -> "GraphReport":
        ops = sum(1 for n in gm.graph.nodes if n.op == "call_function")
        return cls(name, eager_reason=reason, num_ops=ops)

    def to_dict(self) -> dict:
        if self.plan is None:
            return {"name": self.name, "num_ops": self._num_ops, "eager_reason": self.eager_reason,
                    "fallback_ops": {}, "fusion_tiles": [], "decisions": [],
                    "kernels_unfused": 0, "kernels_fused": 0}
        plan, graph = self.plan, self.plan.graph
        measured = self.compiled.measured_us() if self.compiled else {}
        fallbacks = self.compiled.kernel_fallbacks if self.compiled else {}
        native = self.compiled.kernel_native if self.compiled else {}
        cost = CostModel(graph, self.hardware) if self.hardware else None
        tiles = []
        for tile in plan.tiles:
            entry = {
                "name": tile.name,
                "ops": [op.name for op in tile.ops],
                "op_kinds": [op.op for op in tile.ops],
                "kind": tile.kind.value,
                "dtype": tile.dtype,
                "tile_shape": list(tile.tile_shape),
                "footprint_bytes": int(tile.footprint_bytes),
                "footprint_expr": str(tile.footprint_expr),
                "capacity_bytes": int(tile.capacity_bytes),
                # False only when even the smallest tile overflows (e.g. one reduction row)
                "fits": int(tile.footprint_bytes) <= int(tile.capacity_bytes),
                "gm_bytes": int(tile.gm_bytes),
                "bound": tile.bound,
                "predicted_us": round(tile.predicted_us, 3),
                "flops": int(cost.kernel_cost(tile.ops).flops) if cost else 0,
                "kernel_fallback": fallbacks.get(tile.name),
                "native": self.compiled.kernel_native.get(tile.name) if self.compiled else None,
            }
            if self.simulation is not None:
                sim = self.simulation.get(tile.name)
                entry.update(sim.to_dict() if sim is not None else {
                    "pypto_source": None, "simulated_cycles_fused": None,
                    "simulated_cycles_unfused": None, "pto_ir_path": None,
                    "perfetto_trace_path": None, "simulation_error": "not simulated",
                    "split_ops": [], "verified": None})
            if tile.name in measured:
                entry["measured_us"] = round(measured[tile.name], 3)
                entry["measured_GBps"] = round(tile.gm_bytes / max(measured[tile.name], 1e-3) / 1e3,
                                               2)
            tiles.append(entry)
        return {
            "name": self.name,
            "num_ops": len(graph.nodes),
            "fallback_ops": plan.extern_counts(),
            "extern_reasons": {n.name: f"{n.op_name}: {n.reason}" for n in plan.externs},
            # per extern op with a native kernel on this target: which one ran and why
            "extern_native": dict(self.compiled.extern_native) if self.compiled else {},
            "fusion_tiles": tiles,
            "decisions": [d.to_dict() for d in plan.decisions],
            "kernels_unfused": plan.unfused_cost["kernels"],
            "kernels_fused": len(plan.tiles),
            "gm_bytes_unfused": plan.unfused_cost["gm_bytes"],
            "gm_bytes_fused": sum(t.gm_bytes for t in plan.tiles),
            "predicted_us_unfused": round(plan.unfused_cost["time_us"], 3),
            "predicted_us_fused": round(sum(t.predicted_us for t in plan.tiles), 3),
            **_graph.structure(plan, fallbacks, native),
            **({"attention": self.attention} if self.attention is not None else {}),
        }

    def artifacts(self) -> dict[str, dict[str, str]]:
        """Tile name -> {"cpp_source", "pto_ir"} texts that exist (for the HTML's links)."""
        if self.plan is None:
            return {}
        out = {}
        kernels = self.compiled.kernels if self.compiled else {}
        for tile in self.plan.tiles:
            entry = {}
            try:
                entry["pto_ir"] = tile.pto_text(self.plan.graph.specs)
            except Exception as e:  # noqa: BLE001 - a listing must not fail the report
                log.debug("no PTO-like listing of %s: %s", tile.name, e)
            program = getattr(kernels.get(tile.name), "program", None)
            if program is not None:
                from ..codegen.cpp import generate_source

                try:
                    entry["cpp_source"] = generate_source(program)
                except Exception as e:  # noqa: BLE001
                    log.debug("no C++ source of %s: %s", tile.name, e)
            out[tile.name] = entry
        return out


class FusionReport:
    """The fusion ROI report of every graph compiled for one model."""

    def __init__(self, graphs: list[GraphReport] | None = None, target: str = "cpu",
                 hardware=None):
        self.graphs = list(graphs or [])
        self.target = target
        self.hardware = hardware
        # sum of measured_us of the same model compiled with fusion=False (profile only)
        self.measured_us_unfused: float | None = None
        self.model: str | None = None  # a name for the report's title

    def to_dict(self) -> dict:
        graphs = [g.to_dict() for g in self.graphs]
        unfused_us = sum(g.get("predicted_us_unfused", 0) for g in graphs)
        fused_us = sum(g.get("predicted_us_fused", 0) for g in graphs)
        hw = self.hardware or next((g.hardware for g in self.graphs if g.hardware), None)
        summary = {
            "kernels_unfused": sum(g["kernels_unfused"] for g in graphs),
            "kernels_fused": sum(g["kernels_fused"] for g in graphs),
            "gm_bytes_unfused": sum(g.get("gm_bytes_unfused", 0) for g in graphs),
            "gm_bytes_fused": sum(g.get("gm_bytes_fused", 0) for g in graphs),
            "predicted_speedup": round(unfused_us / fused_us, 3) if fused_us else 1.0,
            "fallback_op_count": sum(sum(g["fallback_ops"].values()) for g in graphs),
            "eager_graphs": sum(1 for g in graphs if g.get("eager_reason")),
        }
        measured = measured_total(graphs)
        if measured is not None:
            summary["measured_us_fused"] = measured
            if self.measured_us_unfused:
                summary["measured_us_unfused"] = self.measured_us_unfused
                summary["measured_speedup"] = round(self.measured_us_unfused / measured, 3)
        if any(g.simulation is not None for g in self.graphs):
            summary.update(_simulated_summary(graphs))
        return {
            "target": self.target,
            "hardware": _hardware_dict(hw),
            "graphs": graphs,
            "summary": summary,
        }

    def __str__(self) -> str:
        d = self.to_dict()
        hw = d["hardware"]
        lines = [f"pypto fusion report: target={d['target']} hardware={hw['name']} "
                 f"capacity={hw['capacity_bytes']} B"]
        for g in d["graphs"]:
            lines.append("")
            if g.get("eager_reason"):
                lines.append(f"graph {g['name']}: runs eagerly ({g['eager_reason']})")
                continue
            lines.append(f"graph {g['name']}: {g['num_ops']} ops -> {g['kernels_fused']} kernels "
                         f"(unfused {g['kernels_unfused']}), GM bytes {g['gm_bytes_unfused']} -> "
                         f"{g['gm_bytes_fused']}")
            rows = [[t["name"], " ".join(t["op_kinds"]), t["dtype"],
                     "x".join(map(str, t["tile_shape"])), t["footprint_bytes"],
                     t["predicted_us"], t.get("measured_us", "")] for t in g["fusion_tiles"]]
            lines.append(tabulate(rows, headers=["kernel", "ops", "dtype", "tile", "footprint B",
                                                 "pred us", "meas us"], maxcolwidths=[None, 50]))
            for t in g["fusion_tiles"]:
                if not t.get("fits", True):
                    lines.append(f"over capacity: {t['name']} needs {t['footprint_bytes']} B at its "
                                 f"smallest tile {'x'.join(map(str, t['tile_shape']))} > "
                                 f"{t['capacity_bytes']} B; it runs, but spills past the on-chip "
                                 "buffer")
            rejected = [x for x in g["decisions"] if not x["fused"]]
            if rejected:
                lines.append("not fused:")
                rows = [[x["producer"], x["consumer"], x["reason"],
                         x["roi"]["roi_score"] if x["roi"] else ""] for x in rejected]
                lines.append(tabulate(rows, headers=["producer", "consumer", "reason", "roi"],
                                      maxcolwidths=[None, None, 70]))
            if g["fallback_ops"]:
                lines.append("eager ops: " + ", ".join(f"{k} x{v}" for k, v in g["fallback_ops"].items()))
            for name, e in g.get("extern_native", {}).items():  # which kernel ran each extern
                lines.append(f"{name}: {'native' if e['native'] else 'ATen'} ({e['reason']})")
        s = d["summary"]
        lines += ["", "summary: " + ", ".join(f"{k}={v}" for k, v in s.items())]
        return "\n".join(lines)

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.suffix == ".json":
            path.write_text(json.dumps(self.to_dict(), indent=2, default=str))
        elif path.suffix in (".html", ".htm"):
            from .html import render

            path.write_text(render(self))
        else:
            raise ValueError(f"report path must end in .json or .html, got {path.name!r}")
        return path


# --- collecting reports while compiling ----------------------------------------------
_ACTIVE: list[list[GraphReport]] = []  # report() calls in progress
_BY_PATH: dict[str, FusionReport] = {}  # report_path -> the report written there


def publish(graph_report: GraphReport, config: Config, hardware: HardwareModel) -> None:
    """Called by the backend for every compiled graph (``hardware``: the model it planned
    with)."""
    graph_report.target = config.target
    _log_graph(graph_report)
    for sink in _ACTIVE:
        sink.append(graph_report)
    if config.report_path:
        if config.report_path not in _BY_PATH:
            _BY_PATH[config.report_path] = FusionReport(target=config.target, hardware=hardware)
        rep = _BY_PATH[config.report_path]
        rep.graphs.append(graph_report)
        rep.save(config.report_path)


@contextlib.contextmanager
def collect():
    sink: list[GraphReport] = []
    _ACTIVE.append(sink)
    try:
        yield sink
    finally:
        _ACTIVE.remove(sink)


def measured_total(graphs: list[dict]) -> float | None:
    """Sum of every FusionTile's measured_us, or None when one was not timed."""
    measured = [t.get("measured_us") for g in graphs for t in g["fusion_tiles"]]
    if not measured or any(m is None for m in measured):
        return None
    return round(sum(measured), 3)


def _simulated_summary(graphs: list[dict]) -> dict:
    """Simulated cycles over every FusionTile pypto's simulator ran, fused and unfused.

    A one-op tile counts its own cycles on both sides; a tile missing either number
    is left out of both sums (and counted in simulation_failures).
    """
    fused = unfused = failures = 0
    for g in graphs:
        for t in g["fusion_tiles"]:
            f, u = t.get("simulated_cycles_fused"), t.get("simulated_cycles_unfused")
            if u is None and len(t["ops"]) == 1:
                u = f
            if f is None or u is None:
                failures += 1
                continue
            fused, unfused = fused + f, unfused + u
    checked = [t.get("verified") for g in graphs for t in g["fusion_tiles"] if "verified" in t]
    # options={"verify_passes": True}: pypto's verdicts after its compiler passes (rows
    # checked against the tensor graph; the tensor graph's own rows are against our golden)
    passes = [(t["name"], v) for g in graphs for t in g["fusion_tiles"]
              for v in t.get("pypto_verdicts") or () if v.get("pass") != "tensor_graph"]
    failed_passes = [(n, v) for n, v in passes if v.get("result") != "PASS"]
    return {"simulated_cycles_fused": fused, "simulated_cycles_unfused": unfused,
            "simulated_speedup": round(unfused / fused, 3) if fused else None,
            "simulation_failures": failures,
            # options={"verify": True}: tiles whose pypto kernels matched the reference
            **({"tiles_verified": checked.count(True), "tiles_verify_failed": checked.count(False),
                "tiles_not_verified": checked.count(None)} if checked else {}),
            **({"pypto_pass_verdicts": len(passes), "pypto_pass_verdicts_failed": len(failed_passes),
                "tiles_with_failed_pass": len({n for n, _ in failed_passes})} if passes else {})}


def _hardware_dict(hw) -> dict:
    if hw is None:
        return {"name": None, "capacity_bytes": None}
    d = hw.to_dict()
    d.setdefault("cube_GFLOPs", round(hw.cube_flops_per_s / 1e9, 1))
    return d


def _log_graph(rep: GraphReport) -> None:
    """What the planner decided for one graph, as it is compiled: INFO a line per graph,
    DEBUG a line per decision and per eager op (``TORCH_LOGS=+pypto_inductor``, or
    ``logging.getLogger("pypto_inductor").setLevel(logging.DEBUG)``)."""
    if rep.plan is None:
        log.info("graph %s runs eagerly: %s", rep.name, rep.eager_reason)
        return
    plan = rep.plan
    log.info("graph %s: %d ops -> %d kernels (unfused %d), GM bytes %d -> %d, %d eager ops",
             rep.name, len(plan.graph.nodes), len(plan.tiles), plan.unfused_cost["kernels"],
             plan.unfused_cost["gm_bytes"], sum(t.gm_bytes for t in plan.tiles),
             len(plan.externs))
    if not log.isEnabledFor(logging.DEBUG):
        return
    for d in plan.decisions:
        log.debug("%s %s -> %s: %s", "fuse" if d.fused else "keep apart", d.producer,
                  d.consumer, d.reason)
    for n in plan.externs:
        log.debug("eager %s (%s): %s", n.name, n.op_name, n.reason)
    if rep.compiled is not None:
        for name, why in rep.compiled.kernel_fallbacks.items():
            log.warning("kernel %s did not build, runs on the reference executor: %s", name, why)
