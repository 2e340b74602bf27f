"""On-disk cache of fusion plans: a warm process skips the planner's search.

On a warm start (a new process whose kernel cache is full) the planner's greedy search is
most of what the backend itself does per graph (0.2-0.25 s of a zoo model's ~0.3 s;
lowering and building the kernels from the kernel cache take ~0.05 s: docs/benchmarks.md).
:func:`plan` keys each graph by a sha256 of what the plan depends on: the ATen graph's
code (and its subgraphs'), its inputs' and constants' metadata (dtypes, sizes and
strides with their symbols, devices, requires_grad), the lowered graph's size hints, the
graph's kind (inference, forward, backward), the options, the hardware model, the torch
and Python versions and a hash of pypto_inductor's own sources. The entry holds the plan
as names: the steps in order (each FusionTile as the names of its tile ops) and the
planner's decisions, for the report. A hit rebuilds the tiles from the freshly lowered
graph (boundary, tile shape and cost per tile: no candidate search); an entry that does
not parse or does not name exactly the lowered graph's ops is ignored and rewritten.

Entries are JSON files in ``<cache dir>/plans`` (next to the kernels' ``cpp``), written to
a temporary file and moved into place with ``os.replace``: concurrent writers of one key
write the same content, and a reader sees a whole entry or none. ``PYPTO_INDUCTOR_PLAN_CACHE=0``
turns the cache off.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import sys
import tempfile
from pathlib import Path

import torch
import torch.fx as fx

from .. import config as _config
from ..ir import ExternOp, TileGraph, TileOp
from .planner import Decision, FusionPlan, Planner, plan_fusion
from .roi import RoiEstimate

FORMAT = 1  # bumped when an entry's layout changes
# hits: plans rebuilt from an entry; misses: plans searched (and written); rejected:
# entries that did not parse or did not fit the lowered graph (counted as misses too)
stats = {"hits": 0, "misses": 0, "rejected": 0}
_code_hash: list[str] = []  # pypto_inductor's sources, hashed once per process


def enabled() -> bool:
    return os.environ.get("PYPTO_INDUCTOR_PLAN_CACHE", "1") not in ("0", "")


def cache_dir() -> Path:
    return _config.cache_dir("plans")


def code_hash() -> str:
    """sha256 of every .py file of the package (a changed lowering or planner misses)."""
    if not _code_hash:
        root = Path(__file__).resolve().parent.parent
        h = hashlib.sha256()
        for path in sorted(root.rglob("*.py")):
            h.update(str(path.relative_to(root)).encode())
            h.update(path.read_bytes())
        _code_hash.append(h.hexdigest())
    return _code_hash[0]


_SCALARS = (bool, int, float, str)


def settings_hash() -> str:
    """sha256 of the module-level settings (numbers, flags, strings and tuples of them) of
    every loaded pypto_inductor module: a threshold a benchmark or test sets on a module
    (``planner.MAX_GROUPS_PER_MERGE = 4``) misses too."""
    h = hashlib.sha256()
    for name in sorted(m for m in sys.modules if m.split(".")[0] == "pypto_inductor"):
        for attr, v in sorted(vars(sys.modules[name]).items()):
            if not attr.startswith("__") and (type(v) in _SCALARS or (
                    type(v) is tuple and all(type(x) in _SCALARS for x in v))):
                h.update(f"{name}.{attr}={v!r}\0".encode())
    return h.hexdigest()


def meta(val) -> str:
    if isinstance(val, torch.Tensor):
        return (f"T({val.dtype},{val.device},{val.requires_grad},{tuple(map(str, val.shape))},"
                f"{tuple(map(str, val.stride()))},{val.storage_offset()},{val.layout})")
    if isinstance(val, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return f"S({type(val).__name__},{val.node.expr})"
    return f"V({type(val).__name__},{val!r})" if isinstance(val, (int, float, bool)) \
        else f"O({type(val).__name__})"


def graph_key(gm: fx.GraphModule, graph: TileGraph, kind: str, cfg, hw) -> str:
    """The cache key of ``gm`` lowered to ``graph`` (see the module docstring)."""
    h = hashlib.sha256()
    for part in (f"format {FORMAT}", torch.__version__, sys.version, code_hash(),
                 settings_hash(), kind,
                 repr(dataclasses.replace(cfg, report_path=None, debug_dir=None)), repr(hw)):
        h.update(part.encode() + b"\0")
    for name, mod in gm.named_modules():  # the graph and its subgraphs (higher-order ops)
        if isinstance(mod, fx.GraphModule):
            h.update(f"{name}\0{mod.code}\0".encode())
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            h.update(f"{node.name}:{meta(node.meta.get('val'))}\0".encode())
    for name, value in graph.constants.items():  # their values are read when lowering anew
        h.update(f"{name}:{meta(value)}\0".encode())
    hints = sorted((str(s), v) for s, v in graph.size_hints.items())
    h.update(repr(hints).encode())
    return h.hexdigest()


def plan(gm: fx.GraphModule, graph: TileGraph, kind: str, hw, cfg,
         search=plan_fusion) -> FusionPlan:
    """The graph's FusionPlan: rebuilt from the cache entry of its key, else ``search``ed
    (the planner) and written to the cache."""
    if not enabled():
        return search(graph, hw, cfg)
    path = cache_dir() / f"{graph_key(gm, graph, kind, cfg, hw)}.json"
    try:
        entry = json.loads(path.read_text())
    except FileNotFoundError:
        entry = None
    except (OSError, ValueError):
        entry = False  # unreadable or corrupt
    if entry:
        result = _rebuild(entry, graph, hw, cfg)
        if result is not None:
            stats["hits"] += 1
            return result
    if entry is not None:
        stats["rejected"] += 1
    stats["misses"] += 1
    result = search(graph, hw, cfg)
    write(path, result)
    return result


def _entry(result: FusionPlan) -> dict:
    tiles = {id(t) for t in result.tiles}
    in_tiles = {op.name for t in result.tiles for op in t.ops}
    # a view of a tile's output that its tile also computes (Planner.tile_steps) is
    # rebuilt with the tile
    steps = [{"tile": [op.name for op in s.ops]} if id(s) in tiles else {"op": s.name}
             for s in result.steps if id(s) in tiles or s.name not in in_tiles]
    decisions = [{"producer": d.producer, "consumer": d.consumer, "fused": d.fused,
                  "reason": d.reason,
                  "roi": dataclasses.asdict(d.roi) if d.roi is not None else None}
                 for d in result.decisions]
    unfused = {k: float(v) if k == "time_us" else int(v)
               for k, v in result.unfused_cost.items()}
    return {"format": FORMAT, "steps": steps, "decisions": decisions, "unfused": unfused}


def write(path: Path, result: FusionPlan) -> None:
    try:
        write_atomic(path, json.dumps(_entry(result)).encode())
    except (OSError, TypeError, ValueError):  # a read-only or full cache, a value JSON does
        pass  # not hold: the plan is still good, just not kept


def write_atomic(path: Path, data: bytes) -> None:
    """A temporary file in the cache directory, then os.replace: concurrent writers of
    one key write the same bytes, a reader sees a whole entry or none."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.stem[:16], suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(tmp, 0o644)  # mkstemp's 0600 would hide it from a shared cache's users
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def _rebuild(entry: dict, graph: TileGraph, hw, cfg) -> FusionPlan | None:
    """The plan an entry describes for ``graph``, or None when it does not fit it (every
    op of the graph named exactly once)."""
    try:
        if entry.get("format") != FORMAT:
            return None
        nodes = {n.name: n for n in graph.nodes}
        seen: set[str] = set()
        groups = []
        for step in entry["steps"]:
            names = step["tile"] if "tile" in step else [step["op"]]
            if not names or len(set(names)) < len(names) or \
                    any(n not in nodes or n in seen for n in names):
                return None
            seen.update(names)
            groups.append(("tile" in step, [nodes[n] for n in names]))
        # plan_fusion drops a tile nothing reads; the ops of such a tile are not steps
        planner = Planner(graph, hw, cfg)
        tiles, steps = [], []
        for is_tile, ops in groups:
            if not is_tile:
                if not isinstance(ops[0], ExternOp) and not ops[0].is_view:
                    return None
                steps.append(ops[0])
                continue
            if not all(isinstance(op, TileOp) for op in ops):
                return None
            tile, *views = planner.tile_steps(len(tiles), ops)
            if not tile.outputs:
                return None
            tiles.append(tile)
            steps += [tile, *views]
        unplanned = set(nodes) - seen
        if unplanned and not _unread(graph, unplanned, steps):
            return None
        decisions = [Decision(d["producer"], d["consumer"], bool(d["fused"]), str(d["reason"]),
                              RoiEstimate(**d["roi"]) if d["roi"] is not None else None)
                     for d in entry["decisions"]]
        unfused = {k: entry["unfused"][k] for k in ("kernels", "gm_bytes", "time_us")}
        return FusionPlan(graph, hw, tiles, steps, decisions, unfused)
    except (KeyError, TypeError, ValueError, AttributeError):
        return None


def _unread(graph: TileGraph, names: set[str], steps) -> bool:
    """Whether the ops ``names`` (those of tiles plan_fusion dropped) compute nothing the
    plan's steps or the graph's outputs read."""
    read = {o for o in graph.outputs if isinstance(o, str)}
    for s in steps:
        read.update(s.inputs)
    defined = set()
    for n in graph.nodes:
        if n.name in names:
            if not isinstance(n, TileOp):
                return False
            defined.add(n.name)
    return not (defined & read)
