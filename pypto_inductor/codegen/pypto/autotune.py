"""Tile autotuning for pypto kernels, with a persistent tiling cache.

``options={"simulate": True, "autotune": True}``: for each FusionTile, candidate tile
shapes that fit the device's UB (vector tiles: :func:`.tiling.vec_footprint` times the
buffering factor) or L0/L1 (cube tiles, :func:`.tiling.cube_tile`) are emitted, timed in
pypto's simulator (``SimResult.work_cycles``: task span + an empty kernel's cost, not
the quantized "Total Cycles") and the fastest is kept. The planner's own tile (the
rule) is always timed first, so a tuned tile is never slower than the rule's in
simulated cycles; a bound on the tuning time (``autotune_seconds`` per plan) stops the
search early and keeps the best so far.

Buffering: a tile at buffering ``b`` keeps ``b`` copies of its buffers in UB, so its
vector tile must fit UB / b (smaller tiles, more tasks that overlap load, compute and
store); a candidate's ``buffering`` is the number of copies that fit at the vector tile
it was emitted with. The rule (:func:`rule_buffering`) picks ``b`` from the tile's
share of the AI cores (the domain over one task per AI core); candidates at every ``b`` in
(1, 2, 3) are simulated, and the report says which ``b`` the simulator preferred.
(pypto 0.2.0's own n-buffer pass option, ``vec_nbuffer_setting``, changed no simulated
cycle in our tries, so the factor is expressed through the tile size.)

The cache: one JSON file per (kernel signature, shape bucket, hardware, pypto version)
under ``cache_dir("pypto_tiling")``, written atomically (temporary file + rename) under
a ``filelock.FileLock``; the first writer wins, later writers keep its entry. So it is
reused across processes and runs and safe under concurrent writers. The signature is the
tile's ops with their operands renumbered locally, attributes, dtypes and broadcast
pattern; the bucket rounds each dimension up to a power of two.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import tempfile
import time
from pathlib import Path

import filelock

from ...config import cache_dir
from ...ir import FusionTile, OpKind, TileGraph
from .emit import emit_tile
from .sim import SimResult, pypto_version, simulate_kernels
from .tiling import vec_footprint, vec_operands

__all__ = ["Candidate", "TileTuning", "tune_tile", "tune_plan", "rule_buffering",
           "signature", "shape_bucket", "cache_key", "cache_lookup", "DEFAULT_SECONDS"]

TUNER_VERSION = "2"  # 2: candidates labelled by the buffers that fit at their vec tile
DEFAULT_SECONDS = 120.0  # per plan
BUFFERINGS = (1, 2, 3)


@dataclasses.dataclass
class Candidate:
    tile_shape: tuple[int, ...]  # the planner-level tile shape given to the emitter
    buffering: int
    vec_tile: tuple[int, ...] | None = None  # what the emitter set
    cube_tile: tuple | None = None
    cycles: int | None = None  # SimResult.work_cycles
    total_cycles: int | None = None  # pypto's "Total Cycles"
    error: str | None = None
    rule: bool = False

    def to_dict(self) -> dict:
        return {"tile_shape": list(self.tile_shape), "buffering": self.buffering,
                "vec_tile": list(self.vec_tile) if self.vec_tile else None,
                "cube_tile": [list(x) for x in self.cube_tile] if self.cube_tile else None,
                "cycles": self.cycles, "total_cycles": self.total_cycles,
                "error": self.error, "rule": self.rule}

    @classmethod
    def from_dict(cls, d: dict) -> "Candidate":
        return cls(tuple(d["tile_shape"]), d["buffering"],
                   tuple(d["vec_tile"]) if d.get("vec_tile") else None,
                   tuple(tuple(x) for x in d["cube_tile"]) if d.get("cube_tile") else None,
                   d.get("cycles"), d.get("total_cycles"), d.get("error"), d.get("rule", False))


@dataclasses.dataclass
class TileTuning:
    """One FusionTile's tuning: the rule's candidate, what was tried, the choice."""

    tile: str
    key: str
    rule_buffering: int
    chosen: Candidate | None
    tried: list[Candidate]
    from_cache: bool = False
    seconds: float = 0.0
    timed_out: bool = False

    @property
    def rule(self) -> Candidate | None:
        return next((c for c in self.tried if c.rule), None)

    @property
    def gain(self) -> float | None:
        """Rule cycles / chosen cycles (>= 1)."""
        r, c = self.rule, self.chosen
        return (r.cycles / c.cycles) if r and c and r.cycles and c.cycles else None

    def best_buffering(self) -> int | None:
        """The buffering factor of the fastest candidate the simulator ran."""
        ok = [c for c in self.tried if c.cycles]
        return min(ok, key=lambda c: c.cycles).buffering if ok else None

    def to_dict(self) -> dict:
        return {"key": self.key, "tile_shape": list(self.chosen.tile_shape) if self.chosen else None,
                "buffering": self.chosen.buffering if self.chosen else None,
                "rule_buffering": self.rule_buffering,
                "simulator_buffering": self.best_buffering(),
                "cycles": self.chosen.cycles if self.chosen else None,
                "rule_cycles": self.rule.cycles if self.rule else None,
                "gain": self.gain, "tried": [c.to_dict() for c in self.tried],
                "from_cache": self.from_cache, "seconds": round(self.seconds, 2),
                "timed_out": self.timed_out}

    @classmethod
    def from_dict(cls, name: str, d: dict) -> "TileTuning":
        tried = [Candidate.from_dict(c) for c in d["tried"]]
        chosen = next((c for c in tried if list(c.tile_shape) == d["tile_shape"]
                       and c.buffering == d["buffering"]), None)
        return cls(name, d["key"], d["rule_buffering"], chosen, tried, True, d.get("seconds", 0.0),
                   d.get("timed_out", False))


# --- signature, bucket, cache ----------------------------------------------------------------
def _dim(d) -> str:
    try:
        n = int(d)
    except (TypeError, ValueError):
        return "s"  # a symbolic size
    return str(1 << max(0, (n - 1).bit_length())) if n > 1 else str(n)


def signature(tile: FusionTile, graph: TileGraph) -> str:
    """The tile's kernel, independent of value names and sizes: each op with its operands
    renumbered locally, attributes, dtypes, ranks and which dims are 1 (broadcasts)."""
    local: dict[str, str] = {}

    def name(v: str) -> str:
        if v not in local:
            local[v] = f"v{len(local)}"
        return local[v]

    def spec(v: str) -> str:
        s = graph.specs.get(v)
        shape = getattr(s, "shape", ())
        return f"{getattr(s, 'dtype', '?')}[{','.join('1' if str(d) == '1' else '*' for d in shape)}]"

    parts = [tile.dtype]
    for v in tile.inputs:
        parts.append(f"in {name(v)}:{spec(v)}")
    for op in tile.ops:
        args = ",".join(name(a) if isinstance(a, str) else repr(a) for a in op.args)
        attrs = ",".join(f"{k}={v!r}" for k, v in sorted(op.attrs.items()))
        parts.append(f"{name(op.name)}={op.op}({args};{attrs}):{spec(op.name)}")
    parts.append("out " + ",".join(name(v) for v in tile.outputs))
    return "\n".join(parts)


def shape_bucket(tile: FusionTile, graph: TileGraph) -> str:
    """Every boundary value's dims rounded up to a power of two ("s": symbolic)."""
    out = []
    for v in list(tile.inputs) + list(tile.outputs):
        shape = getattr(graph.specs.get(v), "shape", ())
        out.append("x".join(_dim(d) for d in shape) or "scalar")
    return "|".join(out)


