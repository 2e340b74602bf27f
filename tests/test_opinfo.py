"""OpInfo sweep: every op family the lowering registry claims, run through the backend.

For each ATen op family with a registered lowering (``lowered_op_names()``) we
take the ``op_db`` OpInfo entries that exercise it, run a few float32 CPU
samples of each through ``torch.compile(backend="pypto")`` and compare with
eager. Each (op, sample) is classified:

* **pass**     -- matches eager and everything ran as tile ops;
* **fallback** -- matches eager but some ATen op ran eagerly (an ExternOp, a graph
  that could not be lowered, a Dynamo graph break, or no graph at all);
* **fail**     -- wrong result (values, shape or dtype), an exception, or a tile op
  whose computed shape/dtype differs from the spec its lowering declared.

Families some of whose overloads the backend's decomposition table rewrites are
run a second time ("undecomposed") with those overloads kept, so their own
lowerings are exercised too.

The pytest test fails on any ``fail``; fallbacks are allowed (correct, just not
lowered). ``python tests/test_opinfo.py --write-docs`` regenerates docs/opinfo.md;
``--dtype int64`` / ``--max-samples N`` / ``-k NAME`` / ``--target T`` explore further.
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import datetime
import logging
import os
import sys
import time
import warnings
from pathlib import Path
from unittest import mock

import pytest
import torch
import torch._dynamo
from torch.utils._pytree import tree_flatten, tree_map

import pypto_inductor
import pypto_inductor.backend as pypto_backend_module
from pypto_inductor.backend import pypto_backend
from pypto_inductor.codegen import reference
from pypto_inductor.sizes import size_function
from pypto_inductor.ir import TileOp, op_name
from pypto_inductor.lowering import LOWERINGS, decomposition_table, lowered_op_names
from pypto_inductor.report import collect

try:  # op_db lives in PyTorch's internal test utilities, which import expecttest
    from torch.testing._internal.common_methods_invocations import op_db
except ImportError as e:  # pragma: no cover - depends on the environment
    op_db = None
    _OP_DB_ERROR = str(e)
else:
    # Importing common_utils calls torch.backends.disable_global_flags(), which makes
    # plain assignments like torch.backends.mkldnn.enabled = False raise in every
    # test module of this pytest process; undo it.
    torch.backends.flags_frozen.__globals__["__allow_nonbracketed_mutation_flag"] = True

# Fusion decisions must not depend on this machine's timing (as in tests/conftest.py).
os.environ.setdefault("PYPTO_INDUCTOR_NO_CALIBRATE", "1")

# The codegen target every sample compiles for. The sweep checks lowering (ATen -> tile
# ops) against eager, so by default it runs the tile ops on the reference executor: fast
# and compiler-free. PYPTO_OPINFO_TARGET=cpu (or --target cpu) sweeps the native kernels
# instead (each new kernel is compiled once, so a cold cache takes much longer).
TARGET = os.environ.get("PYPTO_OPINFO_TARGET") or "reference"

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs" / "opinfo.md"
REGENERATE = "python tests/test_opinfo.py --write-docs"
# The training sweep (tests/test_training_ops.py) writes its section at the end of
# DOCS, from this marker on; regenerating the rest keeps it.
TRAINING_MARKER = "<!-- training sweep: python tests/test_training_ops.py --write-docs -->"


def training_section(text: str) -> str:
    """The training sweep's section of a docs/opinfo.md text ("" if it has none)."""
    at = text.find(TRAINING_MARKER)
    return "\n" + text[at:] if at >= 0 else ""


# Samples per OpInfo, spread evenly over its sample list (first and last included).
MAX_SAMPLES = 6

# Registry families whose ATen op never shows up under its own name in op_db:
# family -> the OpInfo names (``name`` or ``name.variant``) that exercise it.
EXTRA_OPINFOS: dict[str, list[str]] = {
    "_softmax": ["softmax", "softmax.with_dtype"],
    "_log_softmax": ["log_softmax", "log_softmax.with_dtype"],
    "_to_copy": ["to", "double", "half"],
    "convert_element_type": ["int", "long", "bool"],
    "_unsafe_view": ["matmul", "nn.functional.linear"],
    "alias": ["alias_copy", "contiguous"],
    "permute": ["T", "mT", "movedim"],
    "clamp_min": ["nn.functional.relu6"],
    "div": ["true_divide"],
    "slice": ["narrow", "chunk"],
    "split": ["tensor_split"],
    "cat": ["stack", "hstack"],
    "mul": ["square"],
    "index": ["__getitem__"],
    "copy_": ["nn.functional.batch_norm"],  # running stats: copy_ into graph inputs
    "copy": ["nn.functional.instance_norm"],
}

