"""``python -m benchmarks compile_time``: cold compile and warm start, pypto vs Inductor.

Per zoo model and backend, each in a fresh Python process, the first call of a step:
``--mode forward`` (default) the forward at 4 x 128 tokens of benchmarks/zoo.py under
``no_grad``; ``--mode train`` the first training step of benchmarks/zoo.py's ``train``
workload (``model.train()``, ``model(**batch)["loss"].backward()``, labels included: a
forward and a backward graph compile). Per step:

- ``cold``: empty cache directories (``PYPTO_INDUCTOR_CACHE_DIR``,
  ``TORCHINDUCTOR_CACHE_DIR``): the first call's wall time, and the CPU time it used in
  the process and the compiler processes it waited for (``cpu``).
- ``warm``: a new process on the caches the cold run filled: the first call's wall time
  (Dynamo's trace and the backend's work, kernels loaded from disk) and ``start``, the
  time from the process's start to that first result (imports and model build included).

``--mode aot``: the forward through torch's ahead-of-time compile
(``torch.compile(run, fullgraph=True).aot_compile(...)``, saved to a file): ``cold`` compiles
and saves it, ``warm`` is a new process loading the file and making the first call (no
Dynamo trace). Guards Dynamo cannot serialize (object identity: the loading process builds
its own model) are left out, and the function returns the output's first tensor (Dynamo's
rebuild of a transformers ModelOutput needs globals a new process lacks).
``--mode aot-train``: the same for the training step (the saved function returns the loss;
the step calls its backward).

``--backends`` may add ``eager`` (Dynamo's trace, the graphs run as traced, no compiler):
its warm first call is the floor of any backend's warm start through ``torch.compile``
(column ``dynamo alone warm cpu s``); what a backend adds is its warm CPU minus that.

Inductor runs with ``TORCHINDUCTOR_COMPILE_THREADS=1`` so its C++ compiles are children
this process waits for (counted in ``cpu``) rather than a worker pool's. The issue-16
targets: pypto's cold compile at most half of Inductor's, its warm start at most 1 s.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time

import torch

DEFAULT_MODELS = "gpt2,bert,llama,distilbert"
MODES = ("forward", "train", "aot", "aot-train")
TINY = "tiny-mlp"  # not a zoo model: a two-layer MLP with a loss, for the tests
COLUMNS = ["model", "pypto cold s", "pypto cold cpu s", "inductor cold s",
           "inductor cold cpu s", "pypto/inductor cold", "pypto/inductor cold cpu",
           "pypto warm first call s", "pypto warm cpu s", "pypto warm start s",
           "inductor warm first call s", "inductor warm cpu s", "inductor warm start s",
           "dynamo alone warm cpu s"]


def _cpu_s() -> float:
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(
        resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


class TinyMLP(torch.nn.Module):  # at module level: aot_compile saves a guard on its type
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(16, 32), torch.nn.Linear(32, 4)

    def forward(self, x, labels=None):
        logits = self.fc2(torch.relu(self.fc1(x)))
        loss = None if labels is None else torch.nn.functional.cross_entropy(logits, labels)
        return {"logits": logits, "loss": loss}


def _tiny_mlp():
    torch.manual_seed(0)
    return TinyMLP(), {"x": torch.randn(8, 16), "labels": torch.randint(0, 4, (8,))}


def model_and_batch(name: str, mode: str):
    """(model, keyword batch) for ``name``: as benchmarks/zoo.py's forward or train."""
    import transformers

    from pypto_inductor import zoo

    from . import zoo as bench_zoo

    transformers.logging.set_verbosity_error()
    if name == TINY:
        model, kw = _tiny_mlp()
    else:
        model, kw = bench_zoo.build(name), bench_zoo.batch(name)
    if mode == "train":
        return model.train(), kw
    if name == TINY or zoo.ZOO[name].kind != "seq2seq":  # as zoo.py's forward: no labels
        kw.pop("labels", None)
    return model.eval(), kw


def child(name: str, backend: str, started: float, mode: str = "forward") -> dict:
    """Build ``name``, run its compiled step (``mode``) once; times of that first call."""
    import contextlib

    torch.set_num_threads(1)
    train = mode in ("train", "aot-train")
    model, kw = model_and_batch(name, "train" if train else "forward")
    f = None if mode.startswith("aot") else torch.compile(model, backend=backend)

    def step():
        if mode == "train":
            f(**kw)["loss"].backward()
        elif mode.startswith("aot"):
            _aot_step(model, kw, backend, train)
        else:
            f(**kw)

    with contextlib.nullcontext() if train else torch.no_grad():
        cpu, start = _cpu_s(), time.perf_counter()
        step()
        first = time.perf_counter() - start
        cpu = _cpu_s() - cpu
    return {"first_s": first, "cpu_s": cpu, "start_s": time.time() - started}


def _first_tensor(model, kw):
    out = model(**kw)
    return out.to_tuple()[0] if hasattr(out, "to_tuple") else next(iter(out.values()))


