"""Launching an emitted pypto kernel on torch tensors (the NPU's, or in pypto's simulator).

The kernel is the module :mod:`.emit` writes (the same source for ``RunMode.NPU``
and ``RunMode.SIM``). :class:`PyptoLauncher` is the shared launch step: it writes
the module to a real file (pypto re-reads its source), imports it, reshapes the
tile's input tensors to the kernel's shapes, allocates the outputs on the inputs'
device, calls the jit function and hands the outputs back in their graph shapes.
The simulator's worker (:mod:`.sim_worker`) launches every simulated kernel
through it, so this module imports only the standard library and torch: the
worker loads it by file path without importing the whole package.
"""
from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path
from typing import Callable

import torch


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
            if p.get("expand"):  # a broadcast the kernel's 2-D layout cannot express
                target = [int(d) for d in p["expand"]]
                x = x.reshape([1] * (len(target) - x.dim()) + list(x.shape)).expand(target)
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
    return math.prod(int(s) for s in shape)


def _default_device() -> torch.device:
    if hasattr(torch, "npu") and torch.npu.is_available():
        return torch.device("npu", torch.npu.current_device())
    return torch.device("cpu")