# Registry families no op_db entry reaches, with the tests that cover them instead.
NO_OPINFO: dict[str, str] = {
    "fma": "prims.fma comes from Dynamo's rewrite of in-place addcmul_/addcdiv_ (the "
           "optimizers); tests/test_mutation_ops.py compiles Adam, AdamW and SGD steps",
    "_transformer_encoder_layer_fwd": "nn.TransformerEncoderLayer's eval fast path; "
                                      "tests/test_composite_ops.py compiles it",
}
# _foreach_* families: their OpInfos live outside op_db (foreach_*_op_db);
# tests/test_composite_ops.py sweeps those.
FOREACH_PREFIX = "_foreach_"

# OpInfo entries matched by name that are deliberately not run, with why. (None of the
# matched entries is a random or in-place-only op; those would be listed here too.)
EXCLUDED: dict[str, str] = {
    # Complex-only variant: it has no float32 or integer samples.
    "nn.functional.silu.complex": "complex-only variant (no float32 samples)",
    # Its samples are views into a larger storage that as_strided reads past the view's
    # end; run_sample clones inputs (compact storage), so eager itself goes out of bounds.
    # as_strided's lowering (a view only where it moves no element) is tested in
    # tests/test_conv.py and by the plain as_strided OpInfo.
    "as_strided.partial_views": "reads storage beyond its input view; cloned inputs "
                                "make eager itself fail",
}

# For ops with no float32 support (bitwise ops) we use the first of these they support.
FALLBACK_DTYPES = (torch.int32, torch.int64, torch.bool)

RTOL = {torch.float32: 1.3e-5, torch.float64: 1e-7, torch.float16: 1e-3, torch.bfloat16: 1.6e-2}
ATOL = {torch.float32: 1e-5, torch.float64: 1e-7, torch.float16: 1e-3, torch.bfloat16: 1e-2}


def opinfo_name(op) -> str:
    return f"{op.name}.{op.variant_test_name}" if op.variant_test_name else op.name


def _families() -> list[str]:
    """Claimed families without namespace: 'add', '_softmax', 'convert_element_type'."""
    return [name.split(".", 1)[1] for name in lowered_op_names()]


def family_of(op, families: set[str]) -> str | None:
    candidates = [op.aten_name, op.name]
    for prefix in ("nn.functional.", "special."):
        if op.name.startswith(prefix):
            candidates.append(op.name[len(prefix):])
    for c in candidates:
        if c in families:
            return c
    return None


def opinfo_plan() -> list[tuple[str, object]]:
    """(family, OpInfo) for every OpInfo we run, ordered by family then name."""
    if op_db is None:
        return []
    families = set(_families())
    by_full = {opinfo_name(op): op for op in op_db}
    plan, seen = [], set()
    for op in op_db:
        fam = family_of(op, families)
        if fam is not None and opinfo_name(op) not in EXCLUDED:
            plan.append((fam, op))
            seen.add(opinfo_name(op))
    for fam, names in EXTRA_OPINFOS.items():
        assert fam in families, f"EXTRA_OPINFOS names {fam!r}, which has no lowering"
        for name in names:
            assert name in by_full, f"no OpInfo {name!r} in op_db"
            if name not in seen and name not in EXCLUDED:
                plan.append((fam, by_full[name]))
                seen.add(name)
    matched = {opinfo_name(op) for op in op_db if family_of(op, families)}
    stale = sorted(set(EXCLUDED) - matched)
    assert not stale, f"EXCLUDED names OpInfos that no claimed family matches: {stale}"
    plan.sort(key=lambda p: (p[0], opinfo_name(p[1])))
    return plan


