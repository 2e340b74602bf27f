"""``python -m benchmarks.memory``: peak memory of eager, Inductor and pypto, side by side.

Measure: the kernel's peak resident set size of this process (``VmHWM``),
reset through ``/proc/self/clear_refs`` just before a call, minus the resident
size just before it: the memory a call adds on top of its inputs and
parameters, exact to the page and with no sampling. glibc's mmap threshold is
fixed at 64 KiB first (``mallopt``), so every tensor buffer of 64 KiB or more is
a mapping of its own, given back to the kernel when freed: a call cannot hide
its peak in heap memory an earlier case freed. torch 2.13 keeps no allocator
statistics for CPU tensors, and its profiler's memory events missed allocations
when tried here (docs/memory.md). Each figure is the smallest of ``--repeats``
calls after two warm-up calls (noise only adds). ``pypto held`` is what pypto's
buffer pools keep between calls (``keep_buffers``), which the in-call peak does
not see; the total adds it. ``pypto no pool`` is pypto with ``keep_buffers=False``.

Cases: the fused pointwise chain ``relu(x) * 2 + 1`` (eager holds two outputs at
its peak, a fused kernel one), the test zoo (pypto_inductor/models.py) at input
sizes whose activations dwarf page-level noise, the demo's gpt_block, and training
steps (forward + backward) of the transformer and LLaMA blocks.
"""
from __future__ import annotations

import argparse
import ctypes
import gc
import os
import re
import sys
import time

import torch

from pypto_inductor import models
from pypto_inductor.report import collect

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
MMAP_THRESHOLD = 64 << 10
MB = 1 << 20


def fix_malloc() -> bool:
    """Every allocation of 64 KiB or more its own mmap, freed memory returned at once."""
    try:
        libc = ctypes.CDLL(None)
        return bool(libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)
                    and libc.mallopt(M_TRIM_THRESHOLD, 0))
    except (OSError, AttributeError):
        return False


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return int(re.search(rf"^{field}:\s+(\d+) kB", f.read(), re.M).group(1))


def peak_bytes(fn, *args) -> tuple[int, object]:
    """(resident bytes the call ``fn(*args)`` added at its peak, its result)."""
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the peak RSS to the current RSS
    before = _status_kib("VmRSS")
    out = fn(*args)
    return (_status_kib("VmHWM") - before) * 1024, out


def measurable() -> bool:
    try:
        peak_bytes(lambda: None)
        return True
    except OSError:
        return False


def nbytes(tree) -> int:
    if isinstance(tree, torch.Tensor):
        return tree.numel() * tree.element_size()
    if isinstance(tree, (tuple, list)):
        return sum(nbytes(t) for t in tree)
    return 0


def pool_bytes(graphs) -> int:
    """Bytes pypto's buffer pool holds between calls (one pool serves every graph)."""
    pools = {id(p): p for g in graphs
             if (p := getattr(getattr(g, "compiled", None), "pool", None)) is not None}
    return sum(p.held for p in pools.values())


def cases(scale: str):
    """(name, model or fn, inputs, training)."""
    k = 4 if scale == "full" else 1
    yield "relu(x)*2+1 fp32", lambda x: torch.relu(x) * 2 + 1, (torch.randn(k * 16 << 20),), False
    sizes = {"mlp": (torch.randn(k * 16384, 64),),
             "transformer": (torch.randn(k * 8, 256, 64),),
             "llama": (torch.randn(k * 8, 256, 64),),
             "conv_bn_relu": (torch.randn(k * 32, 3, 64, 64),),
             "ln_gelu_residual": (torch.randn(k * 32, 256, 256),),
             "gpt_block": (torch.randn(k, 256, 512),)}
    for name, inputs in sizes.items():
        model, _ = models.build(name)
        yield name, model, inputs, False
    for name in ("transformer", "llama"):
        model, _ = models.build(name)
        yield f"{name} train step", model.train(), sizes[name], True


def _train_step(model):
    def step(x):
        model.zero_grad(set_to_none=True)
        model(x).square().mean().backward()
    return step


