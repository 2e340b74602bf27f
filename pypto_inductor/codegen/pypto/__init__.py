"""The pypto target ("npu"): FusionTiles as pypto kernels launched on an Ascend NPU.

Needs pypto, torch_npu and a visible NPU. Without them, asking for the target
raises TargetUnavailable naming what is missing. The same kernels run in
pypto's simulator for the report (:mod:`.sim`, any x86-64 Linux machine).

- :mod:`.emit`: FusionTile -> pypto kernel module (the emitter's entry points;
  :mod:`.kernel`, :mod:`.layout`, :mod:`.tiling`, :mod:`.rows`, :mod:`.columns`,
  :mod:`.writer`, :mod:`.ops`, :mod:`.split` behind it);
- :mod:`.launcher`: writes a kernel module to a real file (pypto re-reads its
  source), imports it and calls it on torch tensors; loadable alone, by path,
  by the simulator's worker (:mod:`.sim_worker`);
- :mod:`.sim`: simulated cycles of a plan's tiles, fused and one kernel per op.
"""
from __future__ import annotations

import hashlib
import importlib.util
from typing import Callable

import torch

from ...config import cache_dir
from ...ir import FusionTile, TileGraph
from ...sizes import size_function
from .. import Kernel, TargetUnavailable, build_each, reference
from .emit import PyptoEmitError, TileSplit, emit_tile, single_op_tile, split_tile
from .launcher import PyptoLauncher


DEVICES = None  # NPU tensors, or CPU ones in the simulator: the launcher takes either


def missing_requirements() -> list[str]:
    missing = []
    if importlib.util.find_spec("pypto") is None:
        missing.append("pypto (pip install 'pypto-inductor[pypto]')")
    if importlib.util.find_spec("torch_npu") is None:
        missing.append("torch_npu (pip install 'pypto-inductor[npu]')")
    else:
        import torch_npu  # noqa: F401  (an optional dependency: registers torch.npu)

        if not (hasattr(torch, "npu") and torch.npu.is_available()):
            missing.append("an Ascend NPU visible to torch_npu")
    return missing


def check_available() -> None:
    missing = missing_requirements()
    if missing:
        raise TargetUnavailable(
            "target='npu' needs " + ", ".join(missing)
            + "; use target='cpu' (native) or 'reference' on this machine, or "
            "options={'simulate': True} in pypto_inductor.report to check NPU fusion with pypto's simulator"
        )


def build(tile: FusionTile, graph: TileGraph) -> Kernel:
    """The FusionTile as a pypto kernel on the NPU.

    A tile whose rows are a size expression gets a dynamic kernel (one source for
    every size); a static kernel called with other sizes raises. A tile with ops
    that have no pypto form is split there (:func:`.emit.split_tile`): those
    ops run eagerly between the pypto kernels of the rest.
    """
    check_available()
    try:
        return build_kernel(tile, graph)
    except PyptoEmitError:
        split = split_tile(tile, graph)
        if split is None or not split.parts:
            raise
        return build_split(split, graph, build_kernel)


def build_many(tiles: list[FusionTile], graph: TileGraph) -> list:
    return build_each(build, tiles, graph)


def build_kernel(tile: FusionTile, graph: TileGraph) -> Kernel:
    """The kernel of one pypto kernel module (raises PyptoEmitError); at the tile shape the
    tiling cache holds for it, when an autotuning run stored one."""
    from .autotune import cached_tile

    kernel = emit_tile(cached_tile(tile, graph), graph, run_mode="NPU")
    digest = hashlib.sha256(kernel.source.encode()).hexdigest()[:16]
    # the module lives in the cache, where pypto re-reads its source
    launcher = PyptoLauncher.load(kernel.to_json(), cache_dir("kernels", digest))
    if not kernel.dynamic:
        def run(inputs: list, syms: tuple) -> list:
            return launcher(inputs)
        return Kernel(run)
    out_shapes = size_function(tuple(tuple(graph.specs[p.value].shape) for p in kernel.outputs),
                               graph.symbols)

    def run_dynamic(inputs: list, syms: tuple) -> list:
        return launcher(inputs, [list(s) for s in out_shapes(syms)])

    return Kernel(run_dynamic)


def build_split(split: TileSplit, graph: TileGraph,
                build_part: Callable[[FusionTile, TileGraph], Kernel]) -> Kernel:
    """The kernel of a split tile: ``build_part(part, graph)`` for each pypto part, the
    split ops one by one with torch (the reference executor)."""
    steps = []
    for kind, x in split.steps:
        if kind == "pypto":
            steps.append((list(x.inputs), list(x.outputs), build_part(x, graph).fn))
        else:
            one = single_op_tile(x, graph, split.tile.tile_shape)
            steps.append((list(one.inputs), list(one.outputs), reference.build(one, graph).fn))
    tile_inputs, tile_outputs = list(split.tile.inputs), list(split.tile.outputs)

    def run(inputs: list, syms: tuple) -> list:
        env = dict(zip(tile_inputs, inputs))
        for ins, outs, fn in steps:
            env.update(zip(outs, fn([env[a] for a in ins], syms)))
        return [env[o] for o in tile_outputs]

    return Kernel(run, split_ops=[op.op for op in split.split_ops])