def _dtype_for(op) -> torch.dtype | None:
    supported = op.supported_dtypes("cpu")
    if torch.float32 in supported:
        return torch.float32
    return next((d for d in FALLBACK_DTYPES if d in supported), None)


def pick_samples(samples: list, k: int) -> list:
    if len(samples) <= k:
        return samples
    idx = sorted({round(i * (len(samples) - 1) / (k - 1)) for i in range(k)})
    return [samples[i] for i in idx]


@dataclasses.dataclass
class Outcome:
    status: str  # "pass" | "fallback" | "fail"
    detail: str = ""
    lowered: frozenset = frozenset()  # ATen families lowered to tile ops, e.g. "aten.add"


def sample_signature(sample) -> str:
    """A short description of a sample's arguments, for failure messages."""
    def short(x):
        if isinstance(x, torch.Tensor):
            return f"{str(x.dtype)[6:]}{list(x.shape)}"
        return x
    inp, args, kwargs = torch.utils._pytree.tree_map(short, (sample.input, sample.args,
                                                             sample.kwargs))
    parts = [repr(inp)] + [repr(a) for a in args] + [f"{k}={v!r}" for k, v in kwargs.items()]
    return "(" + ", ".join(parts).replace("'", "") + ")"


def compare_outputs(actual, expected) -> None:
    a_leaves, a_spec = tree_flatten(actual)
    e_leaves, e_spec = tree_flatten(expected)
    if a_spec != e_spec:
        raise AssertionError(f"output structure differs: {a_spec} vs {e_spec}")
    for a, e in zip(a_leaves, e_leaves):
        if isinstance(e, torch.Tensor):
            assert isinstance(a, torch.Tensor), f"expected a tensor, got {type(a).__name__}"
            if e.dtype.is_floating_point:
                torch.testing.assert_close(a, e, equal_nan=True, rtol=RTOL[e.dtype],
                                           atol=ATOL[e.dtype])
            else:
                torch.testing.assert_close(a, e, rtol=0, atol=0)
        else:
            assert a == e or (a != a and e != e), f"{a!r} != {e!r}"


def describe_error(e: BaseException) -> str:
    inner = getattr(e, "inner_exception", None)  # BackendCompilerFailed wraps the real error
    if inner is not None:
        e = inner
    msg = " ".join(str(e).split())
    return f"{type(e).__name__}: {msg}"[:300]


class SpecMismatch(AssertionError):
    """A tile op computed a value whose shape or dtype differs from its declared spec."""


@contextlib.contextmanager
def checking_specs():
    """Check every tile op's reference result against the TensorSpec lowering declared.

    Results equal to eager are not enough: native targets and the planner trust the
    declared shape and dtype, so a lowering that declares the wrong one is a bug even
    when the reference executor (which just calls torch) happens to compute the
    right value.
    """
    original = reference.op_runner

    def op_runner(op, symbols):
        run = original(op, symbols)
        shape_of = size_function(tuple(op.out.shape), symbols)

        def checked(values, syms):
            out = run(values, syms)
            if isinstance(out, torch.Tensor):
                shape = tuple(shape_of(syms))
                if out.dtype != op.out.dtype or tuple(out.shape) != shape:
                    raise SpecMismatch(
                        f"tile op {op.op} (from {op.source}) declared "
                        f"{str(op.out.dtype)[6:]}{list(shape)} but computed "
                        f"{str(out.dtype)[6:]}{list(out.shape)}")
            return out

        return checked

    reference.op_runner = op_runner
    try:
        yield
    finally:
        reference.op_runner = original


def decomposed_overloads(family: str) -> frozenset:
    """The family's lowered overloads that the backend's decomposition table rewrites
    before lowering (so the default sweep never reaches their lowering)."""
    table = decomposition_table()
    return frozenset(ov for ov in LOWERINGS if ov in table
                     and op_name(ov).rsplit(".", 1)[0].split(".", 1)[1] == family)


