"""Hardware models: the numbers the capacity checks and the ROI model use.

Two models exist (:data:`HARDWARE`, by name): Ascend A2 (pypto's default device,
numbers from pypto's ``lib/configs/A2A3.ini``) and the host CPU (cache sizes read
from sysfs; bandwidth, call cost and compute rate measured once per machine by
:mod:`.calibrate` and passed in by the backend). This module imports nothing of
the package: every other layer may use it.
"""
from __future__ import annotations

import configparser
import dataclasses
import functools
import importlib.util
import os
from pathlib import Path
from typing import Any, Mapping


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
    # --- vector tile preferences (fusion/capacity.py plan_tile); the defaults are
    # the host's behaviour: every live buffer counted, any tile shape.
    # "all_live": footprint = buffering x every live tile buffer of the FusionTile;
    # "per_op": the largest working set of one op (its operand and result tiles in
    # the compute dtype, floats as fp32), as pypto places UB buffers op by op and
    # reuses them (it pipelines itself: no buffering factor).
    footprint_model: str = "all_live"
    # The largest single tile buffer (compute dtype) as a fraction of the vector
    # capacity; None: no limit beyond the footprint.
    max_tile_buffer_fraction: float | None = None
    # Pointwise tiles: at most this many columns (None: the whole last dim, up to 4096).
    preferred_max_tile_cols: int | None = None
    # Pointwise tiles narrower than the row keep cols a multiple of this many bytes.
    tile_col_align_bytes: int = 0
    # Pointwise tiles: halve the columns (down to the alignment) to keep at least
    # this many rows where the domain has them.
    min_tile_rows: int = 1
    # ROI model: elements of a kernel's iteration domain per second (a pass over the
    # domain costs at least numel / rate, whatever its bytes); None: no such term.
    vector_elems_per_s: float | None = None
    # ROI model: fixed cost of each op inside a kernel (instruction issue and pipe
    # synchronisation per tile), added to the launch; 0 on the host.
    op_us: float = 0.0
    # ROI model: fixed cost of a kernel that mixes cube and vector work (a matmul
    # with an epilogue; on A2 they run on separate cores and synchronise); 0 on the host.
    cube_epilogue_us: float = 0.0
    # ROI model: whether memory traffic hides behind compute (the roofline's max) or
    # adds to it. On the host a streaming kernel's time is close to the sum
    # (docs/benchmarks.md).
    memory_overlaps_compute: bool = True
    # Fuse when roi_score reaches this (unless options say otherwise): 1.2 on ascend-a2
    # (how often the fitted model agrees with pypto's simulator:
    # docs/ascend_calibration.md), 1.1 on the host (how close the calibrated model's
    # kernel times are: docs/runtime_overhead.md; a report with profile=True).
    default_roi_threshold: float = 1.2
    # ROI model: a matmul kernel's epilogue re-reads the GEMM result from memory (the
    # host's BLAS writes it, then one native pass runs the epilogue), so fusing an
    # epilogue into a matmul saves a launch but no traffic; on Ascend the epilogue
    # reads the cube's output on chip.
    matmul_epilogue_reads_gm: bool = False
    # ROI model: the matmul's first epilogue op, a bias add, runs inside the GEMM (the
    # host's BLAS adds it as addmm/baddbmm do), so it costs no pass of its own.
    matmul_bias_in_gemm: bool = False
    # Planner: a cat may join a kernel with its consumers (the host's kernels read each
    # part over its columns; pypto 0.2.0 has no cat, so Ascend keeps it apart).
    cat_in_kernels: bool = False
    # Planner: a row kernel (a reduction over the last dim of [rows, C]) may also sum
    # columns over its rows (bias / norm-weight gradients), one pass over the data
    # (the host's row emitter keeps per-run column partials; pypto has no such tile).
    column_sums_in_row_kernels: bool = False

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
            "vector_GFLOPs": round(self.vector_flops_per_s / 1e9, 1),
            "launch_us": self.launch_us,
            "cores": self.cores,
            **{k: v for k, v in self.details},
        }


