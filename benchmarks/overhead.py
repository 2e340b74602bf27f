"""``python -m benchmarks overhead``: what a compiled call costs beyond its kernels.

Two measurements (docs/runtime_overhead.md keeps the figures):

- ``region``: pypto's compiled region alone (the ``CompiledGraph`` call AOTAutograd
  makes, its arguments captured on the first call) on the transformer block and a BERT
  encoder, at the benchmark size and at a tiny size (one token / eight tokens) where
  the kernels' own work is next to nothing, so the time is the per-call overhead; the
  whole compiled calls (Dynamo's guards and AOTAutograd's wrappers included) of eager,
  Inductor and pypto beside it.
- ``chain``: ``x = x - x.mean(i % 2, keepdim=True)`` repeated on an 8x8 tensor, which
  neither backend fuses across the alternating reductions; the per-kernel cost is the
  slope of the whole call's time between 1 and 17 links over the kernels each backend
  generated (Inductor's ``generated_kernel_count``, pypto's FusionTiles).

Medians of interleaved rounds, in microseconds.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time
import types

import torch

from pypto_inductor import models, runtime
from pypto_inductor.report import collect

import benchmarks

from . import median_us


def _compile(fn, backend: str):
    """torch.compile of a call of ``fn`` through a code object of its own: Dynamo keeps
    compiled frames per code object, so a second backend compiling the same module or
    function would run the first one's (the pypto region was never captured)."""
    def call(*args):
        return fn(*args)
    code = call.__code__.replace(co_name=f"call_{backend}")
    return torch.compile(types.FunctionType(code, call.__globals__, code.co_name, None,
                                            call.__closure__), backend=backend)


def _capture(compiled, inputs):
    """(CompiledGraph's generated function, its args) of the first graph compiled for
    ``compiled(*inputs)``."""
    seen = []
    real = runtime.CompiledGraph.call  # the property the backend hands to AOTAutograd

    def spy(self):
        fn = real.fget(self)

        def first(args):
            # the boxed convention: the call empties its argument list, so each timed call
            # gets a fresh copy (a list copy, well under a microsecond)
            seen.append((lambda kept, fn=fn: fn(list(kept)), (list(args),)))
            return fn(args)
        return first

    runtime.CompiledGraph.call = property(spy)
    try:
        with collect() as graphs:
            compiled(*inputs)
    finally:
        runtime.CompiledGraph.call = real
    steps = {}
    for g in graphs:
        for step in g.compiled.program:
            steps[step[0]] = steps.get(step[0], 0) + 1
    return seen[0], steps


def _bert(hidden: int, layers: int, heads: int, ffn: int):
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    return BertModel(BertConfig(vocab_size=1000, hidden_size=hidden, num_hidden_layers=layers,
                                num_attention_heads=heads, intermediate_size=ffn,
                                hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)).eval()


def region_cases():
    block = models.TransformerBlock(256, 4, 1024).eval()
    yield "transformer_block 1x128", block, (torch.randn(1, 128, 256),)
    yield "transformer_block 1x1", block, (torch.randn(1, 1, 256),)
    bert = _bert(256, 2, 4, 1024)

    class Bert(torch.nn.Module):  # positional inputs; the mask pads the last 8 tokens
        def __init__(self):
            super().__init__()
            self.bert = bert

        def forward(self, ids, mask):
            return self.bert(input_ids=ids, attention_mask=mask).last_hidden_state

    def inputs(b, s):
        mask = torch.ones(b, s, dtype=torch.long)
        mask[-1, s - min(8, s // 2):] = 0
        return torch.randint(0, 1000, (b, s)), mask

    yield "bert 8x128", Bert(), inputs(8, 128)
    yield "bert 1x8", Bert(), inputs(1, 8)


def _rounds(fns: dict, repeats: int, rounds: int = 5) -> dict:
    """Medians over rounds; each round's figure is a median of at most ``repeats`` calls
    (fewer for slow calls: about 0.1 s each)."""
    times = {k: [] for k in fns}
    counts = {k: max(3, min(repeats, int(1e5 / max(median_us(f, args, 3), 1.0))))
              for k, (f, args) in fns.items()}
    for _ in range(rounds):
        for k, (f, args) in fns.items():
            times[k].append(median_us(f, args, counts[k]))
    return {k: statistics.median(v) for k, v in times.items()}


def region(repeats: int) -> list[list[str]]:
    # a graph_cache hit rebuilds the compiled call without CompiledGraph.call (no capture)
    os.environ["PYPTO_INDUCTOR_GRAPH_CACHE"] = "0"
    rows = []
    for name, model, inputs in region_cases():
        torch._dynamo.reset()
        with torch.no_grad():
            ind = _compile(model, "inductor")
            ind(*inputs)
            pi = _compile(model, "pypto")
            (graph, args), steps = _capture(pi, inputs)
            med = _rounds({"eager": (model, inputs), "inductor": (ind, inputs),
                           "pypto": (pi, inputs), "region": (graph, args)}, repeats)
        n = sum(steps.values())
        rows.append([name, f"{med['eager']:.0f}", f"{med['inductor']:.0f}",
                     f"{med['pypto']:.0f}", f"{med['region']:.0f}",
                     " ".join(f"{v} {k}" for k, v in sorted(steps.items())),
                     f"{med['region'] / n:.2f}"])
        print(" | ".join(rows[-1]), flush=True)
    return rows


REGION_COLUMNS = ["case", "eager us", "inductor us", "pypto us", "pypto region us", "steps",
                  "region us / step"]
CHAIN_COLUMNS = ["backend", "kernels (1 link)", "kernels (17 links)", "us (1 link)",
                 "us (17 links)", "us per kernel"]


def _chain(n: int):
    def f(x):
        for i in range(n):
            x = x - x.mean(i % 2, keepdim=True)
        return x
    return f


def chain(repeats: int) -> list[list[str]]:
    from torch._inductor import metrics

    x = torch.randn(8, 8)
    fns, kernels = {}, {}
    for n in (1, 17):
        torch._dynamo.reset()
        metrics.reset()
        fns["inductor", n] = (_compile(_chain(n), "inductor"), (x,))
        fns["inductor", n][0](x)
        kernels["inductor", n] = metrics.generated_kernel_count
        with collect() as graphs:
            fns["pypto", n] = (_compile(_chain(n), "pypto"), (x,))
            fns["pypto", n][0](x)
        kernels["pypto", n] = sum(len(g.plan.tiles) for g in graphs)
    med = _rounds(fns, repeats)
    rows = []
    for b in ("inductor", "pypto"):
        k1, k17 = kernels[b, 1], kernels[b, 17]
        rows.append([b, str(k1), str(k17), f"{med[b, 1]:.1f}", f"{med[b, 17]:.1f}",
                     f"{(med[b, 17] - med[b, 1]) / max(k17 - k1, 1):.2f}"])
        print(" | ".join(rows[-1]), flush=True)
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks overhead")
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--cpu-time", action="store_true",
                        help="time the calling thread's CPU time (1 thread only): robust to load")
    args = parser.parse_args(argv)
    if args.cpu_time:
        if args.threads != 1:
            parser.error("--cpu-time needs --threads 1")
        benchmarks.CLOCK = time.thread_time
    torch.set_num_threads(args.threads)
    print(f"# {args.threads} threads, medians of 5 interleaved rounds of {args.repeats} calls")
    print(" | ".join(REGION_COLUMNS))
    region(args.repeats)
    print(" | ".join(CHAIN_COLUMNS))
    chain(args.repeats)
    return 0
