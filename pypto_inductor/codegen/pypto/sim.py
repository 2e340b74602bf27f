"""pypto's simulator (RunMode.SIM) on emitted kernels: simulated cycles, fused and unfused.

pypto's SIM mode runs the Ascend A2/A3 cost model; it computes no values, prints
a lot, writes ``output/output_*/CostModelSimulationOutput/_simulate.stat.report.txt``
("Total Cycles") and a compiled program (``program.json``, the PTO IR) under
the current directory, and starts plotting scripts with ``python3``. So every
simulation runs in a worker process (``sys.executable``) with its own temporary
working directory, a no-op ``python3`` first on its PATH (no plotting, no
matplotlib), pypto's logs redirected into that directory, its output in a log
file, and a timeout. Nothing here raises into the caller: a kernel that fails
to emit or simulate comes back with an error string.

One worker simulates a batch of kernels (importing torch and pypto once); a
kernel that crashes or hangs the worker is recorded and the rest of the batch
goes on in a new worker. Results are cached by kernel source and pypto version
under ``$PYPTO_INDUCTOR_CACHE_DIR`` (default ``~/.cache/pypto_inductor``) in
``pypto_sim/<hash>/``, which also keeps the kernel, its program.json, the
stat report and pypto's Perfetto trace (``pto_ir_path`` and
``perfetto_trace_path`` point there; open the trace in https://ui.perfetto.dev).

A FusionTile with ops that have no pypto form is split at them
(:func:`.emit.split_tile`): its parts are simulated as pypto kernels, the
split ops (extern on the NPU too) are named in ``split_ops``.
"""
from __future__ import annotations

import dataclasses
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from ...config import cache_dir
from ...hardware import usable_cpus
from ...ir import FusionTile, TileGraph
from .emit import PyptoEmitError, PyptoKernel, emit_tile, single_op_tile, split_tile

__all__ = ["SimResult", "TileSimulation", "pypto_available", "simulate_kernels",
           "simulate_tile", "simulate_plan", "parse_total_cycles", "parse_stats", "task_span",
           "emit_variants", "unfused_kernels", "LAUNCH_CYCLES"]

_WORKER_VERSION = "2"  # 2: keeps the Perfetto trace
_TOTAL_CYCLES = re.compile(r"Total Cycles\.*:\s*(\d+)")
DEFAULT_TIMEOUT_S = 180.0  # per kernel; one simulation takes a second or two


def pypto_available() -> bool:
    return importlib.util.find_spec("pypto") is not None


def pypto_version() -> str:
    try:
        return importlib.metadata.version("pypto")
    except importlib.metadata.PackageNotFoundError:
        return "none"


def cache_root() -> Path:
    return cache_dir("pypto_sim")


# A kernel's fixed cost outside its tasks: an empty kernel's (one 8x32 copy, one task)
# "Total Cycles" minus its task span, measured by ``benchmarks.calibrate_ascend``
# (6503 - 1791 on pypto 0.2.0's A2 model: the AICPU start-up before the first task and
# the tail after the last).
LAUNCH_CYCLES = 4712
_STAT = re.compile(r"^\s*\|?-*\s*([A-Za-z_ ]+?)\.{2,}:\s*([\d.]+)", re.M)


def parse_stats(text: str) -> dict:
    """The numbers of a pypto stat report that say what the kernel did: task counts, task
    cycles (average, max, min) and each pipe's average usage (cycles per used pipe).

    "Total Cycles" moves in steps of 2881 cycles and mostly counts tasks; these respond
    to the work inside a task."""
    out: dict = {}
    for name, value in _STAT.findall(text):
        key = name.strip().lower().replace(" ", "_")
        if key not in out:  # the first one: the whole machine's
            out[key] = float(value) if "." in value else int(value)
    return out


