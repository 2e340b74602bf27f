"""The NPU target: FusionTiles as pypto kernels launched on an Ascend NPU.

Needs pypto, torch_npu and a visible NPU. Without them, asking for the target
raises TargetUnavailable naming what is missing.
"""
from __future__ import annotations

import importlib.util


def missing_requirements() -> list[str]:
    missing = []
    if importlib.util.find_spec("pypto") is None:
        missing.append("pypto (pip install 'pypto-inductor[pypto]')")
    if importlib.util.find_spec("torch_npu") is None:
        missing.append("torch_npu (pip install 'pypto-inductor[npu]')")
    else:
        import torch
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


def build(tile, graph):  # pragma: no cover - needs NPU hardware
    raise NotImplementedError("pypto kernel emission for the NPU target is not implemented yet")
