"""Host value checks: emitted pypto kernels run on real inputs by pypto's interpreter.

pypto's SIM mode computes no values, but pypto 0.2.0 carries a host interpreter
for precision debugging ("pass verify"): it runs the kernel's program with a
torch-based op library (the "calculator", C++ built with cmake from
``pypto/lib/calculator``) and writes the results into the kernel's output
buffers once the host tensors are registered (:mod:`.verify_worker`). Here
every pypto kernel of a FusionTile (one, or one per part of a split tile) runs
on seeded random inputs and is compared with the reference executor
(:mod:`..reference`, the test oracle) on the same inputs.

- :func:`calculator_library` builds the calculator once per pypto/torch version
  into the cache directory, under a file lock (concurrent processes wait for
  one build); it raises :class:`VerifyUnavailable` naming what is missing
  (cmake, a C++ compiler) or the build's error.
- :func:`verify_tiles` returns a :class:`TileVerification` per tile:
  ``verified`` (True/False, or None with ``verify_error`` when the kernel could
  not run), ``max_abs_err`` and pypto's own verdicts (``verify_result_brief.csv``:
  per pass, against our reference output as the golden).
"""
from __future__ import annotations

import csv
import dataclasses
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import sympy
import torch

from ...config import cache_dir
from ...ir import FusionTile, TileGraph
from .. import reference
from .emit import PyptoEmitError, PyptoKernel, emit_tile, split_tile
from .sim import (default_workers, pypto_available, pypto_version, read_results, tail_of,
                  unfused_kernels, worker_env)

__all__ = ["VerifyUnavailable", "TileVerification", "KernelCheck", "calculator_library",
           "verify_kernel", "verify_kernels", "random_inputs", "tile_case", "unfused_cases",
           "check_unfused", "interpreter_limit",
           "verify_graphs", "verify_tiles", "verify_plan", "tolerance"]

DEFAULT_TIMEOUT_S = 300.0  # per kernel: the interpreter is slow on big dynamic loops


class VerifyUnavailable(RuntimeError):
    """pypto's host interpreter cannot run here (no cmake, no compiler, a failed build)."""


# --- the calculator library ------------------------------------------------------------
def _calculator_source() -> Path:
    import importlib.util
    spec = importlib.util.find_spec("pypto")
    if spec is None or not spec.submodule_search_locations:
        raise VerifyUnavailable("pypto is not installed (pip install 'pypto-inductor[pypto]')")
    src = Path(list(spec.submodule_search_locations)[0], "lib", "calculator")
    if not (src / "CMakeLists.txt").is_file():
        raise VerifyUnavailable(f"pypto's calculator sources are missing ({src})")
    return src


def calculator_library() -> Path:
    """pypto's calculator library, built once per pypto/torch version into the cache."""
    from filelock import FileLock
    torch_root = Path(torch.__file__).parent
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    key = hashlib.sha256(f"{pypto_version()}|{torch.__version__}|{abi}|{torch_root}"
                         .encode()).hexdigest()[:16]
    root = cache_dir("pypto_calculator", key)
    lib = root / "libtile_fwk_calculator.so"
    if lib.is_file():
        return lib
    src = _calculator_source()
    cmake = shutil.which("cmake")
    if cmake is None:
        raise VerifyUnavailable("cmake is not installed: pypto's host interpreter needs it to "
                                "build its calculator library")
    if not any(shutil.which(c) for c in (os.environ.get("CXX", "c++"), "c++", "g++", "clang++")):
        raise VerifyUnavailable("no C++ compiler (c++, g++ or clang++): pypto's host "
                                "interpreter needs one to build its calculator library")
    root.mkdir(parents=True, exist_ok=True)
    with FileLock(str(root) + ".lock"):
        if lib.is_file():  # another process built it while we waited
            return lib
        with tempfile.TemporaryDirectory(dir=root.parent) as tmp:
            build = Path(tmp, "build")
            steps = [[cmake, "-S", str(src), "-B", str(build), "-DCMAKE_BUILD_TYPE=Release",
                      f"-DPY3_MOD_TORCH_VERSION={torch.__version__}",
                      f"-DPY3_MOD_TORCH_ROOT_PATH={torch_root}",
                      f"-DPY3_MOD_TORCH_C_GLIBCXX_USE_CXX11_ABI={abi}"],
                     [cmake, "--build", str(build), "-j", str(default_workers())]]
            for cmd in steps:
                proc = subprocess.run(cmd, capture_output=True, text=True)
                if proc.returncode != 0:
                    raise VerifyUnavailable(
                        f"building pypto's calculator library failed ({' '.join(cmd[:2])}): "
                        + (proc.stderr or proc.stdout)[-800:])
            built = build / "libtile_fwk_calculator.so"
            if not built.is_file():
                raise VerifyUnavailable(f"cmake built no {built.name}")
            shutil.copyfile(built, Path(tmp, built.name))
            os.replace(Path(tmp, built.name), lib)  # atomic: readers see all of it or nothing
    return lib


