"""The NPU target: FusionTiles as pypto kernels launched on an Ascend NPU.

Needs pypto, torch_npu and a visible NPU. Without them, asking for the target
raises TargetUnavailable naming what is missing.

The kernel is the module :mod:`.pypto_emit` writes (the same one pypto's
simulator runs, with ``RunMode.NPU``). :class:`PyptoLauncher` is the shared
launch step: it writes the module to a real file (pypto re-reads its source),
imports it, reshapes the tile's input tensors to the kernel's shapes, allocates
the outputs on the inputs' device, calls the jit function and hands the outputs
back in their graph shapes. The simulator worker (:mod:`.pypto_sim`) launches
every simulated kernel through it, so this module keeps its top-level imports
to the standard library and torch: the worker loads it by file path without
importing the whole package.
"""
from __future__ import annotations

import hashlib
import importlib.util
import os
import sys
from pathlib import Path
from typing import Callable

import torch


def missing_requirements() -> list[str]:
    missing = []
    if importlib.util.find_spec("pypto") is None:
        missing.append("pypto (pip install 'pypto-inductor[pypto]')")
    if importlib.util.find_spec("torch_npu") is None:
        missing.append("torch_npu (pip install 'pypto-inductor[npu]')")
    else:
        import torch_npu  # noqa: F401

        if not (hasattr(torch, "npu") and torch.npu.is_available()):
            missing.append("an Ascend NPU visible to torch_npu")
    return missing


def check_available() -> None:
    from . import TargetUnavailable

    missing = missing_requirements()
    if missing:
        raise TargetUnavailable(
            "target='npu' needs " + ", ".join(missing)
            + "; use target='cpu' (native) or 'reference' on this machine, or "
            "options={'simulate': True} in pypto_inductor.report to check NPU fusion with pypto's simulator"
        )


def kernel_dir() -> Path:
    """Where generated kernel modules live (pypto re-reads their source)."""
    # Not config.cache_dir: the simulator worker loads this file alone, outside the package.
    root = os.environ.get("PYPTO_INDUCTOR_CACHE_DIR") or Path.home() / ".cache" / "pypto_inductor"
    return Path(root) / "kernels"


def write_kernel_module(name: str, source: str, directory: str | Path) -> Path:
    """Write a kernel module as ``<directory>/<name>.py``."""
    path = Path(directory) / f"{name}.py"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(source)
    return path


def load_kernel_function(name: str, path: str | Path) -> Callable:
    """Import a written kernel module from its file; return its jit function ``name``."""
    mod_name = f"_pypto_inductor_kernel_{name}_{abs(hash(str(path))):x}"
    spec = importlib.util.spec_from_file_location(mod_name, str(path))
    module = importlib.util.module_from_spec(spec)
    sys.modules[mod_name] = module  # inspect.getsource needs the module registered
    spec.loader.exec_module(module)
    return getattr(module, name)


class PyptoLauncher:
    """Calls one emitted pypto kernel on torch tensors (NPU tensors, or CPU ones in SIM).

    ``kernel`` is ``PyptoKernel.to_json()``: its name, source and parameters
    (kernel shape, dtype, graph shape, input or output).
    """

    def __init__(self, kernel: dict, fn: Callable):
        self.name = kernel["name"]
        self.fn = fn
        params = kernel["params"]
        self.inputs = [p for p in params if not p["is_output"]]
        self.outputs = [p for p in params if p["is_output"]]

    @classmethod
    def load(cls, kernel: dict, directory: str | Path) -> "PyptoLauncher":
        """Write the kernel module into ``directory``, import it, and wrap its function."""
        path = write_kernel_module(kernel["name"], kernel["source"], directory)
        return cls(kernel, load_kernel_function(kernel["name"], path))

    def example_inputs(self, device: str | torch.device = "cpu") -> list[torch.Tensor]:
        """Zero tensors of every input's graph shape (the simulator computes no values)."""
        return [torch.zeros(p["graph_shape"], dtype=_dtype(p), device=device)
                for p in self.inputs]

    def __call__(self, inputs: list[torch.Tensor],
                 output_shapes: list | None = None) -> list[torch.Tensor]:
        """Run the kernel; outputs come back in ``output_shapes`` (default: the params' graph
        shapes, which a dynamic kernel's outputs only have at the example sizes)."""
        if len(inputs) != len(self.inputs):
            raise ValueError(f"kernel {self.name} takes {len(self.inputs)} inputs, "
                             f"got {len(inputs)}")
        args = []
        dyn: dict[str, int] = {}  # dynamic kernel dim -> its size in this call
        for x, p in zip(inputs, self.inputs):
            dims = p.get("dims") or p["shape"]
            static = _numel([d for d in dims if not isinstance(d, str)])
            names = [d for d in dims if isinstance(d, str)]
            if not names and x.numel() != static:
                raise ValueError(
                    f"kernel {self.name} was emitted for static shapes: input {p['value']} has "
                    f"{tuple(x.shape)}, the kernel expects {tuple(p['graph_shape'])}")
            if len(names) > 1:  # (R, C): the rows are the leading row_dims dims of x
                k = p.get("row_dims")
                if k is None or x.dim() != len(p["graph_shape"]):
                    raise ValueError(f"kernel {self.name}: input {p['value']} of shape "
                                     f"{tuple(x.shape)} does not fit the kernel dims {dims}")
                sizes = {names[0]: _numel(x.shape[:k]), names[1]: _numel(x.shape[k:])}
            elif names:
                n, rem = divmod(x.numel(), static)
                sizes = {names[0]: None if rem else n}
            else:
                sizes = {}
            for d, n in sizes.items():
                if n is None or dyn.get(d, n) != n:
                    raise ValueError(f"kernel {self.name}: input {p['value']} of shape "
                                     f"{tuple(x.shape)} does not fit the kernel dims {dims}")
                dyn[d] = n
            shape = [dyn[d] if isinstance(d, str) else d for d in dims]
            args.append(x.to(_dtype(p)).contiguous().reshape(shape))
        device = inputs[0].device if inputs else _default_device()
        outs = []
        for p in self.outputs:
            dims = p.get("dims") or p["shape"]
            if any(isinstance(d, str) and d not in dyn for d in dims):
                raise ValueError(f"kernel {self.name}: no input gives the size of {dims}")
            outs.append(torch.empty([dyn[d] if isinstance(d, str) else d for d in dims],
                                    dtype=_dtype(p), device=device))
        self.fn(*args, *outs)
        if output_shapes is None:
            output_shapes = [p["graph_shape"] if _numel(p["graph_shape"]) == o.numel()
                             else o.shape for o, p in zip(outs, self.outputs)]
        return [o.reshape(shape) for o, shape in zip(outs, output_shapes)]


