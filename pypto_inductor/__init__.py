"""pypto-inductor: a graph-level fusion optimizer for torch.compile (backend="pypto").

The backend is registered through the ``torch_dynamo_backends`` entry point, so
``torch.compile(model, backend="pypto")`` works without importing this package.
"""
from .api import report
from .backend import UnsupportedOpsError, pypto_backend
from .codegen import TargetUnavailable
from .config import Config, ConfigError, parse_options
from .report import FusionReport, GraphReport

__version__ = "0.1.0"

__all__ = [
    "Config", "ConfigError", "FusionReport", "GraphReport", "TargetUnavailable",
    "UnsupportedOpsError", "parse_options", "pypto_backend", "report",
]
