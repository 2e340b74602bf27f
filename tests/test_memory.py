"""Peak memory: a fused pointwise chain holds one output above its inputs, eager two.

Measured as benchmarks/memory.py does (docs/memory.md): the peak resident set size
the call adds, reset through /proc/self/clear_refs, with glibc's mmap threshold
fixed so each buffer is its own mapping. It runs in a child process, as both
settings are process-wide.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

CHILD = textwrap.dedent("""
    import json, sys
    import torch
    from benchmarks.memory import fix_malloc, measurable, peak_bytes
    if not measurable():
        print("RESULT null"); sys.exit(0)
    assert fix_malloc()
    dynamic = sys.argv[1] == "1"
    fn = lambda x: torch.relu(x) * 2 + 1
    x = torch.randn(32 << 20)  # 128 MiB
    compiled = torch.compile(fn, backend="pypto", dynamic=dynamic,
                             options={"fallback": "error"})
    if dynamic:
        compiled(torch.randn(1000))  # compiled at another size
    torch.testing.assert_close(compiled(x), fn(x))
    pypto = min(peak_bytes(compiled, x)[0] for _ in range(3))
    eager = min(peak_bytes(fn, x)[0] for _ in range(3))
    print("RESULT " + json.dumps({"pypto": pypto, "eager": eager,
                                  "output": x.numel() * x.element_size()}))
""")


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
def test_fused_pointwise_chain_peaks_at_one_output(dynamic):
    env = {**os.environ, "PYPTO_INDUCTOR_NO_CALIBRATE": "1"}
    proc = subprocess.run([sys.executable, "-c", CHILD, "1" if dynamic else "0"], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=600)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    result = json.loads(lines[-1][len("RESULT "):])
    if result is None:
        pytest.skip("no /proc/self/clear_refs here: the peak RSS cannot be reset")
    out, slack = result["output"], 4 << 20
    # the measure sees eager's second buffer, so it would see a second one of pypto's
    assert result["eager"] >= 1.9 * out, result
    assert result["pypto"] <= out + slack, result


MODELS_CHILD = textwrap.dedent("""
    import json, sys
    from benchmarks.memory import cases, fix_malloc, measurable, measure
    if not measurable():
        print("RESULT null"); sys.exit(0)
    assert fix_malloc()
    rows = [measure(name, fn, inputs, training, 2, inductor=False)
            for name, fn, inputs, training in cases("small") if name in sys.argv[1:]]
    print("RESULT " + json.dumps(rows))
""")


def test_pool_and_peak_stay_within_eager_on_models():
    """A call's peak plus what the buffer pool holds between calls is at most eager's peak
    (the pool holds no more than the largest graph's live peak, shared by a training
    step's forward and backward graphs): the cases that were above it (docs/memory.md)."""
    env = {**os.environ, "PYPTO_INDUCTOR_NO_CALIBRATE": "1"}
    names = ["gpt_block", "transformer train step"]
    proc = subprocess.run([sys.executable, "-c", MODELS_CHILD, *names], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=1200)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    rows = json.loads(lines[-1][len("RESULT "):])
    if rows is None:
        pytest.skip("no /proc/self/clear_refs here: the peak RSS cannot be reset")
    assert [r["case"] for r in rows] == names
    for r in rows:
        assert r["pypto"] + r["pypto held"] <= r["eager"] * 1.02 + (512 << 10), r