def _dtype(param: dict) -> torch.dtype:
    return getattr(torch, param["dtype"])


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


def _default_device() -> torch.device:
    if hasattr(torch, "npu") and torch.npu.is_available():
        return torch.device("npu", torch.npu.current_device())
    return torch.device("cpu")


def build(tile, graph):
    """kernel(inputs, syms) -> outputs: the FusionTile as a pypto kernel on the NPU.

    A tile whose rows are a size expression gets a dynamic kernel (one source for
    every size); a static kernel called with other sizes raises. A tile with ops
    that have no pypto form is split there (:func:`.pypto_emit.split_tile`): those
    ops run eagerly between the pypto kernels of the rest.
    """
    check_available()
    from .pypto_emit import PyptoEmitError, split_tile

    try:
        return build_kernel(tile, graph)
    except PyptoEmitError:
        split = split_tile(tile, graph)
        if split is None or not split.parts:
            raise
        return build_split(split, graph, build_kernel)


def build_kernel(tile, graph):
    """kernel(inputs, syms) -> outputs for one pypto kernel (raises PyptoEmitError)."""
    from .pypto_emit import emit_tile

    kernel = emit_tile(tile, graph, run_mode="NPU")
    digest = hashlib.sha256(kernel.source.encode()).hexdigest()[:16]
    launcher = PyptoLauncher.load(kernel.to_json(), kernel_dir() / digest)
    if not kernel.dynamic:
        def run(inputs: list, syms: tuple) -> list:
            return launcher(inputs)
        return run
    from .sizes import size_function

    out_shapes = size_function(tuple(tuple(graph.specs[p.value].shape) for p in kernel.outputs),
                               graph.symbols)

    def run_dynamic(inputs: list, syms: tuple) -> list:
        return launcher(inputs, [list(s) for s in out_shapes(syms)])

    return run_dynamic


def build_split(split, graph, build_part: Callable) -> Callable:
    """kernel(inputs, syms) -> outputs of a split tile: ``build_part(part, graph)`` for
    each pypto part, the split ops one by one with torch (the reference executor)."""
    from .pypto_emit import single_op_tile
    from .reference import build_reference

    steps = []
    for kind, x in split.steps:
        if kind == "pypto":
            steps.append((list(x.inputs), list(x.outputs), build_part(x, graph)))
        else:
            one = single_op_tile(x, graph, split.tile.tile_shape)
            steps.append((list(one.inputs), list(one.outputs), build_reference(one, graph)))
    tile_inputs, tile_outputs = list(split.tile.inputs), list(split.tile.outputs)

    def run(inputs: list, syms: tuple) -> list:
        env = dict(zip(tile_inputs, inputs))
        for ins, outs, fn in steps:
            env.update(zip(outs, fn([env[a] for a in ins], syms)))
        return [env[o] for o in tile_outputs]

    run.split_ops = [op.op for op in split.split_ops]
    return run