def cache_key(tile: FusionTile, graph: TileGraph, hw) -> str:
    h = hashlib.sha256()
    for part in (TUNER_VERSION, pypto_version(), getattr(hw, "name", str(hw)),
                 signature(tile, graph), shape_bucket(tile, graph)):
        h.update(str(part).encode())
        h.update(b"\0")
    return h.hexdigest()[:24]


def cache_root() -> Path:
    return cache_dir("pypto_tiling")


def cache_lookup(key: str) -> dict | None:
    """The cached entry of ``key`` (files are replaced atomically: no lock to read)."""
    try:
        return json.loads((cache_root() / f"{key}.json").read_text())
    except (OSError, json.JSONDecodeError):
        return None


def cache_store(key: str, entry: dict) -> dict:
    """Store ``entry`` unless another writer stored one first; the entry kept."""
    root = cache_root()
    root.mkdir(parents=True, exist_ok=True)
    path = root / f"{key}.json"
    with filelock.FileLock(str(path) + ".lock", timeout=60):
        existing = cache_lookup(key)
        if existing is not None:
            return existing
        fd, tmp = tempfile.mkstemp(dir=root, prefix=f".{key}.", suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump(entry, f)
        os.replace(tmp, path)
    return entry


# --- candidates ------------------------------------------------------------------------------
def rule_buffering(tile: FusionTile, graph: TileGraph, hw) -> int:
    """Buffering from the tile's share of the AI cores: the buffers (1-3) that fit UB at
    a vector tile of the tile's domain over one task per AI core (domain / 24 elements
    on A2, rounded up to a power of two; the AI cores are the cube cores, each paired
    with two vector cores).

    Why not the compute/IO ratio: in pypto's simulator a kernel's time follows its tasks,
    not the buffers in flight (pypto 0.2.0's own n-buffer setting changed no cycle).
    Split finer than about one task per AI core, tasks queue at ~380 cycles each
    (1024x1024 exp-relu: 64 / 128 / 256 tasks, task spans 24.2k / 47.6k / 99.0k cycles;
    256x1024 add-mul-relu: 16 tasks 17,423 work cycles, 32 tasks 19,857); split coarser,
    cores idle (256x256 add-sigmoid: 4 / 8 / 16 tasks, 14,739 / 13,744 / 13,254). Small
    domains fit three buffers whatever the split. Agreement with the simulator's fastest
    candidates: docs/autotune_gains.md (tasks per kernel of 16-24 fit best; 48, one per
    vector core, and the ratio rule far less)."""
    operands = vec_operands(tile)
    details = dict(getattr(hw, "details", ()) or ())
    cores = int(details.get("cube_cores") or max(1, int(getattr(hw, "cores", 2) or 2) // 2))
    domain = _domain_elems(tile, graph)
    if domain is None:
        return 2
    per_task = 1 << max(0, (-(-domain // max(1, cores)) - 1).bit_length())
    fp = vec_footprint((per_task,), operands)
    return max([b for b in BUFFERINGS if fp * b <= int(hw.vector_capacity_bytes)] or [1])


def _domain_elems(tile: FusionTile, graph: TileGraph) -> int | None:
    """Elements of the tile's largest output (its iteration domain); None if symbolic."""
    best = None
    for v in tile.outputs:
        n = 1
        try:
            for d in graph.specs[v].shape:
                n *= int(d)
        except (TypeError, ValueError, KeyError):
            return None
        best = n if best is None else max(best, n)
    return best


def _pow2_floor(n: int) -> int:
    return 1 << (max(1, int(n)).bit_length() - 1)


def _domain_cols(tile: FusionTile, graph: TileGraph) -> int:
    """The widest static last dim of the tile's outputs and inputs (0: none)."""
    best = 0
    for v in list(tile.outputs) + list(tile.inputs):
        shape = getattr(graph.specs.get(v), "shape", ())
        try:
            best = max(best, int(shape[-1])) if shape else best
        except (TypeError, ValueError):
            pass
    return best


def fitted_buffering(vec: tuple | None, operands: int, hw) -> int:
    """The most buffers (1-3) of vector tile ``vec`` that fit UB together."""
    if not vec:
        return 1
    fp = vec_footprint(vec, operands)
    return max([b for b in BUFFERINGS if fp * b <= int(hw.vector_capacity_bytes)] or [1])


def candidate_shapes(tile: FusionTile, graph: TileGraph, hw, limit: int = 8) -> list[tuple]:
    """(tile_shape, buffering) candidates, best guesses first: for each buffering factor
    the largest tiles of a few widths whose vector footprint fits UB / buffering; matmul
    tiles vary (tm, tn) over the cube unit's usual sizes with the rule's tk."""
    budget = int(hw.vector_capacity_bytes)
    operands = vec_operands(tile)
    rule = tuple(tile.tile_shape)
    out: list[tuple] = []
    if any(op.kind is OpKind.MATMUL for op in tile.ops):
        tk = rule[2] if len(rule) > 2 else 128
        for b in BUFFERINGS:
            for tm, tn in ((128, 128), (64, 128), (128, 256), (64, 64), (256, 128), (32, 128)):
                if vec_footprint((tm, tn), operands) * b <= budget:
                    out.append(((tm, tn, tk)[:max(2, len(rule))], b))
    else:
        rows = max(1, int(rule[0])) if rule else 1
        cols = int(rule[1]) if len(rule) > 1 else 0
        domain = _domain_cols(tile, graph) or cols
        widths = sorted({w for w in (cols, domain if domain <= 2048 else 0, 1024, 512, 256, 128, 64)
                         if w and (not domain or w <= max(domain, cols))}, reverse=True)
        for b in BUFFERINGS:
            for w in widths:
                r = _pow2_floor(budget // (operands * 4 * w * b)) if operands * 4 * w * b <= budget else 0
                if r < 1:
                    continue
                shape = (r, w) + rule[2:] if len(rule) >= 2 else (r,)
                out.append((shape, b))
            # the rule's shape at a smaller row tile: the same width, half the rows
            if rows > 1:
                out.append(((max(1, rows // 2),) + rule[1:], b))
    seen, uniq = set(), []
    for shape, b in out:
        if (shape, b) not in seen and shape != rule:
            seen.add((shape, b))
            uniq.append((shape, b))
    # interleave the buffering factors so a short time bound still tries each
    by_b = {b: [c for c in uniq if c[1] == b] for b in BUFFERINGS}
    mixed = [c for group in zip(*[by_b[b] + [None] * limit for b in BUFFERINGS]) for c in group if c]
    return mixed[:limit]


# --- tuning ----------------------------------------------------------------------------------
def emit_candidate(tile: FusionTile, graph: TileGraph, shape: tuple, hw):
    return emit_tile(dataclasses.replace(tile, tile_shape=tuple(shape)), graph, run_mode="SIM",
                     hw=hw)


def _record(c: Candidate, r: SimResult) -> None:
    c.cycles, c.total_cycles = r.work_cycles, r.cycles
    if not r.ok:
        c.error = (r.error or "no cycles").splitlines()[0][:200]


def tune_tiles(tiles: list[FusionTile], graph: TileGraph, hw, seconds: float = DEFAULT_SECONDS,
               use_cache: bool = True, progress=None, limit: int = 8,
               workers: int | None = None) -> dict[str, TileTuning]:
    """Tune every tile (tile name -> TileTuning); never raises for one tile's failure.

    The rule's kernels of every uncached tile are simulated first (one batch), then the
    candidates in batches of a few per tile until ``seconds`` have passed."""
    t0 = time.monotonic()
    deadline = t0 + seconds
    out: dict[str, TileTuning] = {}
    todo = []  # (tile, key, rule buffering, [(Candidate, kernel)] left)
    for tile in tiles:
        try:
            key = cache_key(tile, graph, hw)
        except Exception as e:  # noqa: BLE001
            out[tile.name] = TileTuning(tile.name, "", 2, None, [Candidate((), 2, error=str(e))])
            continue
        hit = cache_lookup(key) if use_cache else None
        if hit is not None:
            out[tile.name] = TileTuning.from_dict(tile.name, hit)
            if progress:
                progress.update(1)
            continue
        b0 = rule_buffering(tile, graph, hw)
        tuning = TileTuning(tile.name, key, b0, None, [])
        cands = []
        for shape, b in [(tuple(tile.tile_shape), b0)] + candidate_shapes(tile, graph, hw, limit):
            c = Candidate(tuple(shape), b, rule=not cands)
            try:
                k = emit_candidate(tile, graph, shape, hw)
            except Exception as e:  # noqa: BLE001 - a shape the emitter refuses
                c.error = f"emit: {type(e).__name__}: {e}"[:200]
                tuning.tried.append(c)
                if c.rule:
                    break  # no pypto kernel for this tile at all
                continue
            c.vec_tile = tuple(k.vec_tile) if k.vec_tile else None
            c.cube_tile = tuple(tuple(x) for x in k.cube_tile) if k.cube_tile else None
            # every candidate is labelled with the buffers that fit UB at the vector tile
            # it was emitted with (the emitter clamps a shape to the domain, so a tile
            # asked for at buffering 1 may well fit three)
            c.buffering = fitted_buffering(c.vec_tile, vec_operands(tile), hw)
            # shapes the emitter clamps to a kernel already queued are not timed twice
            if any(c.vec_tile == o.vec_tile and c.cube_tile == o.cube_tile
                   for o, _ in cands):
                continue
            cands.append((c, k))
        out[tile.name] = tuning
        todo.append((tile, tuning, cands))
    # round 0: the rules; then the candidates, a few per tile per round
    per_round = 3
    rnd = 0
    while True:
        batch = []
        for tile, tuning, cands in todo:
            take = cands[:1] if rnd == 0 else cands[1 + (rnd - 1) * per_round: 1 + rnd * per_round]
            batch += [(tuning, c, k) for c, k in take]
        if not batch:
            break
        if rnd > 0 and time.monotonic() >= deadline:
            for _t, tuning, cands in todo:
                if len(cands) > 1 + (rnd - 1) * per_round:
                    tuning.timed_out = True
            break
        for (tuning, c, _k), r in zip(batch, simulate_kernels([k for _t, _c, k in batch],
                                                              workers=workers)):
            _record(c, r)
            tuning.tried.append(c)
        rnd += 1
    for tile, tuning, cands in todo:
        ok = [c for c in tuning.tried if c.cycles]
        rule = tuning.rule
        if ok:
            # ties: the rule's tile, then the buffering the compute/IO ratio asks for
            best = min(ok, key=lambda c: (c.cycles, not c.rule, c.buffering != tuning.rule_buffering))
            tuning.chosen = rule if (rule and rule.cycles and rule.cycles <= best.cycles) else best
        tuning.seconds = time.monotonic() - t0
        # only complete, successful tunings are cached (a timed-out one may improve)
        if use_cache and tuning.chosen is not None and not tuning.timed_out:
            stored = cache_store(tuning.key, tuning.to_dict())
            if stored.get("tile_shape") != list(tuning.chosen.tile_shape) or \
                    stored.get("buffering") != tuning.chosen.buffering:
                out[tile.name] = TileTuning.from_dict(tile.name, stored)
        if progress:
            progress.update(1, failed=int(tuning.chosen is None))
    return out


def tune_tile(tile: FusionTile, graph: TileGraph, hw, **kw) -> TileTuning:
    return tune_tiles([tile], graph, hw, **kw)[tile.name]


def tune_plan(plan, seconds: float = DEFAULT_SECONDS, progress=None, **kw) -> dict[str, TileTuning]:
    """Tune a FusionPlan's tiles (tile name -> TileTuning)."""
    from .sim import pypto_available

    if not pypto_available():
        return {}
    return tune_tiles(plan.tiles, plan.graph, plan.hardware, seconds, progress=progress, **kw)


def cached_tile(tile: FusionTile, graph: TileGraph, hw=None) -> FusionTile:
    """The tile at the shape the tiling cache holds for its signature and bucket (a file
    read at compile time, never on a call's path); unchanged without an entry."""
    from ...hardware import ascend_a2

    try:
        entry = cache_lookup(cache_key(tile, graph, hw or ascend_a2()))
    except Exception:  # noqa: BLE001 - the cache is an optimisation only
        return tile
    if not entry or not entry.get("tile_shape"):
        return tile
    return dataclasses.replace(tile, tile_shape=tuple(entry["tile_shape"]))
