"""``torch.compile(fn, backend="pypto", fullgraph=True).aot_compile(example_inputs)``.

torch's ahead-of-time compile saves a compiled function to a file and loads it in a new
process without Dynamo's trace (about 0.9 s of a zoo model's warm first call,
docs/benchmarks.md). It asks the backend for a callable it can serialize
(``SerializableCallable``); the backend knows it is asked from torch's functorch config
(:func:`requested`). For an inference graph we save its FusionPlan, pickled as graph_cache
stores it, with the options: loading rebuilds the CompiledGraph from it (kernels from the
kernel cache, compiled on a miss), as a graph_cache hit does, with no AOTAutograd at all.
Such graphs are those graph_cache can store (its docstring: static shapes, fresh outputs).
A training graph (training_cache.py's conditions) is saved as torch saves Inductor's: the
AOTAutograd entry holding our forward and backward GraphOutputCodes (:func:`saved_training`).
Any other graph gets :class:`PrecompileError` naming why.
"""
from __future__ import annotations

import contextlib

import torch
from torch._dynamo.aot_compile_types import SerializableCallable

from . import graph_cache
from .codegen import get_target
from .config import Config
from .runtime import CompiledGraph


class PrecompileError(RuntimeError):
    """aot_compile asked to save a graph pypto cannot save."""


def requested() -> bool:
    """Whether the backend runs inside aot_compile, which turns AOTAutograd's bundled cache
    on (off by default) and needs a result it can serialize."""
    return bool(torch._functorch.config.bundled_autograd_cache)


@contextlib.contextmanager
def autograd_cache_unbundled():
    """AOTAutograd's bundled cache (which aot_compile turns on) holds Inductor's OutputCode
    only: our compilers' graphs go around it."""
    with torch._functorch.config.patch(bundled_autograd_cache=False,
                                       force_autograd_cache=False,
                                       strict_autograd_cache=False):
        yield


class PrecompiledGraph(SerializableCallable):
    """One inference graph's plan and options, and the CompiledGraph built from them,
    called as AOTAutograd's inference wrapper calls it (graph_cache.inference_call)."""

    def __init__(self, plan, config: Config, compiled: CompiledGraph | None = None):
        self.plan, self.config = plan, config
        self._run = graph_cache.inference_call(
            compiled or CompiledGraph(plan, get_target(config.target), config))

    def __call__(self, *args):
        return self._run(*args)

    @classmethod
    def serialize_compile_artifacts(cls, fn: "PrecompiledGraph") -> bytes:
        return graph_cache.dumps((fn.plan, fn.config))

    @classmethod
    def deserialize_compile_artifacts(cls, data: bytes) -> "PrecompiledGraph":
        plan, config = graph_cache.loads(data)
        return cls(plan, config)


def saved_graph(record: dict | None, config: Config) -> PrecompiledGraph:
    """The saveable form of the graph just compiled (``record`` as compile_graph filled it)."""
    if record is None or "plan" not in record:
        raise PrecompileError(
            "pypto can save (aot_compile) graphs with static shapes, no constants or modules "
            "on the graph, and, for inference, outputs that are fresh tensors: compile "
            "without dynamic shapes, autocast or a debug_dir. Other graphs: use "
            "torch.compile(..., backend='pypto') without aot_compile.")
    return PrecompiledGraph(record["plan"], config, record["compiled"])


def saved_training(compiled, built: list):
    """AOTAutograd's result for a training graph (``built``: its GraphOutputCodes), which
    aot_compile wraps and serializes as it does Inductor's."""
    eager = [b for b in built if not b.native]
    if eager or getattr(compiled, "serialize", None) is None:
        raise PrecompileError(
            f"{len(eager)} of the training graph's {len(built)} ATen graphs run eagerly "
            "(see the warnings above), so it cannot be saved: use torch.compile(..., "
            "backend='pypto') without aot_compile.")
    return compiled
