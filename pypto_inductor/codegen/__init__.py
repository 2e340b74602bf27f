"""Codegen targets: each turns a FusionTile into a :class:`Kernel`.

A target is a module satisfying :class:`Target`: ``DEVICES`` names the device
types its kernels run on (None: any); ``check_available()`` raises
:class:`TargetUnavailable` naming what the machine lacks; ``build(tile, graph)``
returns the tile's :class:`Kernel`; ``build_many(tiles, graph)`` returns the kernels
of all FusionTiles of one graph at once (each entry a Kernel or the exception its
build raised), so slow builds can be batched and run in parallel (the runtime always
calls it). ``config.TARGETS`` names every target and the module defining it; a
target's module is imported on first use, so the NPU's optional dependencies are
never imported for the other targets.

- ``reference`` (:mod:`.reference`): each tile's ops run one by one with torch; the
  oracle of what every tile op means;
- ``cpu`` (:mod:`.cpp`): native C++ kernels, compiled and cached on disk;
- ``npu`` (:mod:`.pypto`): pypto kernels on an Ascend NPU; the same kernels run in
  pypto's simulator for the report.
"""
from __future__ import annotations

import dataclasses
import importlib
from typing import Any, Callable, Protocol

from ..config import TARGETS
from ..ir import FusionTile, TileGraph

__all__ = ["Kernel", "Target", "TargetUnavailable", "TARGETS", "build_each", "get_target"]


class TargetUnavailable(RuntimeError):
    """The requested target cannot run on this machine; the message says what is missing."""


@dataclasses.dataclass(eq=False)
class Kernel:
    """A FusionTile's compiled kernel: ``fn(inputs, syms) -> outputs``.

    ``fn`` takes the tile's input tensors (in ``tile.inputs`` order) and the values of
    the graph's size symbols, and returns the tile's outputs. The runtime calls ``fn``
    itself (calling the record adds a Python frame, a noticeable part of a small
    kernel's cost).
    """

    fn: Callable[..., list]
    # Whether the target's native code runs the tile (cpu: False when the tile is
    # outside the native slice and runs the reference executor); None: the target
    # does not say.
    native: bool | None = None
    # why the tile is not native; for a native tile, a choice of how it runs (the report)
    reason: str | None = None
    takes_allocator: bool = False  # fn(inputs, syms, empty=...): outputs from the runtime's pool
    program: Any = None  # cpu: the analysed kernel program (None for a bare GEMM)
    # cpu: what the graph's generated code needs to call the kernel inline (launcher.Launch)
    launch: Any = None
    split_ops: list[str] = dataclasses.field(default_factory=list)  # npu: ops run eagerly

    def __call__(self, inputs: list, syms: tuple, **kwargs) -> list:
        return self.fn(inputs, syms, **kwargs)


class Target(Protocol):
    """What a codegen target module provides."""

    # The device types its kernels run on; None: any device torch computes on (not
    # ``meta``, which has no data). Graphs on other devices run eagerly (runtime.py).
    DEVICES: tuple[str, ...] | None

    def check_available(self) -> None:
        """Raise :class:`TargetUnavailable` when the target cannot run here."""

    def build(self, tile: FusionTile, graph: TileGraph) -> Kernel:
        """The tile's kernel (raises when it cannot be built)."""

    def build_many(self, tiles: list[FusionTile], graph: TileGraph) -> list:
        """Every tile's Kernel, or the exception its build raised."""

    # Optional: ``native_extern(step, graph)`` -> (callable, why) to run an ExternOp with
    # instead of its ATen kernel, (None, why not), or None (no native kernel for the op);
    # runtime.CompiledGraph._bind_extern asks it (cpu: SDPA's flash forward and backward).


def build_each(build: Callable[[FusionTile, TileGraph], Kernel], tiles: list[FusionTile],
               graph: TileGraph) -> list:
    """``build_many`` of a target that builds tiles one at a time."""
    out: list = []
    for tile in tiles:
        try:
            out.append(build(tile, graph))
        except Exception as e:  # noqa: BLE001 - reported per tile by the runtime
            out.append(e)
    return out


def get_target(name: str) -> Target:
    """The target named ``name`` (a key of ``config.TARGETS``), checked to be usable here."""
    target: Target = importlib.import_module(TARGETS[name])
    target.check_available()
    return target
