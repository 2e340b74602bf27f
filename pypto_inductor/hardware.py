"""Hardware models: the numbers the capacity checks and the ROI model use.

Two models exist: Ascend A2 (pypto's default device, numbers from pypto's
``lib/configs/A2A3.ini``) and the host CPU (cache sizes read from sysfs).
"""
from __future__ import annotations

import dataclasses
import functools
import os
from pathlib import Path


@dataclasses.dataclass(frozen=True)
class HardwareModel:
    name: str
    # On-chip buffer a vector (elementwise/reduction) FusionTile must fit in.
    vector_capacity_bytes: int
    # On-chip buffer a cube (matmul) FusionTile must fit in.
    cube_capacity_bytes: int
    gm_bandwidth_bytes_per_s: float  # global memory (HBM / DRAM), read + write
    vector_flops_per_s: float
    cube_flops_per_s: float
    launch_us: float  # fixed cost of one kernel launch
    cores: int
    details: tuple[tuple[str, object], ...] = ()

    def with_capacity(self, capacity_bytes: int | None) -> "HardwareModel":
        if capacity_bytes is None:
            return self
        return dataclasses.replace(
            self, vector_capacity_bytes=capacity_bytes, cube_capacity_bytes=capacity_bytes
        )

    def to_dict(self) -> dict:
        return {
            "name": self.name,
            "capacity_bytes": self.vector_capacity_bytes,
            "cube_capacity_bytes": self.cube_capacity_bytes,
            "gm_bandwidth_GBps": round(self.gm_bandwidth_bytes_per_s / 1e9, 1),
            "launch_us": self.launch_us,
            "cores": self.cores,
            **{k: v for k, v in self.details},
        }


KiB = 1024
MiB = 1024 * KiB


def ascend_a2() -> HardwareModel:
    """Ascend 910B2 as pypto 0.2.0 models it (A2A3.ini): 24 cube and 48 vector cores."""
    freq = 1.85e9
    cube_cores, vector_cores = 24, 48
    return HardwareModel(
        name="ascend-a2",
        vector_capacity_bytes=192 * KiB,  # UB
        cube_capacity_bytes=512 * KiB,  # L1
        gm_bandwidth_bytes_per_s=1.6e12,
        # 2 flops x 16x16x16 MACs per cycle per cube core; vector: 128 B/cycle of fp32.
        cube_flops_per_s=cube_cores * 2 * 16**3 * freq,
        vector_flops_per_s=vector_cores * 64 * freq,
        launch_us=3.0,
        cores=vector_cores,
        details=(
            ("ub_bytes", 192 * KiB),
            ("l1_bytes", 512 * KiB),
            ("l0a_bytes", 64 * KiB),
            ("l0b_bytes", 64 * KiB),
            ("l0c_bytes", 128 * KiB),
            ("l2_bytes", 192 * MiB),
            ("freq_hz", freq),
            ("cube_cores", cube_cores),
            ("vector_cores", vector_cores),
        ),
    )


def _sysfs_cache_bytes(level: int, default: int) -> int:
    base = Path("/sys/devices/system/cpu/cpu0/cache")
    try:
        for index in base.glob("index*"):
            if (index / "level").read_text().strip() != str(level):
                continue
            if (index / "type").read_text().strip() == "Instruction":
                continue
            text = (index / "size").read_text().strip().upper()
            scale = {"K": KiB, "M": MiB}.get(text[-1], 1)
            return int(text.rstrip("KM")) * scale
    except (OSError, ValueError):
        pass
    return default


@functools.lru_cache(maxsize=None)
def host() -> HardwareModel:
    """The host CPU: a FusionTile's working set must stay within one core's L2."""
    l2 = _sysfs_cache_bytes(2, 1 * MiB)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return HardwareModel(
        name="host",
        vector_capacity_bytes=l2,
        cube_capacity_bytes=l2,
        gm_bandwidth_bytes_per_s=40e9,  # measured copy bandwidth on our 2-core machines
        vector_flops_per_s=cores * 16 * 2.5e9,
        cube_flops_per_s=cores * 32 * 2.5e9,
        launch_us=4.0,  # one Python-level kernel call
        cores=cores or 1,
        details=(("l1d_bytes", _sysfs_cache_bytes(1, 32 * KiB)), ("l2_bytes", l2),
                 ("l3_bytes", _sysfs_cache_bytes(3, 32 * MiB))),
    )


def get_hardware(name: str, capacity_bytes: int | None = None) -> HardwareModel:
    models = {"ascend-a2": ascend_a2, "host": host}
    return models[name]().with_capacity(capacity_bytes)