@contextlib.contextmanager
def keeping(overloads: frozenset):
    """Compile with ``overloads`` left out of the backend's decomposition table."""
    if not overloads:
        yield
        return
    original = pypto_backend_module.decomposition_table
    table = {k: v for k, v in original().items() if k not in overloads}
    pypto_backend_module.decomposition_table = lambda: table
    try:
        # graph_cache keys the Dynamo graph, not the table: a hit would bring back the
        # graph compiled with the full table (the script runs without conftest's settings)
        with mock.patch.dict(os.environ, {"PYPTO_INDUCTOR_GRAPH_CACHE": "0"}):
            yield
    finally:
        pypto_backend_module.decomposition_table = original


def run_sample(op, sample, keep: frozenset = frozenset()) -> Outcome:
    """Compile one sample through the backend, compare with eager, classify."""
    def clone_args():
        return tree_map(lambda x: x.clone() if isinstance(x, torch.Tensor) else x,
                        (sample.input, sample.args, sample.kwargs))

    def call(inp, args, kwargs):
        # Tensors reach the compiled function as closure cells, which Dynamo lifts to
        # graph inputs; rebuilding them from flat arguments would cost more to trace.
        return lambda: op.op(inp, *args, **kwargs)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        expected = call(*clone_args())()
    fn = call(*clone_args())
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    options = {"target": TARGET}
    compiled = torch.compile(fn, backend=lambda gm, ex: pypto_backend(gm, ex, options=options),
                             dynamic=False)
    try:
        with collect() as graphs, checking_specs(), keeping(keep), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            actual = compiled()
        compare_outputs(actual, expected)
    except Exception as e:  # noqa: BLE001 - any error is a failure of this sample
        return Outcome("fail", f"{sample_signature(sample)}: {describe_error(e)}")

    reasons, lowered = [], set()
    for g in graphs:
        if g.plan is not None:
            lowered |= {n.source.rsplit(".", 1)[0] for n in g.plan.graph.nodes
                        if isinstance(n, TileOp)}
        d = g.to_dict()
        if d.get("eager_reason"):
            reasons.append(f"graph ran eagerly: {d['eager_reason']}")
        reasons += sorted(set(d.get("extern_reasons", {}).values()))
        reasons += sorted({f"kernel build failed, ran on the reference executor: "
                           f"{t['kernel_fallback']}"[:200]
                           for t in d.get("fusion_tiles", []) if t.get("kernel_fallback")})
    breaks = torch._dynamo.utils.counters["graph_break"]
    if breaks:
        first = " ".join(sorted(breaks)[0].split())
        reasons.append("graph break: " + first.split(" Explanation:")[0][:120])
    if not graphs:
        reasons.append("no graph reached the pypto compiler (Dynamo/AOTAutograd could not "
                       "trace it and ran it eagerly)")
    if reasons:
        return Outcome("fallback", "; ".join(reasons), frozenset(lowered))
    return Outcome("pass", "", frozenset(lowered))


def run_opinfo(family: str, op, dtype: torch.dtype | None = None,
               max_samples: int = MAX_SAMPLES) -> dict[str, list[Outcome]]:
    """Outcomes per mode: "default" (the backend as users get it) and, when the
    decomposition table rewrites some of the family's overloads, "undecomposed" (the
    same samples with those overloads kept, so their lowering runs too)."""
    if dtype is None:
        dtype = _dtype_for(op)
        if dtype is None:
            return {"default": [Outcome("fail", "no float32 or integer dtype supported")]}
    elif dtype not in op.supported_dtypes("cpu"):
        return {}
    torch.manual_seed(0)
    samples = pick_samples(list(op.sample_inputs("cpu", dtype, requires_grad=False)), max_samples)
    results = {"default": [run_sample(op, s) for s in samples]}
    keep = decomposed_overloads(family)
    if keep:
        results["undecomposed"] = [run_sample(op, s, keep) for s in samples]
    return results


# --- pytest ----------------------------------------------------------------------------
_PLAN = opinfo_plan()


@pytest.mark.skipif(op_db is None, reason="torch.testing._internal needs expecttest")
@pytest.mark.parametrize("family,op", _PLAN, ids=[f"{f}:{opinfo_name(o)}" for f, o in _PLAN])
def test_opinfo(family, op):
    fails = [f"[{mode}] {o.detail}" for mode, outcomes in run_opinfo(family, op).items()
             for o in outcomes if o.status == "fail"]
    assert not fails, f"{opinfo_name(op)}: {len(fails)} samples failed:\n" + "\n".join(fails)


