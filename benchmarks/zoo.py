"""``python -m benchmarks zoo``: the transformers zoo (pypto_inductor.zoo), eager vs Inductor vs pypto.

Three workloads per model, each at 1 and 2 torch threads:

- ``forward``: ``model(**batch)`` under ``torch.no_grad()``, batch 4 x 128 tokens (ViT and
  the ResNet: 4 images of 64x64; Whisper: 256 mel frames, 128 encoder positions). The
  encoder-decoder models (T5, Whisper) get their labels, so the decoder runs too.
- ``decode`` (causal LMs): ``model.generate`` with ``model.forward`` compiled, batch 1, a
  32-token prompt, greedy; the time per new token is
  (time of 1 + N new tokens - time of 1 new token) / N, so the prompt's prefill is left out.
- ``train``: ``zero_grad``, ``model(**batch)["loss"].backward()`` on the same batch.

The zoo's models come from tiny configs (hidden 64, 2 layers); here the position tables are
widened (and the zoo's batch constants patched) to reach 128 tokens. Every backend runs
on its own copy of one seeded model. Each workload is compiled afresh per thread count
(Inductor bakes the thread count into its kernels), run once to compile (``compile s``:
that first call's wall time, fresh cache directories per run, so the first thread count
is a cold compile), checked against eager (``check``: the largest difference, relative
to eager's largest magnitude, over the outputs or gradients; ``pypto eager graphs``: the
graphs pypto ran eagerly, from its reports), then timed in interleaved
rounds (eager, inductor, pypto, eager, ...): medians over ``--repeats`` calls, the median
of three rounds. Each compiled variant runs a code object of its own
(``benchmarks.own_code``): Dynamo looks up compiled frames per code object, and the
variants of one model class would otherwise share ``forward``'s list. The summary gives geometric means of Inductor/pypto and eager/pypto per
workload and thread count.
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import math
import os
import shutil
import statistics
import sys
import tempfile
import time

import torch

from pypto_inductor import zoo
from pypto_inductor.report import collect

import benchmarks

from . import md_table, median_us, own_code

MODES = ("forward", "decode", "train")
BATCH, SEQ, IMAGE = 4, 128, 64
PROMPT, NEW_TOKENS = 32, 16
COLUMNS = ["model", "mode", "threads", "eager ms", "inductor ms", "pypto ms", "eager/pypto",
           "inductor/pypto", "ind compile s", "pypto compile s", "check ind", "check pypto",
           "pypto eager graphs"]


@contextlib.contextmanager
def _zoo_sizes():
    """The zoo's batch helpers read these module constants at call time."""
    old = zoo.BATCH, zoo.SEQ, zoo.IMAGE
    zoo.BATCH, zoo.SEQ, zoo.IMAGE = BATCH, SEQ, IMAGE
    try:
        yield
    finally:
        zoo.BATCH, zoo.SEQ, zoo.IMAGE = old


def build(name: str) -> torch.nn.Module:
    """The zoo model with position tables long enough for SEQ tokens (seeded, eval)."""
    model = zoo.build(name)
    cfg = getattr(model, "config", None)
    if cfg is None:  # the hand-built ResNet: any image size
        return model
    for attr in ("max_position_embeddings", "n_positions", "original_max_position_embeddings"):
        if hasattr(cfg, attr):
            setattr(cfg, attr, 2 * SEQ)
    if hasattr(cfg, "max_source_positions"):  # Whisper: 2 frames per encoder position
        cfg.max_source_positions = SEQ
    if hasattr(cfg, "image_size"):
        cfg.image_size = IMAGE
    torch.manual_seed(0)
    return type(model)(cfg).eval()


def batch(name: str, seed: int = 0) -> dict:
    with _zoo_sizes():
        return zoo.batch(name, seed)


def forward_inputs(name: str) -> dict:
    kw = batch(name)
    if zoo.ZOO[name].kind != "seq2seq":  # the decoder of T5/Whisper runs on the labels
        kw.pop("labels", None)
    return kw


def tensors(out) -> list[torch.Tensor]:
    return list(zoo.output_tensors(out).values())


