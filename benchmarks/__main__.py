"""``python -m benchmarks``: eager, Inductor and pypto side by side in one process.

Each case is compiled cold (fresh Inductor and pypto cache directories, Dynamo
reset, in-process kernel caches cleared; the first call's wall time), checked
against eager, then timed: medians over repeats, interleaved (eager, inductor,
pypto, eager, ...) so machine noise hits all three alike; ratios are what to
read, not absolute times. Then each case is compiled again warm (Dynamo reset
and in-process caches cleared, on-disk caches kept). Memory-bound cases also
print achieved GB/s (the minimum traffic: inputs, parameters and outputs read
or written once) against a measured torch copy bandwidth. The summary line is
the geometric mean of Inductor time / pypto time over all cases. A last table
times training steps (forward + backward) of the two blocks (``training.py``).

``--markdown PATH`` also writes the table (with date, machine and command).
``python -m benchmarks zoo [--models ..] [--modes ..] [--threads ..]`` runs the
transformers zoo instead (forward, decode step, training step: ``zoo.py``);
``python -m benchmarks compile_time`` cold compile and warm start times per zoo model;
``python -m benchmarks overhead`` the per-call and per-kernel overhead (``overhead.py``);
``python -m benchmarks ab MODULE.ATTR --models ..`` one switch off and on (``ab.py``);
``python -m benchmarks.rope`` RoPE and RoPE into the KV cache cat, cat parts fused or not.
"""
from __future__ import annotations

import argparse
import contextlib
import math
import os
import shutil
import statistics
import sys
import tempfile
import time

import torch
import torch.nn.functional as F
from torch import nn

from pypto_inductor import calibrate, models
from pypto_inductor.codegen.cpp import compiler as cpp_build

from . import md_table, median_us, training