def test_every_family_has_an_opinfo():
    if op_db is None:
        pytest.skip("torch.testing._internal needs expecttest")
    covered = {fam for fam, _ in _PLAN} | set(NO_OPINFO) | {
        f for f in _families() if f.startswith(FOREACH_PREFIX)}
    missing = sorted(set(_families()) - covered)
    assert not missing, (f"registry families with no OpInfo: {missing}; map each to the "
                         "op_db entries that exercise it in EXTRA_OPINFOS")


# --- docs/opinfo.md --------------------------------------------------------------------
def sweep(verbose: bool = True, dtype: torch.dtype | None = None,
          max_samples: int = MAX_SAMPLES) -> list[tuple[str, str, dict[str, list[Outcome]]]]:
    results = []
    for fam, op in _PLAN:
        start = time.perf_counter()
        by_mode = run_opinfo(fam, op, dtype, max_samples)
        results.append((fam, opinfo_name(op), by_mode))
        if verbose:
            counts = {m: dict(collections.Counter(o.status for o in outs))
                      for m, outs in by_mode.items()}
            print(f"{fam:22s} {opinfo_name(op):28s} {counts} "
                  f"{time.perf_counter() - start:.1f}s", flush=True)
            for mode, outs in by_mode.items():
                for o in outs:
                    if o.status == "fail":
                        print(f"    FAIL [{mode}] {o.detail}", flush=True)
    return results


def _tally(results, mode):
    """Per family: status counts, OpInfo names, and whether some sample lowered it."""
    full_name = {name.split(".", 1)[1]: name for name in lowered_op_names()}
    counts: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    ops_of: dict[str, list[str]] = collections.defaultdict(list)
    lowered: set[str] = set()
    for fam, name, by_mode in results:
        if mode not in by_mode:
            continue
        ops_of[fam].append(name)
        for o in by_mode[mode]:
            counts[fam][o.status] += 1
            lowered |= o.lowered
    total = collections.Counter()
    for c in counts.values():
        total.update(c)
    rows = ["| family | OpInfos | lowered | pass | fallback | fail |",
            "| --- | --- | :---: | ---: | ---: | ---: |"]
    never = sorted(full_name[f] for f in counts if full_name[f] not in lowered)
    for fam in sorted(counts):
        c = counts[fam]
        mark = "yes" if full_name[fam] in lowered else "no"
        rows.append(f"| `{full_name[fam]}` | {', '.join(ops_of[fam])} | {mark} | {c['pass']} "
                    f"| {c['fallback']} | {c['fail']} |")
    rows.append(f"| **total** | {sum(map(len, ops_of.values()))} | {len(counts) - len(never)}/"
                f"{len(counts)} | {total['pass']} | {total['fallback']} | {total['fail']} |")
    return total, rows, never, len(counts)


