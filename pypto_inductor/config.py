"""Backend options: parsing and validation.

Every option of ``torch.compile(..., backend="pypto", options={...})`` and of
``pypto_inductor.report(..., options={...})`` is a field of :class:`Config`.
Bad keys and values raise :class:`ConfigError` naming the key and what is valid.
"""
from __future__ import annotations

import dataclasses
import math
import os
from pathlib import Path
from typing import Any, Mapping

import torch

from .hardware import HARDWARE

# The codegen targets: name -> the module defining it (see codegen.Target; imported on
# first use by codegen.get_target, so an unused target's dependencies are never loaded).
TARGETS = {
    "cpu": "pypto_inductor.codegen.cpp",  # native C++ kernels
    "npu": "pypto_inductor.codegen.pypto",  # pypto kernels on an Ascend NPU
    "reference": "pypto_inductor.codegen.reference",  # tile ops run one by one with torch
}
DTYPE_POLICIES = ("upcast", "strict")
FALLBACK_MODES = ("eager", "error")


def cache_dir(*parts: str) -> Path:
    """The on-disk cache (kernels, simulations, calibration): ``$PYPTO_INDUCTOR_CACHE_DIR``,
    default ``~/.cache/pypto_inductor``; ``parts`` name a subfolder."""
    root = os.environ.get("PYPTO_INDUCTOR_CACHE_DIR") or Path.home() / ".cache" / "pypto_inductor"
    return Path(root, *parts)


def _env_strict() -> bool:
    return os.environ.get("PYPTO_INDUCTOR_STRICT", "") not in ("", "0")


class ConfigError(ValueError):
    """An option passed to the pypto backend is unknown or has a bad value."""


@dataclasses.dataclass(frozen=True)
class Config:
    target: str = "cpu"
    hardware: str | None = None  # None: follows the target (npu -> ascend-a2, else host)
    capacity_bytes: int | None = None  # overrides the hardware model's on-chip capacity
    roi_threshold: float | None = None  # None: the hardware model's default_roi_threshold
    fusion: bool = True
    fuse_attention: bool = True  # attention chains -> one SDPA call (lowering/attention.py)
    dtype_policy: str = "upcast"
    fallback_ops: tuple[str, ...] = ()
    fallback: str = "eager"
    report_path: str | None = None
    debug_dir: str | None = None
    buffering: int = 2  # double buffering: each live tile buffer is allocated twice
    profile: bool = False
    simulate: bool = False
    verify: bool = False  # with simulate: each pypto kernel's values checked in pypto's interpreter
    # verify, and pypto's interpreter re-runs each kernel after its compiler passes: per-pass
    # verdicts per tile (slower: one interpreter run per checked pass); implies verify
    verify_passes: bool = False
    autotune: bool = False  # with simulate: tile shapes tuned in pypto's simulator (tiling cache)
    autotune_seconds: float = 120.0  # bound on the tuning time of one graph's tiles
    keep_buffers: bool = True  # native kernel outputs dying inside the graph serve its next call
    # an unexpected exception while compiling a graph is raised instead of running the graph
    # eagerly with a warning; default from $PYPTO_INDUCTOR_STRICT (the tests and fuzzer set it)
    strict: bool = dataclasses.field(default_factory=lambda: _env_strict())

    def __post_init__(self):  # a Config built directly gets the numeric checks too
        for key in ("capacity_bytes", "roi_threshold", "buffering", "autotune_seconds"):
            value = getattr(self, key)
            if value is not None and not (isinstance(value, (int, float)) and
                                          not isinstance(value, bool) and math.isfinite(value)):
                raise ConfigError(f"option {key!r} must be a finite number, got {value!r}")
        if self.verify_passes and not self.verify:  # per-pass verdicts are a value check too
            object.__setattr__(self, "verify", True)

    @property
    def hardware_name(self) -> str:
        if self.hardware is not None:
            return self.hardware
        return ("ascend-a2" if self.target == "npu" or self.simulate or self.verify
                or self.autotune else "host")

    @property
    def raise_compile_errors(self) -> bool:
        """An unexpected exception while compiling a graph reaches the caller (strict, or
        fallback='error') instead of the graph running eagerly with a warning."""
        return self.strict or self.fallback == "error"

    def forced_fallback(self, op_name: str) -> bool:
        """True when ``op_name`` (e.g. "aten.gelu.default") is listed in fallback_ops.

        "aten.gelu" matches every overload of gelu; "aten.gelu.default" only that one.
        """
        packet = op_name.rsplit(".", 1)[0]
        return op_name in self.fallback_ops or packet in self.fallback_ops