def task_span(trace_path: str | os.PathLike | None) -> int | None:
    """Cycles from the first core task's start to the last one's end in pypto's Perfetto
    trace: the kernel's own time (dependencies, waves of tasks and their dispatch
    included), without the simulator's quantized start-up and tail."""
    if not trace_path:
        return None
    try:
        data = json.loads(Path(trace_path).read_text())
    except (OSError, json.JSONDecodeError):
        return None
    events = data.get("traceEvents", []) if isinstance(data, dict) else data
    cores = {e["pid"] for e in events if e.get("name") == "process_name"
             and re.fullmatch(r"AI[CV]_\d+", str(e.get("args", {}).get("name", "")))}
    views = {(e["pid"], e.get("tid")) for e in events if e.get("name") == "thread_name"
             and e["pid"] in cores and "Machien_View" in str(e.get("args", {}).get("name", ""))}
    start = end = None
    for e in events:
        if e.get("ph") == "X" and (e.get("pid"), e.get("tid")) in views \
                and "Init" not in str(e.get("name", "")):
            s, f = e["ts"], e["ts"] + e.get("dur", 0)
            start = s if start is None else min(start, s)
            end = f if end is None else max(end, f)
    return None if start is None else int(end - start)


def parse_total_cycles(text: str) -> int | None:
    """The first "Total Cycles" of a pypto stat report (the whole machine's)."""
    m = _TOTAL_CYCLES.search(text)
    return int(m.group(1)) if m else None


@dataclasses.dataclass
class SimResult:
    kernel: str
    cycles: int | None = None
    error: str | None = None
    pto_ir_path: str | None = None  # pypto's compiled program (program.json), kept in the cache
    report_path: str | None = None  # the stat report, kept in the cache
    perfetto_trace_path: str | None = None  # pypto's Perfetto trace (ui.perfetto.dev), in the cache
    seconds: float = 0.0
    cached: bool = False
    # the kernel's task span (:func:`task_span`) and stat report numbers (:func:`parse_stats`)
    span_cycles: int | None = None
    stats: dict | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.cycles is not None

    @property
    def work_cycles(self) -> int | None:
        """What the kernel costs, from its tasks rather than the quantized total: its
        task span plus an empty kernel's fixed cost (:data:`LAUNCH_CYCLES`)."""
        if not self.ok:
            return None
        return (self.span_cycles if self.span_cycles is not None else
                max(0, self.cycles - LAUNCH_CYCLES)) + LAUNCH_CYCLES

    def measure(self) -> "SimResult":
        """Fill span_cycles and stats from the cached report and trace (once)."""
        if self.stats is None and self.report_path:
            try:
                self.stats = parse_stats(Path(self.report_path).read_text(errors="replace"))
            except OSError:
                self.stats = {}
        if self.span_cycles is None and self.perfetto_trace_path:
            self.span_cycles = task_span(self.perfetto_trace_path)
        return self


# --- the worker --------------------------------------------------------------------------
def worker_env(tmp: Path) -> dict:
    shim = tmp / "bin"
    shim.mkdir(exist_ok=True)
    stub = shim / "python3"  # pypto runs its plotting scripts with `python3 script.py`
    stub.write_text("#!/bin/sh\nexit 0\n")
    stub.chmod(0o755)
    env = dict(os.environ)
    env["PATH"] = f"{shim}{os.pathsep}{env.get('PATH', '')}"
    env["ASCEND_PROCESS_LOG_PATH"] = str(tmp / "ascend_log")
    env["MPLBACKEND"] = "Agg"
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    return env


def tail_of(path: Path, n: int = 1200) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return ""
    text = re.sub(r"\x1b\[[0-9;]*m", "", text)
    text = "\n".join(line for line in text.splitlines()
                     if line.strip() and not re.search(r"\+0x[0-9a-f]+\)", line))
    return text[-n:]