def render(results) -> str:
    total, rows, never, n_families = _tally(results, "default")
    u_total, u_rows, u_never, _ = _tally(results, "undecomposed")
    n = sum(total.values())
    integer_ops = sorted(f"{opinfo_name(op)} ({str(_dtype_for(op))[6:]})" for _, op in _PLAN
                         if _dtype_for(op) != torch.float32)
    lines = [
        "# OpInfo sweep",
        "",
        f"Generated {datetime.date.today().isoformat()} with torch {torch.__version__}, "
        f"pypto_inductor {pypto_inductor.__version__}, codegen target `{TARGET}`.",
        "",
        "Every ATen op family with a registered lowering (`lowered_op_names()`) is exercised "
        "through the OpInfo entries of `torch.testing._internal.common_methods_invocations."
        f"op_db` that call it: up to {MAX_SAMPLES} float32 CPU samples per OpInfo, spread "
        "over its sample list, each compiled with `torch.compile(backend=\"pypto\", "
        f"dynamic=False)` (options `{{\"target\": \"{TARGET}\"}}`) and compared with "
        "eager (values, shape and dtype; float32 "
        "tolerances, exact for integer and bool results). Every tile op's result is also "
        "checked against the shape and dtype its lowering declared.",
        "",
        "* **pass**: matches eager and every ATen op ran as tile ops;",
        "* **fallback**: matches eager but some op ran eagerly (an extern op, a graph that "
        "could not be lowered, or a Dynamo graph break);",
        "* **fail**: wrong values, shape or dtype, or an exception.",
        "",
        f"Regenerate with `{REGENERATE}` (about 3 minutes on 2 cores); "
        "`pytest tests/test_opinfo.py` runs the same sweep and fails on any fail.",
        "",
        f"**Totals: {total['pass']} pass, {total['fallback']} fallback, {total['fail']} fail "
        f"({n} samples, {len(results)} OpInfos, {n_families} families).**",
        "",
        "Ops without float32 support run on integer samples: "
        + (", ".join(integer_ops) or "none") + ".",
        "",
        "The *lowered* column says whether some sample actually turned the family's ATen "
        "op into tile ops. Some never are with the backend's decomposition table (it "
        "rewrites them first) or at all (Dynamo/AOTAutograd trace composite ops such as "
        "`reshape` and `flatten` into others); the *undecomposed* sweep below covers the "
        "first kind.",
        "",
        *rows,
    ]
    if never:
        lines += ["", "Families no sample lowered: " + ", ".join(f"`{f}`" for f in never) + "."]
    lines += [
        "",
        "## Undecomposed",
        "",
        "The same samples for the families some of whose lowered overloads are in the "
        "backend's decomposition table, compiled with those overloads kept out of it, so "
        "their own lowering runs: "
        f"{u_total['pass']} pass, {u_total['fallback']} fallback, {u_total['fail']} fail.",
        "",
        *u_rows,
    ]
    if u_never:
        lines += ["", "Still not lowered (decomposed by Dynamo/AOTAutograd before the table "
                  "applies, or the OpInfo reaches another overload): "
                  + ", ".join(f"`{f}`" for f in u_never) + "."]
    notes = []
    for fam, name, by_mode in results:
        for mode, outcomes in by_mode.items():
            for status in ("fail", "fallback"):
                details = collections.Counter(o.detail for o in outcomes if o.status == status)
                for detail, k in sorted(details.items()):
                    notes.append(f"| {name} | {mode} | {status} | {k} | "
                                 f"{detail.replace('|', '/')} |")
    if notes:
        lines += ["", "## Fallbacks and failures", "",
                  "| OpInfo | sweep | status | samples | why |",
                  "| --- | --- | --- | ---: | --- |", *notes]
    lines += ["", "## Not run", "", "| OpInfo | why |", "| --- | --- |"]
    lines += [f"| {name} | {why} |" for name, why in sorted(EXCLUDED.items())]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    global TARGET, _PLAN
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write-docs", action="store_true", help=f"write {DOCS}")
    parser.add_argument("-k", default=None, help="only OpInfos whose name contains this")
    parser.add_argument("--dtype", default=None,
                        help="exploration: run samples of this dtype (e.g. int64) instead")
    parser.add_argument("--max-samples", type=int, default=MAX_SAMPLES)
    parser.add_argument("--target", default=TARGET, help=f"codegen target (default {TARGET})")
    args = parser.parse_args(argv)
    TARGET = args.target
    dtype = getattr(torch, args.dtype) if args.dtype else None
    if args.write_docs and (dtype is not None or args.max_samples != MAX_SAMPLES or args.k
                            or TARGET != "reference"):
        parser.error("--write-docs records the default sweep only")
    if op_db is None:
        print(f"cannot import op_db: {_OP_DB_ERROR}", file=sys.stderr)
        return 2
    if args.k:
        _PLAN = [(f, o) for f, o in _PLAN if args.k in opinfo_name(o) or args.k == f]
    logging.getLogger("torch._dynamo").setLevel(logging.ERROR)  # expected graph-break noise
    start = time.perf_counter()
    results = sweep(dtype=dtype, max_samples=args.max_samples)
    text = render(results)
    print(text)
    print(f"sweep took {time.perf_counter() - start:.0f}s")
    if args.write_docs:
        DOCS.parent.mkdir(parents=True, exist_ok=True)
        DOCS.write_text(text + training_section(DOCS.read_text() if DOCS.exists() else ""))
        print(f"wrote {DOCS}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