def measure(name, fn, inputs, training: bool, repeats: int, inductor: bool) -> dict:
    """Peak bytes per backend (and pypto's pool) for one case."""
    import copy

    backends = {"eager": lambda m: m}
    if inductor:
        backends["inductor"] = lambda m: torch.compile(m)
    backends["pypto"] = lambda m: torch.compile(m, backend="pypto")
    backends["pypto no pool"] = lambda m: torch.compile(m, backend="pypto",
                                                        options={"keep_buffers": False})
    row = {"case": name, "inputs": nbytes(inputs)}
    for label, make in backends.items():
        torch._dynamo.reset()
        model = copy.deepcopy(fn) if isinstance(fn, torch.nn.Module) else fn
        with collect() as graphs:
            compiled = make(model)
            call = _train_step(compiled) if training else compiled
            with torch.set_grad_enabled(training):
                for _ in range(2):
                    out = call(*inputs)
                del out
                peaks = []
                for _ in range(repeats):
                    peak, out = peak_bytes(call, *inputs)
                    peaks.append(peak)
                    row.setdefault("output", nbytes(out))
                    del out
        row[label] = min(peaks)
        if label == "pypto":
            row["pypto held"] = pool_bytes(graphs)
        del compiled, call, model
        gc.collect()
    torch._dynamo.reset()
    return row


def table(rows, inductor: bool) -> list[str]:
    cols = ["case", "inputs MB", "output MB", "eager MB"] + (["inductor MB"] if inductor else []) \
        + ["pypto MB", "pypto held MB", "pypto total / eager", "pypto no pool MB"]
    out = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        cells = [r["case"], f"{r['inputs'] / MB:.1f}", f"{r['output'] / MB:.1f}",
                 f"{r['eager'] / MB:.1f}"]
        if inductor:
            cells.append(f"{r['inductor'] / MB:.1f}")
        total = r["pypto"] + r["pypto held"]
        cells += [f"{r['pypto'] / MB:.1f}", f"{r['pypto held'] / MB:.1f}",
                  f"{total / max(r['eager'], 1):.2f}", f"{r['pypto no pool'] / MB:.1f}"]
        out.append("| " + " | ".join(cells) + " |")
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.memory", description=__doc__)
    p.add_argument("--scale", choices=["small", "full"], default="small")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--no-inductor", action="store_true")
    p.add_argument("--only", default="", help="comma-separated case names")
    p.add_argument("--markdown", default="", help="also write the table to this file")
    args = p.parse_args(argv)
    os.environ.setdefault("PYPTO_INDUCTOR_NO_CALIBRATE", "1")  # no timing is involved
    if not measurable():
        print("needs Linux's /proc/self/clear_refs (peak RSS reset)", file=sys.stderr)
        return 1
    fixed = fix_malloc()
    only = {c for c in args.only.split(",") if c}
    inductor = not args.no_inductor
    rows = []
    for name, fn, inputs, training in cases(args.scale):
        if only and name not in only:
            continue
        rows.append(measure(name, fn, inputs, training, args.repeats, inductor))
        print("\n".join(table(rows[-1:], inductor)[2:]), flush=True)
    title = (f"{time.strftime('%Y-%m-%d')} torch {torch.__version__}, "
             f"{torch.get_num_threads()} threads, scale={args.scale}, "
             f"malloc mmap threshold {'fixed at 64 KiB' if fixed else 'NOT fixed'}: "
             "peak MB a call adds to resident memory (min of "
             f"{args.repeats})")
    lines = [title, "", *table(rows, inductor)]
    worse = [f"{r['case']} ({(r['pypto'] + r['pypto held']) / r['eager']:.2f}x)" for r in rows
             if r["pypto"] + r["pypto held"] > r["eager"] * 1.02 + MB // 2]
    lines += ["", "pypto (in-call peak + pool) above eager: "
              + (", ".join(worse) if worse else "none")]
    worse = [r["case"] for r in rows if r["pypto no pool"] > r["eager"] * 1.02 + MB // 2]
    lines += ["pypto with keep_buffers=False above eager: "
              + (", ".join(worse) if worse else "none")]
    print("\n".join(lines))
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