class LinearGeluLinear(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


class RMSNormSiluGate(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.norm = models.RMSNorm(dim)
        with torch.no_grad():
            self.norm.weight.normal_()

    def forward(self, x, gate):
        return self.norm(x) * F.silu(gate)


def cases(scale: str):
    """(name, fn, inputs, tolerance, memory-bound)."""
    big = scale == "full"
    rows = 8192 if big else 1024
    ln = models.LayerNormGeluResidual(1024)
    yield "ln_gelu_residual", ln, (torch.randn(rows, 1024),), 1e-4, True

    def chain(x, b, s):
        return torch.relu(x * s + b) * torch.sigmoid(x) - x / (1 + s)

    yield "elementwise_broadcast", chain, (torch.randn(rows, 1024), torch.randn(1024),
                                           torch.randn(rows, 1)), 1e-4, True

    def masked_softmax(x, mask):
        return torch.softmax((x * 0.125).masked_fill(mask, float("-inf")), dim=-1)

    s = 256
    yield "masked_softmax", masked_softmax, (torch.randn(8 if big else 2, 8, s, s),
                                             torch.ones(s, s, dtype=torch.bool).triu(1)), \
        1e-4, True
    rms = RMSNormSiluGate(1024)
    yield "rmsnorm_silu_gate", rms, (torch.randn(rows, 1024), torch.randn(rows, 1024)), \
        1e-4, True
    mlp = LinearGeluLinear(512, 2048)
    yield "linear_gelu_linear", mlp, (torch.randn(2048 if big else 256, 512),), 1e-3, False
    block = models.TransformerBlock(256, 4, 1024).eval()
    yield "transformer_block", block, (torch.randn(4 if big else 1, 128, 256),), 1e-3, False
    llama = models.LlamaBlock(256, 4, 688).eval()
    yield "llama_block", llama, (torch.randn(4 if big else 1, 128, 256),), 1e-3, False
    yield "ln_gelu_residual_bf16", ln.to(torch.bfloat16), (
        torch.randn(rows, 1024, dtype=torch.bfloat16),), 5e-2, True


def _min_bytes(fn, inputs, out) -> int:
    n = sum(t.numel() * t.element_size() for t in inputs)
    if isinstance(fn, nn.Module):
        n += sum(p.numel() * p.element_size() for p in fn.parameters())
        n += sum(b.numel() * b.element_size() for b in fn.buffers())
    outs = out if isinstance(out, (tuple, list)) else (out,)
    return n + sum(t.numel() * t.element_size() for t in outs)


@contextlib.contextmanager
def _env(name: str, value: str):
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old


def _clear_in_process_caches() -> None:
    torch._dynamo.reset()
    from torch._inductor.utils import clear_caches

    clear_caches()
    cpp_build.loaded.clear()  # loaded pypto kernel libraries


def _first_call_s(make, inputs, cache_env: str, cache_dir: str):
    """(compiled fn, seconds of its first call) with the given cache directory."""
    with _env(cache_env, cache_dir):
        compiled = make()
        start = time.perf_counter()
        compiled(*inputs)
        return compiled, time.perf_counter() - start


def _copy_bandwidth() -> float:
    """The copy bandwidth as the kernels' times are taken: a median (the host model's
    calibration takes the fastest copy instead)."""
    return calibrate.measure_bandwidth(stat=statistics.median)


MIN_TILE_BYTES = 1 << 20  # smaller tiles are call-overhead bound whatever the roofline says


def _memory_bound_tiles(name, fn, inputs, target: str, repeats: int) -> list[dict]:
    """Every FusionTile the roofline calls memory-bound, timed by the runtime's profiler
    (median over ``repeats`` calls, output allocation included) as the report gives it,
    with the copy bandwidth measured just before and after (``copy_bw``: their mean), as
    this shared machine's bandwidth drifts by a third within a run."""
    from pypto_inductor.report import collect

    torch._dynamo.reset()
    with collect() as graphs:
        f = torch.compile(fn, backend="pypto", options={"target": target, "profile": True})
        f(*inputs)
    before = _copy_bandwidth()
    for _ in range(repeats):
        f(*inputs)
    copy_bw = statistics.fmean([before, _copy_bandwidth()])
    rows = []
    for g in graphs:
        for t in g.to_dict()["fusion_tiles"]:
            if t["bound"] == "memory" and t["gm_bytes"] >= MIN_TILE_BYTES and "measured_us" in t:
                rows.append({"case": name, "copy_bw": copy_bw, **t})
    torch._dynamo.reset()
    return rows


def machine() -> str:
    return f"{calibrate.cpu_model()}, {os.cpu_count()} cores"


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] in (["zoo"], ["--zoo"]):  # the transformers zoo (long: benchmarks/zoo.py)
        from . import zoo

        return zoo.main(argv[1:])
    if argv[:1] == ["compile_time"]:  # cold compile, warm start (benchmarks/compile_time.py)
        from . import compile_time

        return compile_time.main(argv[1:])
    if argv[:1] == ["ab"]:  # one switch off and on against Inductor (benchmarks/ab.py)
        from . import ab

        return ab.main(argv[1:])
    if argv[:1] == ["overhead"]:  # per-call and per-kernel overhead (benchmarks/overhead.py)
        from . import overhead

        return overhead.main(argv[1:])
    parser = argparse.ArgumentParser(prog="python -m benchmarks")
    parser.add_argument("--scale", choices=["small", "full"], default="small")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--target", default="cpu", help="pypto target (cpu, reference, ...)")
    parser.add_argument("--no-inductor", action="store_true")
    parser.add_argument("--only", default="", help="comma-separated case names")
    parser.add_argument("--markdown", default="", help="also write the table to this file")
    args = parser.parse_args(argv)
    torch.set_num_threads(2)
    hw = calibrate.host_model()  # calibration (once per machine) before any timing
    copy_bw = _copy_bandwidth()
    title = (f"{time.strftime('%Y-%m-%d')} torch {torch.__version__} on {machine()}, "
             f"{torch.get_num_threads()} threads, scale={args.scale}, repeats={args.repeats}")
    print(f"# {title}")
    print(f"# copy bandwidth {copy_bw / 1e9:.1f} GB/s (now); host model "
          f"{hw.gm_bandwidth_bytes_per_s / 1e9:.1f} GB/s, {hw.launch_us:.1f} us per kernel call "
          f"({dict(hw.details).get('source')})")
    cols = ["case", "eager us", "inductor us", "pypto us", "eager/pypto", "inductor/pypto",
            "pypto GB/s", "inductor GB/s", "pypto % copy", "ind cold s", "ind warm s",
            "pypto cold s", "pypto warm s"]
    print(" | ".join(cols))
    rows, ratios, tile_rows = [], [], []
    only = {c for c in args.only.split(",") if c}
    tmp_root = tempfile.mkdtemp(prefix="pypto_bench_")
    try:
        for name, fn, inputs, tol, memory_bound in cases(args.scale):
            if only and name not in only:
                continue
            ind_dir = tempfile.mkdtemp(prefix=f"{name}_inductor_", dir=tmp_root)
            pi_dir = tempfile.mkdtemp(prefix=f"{name}_pypto_", dir=tmp_root)
            makers = {}
            if not args.no_inductor:
                makers["inductor"] = (lambda: torch.compile(fn, backend="inductor"),
                                      "TORCHINDUCTOR_CACHE_DIR", ind_dir)
            makers["pypto"] = (lambda: torch.compile(fn, backend="pypto",
                                                     options={"target": args.target}),
                               "PYPTO_INDUCTOR_CACHE_DIR", pi_dir)
            compile_s: dict = {}
            backends = {"eager": fn}
            with torch.no_grad():
                expected = fn(*inputs)
                _clear_in_process_caches()
                for label, (make, env, d) in makers.items():
                    backends[label], compile_s[label, "cold"] = _first_call_s(make, inputs, env, d)
                for label, f in backends.items():
                    torch.testing.assert_close(f(*inputs), expected, rtol=tol, atol=tol)
                times = {label: [] for label in backends}
                for _ in range(3):  # interleave rounds so noise hits every backend alike
                    for label, f in backends.items():
                        times[label].append(median_us(f, inputs, args.repeats))
                _clear_in_process_caches()
                for label, (make, env, d) in makers.items():
                    _, compile_s[label, "warm"] = _first_call_s(make, inputs, env, d)
                with _env("PYPTO_INDUCTOR_CACHE_DIR", pi_dir):
                    tile_rows += _memory_bound_tiles(name, fn, inputs, args.target, args.repeats)
                _clear_in_process_caches()
            med = {label: statistics.median(t) for label, t in times.items()}
            ind = med.get("inductor", float("nan"))
            if not math.isnan(ind):
                ratios.append(ind / med["pypto"])
            nbytes = _min_bytes(fn, inputs, expected)
            gbs = {k: nbytes / (v * 1e-6) / 1e9 for k, v in med.items()}
            row = [name, f"{med['eager']:.1f}", f"{ind:.1f}", f"{med['pypto']:.1f}",
                   f"{med['eager'] / med['pypto']:.2f}", f"{ind / med['pypto']:.2f}",
                   f"{gbs['pypto']:.1f}" if memory_bound else "-",
                   f"{gbs.get('inductor', float('nan')):.1f}" if memory_bound else "-",
                   f"{100 * gbs['pypto'] * 1e9 / copy_bw:.0f}%" if memory_bound else "-",
                   *(f"{compile_s.get((b, w), float('nan')):.2f}"
                     for b in ("inductor", "pypto") for w in ("cold", "warm"))]
            rows.append(row)
            print(" | ".join(row), flush=True)
    finally:
        shutil.rmtree(tmp_root, ignore_errors=True)
    geo = math.exp(statistics.fmean(math.log(r) for r in ratios)) if ratios else float("nan")
    print(f"# geometric mean speedup of pypto over Inductor (inductor us / pypto us): {geo:.2f}"
          f" over {len(ratios)} cases")
    tile_cols = ["case", "FusionTile ops", "GM MB", "measured us", "GB/s", "copy GB/s",
                 "% copy"]
    tile_table = [[r["case"], " ".join(r["op_kinds"]), f"{r['gm_bytes'] / 1e6:.1f}",
                   f"{r['measured_us']:.1f}", f"{r['measured_GBps']:.1f}",
                   f"{r['copy_bw'] / 1e9:.1f}",
                   f"{100 * r['measured_GBps'] * 1e9 / r['copy_bw']:.0f}%"] for r in tile_rows]
    print("# memory-bound FusionTiles (roofline), profiled in the runtime")
    print(" | ".join(tile_cols))
    for r in tile_table:
        print(" | ".join(r))
    train_rows = training.run(args.scale, args.repeats, args.target, not args.no_inductor,
                              only)
    if train_rows:
        print("# training steps (forward + backward)")
        print(" | ".join(training.COLUMNS))
        for r in train_rows:
            print(" | ".join(r), flush=True)
    if args.markdown:
        command = "python -m benchmarks " + " ".join(argv)
        lines = [
            "# Benchmarks: eager vs Inductor vs pypto (cpu target)", "",
            f"{title}.", "",
            f"Machine: {machine()} (`lscpu` model name; {torch.get_num_threads()} torch "
            f"threads). Measured copy bandwidth at the start of the run: "
            f"{copy_bw / 1e9:.1f} GB/s; host model: {hw.gm_bandwidth_bytes_per_s / 1e9:.1f} "
            f"GB/s and {hw.launch_us:.1f} us per kernel call "
            f"({dict(hw.details).get('source')}).", "",
            f"Command: `{command}` (from the repository root, venv python).", "",
            "Times are medians (us) of interleaved rounds; ratios > 1 mean pypto is faster. "
            "GB/s counts the minimum traffic (inputs, parameters, outputs once) for "
            "memory-bound cases; `% copy` is pypto's GB/s over the copy bandwidth. Compile "
            "times are the first call's wall time (s): cold with fresh "
            "`TORCHINDUCTOR_CACHE_DIR` / `PYPTO_INDUCTOR_CACHE_DIR` directories, warm with "
            "the same directories after `torch._dynamo.reset()` and in-process caches "
            "cleared (Inductor's `clear_caches()`, pypto's loaded-library table). The host "
            "calibration (once per machine) ran before timing.", "",
            *md_table(cols, rows), "",
            f"Geometric mean speedup of pypto over Inductor (Inductor time / pypto time): "
            f"**{geo:.2f}** over {len(ratios)} cases.", "",
            "## Memory-bound FusionTiles", "",
            "Every FusionTile of the cases whose roofline time is set by memory traffic "
            f"(report field `bound`, GM traffic >= {MIN_TILE_BYTES >> 20} MiB), timed by the "
            "runtime's profiler (`options={\"profile\": True}`, median over the repeats, "
            "output allocation included). GB/s is the tile's GM bytes (inputs read once, "
            "outputs written once) over its time; `% copy` is against `copy GB/s`, the "
            "mean of the copy bandwidth measured just before and just after that case's "
            "profiled calls (the same measurement as above; it drifts by a third within a "
            "run on this shared machine).", "",
            *md_table(tile_cols, tile_table), "",
            "## Training steps", "",
            "One step of each block: `zero_grad`, `model(x).square().mean().backward()`, "
            "eager, Inductor and pypto each on its own copy of the model, every gradient "
            "checked against eager's, then timed as above. These are not in the geometric "
            "mean (it covers the inference suite). `reference tiles` counts pypto's "
            "FusionTiles (forward and backward graphs) that do not run natively.", "",
            *md_table(training.COLUMNS, train_rows), "",
        ]
        with open(args.markdown, "w") as f:
            f.write("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
