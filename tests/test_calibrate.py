"""Calibrated host model: measured once, cached on disk per machine, off with an env var."""
from __future__ import annotations

import json
import warnings

import pytest
import torch

from pypto_inductor import calibrate


@pytest.fixture
def fresh(tmp_path, monkeypatch):
    monkeypatch.setenv("PYPTO_INDUCTOR_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv(calibrate.ENV_OFF, raising=False)
    calibrate.host_model.cache_clear()
    yield tmp_path
    calibrate.host_model.cache_clear()


def test_host_uses_cached_calibration(fresh, monkeypatch):
    hw = calibrate.host_model()
    data = json.loads((fresh / "host_calibration.json").read_text())
    entry = data[calibrate.machine_key()]
    assert hw.gm_bandwidth_bytes_per_s == entry["gm_bandwidth_bytes_per_s"] > 1e8
    assert hw.launch_us == entry["launch_us"] > 0
    # the native exp's rate, well below the FMA peak the built-in default assumes
    assert 1e8 < hw.vector_flops_per_s == entry["vector_flops_per_s"] < hw.cube_flops_per_s
    assert dict(hw.details)["source"].startswith("calibrated")
    # second use: read from disk, nothing measured again
    calibrate.host_model.cache_clear()
    monkeypatch.setattr(calibrate, "measure", lambda: pytest.fail("measured twice"))
    assert calibrate.host_model().launch_us == entry["launch_us"]


def test_other_machine_entry_is_kept_and_corrupt_file_remeasured(fresh):
    (fresh / "host_calibration.json").write_text("{not json")
    calibrate.host_numbers()
    path = fresh / "host_calibration.json"
    data = json.loads(path.read_text())
    data["v1|other cpu|64 cores"] = {"gm_bandwidth_bytes_per_s": 1.0, "launch_us": 1.0}
    path.write_text(json.dumps(data))
    assert calibrate.host_numbers() == data[calibrate.machine_key()]
    assert not list(fresh.glob("*.tmp"))


def test_no_calibrate_keeps_defaults(fresh, monkeypatch):
    monkeypatch.setenv(calibrate.ENV_OFF, "1")
    monkeypatch.setattr(calibrate, "measure", lambda: pytest.fail("measured"))
    hw = calibrate.host_model()
    assert hw.gm_bandwidth_bytes_per_s == 40e9 and hw.launch_us == 4.0
    assert not (fresh / "host_calibration.json").exists()


def test_first_use_inside_compilation(fresh):
    """host() first runs inside the backend (fake tensors active): still real measurements."""
    fn = lambda x: torch.sigmoid(x) * 2.0  # noqa: E731
    x = torch.randn(8, 16)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = torch.compile(fn, backend="pypto", options={"target": "cpu"})(x)
    torch.testing.assert_close(out, fn(x))
    entry = json.loads((fresh / "host_calibration.json").read_text())[calibrate.machine_key()]
    assert entry["gm_bandwidth_bytes_per_s"] > 1e8 and entry["launch_us"] > 0