# --- one kernel ---------------------------------------------------------------------------
def tolerance(dtype: torch.dtype) -> tuple[float, float]:
    """(rtol, atol) of a kernel output against the reference, by the output's dtype.

    Kernels compute in fp32 (fp16 under dtype_policy "strict") with pypto's own
    transcendental approximations; a wrong kernel is off by O(1)."""
    if dtype == torch.float16:
        return 1e-2, 1e-2
    if dtype == torch.bfloat16:
        return 2e-2, 2e-2
    if dtype.is_floating_point:
        return 1e-3, 1e-4
    return 0.0, 0.0


@dataclasses.dataclass
class KernelCheck:
    kernel: str
    verified: bool | None = None
    max_abs_err: float | None = None
    error: str | None = None
    pypto_verdicts: list = dataclasses.field(default_factory=list)  # verify_result_brief.csv
    seconds: float = 0.0


def random_inputs(kernel: PyptoKernel, seed: int) -> list[torch.Tensor]:
    """Seeded random inputs of the kernel's graph shapes and dtypes."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for p in kernel.inputs:
        shape = tuple(int(s) for s in p.graph_shape)
        if p.dtype.is_floating_point:
            out.append(torch.randn(shape, generator=gen).to(p.dtype))
        elif p.dtype == torch.bool:
            out.append(torch.rand(shape, generator=gen) > 0.5)
        else:
            out.append(torch.randint(-8, 9, shape, generator=gen).to(p.dtype))
    return out


def _compare(out: torch.Tensor, ref: torch.Tensor) -> tuple[bool, float]:
    ref = ref.reshape(out.shape)
    if ref.dtype.is_floating_point or out.dtype.is_floating_point:
        rtol, atol = tolerance(out.dtype)
        o, r = out.double(), ref.double()
        both_nan = torch.isnan(o) & torch.isnan(r)
        same = both_nan | (o == r)  # equal infinities too (o - r would be nan)
        diff = torch.where(same, torch.zeros_like(o), (o - r).abs())
        diff = torch.where(torch.isnan(diff), torch.full_like(diff, float("inf")), diff)
        err = float(diff.max()) if diff.numel() else 0.0
        ok = bool((diff <= atol + rtol * r.abs().nan_to_num(0.0, posinf=0.0)).all())
        return ok, err
    err = float((out.long() - ref.long()).abs().max()) if out.numel() else 0.0
    return err == 0.0, err


def _read_verdicts(work: Path) -> list[dict]:
    rows = []
    for path in sorted(work.glob("output/output_*/verify_*/verify_result_brief.csv")):
        with open(path, newline="") as f:
            for r in csv.DictReader(f):
                rows.append({"pass": r.get("passName"), "against": r.get("referPassName"),
                             "result": r.get("verifyResult"),
                             "max_abs_diff": _float(r.get("maxAbsDiff")),
                             "error_ratio": _float(r.get("errorRatio"))})
    return rows


def _float(x) -> float | None:
    try:
        return float(x)
    except (TypeError, ValueError):
        return None


def _run_worker(tmp: Path, items: list[dict], calculator: Path, per_pass: bool,
                timeout: float) -> tuple[dict[int, dict], str]:
    """One worker over ``items`` (kernels in order); (results by index, failure text)."""
    first = items[0]["index"]
    res = tmp / f"results_{first}.jsonl"
    job = {"calculator": str(calculator), "launcher": str(Path(__file__).with_name("launcher.py")),
           "results": str(res), "per_pass": per_pass, "items": items}
    (tmp / f"job_{first}.json").write_text(json.dumps(job))
    log = tmp / f"worker_{first}.log"
    failure = ""
    with open(log, "wb") as out:
        try:
            proc = subprocess.run([sys.executable, str(Path(__file__).with_name("verify_worker.py")),
                                   str(tmp / f"job_{first}.json")],
                                  cwd=tmp, env=worker_env(tmp), stdout=out,
                                  stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                  timeout=timeout * len(items) + 60)
            if proc.returncode not in (0, 3):
                failure = f"verify worker exited with code {proc.returncode}"
        except subprocess.TimeoutExpired:
            failure = f"verify worker timed out ({timeout:.0f} s per kernel)"
    done, _ = read_results(res)
    if failure and tail_of(log):
        failure += ": " + tail_of(log, 600)
    return done, failure


def verify_kernels(cases: list[tuple[PyptoKernel, list, list]], per_pass: bool = False,
                   timeout: float = DEFAULT_TIMEOUT_S, calculator: Path | None = None
                   ) -> list[KernelCheck]:
    """Run each ``(kernel, inputs, expected outputs)`` in pypto's interpreter and compare
    its outputs with the expected ones; one worker process for the batch (a fresh one
    after a kernel that fails). Never raises: reasons land in ``error``."""
    checks = [KernelCheck(k.name) for k, _, _ in cases]
    if not cases:
        return checks
    try:
        calculator = calculator or calculator_library()
    except VerifyUnavailable as e:
        for c in checks:
            c.error = str(e)
        return checks
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="pypto_verify_") as tmp:
        tmp = Path(tmp)
        items = []
        for i, (kernel, inputs, expected) in enumerate(cases):
            torch.save({"inputs": [x.contiguous() for x in inputs],
                        "goldens": [e.detach().contiguous() for e in expected]},
                       tmp / f"data_{i}.pt")
            items.append({"index": i, "dir": f"k{i}", "kernel": kernel.to_json(),
                          "data": str(tmp / f"data_{i}.pt"), "outputs": str(tmp / f"out_{i}.pt"),
                          # pypto's own verdicts at our tolerance (the loosest output's)
                          "tol": list(max((tolerance(p.dtype) for p in kernel.outputs),
                                          default=(1e-3, 1e-4)))})
        pending = items
        while pending:
            done, failure = _run_worker(tmp, pending, calculator, per_pass, timeout)
            for item in pending:
                rec = done.get(item["index"])
                if rec is not None:
                    checks[item["index"]].error = rec.get("error")
            ran = [i for i, item in enumerate(pending) if item["index"] in done]
            if not ran:  # the worker died on the first kernel: record it, go on after it
                checks[pending[0]["index"]].error = failure or "verify worker produced no result"
                ran = [0]
            elif failure and len(ran) < len(pending):
                nxt = pending[max(ran) + 1]  # the kernel the worker died on
                checks[nxt["index"]].error = failure
                ran.append(max(ran) + 1)
            pending = pending[max(ran) + 1:]
        elapsed = time.monotonic() - start
        for item, check, (kernel, _inputs, expected) in zip(items, checks, cases):
            check.seconds = round(elapsed / len(cases), 3)
            check.pypto_verdicts = _read_verdicts(tmp / item["dir"])
            if check.error is not None:
                check.error = interpreter_limit(kernel, check.error) or check.error
                continue
            outs = torch.load(item["outputs"])
            oks, errs = zip(*(_compare(o, e) for o, e in zip(outs, expected))) if outs else ((), ())
            check.verified = all(oks)
            check.max_abs_err = max(errs) if errs else 0.0
    return checks


_SIZE_MISMATCH = re.compile(r"The size of tensor a \((\d+)\) must match the size of "
                            r"tensor b \((\d+)\)")


def interpreter_limit(kernel: PyptoKernel, error: str | None) -> str | None:
    """Why ``kernel`` could not run in pypto's interpreter, when ``error`` is a known limit
    of the interpreter rather than a wrong kernel; None otherwise (``verified`` stays None
    either way: not checked, neither right nor wrong).

    Known: a reduction over dynamic columns inside dynamic rows, at a partial row tile.
    The interpreter keeps the loop-carried accumulator at the full row tile and refuses
    to combine it with the partial tile's chunk reduction (a ``valid_shape`` on the
    accumulator changes nothing); the same kernel verifies when the rows fill whole
    tiles (tests/test_pypto_verify.py asserts both)."""
    m = _SIZE_MISMATCH.search(error or "")
    if m is None or not {"R", "C"} <= set(kernel.dynamic_dims) or "acc" not in kernel.source:
        return None
    full, valid = m.groups()
    return (f"not value-checked (pypto interpreter limit, not a kernel error): a reduction "
            f"over dynamic columns inside dynamic rows at a partial row tile ({valid} valid "
            f"rows of {full}); the interpreter keeps the loop-carried accumulator at "
            f"{full} rows. The kernel verifies when the rows fill whole tiles of {full}. "
            f"pypto said: {m.group(0)}")


def verify_kernel(kernel: PyptoKernel, inputs: list, expected: list, per_pass: bool = False,
                  timeout: float = DEFAULT_TIMEOUT_S) -> KernelCheck:
    """:func:`verify_kernels` for one kernel."""
    return verify_kernels([(kernel, inputs, expected)], per_pass, timeout)[0]


# --- tiles -------------------------------------------------------------------------------
@dataclasses.dataclass
class TileVerification:
    tile: str
    verified: bool | None = None
    max_abs_err: float | None = None
    verify_error: str | None = None
    kernels: list = dataclasses.field(default_factory=list)  # KernelCheck per pypto kernel

    def to_dict(self) -> dict:
        return {"verified": self.verified, "max_abs_err": self.max_abs_err,
                "verify_error": self.verify_error,
                "pypto_verdicts": [v for k in self.kernels for v in k.pypto_verdicts] or None,
                "verify_seconds": round(sum(k.seconds for k in self.kernels), 3)}


def tile_kernels(tile: FusionTile, graph: TileGraph) -> list[tuple[FusionTile, PyptoKernel]]:
    """The pypto kernels of a tile: one, or one per pypto part of a split tile."""
    try:
        return [(tile, emit_tile(tile, graph, run_mode="SIM"))]
    except PyptoEmitError:
        split = split_tile(tile, graph)
        if split is None or not split.parts:
            raise
        return [(part, emit_tile(part, graph, run_mode="SIM")) for part in split.parts]


def _case(tile: FusionTile, graph: TileGraph, kernel: PyptoKernel, seed: int,
          sizes: dict | None = None):
    """(kernel, random inputs, the reference executor's outputs on them).

    A dynamic kernel runs at concrete ``sizes`` (size symbol -> int, every symbol of
    the graph; default: the graph's hints): the interpreter needs concrete tensors,
    and the kernel keeps its one dynamic source (:meth:`PyptoKernel.at_sizes`)."""
    if kernel.dynamic:
        names = {str(k): int(v) for k, v in (sizes or {}).items()}
        names = {str(s): names.get(str(s), graph.hint(s)) for s in graph.symbols}
        kernel = kernel.at_sizes(names)
        syms = tuple(names[str(s)] for s in graph.symbols)
    elif sizes:
        raise ValueError(f"kernel {kernel.name} has static shapes; sizes {sizes} mean nothing")
    else:
        syms = tuple(graph.hint(s) for s in graph.symbols)
    inputs = random_inputs(kernel, seed)
    # indices of lookups (embeddings) must be in range: rows of the table they index
    gen = torch.Generator().manual_seed(seed + 1)
    for op in tile.ops:
        if op.op == "gather" and op.attrs.get("check") in ("embedding", "gather") \
                and len(op.args) == 2:
            dim = 0 if op.attrs["check"] == "embedding" else op.attrs["source_dims"].index(-1)
            rows = int(sympy.sympify(graph.specs[op.args[0]].shape[dim]).subs(
                {s: v for s, v in zip(graph.symbols, syms)}))
            for i, p in enumerate(kernel.inputs):
                if p.value == op.args[1]:
                    inputs[i] = torch.randint(0, rows, inputs[i].shape, generator=gen,
                                              dtype=inputs[i].dtype)
    return kernel, inputs, list(reference.build(tile, graph).fn(inputs, syms))


def tile_case(tile: FusionTile, graph: TileGraph, sizes: dict | None = None, seed: int = 0,
              kernel: PyptoKernel | None = None) -> list[tuple[PyptoKernel, list, list]]:
    """:func:`verify_kernels` cases of a tile's pypto kernels (``kernel`` as given, else
    one per part of a split tile) on seeded random inputs, a dynamic kernel at ``sizes``
    (see :func:`_case`)."""
    pairs = [(tile, kernel)] if kernel is not None else tile_kernels(tile, graph)
    return [_case(part, graph, k, seed, sizes) for part, k in pairs]


def unfused_cases(tile: FusionTile, graph: TileGraph, hw=None, buffering: int = 2,
                  seed: int = 0) -> list[tuple[PyptoKernel, list, list]]:
    """:func:`verify_kernels` cases of the one-op kernels a simulation costs as ``tile``'s
    unfused variant (:func:`.sim.unfused_kernels`, the same ``hw`` and ``buffering``):
    cost baselines that never ship, value-checked so a cycle count is of a kernel that
    computes the op."""
    return [_case(one, graph, k, seed) for one, k in unfused_kernels(tile, graph, hw, buffering)]


def check_unfused(cases: list[tuple[PyptoKernel, list, list]], per_pass: bool = False,
                  calculator: Path | None = None) -> list[KernelCheck]:
    """:func:`verify_kernels` over :func:`unfused_cases`; a kernel pypto's compiler
    rejects (its interpreter and its simulator alike: no cost figure either, the
    simulation lists the op's unfused cycles as None and says why) comes back
    ``verified`` None with ``error`` starting "rejected by pypto"; any other failure
    to run stays as it is."""
    from .sim import simulate_kernels
    checks = verify_kernels(cases, per_pass, calculator=calculator)
    failed = [i for i, c in enumerate(checks) if c.verified is None]
    if failed:
        sims = simulate_kernels([cases[i][0] for i in failed])
        for i, r in zip(failed, sims):
            if r.cycles is None and r.error:
                checks[i].error = (f"rejected by pypto (simulator too, no unfused cost): "
                                   f"{_first_error_line(r.error)}")
    return checks


def _first_error_line(text: str) -> str:
    lines = [x for x in text.splitlines() if "CHECK FAILED" in x or "Error" in x]
    return (lines[-1] if lines else text.splitlines()[-1]).strip()[:300]


def verify_tiles(tiles: list[FusionTile], graph: TileGraph, seed: int = 0,
                 per_pass: bool = False, timeout: float = DEFAULT_TIMEOUT_S,
                 workers: int | None = None) -> dict[str, TileVerification]:
    """Value-check every tile's pypto kernels; never raises (reasons in verify_error)."""
    return verify_graphs([(tiles, graph)], seed, per_pass, timeout, workers)


def verify_graphs(groups: list[tuple[list[FusionTile], TileGraph]], seed: int = 0,
                  per_pass: bool = False, timeout: float = DEFAULT_TIMEOUT_S,
                  workers: int | None = None) -> dict[str, TileVerification]:
    """:func:`verify_tiles` over tiles of several graphs in one batch (tile names must be
    unique across them, as the planner's are)."""
    tiles = [(t, g) for ts, g in groups for t in ts]
    out = {t.name: TileVerification(t.name) for t, _ in tiles}
    if not pypto_available():
        for v in out.values():
            v.verify_error = "pypto is not installed (pip install 'pypto-inductor[pypto]')"
        return out
    try:
        calculator = calculator_library()
    except VerifyUnavailable as e:
        for v in out.values():
            v.verify_error = f"not verified: {e}"
        return out
    owners, cases = [], []
    for tile, graph in tiles:
        try:
            for part, kernel in tile_kernels(tile, graph):
                cases.append(_case(part, graph, kernel, seed))
                owners.append(tile.name)
        except Exception as e:  # noqa: BLE001
            out[tile.name].verify_error = f"emit failed: {type(e).__name__}: {e}"
    # the batch in ``workers`` worker processes, each over a contiguous share
    n = max(1, min(workers or default_workers(), len(cases)))
    shares = [list(range(len(cases)))[i * len(cases) // n:(i + 1) * len(cases) // n]
              for i in range(n)]
    with ThreadPoolExecutor(max_workers=n) as pool:
        futures = [pool.submit(verify_kernels, [cases[i] for i in share], per_pass, timeout,
                               calculator) for share in shares]
        for share, fut in zip(shares, futures):
            for i, check in zip(share, fut.result()):
                out[owners[i]].kernels.append(check)
    for v in out.values():
        if v.verify_error or not v.kernels:
            v.verify_error = v.verify_error or "no pypto kernel"
            continue
        errors = [f"{k.kernel}: {k.error}" for k in v.kernels if k.error]
        if errors:
            v.verify_error = "\n".join(errors)
        if any(k.verified is False for k in v.kernels):
            v.verified = False
        elif all(k.verified for k in v.kernels):
            v.verified = True
        errs = [k.max_abs_err for k in v.kernels if k.max_abs_err is not None]
        v.max_abs_err = max(errs) if errs else None
    return out


def verify_plan(plan, seed: int = 0, per_pass: bool = False) -> dict[str, TileVerification]:
    """Per-FusionTile value checks of a FusionPlan (tile name -> TileVerification)."""
    try:
        return verify_tiles(plan.tiles, plan.graph, seed=seed, per_pass=per_pass)
    except Exception as e:  # noqa: BLE001 - a report must never fail on the interpreter
        return {t.name: TileVerification(t.name, verify_error=f"{type(e).__name__}: {e}")
                for t in plan.tiles}