KiB = 1024
MiB = 1024 * KiB


@functools.lru_cache(maxsize=None)
def pypto_a2a3_ini() -> dict[str, dict[str, str]]:
    """Sections of pypto's lib/configs/A2A3.ini when pypto is installed, else {}.

    Found through the package's location, without importing pypto (which loads
    its native libraries).
    """
    try:
        spec = importlib.util.find_spec("pypto")
    except (ImportError, ValueError):
        return {}
    if spec is None or not spec.submodule_search_locations:
        return {}
    for location in spec.submodule_search_locations:
        path = Path(location) / "lib" / "configs" / "A2A3.ini"
        if path.is_file():
            parser = configparser.ConfigParser(strict=False, interpolation=None)
            try:
                parser.read(path)
            except (configparser.Error, OSError, UnicodeDecodeError):
                return {}
            return {name: dict(parser[name]) for name in parser.sections()}
    return {}


def _ini_int(ini: dict, section: str, key: str, default: int) -> int:
    try:
        return int(ini[section][key])
    except (KeyError, ValueError):
        return default


def ascend_a2() -> HardwareModel:
    """Ascend 910B2 as pypto 0.2.0 models it (A2A3.ini): 24 cube and 48 vector cores.

    The numbers are read from pypto's ``lib/configs/A2A3.ini`` when pypto is
    installed; the built-in copies below are the fallback.
    """
    ini = pypto_a2a3_ini()
    soc = lambda key, default: _ini_int(ini, "SoCInfo", key, default)  # noqa: E731
    core = lambda key, default: _ini_int(ini, "AICoreSpec", key, default)  # noqa: E731
    rate = lambda key, default: _ini_int(ini, "AICoreMemoryRates", key, default)  # noqa: E731
    freq = core("cube_freq", 1850) * 1e6
    cube_cores, vector_cores = soc("cube_core_cnt", 24), soc("vector_core_cnt", 48)
    ub, l1 = core("ub_size", 192 * KiB), core("l1_size", 512 * KiB)
    cube_m, cube_n, cube_k = core("cube_m_size", 16), core("cube_n_size", 16), core("cube_k_size", 16)
    vec_bytes = core("vec_calc_size", 128)  # bytes per cycle of one vector instruction
    return HardwareModel(
        name="ascend-a2",
        vector_capacity_bytes=ub,  # UB
        cube_capacity_bytes=l1,  # L1
        # Fitted to pypto 0.2.0's simulator on work cycles (task span + an empty kernel's
        # cost, not the quantized "Total Cycles"): a coordinate search on squared log
        # errors of roi_score vs simulated speedup and of every kernel's time, then on
        # the fuse-or-not decisions, over the calibration set incl. real-model tiles:
        # docs/ascend_calibration.md, `python -m benchmarks.calibrate_ascend`, which
        # also lists the numbers before fitting: peak rates, no per-op, epilogue or
        # element term). Simulated matmuls run far below the cube peak.
        launch_us=4.64,
        op_us=0.292,
        cube_epilogue_us=3.34,
        gm_bandwidth_bytes_per_s=3.73e11,
        vector_flops_per_s=5.71e11,
        vector_elems_per_s=4.60e10,
        cube_flops_per_s=6.75e12,
        cores=vector_cores,
        # pypto-friendly vector tiles (docs/ascend_calibration.md): pypto places UB
        # buffers op by op and fails to place one above about a third of UB (64x256
        # fp32 compiles, 128x256 does not); 64x256 simulates faster than 4x1024.
        footprint_model="per_op",
        max_tile_buffer_fraction=1 / 3,
        preferred_max_tile_cols=256,
        tile_col_align_bytes=32,  # the UB block
        min_tile_rows=8,
        details=(
            ("ub_bytes", ub),
            ("l1_bytes", l1),
            ("l0a_bytes", core("l0_a_size", 64 * KiB)),
            ("l0b_bytes", core("l0_b_size", 64 * KiB)),
            ("l0c_bytes", core("l0_c_size", 128 * KiB)),
            ("l2_bytes", soc("l2_size", 192 * MiB)),
            ("freq_hz", freq),
            # peaks of the units (2 flops x 16x16x16 MACs per cycle per cube core;
            # 128 B/cycle of fp32 per vector core); the ROI model uses the fitted rates
            ("peak_cube_flops_per_s", cube_cores * 2 * cube_m * cube_n * cube_k * freq),
            ("peak_vector_flops_per_s", vector_cores * (vec_bytes // 2) * freq),
            ("cube_cores", cube_cores),
            ("vector_cores", vector_cores),
            ("l1_to_l0a_bytes_per_cycle", rate("l1_to_l0_a_rate", 512)),
            ("l1_to_l0b_bytes_per_cycle", rate("l1_to_l0_b_rate", 256)),
            ("l1_to_ub_bytes_per_cycle", rate("l1_to_ub_rate", 128)),
            ("l0c_to_ub_bytes_per_cycle", rate("l0_c_to_ub_rate", 256)),
            ("ub_to_l2_bytes_per_cycle", rate("ub_to_l2_rate", 64)),
            ("ub_to_ddr_bytes_per_cycle", rate("ub_to_ddr_rate", 64)),
            ("ub_to_l1_bytes_per_cycle", rate("ub_to_l1_rate", 128)),
            ("source", "pypto A2A3.ini" if ini else "built-in"),
        ),
    )


def cache_bytes(level: int, default: int) -> int:
    """Size of this CPU's level-``level`` data cache (sysfs), or ``default``."""
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


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity mask), at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


@functools.lru_cache(maxsize=None)
def _host_caches() -> tuple[int, int, int]:
    """(L1d, L2, L3) bytes of this CPU."""
    return cache_bytes(1, 32 * KiB), cache_bytes(2, 1 * MiB), cache_bytes(3, 32 * MiB)


def host(calibration: Mapping[str, Any] | None = None) -> HardwareModel:
    """The host CPU: a FusionTile's working set must stay within one core's L2.

    ``calibration``: this machine's measured bandwidth, per-kernel call cost and vector
    compute rate (:func:`calibrate.host_numbers`, passed down by the backend); without
    it the built-in defaults below.
    """
    l1d, l2, l3 = _host_caches()
    cores = usable_cpus()
    bandwidth = 40e9  # default: measured copy bandwidth on our 2-core machines
    launch_us = 4.0  # default: one Python-level kernel call
    # default: 8-lane AVX2 FMA (2 flops) on 2 ports per core at ~2.5 GHz
    flops = cores * 32 * 2.5e9
    source = "built-in"
    if calibration:
        bandwidth = float(calibration.get("gm_bandwidth_bytes_per_s") or bandwidth)
        launch_us = float(calibration.get("launch_us") or launch_us)
        flops = float(calibration.get("vector_flops_per_s") or flops)
        source = f"calibrated {calibration.get('measured_at', '')}".strip()
    return HardwareModel(
        name="host",
        vector_capacity_bytes=l2,
        cube_capacity_bytes=l2,
        gm_bandwidth_bytes_per_s=bandwidth,
        vector_flops_per_s=flops,
        cube_flops_per_s=cores * 32 * 2.5e9,  # GEMMs run on BLAS at near FMA peak
        launch_us=launch_us,
        cores=cores,
        memory_overlaps_compute=False,
        default_roi_threshold=1.1,
        matmul_epilogue_reads_gm=True,
        matmul_bias_in_gemm=True,
        cat_in_kernels=True,
        column_sums_in_row_kernels=True,
        details=(("l1d_bytes", l1d), ("l2_bytes", l2), ("l3_bytes", l3), ("source", source)),
    )


# The hardware models by name (the ``hardware`` option's values).
HARDWARE = {"ascend-a2": ascend_a2, "host": host}


def get_hardware(name: str, capacity_bytes: int | None = None) -> HardwareModel:
    """The model named ``name`` with its built-in numbers (the host's calibrated one:
    ``calibrate.hardware_model``)."""
    return HARDWARE[name]().with_capacity(capacity_bytes)
