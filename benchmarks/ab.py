"""``python -m benchmarks ab MODULE.ATTR --models a,b [--mode forward|train]``: one of our
switches off and on, against Inductor, on zoo models, in one process.

The switches are module attributes read when a graph compiles (``FOO = True``). Each
variant is compiled with the switch set, through a backend callable of its own and behind
a code object of its own (``benchmarks.own_code``): Dynamo keeps its compiled frames per
code object, so copies of a model compiled through ``forward`` would be looked up in one
list (each call paying for the guards of the variants found before it: a bias between the
variants) and, with the same backend, share the first one's kernels (a
``torch._dynamo.reset()`` between them makes the first recompile, in the timed loop, with
whatever the switch is then). A compile inside the timed loop raises. Rounds of 5 calls
per variant, the order reversed every other round, one thread, the thread's CPU time (robust to other
processes); with ``--threads N`` (N > 1) N torch threads and wall time (the thread's CPU
time would leave the other threads out: noisy on a shared machine, say its load). Printed:
medians per variant and the per-round median of off / on.
"""
from __future__ import annotations

import argparse
import copy
import importlib
import statistics
import time

import torch

from pypto_inductor.backend import pypto_backend

from . import own_code
from . import zoo as bench_zoo


class _CompiledInTimedLoop:
    def __bool__(self):
        raise RuntimeError("a graph compiled inside the timed loop (a recompile)")


def _variants(name: str, mode: str, switch: tuple) -> tuple[dict, dict]:
    """label -> step callable, and label -> the step's results (outputs or gradients)."""
    mod, attr = switch
    model = bench_zoo.build(name)
    kw = bench_zoo.forward_inputs(name) if mode == "forward" else bench_zoo.batch(name)
    steps, results = {}, {}
    for label in ("eager", "inductor", "off", "on"):
        m = copy.deepcopy(model).train(mode == "train")
        if label in ("off", "on"):
            setattr(mod, attr, label == "on")
            f = torch.compile(own_code(m), backend=lambda gm, ex: pypto_backend(gm, ex))
        else:
            f = m if label == "eager" else torch.compile(own_code(m))
        if mode == "forward":
            def step(f=f):
                with torch.no_grad():
                    return bench_zoo.tensors(f(**kw))
        else:
            def step(f=f, m=m):
                m.zero_grad(set_to_none=True)
                f(**kw)["loss"].backward()
                return [p.grad for p in m.parameters() if p.grad is not None]
        results[label] = step()
        step()
        steps[label] = step
    return steps, results


def run(switch: str, models: list[str], mode: str, rounds: int, threads: int = 1) -> None:
    modname, attr = switch.rsplit(".", 1)
    mod = importlib.import_module(modname)
    old = getattr(mod, attr)
    torch.set_num_threads(threads)
    clock = time.thread_time if threads == 1 else time.perf_counter
    # frames called after a graph break are shared by the variants, each a new compile of
    # them: past Dynamo's default limit of 8 they would run eagerly
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    for name in models:
        try:
            steps, results = _variants(name, mode, (mod, attr))
            setattr(mod, attr, _CompiledInTimedLoop())
            diff = {k: bench_zoo.rel_diff(v, results["eager"]) for k, v in results.items()}
            times = {label: [] for label in steps}
            for r in range(rounds):
                order = list(steps.items())[:: 1 if r % 2 == 0 else -1]
                per = {label: [] for label in steps}
                for _ in range(5):
                    for label, step in order:
                        start = clock()
                        step()
                        per[label].append(clock() - start)
                for label in steps:
                    times[label].append(statistics.median(per[label]) * 1e3)
        finally:
            setattr(mod, attr, old)
        med = {label: statistics.median(t) for label, t in times.items()}
        ratio = statistics.median(a / b for a, b in zip(times["off"], times["on"]))
        print(f"{name} {mode} ({threads} thread{'s' if threads > 1 else ''}): " + ", ".join(f"{k} {v:.3f} ms" for k, v in med.items())
              + f"; off/on {ratio:.3f} (per-round median); Inductor/pypto off "
              f"{med['inductor'] / med['off']:.3f}, on {med['inductor'] / med['on']:.3f}; "
              "max relative difference from eager " + ", ".join(
                  f"{k} {v:.1e}" for k, v in diff.items() if k != "eager"), flush=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks ab", description=__doc__.splitlines()[0])
    p.add_argument("switch", help="module.ATTR, e.g. pypto_inductor.codegen.graph.memo.MEMO_SIZE_ONLY")
    p.add_argument("--models", default="t5", help="comma-separated zoo names")
    p.add_argument("--mode", choices=("forward", "train"), default="forward")
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads; above 1 the rounds are timed in wall time")
    a = p.parse_args(argv)
    run(a.switch, a.models.split(","), a.mode, a.rounds, a.threads)
    return 0
