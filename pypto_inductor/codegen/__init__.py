"""Codegen targets: each turns a FusionTile into a kernel callable.

A target module provides ``build(tile, graph) -> kernel`` where
``kernel(inputs: list[Tensor], syms: tuple[int, ...]) -> list[Tensor]`` takes
the tile's input values and the graph's size-symbol values, and returns its
output values. A target may also provide ``build_many(tiles, graph) -> list``, the
kernels of all FusionTiles of one graph at once (each entry a kernel or the exception
its build raised), to batch and parallelise slow builds; the runtime uses it when
present and ``build`` otherwise. Adding a target is adding a module here and a line in
TARGETS.
"""
from __future__ import annotations

import importlib
from types import ModuleType

TARGETS = {
    "reference": "pypto_inductor.codegen.reference",
    "cpu": "pypto_inductor.codegen.cpp",  # native C++ kernels
    "npu": "pypto_inductor.codegen.npu",
}


class TargetUnavailable(RuntimeError):
    """The requested target cannot run on this machine; the message says what is missing."""


def get_target(name: str) -> ModuleType:
    module = importlib.import_module(TARGETS[name])
    check = getattr(module, "check_available", None)
    if check is not None:
        check()
    return module