def rel_diff(got: list[torch.Tensor], want: list[torch.Tensor]) -> float:
    worst = 0.0
    for g, w in zip(got, want):
        if g.dtype.is_floating_point:
            scale = max(w.abs().max().item(), 1e-6)
            worst = max(worst, (g - w).abs().max().item() / scale)
        elif not torch.equal(g, w):
            worst = math.inf
    return worst


def _compile(model, label: str, dynamic=None):
    """``model`` compiled with backend ``label`` behind a code object of its own
    (:func:`benchmarks.own_code`): every backend's copy shares the class's ``forward``."""
    if label == "eager":
        return model
    return torch.compile(own_code(model), backend=label, dynamic=dynamic)


def _first_call_s(fn) -> tuple[object, float]:
    start = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - start


def _forward(name, model, labels, repeats):
    kw = forward_inputs(name)
    runs, compile_s, outs = {}, {}, {}
    with torch.no_grad():
        for label in labels:
            f = _compile(model, label)
            runs[label] = lambda f=f: f(**kw)
            out, compile_s[label] = _first_call_s(runs[label])
            outs[label] = tensors(out)
    return runs, compile_s, outs, torch.no_grad


def _train(name, model, labels, repeats):
    kw = batch(name)
    runs, compile_s, grads = {}, {}, {}
    for label in labels:
        m = copy.deepcopy(model).train()
        f = _compile(m, label)

        def step(f=f, m=m):
            m.zero_grad(set_to_none=True)
            f(**kw)["loss"].backward()

        runs[label] = step
        _, compile_s[label] = _first_call_s(step)
        grads[label] = [p.grad for p in m.parameters() if p.grad is not None]
    return runs, compile_s, grads, contextlib.nullcontext


def _decode(name, model, labels, repeats):
    ids = batch(name)["input_ids"][:1, :PROMPT]
    mask = torch.ones_like(ids)
    runs, compile_s, outs = {}, {}, {}
    for label in labels:
        m = copy.deepcopy(model)
        if label != "eager":
            m.forward = torch.compile(own_code(m.forward), backend=label)

        def gen(n, m=m):
            return m.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                              do_sample=False)

        with torch.no_grad():
            out, compile_s[label] = _first_call_s(lambda gen=gen: gen(1 + NEW_TOKENS))
            gen(1 + NEW_TOKENS)  # any recompile for a grown cache happens here

        def per_token(gen=gen):
            with torch.no_grad():
                start = benchmarks.CLOCK()
                gen(1)
                one = benchmarks.CLOCK() - start
                start = benchmarks.CLOCK()
                gen(1 + NEW_TOKENS)
                return (benchmarks.CLOCK() - start - one) / NEW_TOKENS

        runs[label] = per_token
        outs[label] = [out]
    return runs, compile_s, outs, None