def _run_worker(tmp: Path, items: list[dict], timeout: float) -> tuple[dict[int, dict], set[int], str]:
    """Run one worker over ``items``; (results by index, started indices, failure text)."""
    job, res = tmp / f"job_{items[0]['index']}.json", tmp / f"results_{items[0]['index']}.jsonl"
    job.write_text(json.dumps(items))
    worker = Path(__file__).with_name("sim_worker.py")
    log = tmp / f"worker_{items[0]['index']}.log"
    failure = ""
    with open(log, "wb") as out:
        launcher = Path(__file__).with_name("launcher.py")
        proc = subprocess.Popen([sys.executable, str(worker), str(job), str(res), str(launcher)],
                                cwd=tmp,
                                env=worker_env(tmp), stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
        # A watchdog on progress: each kernel gets ``timeout`` seconds (plus start-up).
        deadline = time.monotonic() + timeout + 60
        seen = 0
        while True:
            try:
                rc = proc.wait(timeout=0.25)
                if rc not in (0, 3):  # 3: the worker stopped after a failed kernel
                    failure = f"simulation worker exited with code {rc}"
                break
            except subprocess.TimeoutExpired:
                pass
            size = res.stat().st_size if res.exists() else 0
            if size != seen:
                seen, deadline = size, time.monotonic() + timeout
            if time.monotonic() > deadline:
                failure = f"simulation timed out after {timeout:.0f} s"
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                proc.wait()
                break
    done, started = read_results(res)
    if failure:
        failure += (": " + tail_of(log, 600)) if tail_of(log) else ""
    return done, started, failure


def _cache_key(kernel: PyptoKernel) -> str:
    h = hashlib.sha256()
    for part in (_WORKER_VERSION, pypto_version(), kernel.source,
                 json.dumps([p.to_json() for p in kernel.params])):
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()[:20]


def _from_cache(kernel: PyptoKernel, entry: Path) -> SimResult | None:
    try:
        rec = json.loads((entry / "result.json").read_text())
    except (OSError, json.JSONDecodeError):
        return None
    trace = rec.get("perfetto_trace_path")
    if trace and not Path(trace).is_file():  # a cache entry whose trace was removed: rerun
        return None
    return SimResult(kernel.name, rec.get("cycles"), rec.get("error"), rec.get("pto_ir_path"),
                     rec.get("report_path"), trace, rec.get("seconds", 0.0), cached=True,
                     span_cycles=rec.get("span_cycles"), stats=rec.get("stats")).measure()


def _store(kernel: PyptoKernel, entry: Path, rec: dict, seconds: float) -> SimResult:
    entry.mkdir(parents=True, exist_ok=True)
    (entry / f"{kernel.name}.py").write_text(kernel.source)
    result = SimResult(kernel.name, seconds=round(seconds, 3))
    if rec.get("report"):
        report = entry / "_simulate.stat.report.txt"
        shutil.copyfile(rec["report"], report)
        result.report_path = str(report)
        result.cycles = parse_total_cycles(report.read_text(errors="replace"))
    if rec.get("program"):
        program = entry / "program.json"
        shutil.copyfile(rec["program"], program)
        result.pto_ir_path = str(program)
    if rec.get("trace"):
        trace = entry / "perfetto_trace.json"
        shutil.copyfile(rec["trace"], trace)
        result.perfetto_trace_path = str(trace)
    if rec.get("error"):
        result.error = rec["error"]
        log_tail = tail_of(Path(rec["log"]), 600) if rec.get("log") else ""
        if log_tail and log_tail not in result.error:
            result.error += "\n" + log_tail
    elif result.cycles is None:
        result.error = "pypto wrote no stat report with 'Total Cycles'"
        if rec.get("log"):
            result.error += ": " + tail_of(Path(rec["log"]), 600)
    result.measure()
    if result.error is None:  # failures are not cached: they may be the machine's
        (entry / "result.json").write_text(json.dumps(dataclasses.asdict(result)))
    return result


def read_results(res: Path) -> tuple[dict[int, dict], set[int]]:
    """A worker's results file (JSON lines, a torn last line skipped): the finished
    records by kernel index, and the indices that started."""
    done: dict[int, dict] = {}
    started: set[int] = set()
    if res.exists():
        for line in res.read_text().splitlines():
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue
            if rec.get("started"):
                started.add(rec["index"])
            else:
                done[rec["index"]] = rec
    return done, started


def default_workers() -> int:
    env = os.environ.get("PYPTO_INDUCTOR_SIM_WORKERS")
    if env and env.isdigit() and int(env) > 0:
        return int(env)
    return min(2, usable_cpus())


def simulate_kernels(kernels: list[PyptoKernel], timeout: float = DEFAULT_TIMEOUT_S,
                     use_cache: bool = True, workers: int | None = None,
                     on_result=None) -> list[SimResult]:
    """Simulate each kernel with pypto's SIM run mode; one result per kernel, never raises.

    Kernels run in ``workers`` worker processes (default: 2, or
    $PYPTO_INDUCTOR_SIM_WORKERS), each over its share of the batch.
    ``on_result(index)`` is called (from worker threads too) as each kernel's result is
    known, for a progress bar.
    """
    done = on_result or (lambda i: None)
    results: list[SimResult | None] = [None] * len(kernels)
    if not kernels:
        return []
    if not pypto_available():
        return [SimResult(k.name, error="pypto is not installed (pip install 'pypto-inductor[pypto]')")
                for k in kernels]
    root = cache_root()
    entries = [root / _cache_key(k) for k in kernels]
    pending = []
    for i, (k, entry) in enumerate(zip(kernels, entries)):
        hit = _from_cache(k, entry) if use_cache else None
        if hit is not None and hit.ok:
            results[i] = hit
            done(i)
        else:
            pending.append(i)
    # Identical kernels (e.g. the same op in two tiles) are simulated once.
    first_of: dict[Path, int] = {}
    unique = []
    for i in pending:
        if entries[i] not in first_of:
            first_of[entries[i]] = i
            unique.append(i)
    try:
        tmp = Path(tempfile.mkdtemp(prefix="pypto_sim_"))
    except OSError as e:
        return [r or SimResult(k.name, error=f"no temporary directory: {e}")
                for r, k in zip(results, kernels)]

    copies: dict[Path, list[int]] = {}
    for i in pending:
        copies.setdefault(entries[i], []).append(i)

    def report_copies(i: int) -> None:  # a result stands for every identical kernel
        for j in copies[entries[i]]:
            done(j)

    def run_chunk(items: list[dict]) -> None:
        try:
            _run_chunk(items)
        except Exception as e:  # noqa: BLE001 - recorded per kernel, never raised
            for item in items:
                if results[item["index"]] is None:
                    results[item["index"]] = SimResult(kernels[item["index"]].name,
                                                       error=f"{type(e).__name__}: {e}")

    def _run_chunk(items: list[dict]) -> None:
        while items:
            t0 = time.monotonic()
            finished, started, failure = _run_worker(tmp, items, timeout)
            per = (time.monotonic() - t0) / max(len(finished), 1)
            progressed = any(item["index"] in finished or item["index"] in started
                             for item in items)
            remaining = []
            for item in items:
                i = item["index"]
                if i in finished:
                    results[i] = _store(kernels[i], entries[i], finished[i], per)
                    report_copies(i)
                elif i in started or not progressed:
                    # the kernel the worker died on, or a worker that never got going
                    results[i] = SimResult(kernels[i].name,
                                           error=failure or "simulation worker stopped")
                    report_copies(i)
                else:
                    remaining.append(item)
            items = remaining

    try:
        items = [{"index": i, "dir": f"k{i}", "kernel": kernels[i].to_json()} for i in unique]
        n = max(1, min(workers or default_workers(), len(items)))
        chunks = [items[j::n] for j in range(n)]
        if n == 1:
            run_chunk(chunks[0])
        else:
            threads = [threading.Thread(target=run_chunk, args=(c,), daemon=True) for c in chunks]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
    except Exception as e:  # noqa: BLE001 - never raise into the caller
        for i in unique:
            if results[i] is None:
                results[i] = SimResult(kernels[i].name, error=f"{type(e).__name__}: {e}")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    for i in pending:
        if results[i] is None:
            src = results[first_of[entries[i]]]
            results[i] = dataclasses.replace(src, kernel=kernels[i].name) if src else SimResult(
                kernels[i].name, error="not simulated")
    return results  # type: ignore[return-value]


# --- FusionTiles and plans -------------------------------------------------------------------
@dataclasses.dataclass
class TileSimulation:
    """What pypto's simulator says about one FusionTile."""

    tile: str
    pypto_source: str | None = None
    simulated_cycles_fused: int | None = None
    simulated_cycles_unfused: int | None = None  # None for a one-op tile
    unfused_cycles_by_op: dict[str, int | None] = dataclasses.field(default_factory=dict)
    pto_ir_path: str | None = None
    perfetto_trace_path: str | None = None  # the fused kernel's Perfetto trace
    simulation_error: str | None = None
    # A tile with ops that have no pypto form is split there: those ops run as extern
    # (eager) ops, the rest as pypto kernels (split_parts); both cycle sums leave the
    # split ops out.
    split_ops: list[str] = dataclasses.field(default_factory=list)
    split_parts: list[dict] = dataclasses.field(default_factory=list)
    # options={"verify": True}: the tile's values checked in pypto's interpreter
    # (verify.TileVerification: verified, max_abs_err, verify_error, pypto_verdicts)
    verification: object | None = None
    # fused kernels pypto rejected at their vector tile and re-emitted smaller (what, and
    # whether the retry compiled)
    ub_retries: list[str] = dataclasses.field(default_factory=list)
    vec_tile: list | None = None  # the fused kernel's tiling (a split tile: its first part's)
    cube_tile: list | None = None
    # SimResult.work_cycles sums (task spans + an empty kernel's cost each): what the
    # kernels do, not the task-counting totals
    work_cycles_fused: int | None = None
    work_cycles_unfused: int | None = None
    unfused_work_by_op: dict[str, int | None] = dataclasses.field(default_factory=dict)
    # options={"autotune": True}: autotune.TileTuning.to_dict() (chosen tile shape and
    # buffering, every candidate tried and its cycles)
    tuning: dict | None = None

    def to_dict(self) -> dict:
        checked = self.verification.to_dict() if self.verification is not None else {}
        return {**checked,
            "pypto_source": self.pypto_source,  # a split tile: its parts' modules
            "simulated_cycles_fused": self.simulated_cycles_fused,
            "simulated_cycles_unfused": self.simulated_cycles_unfused,
            "simulated_cycles_unfused_by_op": dict(self.unfused_cycles_by_op) or None,
            "pto_ir_path": self.pto_ir_path,
            "perfetto_trace_path": self.perfetto_trace_path,
            "simulation_error": self.simulation_error,
            "split_ops": list(self.split_ops),
            "split_parts": [dict(p) for p in self.split_parts] or None,
            "ub_retries": list(self.ub_retries) or None,
            "vec_tile": self.vec_tile, "cube_tile": self.cube_tile,
            "simulated_work_cycles_fused": self.work_cycles_fused,
            "simulated_work_cycles_unfused": self.work_cycles_unfused,
            "tuning": self.tuning,
        }


def emit_variants(tile: FusionTile, graph: TileGraph, hw, buffering: int):
    """(fused kernel or None, [(op name, kernel or None)], errors)."""
    errors = []
    try:
        fused = emit_tile(tile, graph, run_mode="SIM")
    except PyptoEmitError as e:
        fused = None
        errors.append(f"split: {e}")
    except Exception as e:  # noqa: BLE001
        fused = None
        errors.append(f"emit failed: {type(e).__name__}: {e}")
    return fused, _emit_singles(tile, graph, hw, buffering, set(), errors), errors


def _emit_singles(tile: FusionTile, graph: TileGraph, hw, buffering: int, skip: set,
                  errors: list[str], tiles: list | None = None) -> list:
    """[(op name, one-op kernel or None)] for a multi-op tile's unfused variant
    (``tiles``, when given, gets each kernel's one-op tile)."""
    singles = []
    if len(tile.ops) > 1:
        for op in tile.ops:
            if op.name in skip:
                continue
            try:
                one = single_op_tile(op, graph, tile.tile_shape, hw, buffering)
                singles.append((op.name, emit_tile(one, graph, "SIM")))
                if tiles is not None:
                    tiles.append(one)
            except Exception as e:  # noqa: BLE001
                singles.append((op.name, None))
                errors.append(f"unfused {op.name} ({op.op}): {e}")
    return singles


def unfused_kernels(tile: FusionTile, graph: TileGraph, hw=None, buffering: int = 2
                    ) -> list[tuple[FusionTile, PyptoKernel]]:
    """The one-op kernels :func:`simulate_tiles` costs as a tile's unfused variant, with
    their one-op tiles (none for a one-op tile; ops a split leaves extern and ops whose
    kernel fails to emit are left out, as there): what a value check of that cost
    baseline runs (:func:`.verify.unfused_cases`)."""
    skip = set()
    try:
        emit_tile(tile, graph, run_mode="SIM")
    except PyptoEmitError:
        split = split_tile(tile, graph)
        skip = {op.name for op in split.split_ops} if split else set()
    tiles: list[FusionTile] = []
    singles = _emit_singles(tile, graph, hw, buffering, skip, [], tiles)
    return list(zip(tiles, [k for _, k in singles if k is not None]))


def _emit_split(tile: FusionTile, graph: TileGraph, hw, buffering: int):
    """Like :func:`emit_variants`, splitting a tile at ops with no pypto form.

    (fused kernels [(part, kernel)], the split (or None), [(op name, kernel or None)],
    errors): one fused kernel, or one per part of a split tile; the unfused kernels
    leave out the split ops (extern in both variants).
    """
    errors: list[str] = []
    split = None
    fused: list[tuple[FusionTile, PyptoKernel]] = []
    try:
        fused.append((tile, emit_tile(tile, graph, run_mode="SIM")))
    except PyptoEmitError as e:
        try:
            split = split_tile(tile, graph)
        except Exception as e2:  # noqa: BLE001
            errors.append(f"split failed: {type(e2).__name__}: {e2}")
        if split is None or not split.parts:
            errors.append(f"split: {e}" + ("; no op left for a pypto kernel" if split else ""))
        else:
            for part in split.parts:
                try:
                    fused.append((part, emit_tile(part, graph, run_mode="SIM")))
                except Exception as e3:  # noqa: BLE001
                    errors.append(f"split part {part.name} ({' '.join(part.op_names)}): {e3}")
    except Exception as e:  # noqa: BLE001
        errors.append(f"emit failed: {type(e).__name__}: {e}")
    extern = {op.name for op in split.split_ops} if split else set()
    return fused, split, _emit_singles(tile, graph, hw, buffering, extern, errors), errors


def simulate_tiles(tiles: list[FusionTile], graph: TileGraph, hw=None, buffering: int = 2,
                   timeout: float = DEFAULT_TIMEOUT_S, progress=None) -> dict[str, TileSimulation]:
    """Simulate every tile fused, and each of its ops as its own kernel; one worker batch.

    A tile with ops that have no pypto form is split there (:func:`split_tile`): its
    parts are simulated as pypto kernels and the split ops named in ``split_ops``.
    """
    plans = []
    kernels: list[PyptoKernel] = []
    for tile in tiles:
        try:
            fused, split, singles, errors = _emit_split(tile, graph, hw, buffering)
        except Exception as e:  # noqa: BLE001
            fused, split, singles, errors = [], None, [], [f"{type(e).__name__}: {e}"]
        slots = {}
        for part, k in fused:
            slots[("fused", part.name)] = len(kernels)
            kernels.append(k)
        for name, k in singles:
            if k is not None:
                slots[name] = len(kernels)
                kernels.append(k)
        plans.append((tile, fused, split, singles, errors, slots))
    results = simulate_kernels(kernels, timeout=timeout,
                               on_result=_tile_progress(plans, progress) if progress else None)
    retries = _retry_smaller(plans, kernels, results, graph, timeout)
    out: dict[str, TileSimulation] = {}
    for tile, fused, split, singles, errors, slots in plans:
        sim = TileSimulation(tile.name)
        sim.ub_retries = retries.get(tile.name, [])
        errors = list(errors)
        if split is not None:
            sim.split_ops = [op.op for op in split.split_ops]
        if fused:
            sim.pypto_source = "\n\n".join(k.source for _, k in fused)
            first = fused[0][1]
            sim.vec_tile = list(first.vec_tile) if first.vec_tile else None
            sim.cube_tile = [list(x) for x in first.cube_tile] if first.cube_tile else None
            total: int | None = 0
            work: int | None = 0
            for part, k in fused:
                r = results[slots[("fused", part.name)]]
                work = None if (work is None or r.work_cycles is None) else work + r.work_cycles
                if sim.pto_ir_path is None:  # a split tile: its first part's
                    sim.pto_ir_path, sim.perfetto_trace_path = r.pto_ir_path, r.perfetto_trace_path
                if split is not None:
                    sim.split_parts.append({
                        "name": part.name, "ops": [op.name for op in part.ops],
                        "simulated_cycles": r.cycles, "pto_ir_path": r.pto_ir_path,
                        "perfetto_trace_path": r.perfetto_trace_path})
                if r.error:
                    errors.append(f"{'fused kernel' if split is None else part.name}: {r.error}")
                total = None if (total is None or r.cycles is None) else total + r.cycles
            if split is None or len(fused) == len(split.parts):
                sim.simulated_cycles_fused, sim.work_cycles_fused = total, work
        record_unfused(sim, singles, slots, results, errors)
        sim.simulation_error = "\n".join(errors) if errors else None
        out[tile.name] = sim
    return out


def _tile_progress(plans: list, progress):
    """A per-kernel callback calling ``progress.update(1)`` once all of a tile's kernels
    are done (at once for a tile with none)."""
    lock = threading.Lock()
    left, tile_of = [], {}
    for t, (_tile, _f, _s, _singles, _errors, slots) in enumerate(plans):
        left.append(len(slots))
        for k in slots.values():
            tile_of[k] = t
        if not slots:
            progress.update(1, failed=1)

    def on_result(k: int) -> None:
        with lock:
            t = tile_of[k]
            left[t] -= 1
            finished = left[t] == 0
        if finished:
            progress.update(1)
    return on_result


MAX_SHRINK = 3  # halvings of a vector tile pypto rejected before giving up
_UB_REJECTED = re.compile(r"exceeds MEM_UB|MEM_UB size|Run pass failed")


def _retry_smaller(plans: list, kernels: list, results: list, graph: TileGraph,
                   timeout: float) -> dict[str, list[str]]:
    """Fused kernels pypto rejected at their vector tile (its UB check, "Run pass failed")
    re-emitted with the tile halved, up to MAX_SHRINK times; ``plans``, ``kernels`` and
    ``results`` are updated in place. Returns tile name -> what was retried."""
    notes: dict[str, list[str]] = {}
    for shrink in range(1, MAX_SHRINK + 1):
        redo = []  # (plan index, position in its fused list, slot, part)
        for p, (tile, fused, *_rest, slots) in enumerate(plans):
            for j, (part, k) in enumerate(fused):
                i = slots[("fused", part.name)]
                r = results[i]
                if r.error and _UB_REJECTED.search(r.error) and k.vec_tile is not None:
                    redo.append((p, j, i, part))
        if not redo:
            break
        again = []
        for p, j, i, part in redo:
            old = kernels[i]
            try:
                k = emit_tile(part, graph, run_mode="SIM", shrink=shrink)
            except Exception:  # noqa: BLE001 - keep the first failure
                continue
            if k.vec_tile == old.vec_tile:
                continue
            notes.setdefault(plans[p][0].name, []).append(
                f"{part.name}: pypto rejected vector tile {tuple(old.vec_tile)} "
                f"({_first_line(results[i].error)}); retried at {tuple(k.vec_tile)}")
            again.append((p, j, i, part, k))
        if not again:
            break
        for (p, j, i, part, k), r in zip(again, simulate_kernels([a[4] for a in again],
                                                                 timeout=timeout)):
            kernels[i] = k
            results[i] = r
            plans[p][1][j] = (part, k)
            notes[plans[p][0].name][-1] += ": " + ("ok" if r.ok else "rejected again")
    return notes


def _first_line(text: str | None) -> str:
    m = re.search(r"[^\n]*(MEM_UB|Run pass failed)[^\n]*", text or "")
    return (m.group(0) if m else (text or "").split("\n")[0]).strip()[:160]


def record_unfused(sim: "TileSimulation", singles: list, slots: dict, results: list,
                   errors: list[str]) -> None:
    """Fill a tile's per-op and total unfused cycles from its one-op kernels' results
    (None in the total when any one-op kernel has no cycles)."""
    if not singles:
        return
    total = work = 0
    for name, _kernel in singles:
        r = results[slots[name]] if name in slots else None
        sim.unfused_cycles_by_op[name] = r.cycles if r else None
        sim.unfused_work_by_op[name] = r.work_cycles if r else None
        if r is not None and r.error:
            errors.append(f"unfused {name}: {r.error}")
        total = None if (total is None or r is None or r.cycles is None) else total + r.cycles
        work = None if (work is None or r is None or r.work_cycles is None) else work + r.work_cycles
    sim.simulated_cycles_unfused, sim.work_cycles_unfused = total, work


def simulate_tile(tile: FusionTile, graph: TileGraph, hw=None, buffering: int = 2,
                  timeout: float = DEFAULT_TIMEOUT_S) -> TileSimulation:
    return simulate_tiles([tile], graph, hw, buffering, timeout)[tile.name]


def _tuned_tile(tile, tuning):
    """The tile at its tuned shape (an autotune.TileTuning; unchanged without a choice)."""
    if tuning is None or tuning.chosen is None:
        return tile
    return dataclasses.replace(tile, tile_shape=tuple(tuning.chosen.tile_shape))


def simulate_plan(plan, buffering: int = 2, timeout: float = DEFAULT_TIMEOUT_S,
                  progress=None, tunings: dict | None = None) -> dict[str, TileSimulation]:
    """Per-FusionTile simulation results of a FusionPlan (tile name -> TileSimulation);
    ``progress``: a :class:`pypto_inductor.progress.Progress` counting tiles;
    ``tunings``: tile name -> autotune.TileTuning, tiles simulated at their tuned shape."""
    try:
        tiles = plan.tiles
        if tunings:
            tiles = [_tuned_tile(t, tunings.get(t.name)) for t in tiles]
        out = simulate_tiles(tiles, plan.graph, plan.hardware, buffering, timeout, progress)
        for name, tuning in (tunings or {}).items():
            if name in out:
                out[name].tuning = tuning.to_dict()
        return out
    except Exception as e:  # noqa: BLE001 - a report must never fail on the simulator
        return {t.name: TileSimulation(t.name, simulation_error=f"{type(e).__name__}: {e}")
                for t in plan.tiles}