def _choice(key: str, value: Any, valid: tuple[str, ...]) -> str:
    if value not in valid:
        raise ConfigError(f"option {key!r} must be one of {list(valid)}, got {value!r}")
    return value


def _check_type(key: str, value: Any, types: tuple[type, ...], what: str) -> Any:
    if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
        raise ConfigError(f"option {key!r} must be {what}, got {value!r}")
    return value


def _number(key: str, value: Any, types: tuple[type, ...], what: str) -> Any:
    """A finite number of ``types`` (bools are not numbers here): NaN or inf would pass
    every comparison the planner makes (NaN > x is False), quietly changing its decisions."""
    _check_type(key, value, types, what)
    if not math.isfinite(value):
        raise ConfigError(f"option {key!r} must be {what}, got {value!r} (not finite)")
    return value


def _normalise_op_name(key: str, name: Any) -> str:
    if not isinstance(name, str):
        name = str(name)  # accept torch.ops.aten.gelu.default itself
    parts = name.split(".")
    if parts[0] != "aten" or len(parts) not in (2, 3):
        raise ConfigError(
            f"option {key!r}: op names look like 'aten.gelu' or 'aten.gelu.default', got {name!r}"
        )
    packet = getattr(torch.ops.aten, parts[1], None)
    if packet is None or (len(parts) == 3 and parts[2] not in packet.overloads()):
        raise ConfigError(f"option {key!r}: {name!r} is not an ATen operator or overload")
    return name


# torch.compile's mode= names. None changes what pypto does: CUDA graphs ("reduce-overhead")
# do not exist on the CPU, and our kernels are tuned when built ("max-autotune"; the
# simulator's tile tuning is the `autotune` option). Accepted so that switching a
# torch.compile call's backend to "pypto" keeps working.
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


def check_mode(mode: str | None) -> None:
    """Validate ``torch.compile(..., mode=...)`` (it reaches the backend as a keyword)."""
    if mode is not None:
        _choice("mode", mode, COMPILE_MODES)


def parse_options(options: Mapping[str, Any] | Config | None) -> Config:
    """Turn a user's options dict into a validated :class:`Config`."""
    if options is None:
        return Config()
    if isinstance(options, Config):
        return options
    if not isinstance(options, Mapping):
        raise ConfigError(f"options must be a dict, got {type(options).__name__}")
    fields = {f.name for f in dataclasses.fields(Config)}
    unknown = sorted(set(options) - fields)
    if unknown:
        raise ConfigError(
            f"unknown option(s) {unknown}; valid options are {sorted(fields)}"
        )
    kw: dict[str, Any] = {}
    for key, value in options.items():
        if key == "target":
            kw[key] = _choice(key, value, tuple(TARGETS))
        elif key == "hardware":
            kw[key] = None if value is None else _choice(key, value, tuple(HARDWARE))
        elif key == "dtype_policy":
            kw[key] = _choice(key, value, DTYPE_POLICIES)
        elif key == "fallback":
            kw[key] = _choice(key, value, FALLBACK_MODES)
        elif key == "capacity_bytes":
            if value is not None:
                _number(key, value, (int,), "a positive int (bytes)")
                if value <= 0:
                    raise ConfigError(f"option 'capacity_bytes' must be > 0, got {value}")
            kw[key] = value
        elif key == "roi_threshold":
            if value is not None:
                value = float(_number(key, value, (int, float), "a number (e.g. 1.2)"))
                if value <= 0:
                    raise ConfigError(f"option 'roi_threshold' must be > 0, got {value}")
            kw[key] = value
        elif key == "buffering":
            _number(key, value, (int,), "1, 2 or 3")
            if value not in (1, 2, 3):
                raise ConfigError(f"option 'buffering' must be 1, 2 or 3, got {value}")
            kw[key] = value
        elif key == "autotune_seconds":
            value = float(_number(key, value, (int, float), "a number of seconds"))
            if value <= 0:
                raise ConfigError(f"option 'autotune_seconds' must be > 0, got {value}")
            kw[key] = value
        elif key in ("fusion", "fuse_attention", "profile", "simulate", "verify", "verify_passes",
                     "keep_buffers", "autotune", "strict"):
            kw[key] = _check_type(key, value, (bool,), "True or False")
        elif key == "fallback_ops":
            if isinstance(value, str) or not hasattr(value, "__iter__"):
                value = [value]
            kw[key] = tuple(_normalise_op_name(key, v) for v in value)
        elif key in ("report_path", "debug_dir"):
            if value is not None:
                value = str(_check_type(key, value, (str, os.PathLike), "a path"))
            kw[key] = value
    return Config(**kw)