def _serializable_guards(entries):
    """Dynamo's guards it can save: no global and no object-identity guard."""
    from torch._dynamo.guards import CheckFunctionManager

    bad = {*CheckFunctionManager.UNSUPPORTED_SERIALIZATION_GUARD_TYPES, "ID_MATCH",
           "MODULE_MATCH", "CLOSURE_MATCH", "FUNCTION_MATCH"}
    return [not e.is_global and e.guard_type not in bad and not bad & set(e.derived_guard_types)
            for e in entries]


def _loss(model, kw):
    return model(**kw)["loss"]


def _aot_step(model, kw, backend: str, train: bool) -> None:
    """The first aot call (of the forward, or of the training step's loss and its
    backward): compile and save (cold), or load and call (warm)."""
    caches = os.path.dirname(os.environ["PYPTO_INDUCTOR_CACHE_DIR"])  # _run's directory
    path = os.path.join(caches, f"aot_{backend}.bin")
    if os.path.exists(path):
        with open(path, "rb") as f:
            compiled = torch.compiler.load_compiled_function(f)
    else:
        # fullgraph: transformers' warning_once (GPT-2's unset loss_type) would break it
        from transformers.modeling_utils import logger
        torch._dynamo.config.ignore_logging_functions.add(logger.warning_once.__func__)
        fn = torch.compile(_loss if train else _first_tensor, backend=backend,
                           fullgraph=True, options={"guard_filter_fn": _serializable_guards})
        compiled = fn.aot_compile(((model, kw), {}))
        compiled.save_compiled_function(path)
    out = compiled(model, kw)
    if train:
        out.backward()


def _run(name: str, backend: str, caches: str, mode: str = "forward") -> dict:
    env = dict(os.environ, PYPTO_INDUCTOR_CACHE_DIR=os.path.join(caches, "pypto"),
               TORCHINDUCTOR_CACHE_DIR=os.path.join(caches, "inductor"),
               TORCHINDUCTOR_COMPILE_THREADS="1")
    cmd = [sys.executable, "-m", "benchmarks.compile_time", "--child", name, backend,
           repr(time.time()), mode]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=3600)
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("{")]
    if out.returncode != 0 or not lines:
        raise RuntimeError(f"{name}/{backend} failed: {out.stderr[-2000:]}")
    return json.loads(lines[-1])


def measure(name: str, backends=("pypto", "inductor"), mode: str = "forward") -> dict:
    result = {}
    for backend in backends:
        caches = tempfile.mkdtemp(prefix=f"pypto_compile_time_{backend}_")
        try:
            result[backend, "cold"] = _run(name, backend, caches, mode)
            result[backend, "warm"] = _run(name, backend, caches, mode)
        finally:
            shutil.rmtree(caches, ignore_errors=True)
    return result


def row(name: str, r: dict) -> list[str]:
    """A table row; "-" for a backend not measured (``--backends``)."""
    nan = {"first_s": float("nan"), "cpu_s": float("nan"), "start_s": float("nan")}
    pc, ic = r.get(("pypto", "cold"), nan), r.get(("inductor", "cold"), nan)
    pw, iw = r.get(("pypto", "warm"), nan), r.get(("inductor", "warm"), nan)
    dynamo = r.get(("eager", "warm"), nan)
    cells = [f"{pc['first_s']:.1f}", f"{pc['cpu_s']:.1f}", f"{ic['first_s']:.1f}",
             f"{ic['cpu_s']:.1f}", f"{pc['first_s'] / ic['first_s']:.2f}",
             f"{pc['cpu_s'] / ic['cpu_s']:.2f}", f"{pw['first_s']:.2f}", f"{pw['cpu_s']:.2f}",
             f"{pw['start_s']:.2f}", f"{iw['first_s']:.2f}", f"{iw['cpu_s']:.2f}",
             f"{iw['start_s']:.2f}", f"{dynamo['cpu_s']:.2f}"]
    return [name] + [c.replace("nan", "-") for c in cells]


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--child"]:
        print(json.dumps(child(argv[1], argv[2], float(argv[3]), *argv[4:5])), flush=True)
        return 0
    parser = argparse.ArgumentParser(prog="python -m benchmarks compile_time")
    parser.add_argument("--models", default=DEFAULT_MODELS, help="comma-separated zoo names")
    parser.add_argument("--markdown", default="", help="also append the table to this file")
    parser.add_argument("--backends", default="pypto,inductor",
                        help="comma-separated: pypto, inductor, eager (Dynamo alone: the "
                             "warm start's floor)")
    parser.add_argument("--mode", default="forward", choices=MODES,
                        help="forward (no_grad), train (first forward+backward step), aot "
                             "(the forward saved by aot_compile, then loaded) or aot-train "
                             "(the training step so)")
    args = parser.parse_args(argv)
    backends = tuple(b for b in args.backends.split(",") if b)
    print(" | ".join(COLUMNS), flush=True)
    rows = []
    for name in (m for m in args.models.split(",") if m):
        rows.append(row(name, measure(name, backends, args.mode)))
        print(" | ".join(rows[-1]), flush=True)
    if args.markdown:
        from . import md_table

        with open(args.markdown, "a") as f:
            f.write(f"\n## Compile time, {args.mode} ({time.strftime('%Y-%m-%d %H:%M')})\n\n"
                    + "\n".join(md_table(COLUMNS, rows)) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