def _time(runs: dict, repeats: int, ctx, per_token: bool) -> dict[str, float]:
    """Median ms per backend over three interleaved rounds."""
    times = {label: [] for label in runs}
    for _ in range(3):
        for label, fn in runs.items():
            if per_token:
                times[label].append(statistics.median(fn() for _ in range(max(repeats // 4, 3)))
                                    * 1e3)
            else:
                with ctx():
                    times[label].append(median_us(fn, (), repeats) / 1e3)
    return {label: statistics.median(t) for label, t in times.items()}


WORKLOADS = {"forward": _forward, "train": _train, "decode": _decode}


def _geomean(xs):
    xs = [x for x in xs if x > 0 and math.isfinite(x)]
    return math.exp(statistics.fmean(math.log(x) for x in xs)) if xs else float("nan")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks zoo")
    parser.add_argument("--models", default=",".join(zoo.ZOO), help="comma-separated zoo names")
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--markdown", default="", help="also write the table to this file")
    parser.add_argument("--cpu-time", action="store_true",
                        help="time with the calling thread's CPU time (needs --threads 1): "
                             "what a loaded machine's other processes do not inflate")
    args = parser.parse_args(argv)
    if args.cpu_time:
        if args.threads != "1":
            parser.error("--cpu-time needs --threads 1")
        benchmarks.CLOCK = time.thread_time
    import transformers

    transformers.logging.set_verbosity_error()
    models = [m for m in args.models.split(",") if m]
    modes = [m for m in args.modes.split(",") if m]
    threads = [int(t) for t in args.threads.split(",") if t]
    title = (f"{time.strftime('%Y-%m-%d %H:%M')} torch {torch.__version__}, transformers "
             f"{transformers.__version__}, {os.cpu_count()} cores, repeats={args.repeats}")
    print(f"# {title}")
    print(" | ".join(COLUMNS), flush=True)
    rows, ratios = [], {}
    tmp = tempfile.mkdtemp(prefix="pypto_zoo_bench_")
    old_env = {k: os.environ.get(k) for k in ("TORCHINDUCTOR_CACHE_DIR", "PYPTO_INDUCTOR_CACHE_DIR")}
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(tmp, "inductor")
    os.environ["PYPTO_INDUCTOR_CACHE_DIR"] = os.path.join(tmp, "pypto")
    labels = ("eager", "inductor", "pypto")
    start_all = time.perf_counter()
    try:
        for name in models:
            model = build(name)
            for mode in modes:
                if mode == "decode" and not zoo.ZOO[name].causal_lm:
                    continue
                for t in threads:
                    torch.set_num_threads(t)
                    torch._dynamo.reset()
                    try:
                        with collect() as graphs:  # pypto's, eager ones counted in the row
                            runs, compile_s, outs, ctx = WORKLOADS[mode](name, model, labels,
                                                                         args.repeats)
                            med = _time(runs, args.repeats, ctx, mode == "decode")
                    except Exception as e:  # noqa: BLE001 - one model's failure is a row
                        print(f"{name} | {mode} | {t} | failed: {type(e).__name__}: "
                              f"{str(e)[:200]}", flush=True)
                        rows.append([name, mode, str(t), f"failed: {type(e).__name__}"]
                                    + [""] * (len(COLUMNS) - 4))
                        continue
                    checks = [rel_diff(outs[b], outs["eager"]) if mode != "decode"
                              else (0.0 if torch.equal(outs[b][0], outs["eager"][0]) else math.inf)
                              for b in ("inductor", "pypto")]
                    pi = med["eager"] / med["pypto"]
                    ratios.setdefault((mode, t), []).append((med["inductor"] / med["pypto"], pi))
                    row = [name, mode, str(t), *(f"{med[b]:.3f}" for b in labels),
                           f"{pi:.2f}", f"{med['inductor'] / med['pypto']:.2f}",
                           f"{compile_s['inductor']:.1f}", f"{compile_s['pypto']:.1f}",
                           *(f"{c:.1e}" for c in checks),
                           str(sum(1 for g in graphs if g.eager_reason))]
                    rows.append(row)
                    print(" | ".join(row), flush=True)
                    del runs, outs
            torch._dynamo.reset()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        for k, v in old_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    summary = []
    for (mode, t), rs in ratios.items():
        summary.append([mode, str(t), str(len(rs)), f"{_geomean(r[0] for r in rs):.2f}",
                        f"{_geomean(r[1] for r in rs):.2f}",
                        f"{min(r[0] for r in rs):.2f}"])
    scols = ["mode", "threads", "models", "geomean inductor/pypto", "geomean eager/pypto",
             "worst inductor/pypto"]
    print("# geometric means (ratios > 1: pypto faster)")
    print(" | ".join(scols))
    for r in summary:
        print(" | ".join(r))
    total = time.perf_counter() - start_all
    print(f"# total {total / 60:.1f} min")
    if args.markdown:
        command = "python -m benchmarks zoo " + " ".join(sys.argv[2:] if argv is None else argv)
        with open(args.markdown, "a") as f:
            f.write("\n".join([
                "", f"## Transformers zoo ({title})", "",
                f"Command: `{command}` ({total / 60:.0f} min). " + __doc__.split("\n\n", 1)[1]
                .replace("\n", " ").strip(), "",
                *md_table(scols, summary), "", *md_table(COLUMNS, rows), ""]))
    return 0
