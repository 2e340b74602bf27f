"""Runs fuzz cases over the configurations, attributes and shrinks failures, writes repros.

A configuration is (target, dynamic): static compiles run size variant 0,
dynamic ones compile once and run variants 0 and 1. A failure is also run
through ``decomposed_eager`` (Dynamo + AOTAutograd with pypto's decomposition
table, the graphs run eagerly): if that fails alike, the fault is upstream of
the backend's lowering (torch's tracing or a decomposition), and it is labelled
"upstream".
"""
from __future__ import annotations

import collections
import dataclasses
import inspect
import pprint
import re
import time
import warnings
from pathlib import Path
from unittest import mock

import torch
import torch._dynamo
from functorch.compile import make_boxed_func
from torch._dynamo.backends.common import aot_autograd

from pypto_inductor.lowering import decomposition_table

from . import check
from .generator import generate
from .program import Program

CONFIGS = (("cpu", False), ("cpu", True), ("reference", False), ("reference", True))


def decomposed_eager(gm, example_inputs):
    """AOTAutograd with the backend's decompositions; graphs run as they are."""
    boxed = lambda g, _: make_boxed_func(g.forward)  # noqa: E731
    return aot_autograd(fw_compiler=boxed, bw_compiler=boxed, inference_compiler=boxed,
                        decompositions=decomposition_table(),
                        keep_inference_input_mutations=True)(gm, example_inputs)


@dataclasses.dataclass
class CaseResult:
    seed: int
    program: Program
    failures: list[dict]  # check.check dicts plus target, dynamic, upstream, repro
    seconds: float

    @property
    def families(self) -> set[str]:
        return self.program.families


def check_program(program: Program, target: str, dynamic: bool, refs=None, backend="pypto"):
    torch._dynamo.reset()
    try:
        return check.check(program.case(), target, dynamic, refs, backend=backend)
    except Exception as e:  # noqa: BLE001 - the reference run itself failed: report it
        return [{"variant": 0, "kind": "crash", "message": f"{type(e).__name__}: {e}"}]


class _FanOut:
    """Stands in for ``pypto_inductor.backend.compile_graph`` in a shared check: each ATen
    graph AOTAutograd hands the backend is compiled once per target, by the real
    compile_graph with the config's target replaced, and the callable returned runs the
    target ``current`` names (see ``check_shared``)."""

    def __init__(self, targets, compile_graph):
        self.targets, self.compile_graph = list(targets), compile_graph
        self.current = self.targets[0]
        self.graphs = 0  # ATen graphs compiled (for every target)

    def __call__(self, gm, example_inputs, config, kind, attention=None, convs=None,
                 record=None):
        self.graphs += 1
        compiled = {}
        for i, target in enumerate(self.targets):
            last = i == len(self.targets) - 1  # the decision lists are reported with the
            # first graph and cleared there: every target's first graph gets them
            compiled[target] = self.compile_graph(
                gm, example_inputs, dataclasses.replace(config, target=target), kind,
                attention if last or attention is None else list(attention),
                convs if last or convs is None else list(convs),
                # graph_cache stores the plan under the key of the compile's own target
                record if target == config.target else None)

        def run(args):  # boxed, as compile_graph's callables
            return compiled[self.current](args)

        run._boxed_call = True
        return run


def check_shared(program: Program, targets, dynamic: bool, refs: dict) -> bool:
    """True when ``program`` passes on every target in ``targets`` (static, or dynamic at
    both sizes), from one torch.compile: one Dynamo trace and one AOTAutograd trace serve
    all targets, each ATen graph is compiled once per target (``_FanOut``), and each size
    variant is called once per target, in the order a separate compile would see (variant
    0 on every target, then variant 1). False on any failure, anomaly or graph compiled
    by no target: the caller then runs each target on its own compile (``check_program``),
    whose findings are the ones reported. Why one trace can serve every target:
    docs/fuzz.md, "Throughput"."""
    from pypto_inductor import backend

    case = program.case()
    torch._dynamo.reset()
    fan = _FanOut(targets, backend.compile_graph)
    fn = check.load(case["source"])
    compiled = torch.compile(fn, backend="pypto", dynamic=dynamic,
                             options={"target": targets[0], "strict": True})
    try:
        with mock.patch.object(backend, "compile_graph", fan):
            for v in ([0, 1] if dynamic else [0]):
                if v not in refs:
                    refs[v] = check.reference(case, v)
                for target in targets:
                    fan.current = target
                    with warnings.catch_warnings():
                        warnings.simplefilter("ignore")
                        got = check.run(compiled, check.inputs_for(case, v), case, v)
                    if check.compare_runs(got, refs[v]):
                        return False
    except Exception:  # noqa: BLE001 - the separate compiles say what it is
        return False
    finally:
        torch._dynamo.reset()
    return fan.graphs > 0


def _runs_eagerly(program: Program) -> bool:
    try:
        for v in (0, 1):
            refs = check.reference(program.case(), v)
            if program.backward and not refs["eager"].get("gradients"):
                return False
        return True
    except Exception:  # noqa: BLE001
        return False


def failure_key(f: dict) -> str:
    """What two failures share when they are likely the same fault: the kind, and for a
    crash the exception's first line with numbers and the backend's name blanked. Dynamo
    wraps a compile-time exception as "BackendCompilerFailed: backend='<name>' raised:"
    with the exception on the next line; that line is the key (with the backend's name in
    it, no crash while compiling could match ``decomposed_eager``'s and be upstream)."""
    if f["kind"] != "crash":
        return f["kind"]
    lines = f["message"].splitlines() or [""]
    first = re.sub(r"backend='[^']*'", "backend=B", lines[0])
    if first.startswith("BackendCompilerFailed") and len(lines) > 1:
        first += " " + lines[1]
    return "crash: " + re.sub(r"\d+", "N", first)[:200]


def _fails(program: Program, target: str, dynamic: bool, key: str) -> bool:
    if not _runs_eagerly(program):
        return False
    return any(failure_key(f) == key for f in check_program(program, target, dynamic))


def shrink(program: Program, target: str, dynamic: bool, key: str,
           budget_s: float = 90.0) -> Program:
    """A smaller program failing alike: one output, then statements bypassed (their
    value replaced by an operand) or dropped while the failure stays; stops at the
    time budget."""
    deadline = time.monotonic() + budget_s
    for out in program.outputs:
        candidate = program.pruned([out])
        if len(program.outputs) > 1 and _fails(candidate, target, dynamic, key):
            program = candidate
            break
    changed = True
    while changed and time.monotonic() < deadline:
        changed = False
        for i in reversed(range(len(program.statements))):
            if time.monotonic() > deadline or i >= len(program.statements):
                break
            s = program.statements[i]
            if s.defines is None:  # an in-place write: drop it
                options = [dataclasses.replace(
                    program, statements=program.statements[:i] + program.statements[i + 1:])]
            else:
                options = [program.without(i, u).pruned(list(dict.fromkeys(
                    u if o == s.defines else o for o in program.outputs)))
                    for u in s.uses if u != s.defines]
            for candidate in options:
                if candidate.statements and _fails(candidate, target, dynamic, key):
                    program, changed = candidate, True
                    break
    return _drop_unused_inputs(program)


def _drop_unused_inputs(program: Program) -> Program:
    used = {u for s in program.statements for u in s.uses} | set(program.outputs)
    inputs = [s for s in program.inputs if s["name"] in used]
    return dataclasses.replace(program, inputs=inputs)


def repro_source(program: Program, target: str, dynamic: bool, failures: list[dict]) -> str:
    """A standalone script: check.py verbatim, the case, a main printing OK/MISMATCH/CRASH."""
    summary = "\n".join(f"# {f['kind']} at size variant {f['variant']}: "
                        f"{f['message'].splitlines()[0][:300]}" for f in failures[:4])
    head = (f"# Fuzz repro: seed {program.seed}, target={target!r}, dynamic={dynamic}, "
            f"backward={program.backward}.\n# Found:\n{summary}\n"
            "# Run it with the project's venv: it prints OK, MISMATCH or CRASH.\n")
    main = f'''

CASE = {pprint.pformat(program.case(), width=96, sort_dicts=False)}
TARGET, DYNAMIC = {target!r}, {dynamic}

if __name__ == "__main__":
    print(CASE["source"])
    found = check(CASE, TARGET, dynamic=DYNAMIC)
    for f in found:
        print(f"{{f['kind'].upper()}} (size variant {{f['variant']}}): {{f['message']}}")
    if any(f["kind"] == "crash" for f in found):
        print("CRASH")
    elif found:
        print("MISMATCH")
    else:
        print("OK")
'''
    return head + inspect.getsource(check) + main


# failure key -> how many failures with it were shrunk in this process
_shrunk: collections.Counter = collections.Counter()


def run_case(seed: int, configs=CONFIGS, shrink_budget_s: float = 0.0,
             repro_dir: Path | None = None, shrinks_per_key: int = 3,
             share: bool = True) -> CaseResult:
    """Generate case ``seed``, run every configuration (the targets of one static or
    dynamic configuration from one trace first, ``check_shared``, unless ``share`` is
    False; a configuration that fails there is run on its own); failures get attributed, shrunk
    (when ``shrink_budget_s`` > 0, at most ``shrinks_per_key`` times per target and
    crash message or mismatch kind in this process: a long run meets the same fault
    many times) and written to ``repro_dir``."""
    start = time.monotonic()
    program = generate(seed)
    refs: dict = dict(program.refs or {})  # the generator's validation ran them
    failures = []
    passed = set()  # configurations a shared compile passed (check_shared)
    if share:
        for dynamic in dict.fromkeys(d for _, d in configs):
            targets = [t for t, d in configs if d == dynamic]
            if len(targets) > 1 and check_shared(program, targets, dynamic, refs):
                passed.update((t, dynamic) for t in targets)
    for target, dynamic in configs:
        if (target, dynamic) in passed:
            continue
        for f in check_program(program, target, dynamic, refs):
            failures.append({**f, "target": target, "dynamic": dynamic})
    by_config: dict = {}
    for f in failures:
        by_config.setdefault((f["target"], f["dynamic"]), []).append(f)
    for (target, dynamic), found in by_config.items():
        key = failure_key(found[0])
        upstream = any(failure_key(f) == key
                       for f in check_program(program, target, dynamic, backend=decomposed_eager))
        small = program
        if shrink_budget_s > 0 and not upstream and _shrunk[target, key] < shrinks_per_key:
            _shrunk[target, key] += 1
            small = shrink(program, target, dynamic, key, shrink_budget_s)
            found_small = check_program(small, target, dynamic) or found
        else:
            found_small = found
        path = None
        if repro_dir is not None:
            repro_dir.mkdir(parents=True, exist_ok=True)
            mode = "dynamic" if dynamic else "static"
            path = repro_dir / f"seed{seed}_{target}_{mode}.py"
            path.write_text(repro_source(small, target, dynamic, found_small))
        for f in found:
            f.update(upstream=upstream, repro=str(path) if path else None,
                     shrunk=small.source if small is not program else None)
    torch._dynamo.reset()
    return CaseResult(seed, program, failures, time.monotonic() - start)
