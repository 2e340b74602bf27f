"""Training sweep: forward + backward of every op family the backend touches, against eager.

The families are those the decomposition table rewrites and those the lowering
registry lowers (a ``*_backward`` family is exercised through its forward op's
OpInfos). For each we take the float32 ``op_db`` OpInfos that support autograd,
run a few samples with ``requires_grad=True`` through
``torch.compile(backend="pypto")``, pull a seeded random cotangent through
``torch.autograd.grad`` and compare the outputs and every input gradient with
eager. Each sample is a pass, fallback or fail as in tests/test_opinfo.py (whose
helpers this reuses); the pytest test fails on any fail.

``python tests/test_training_ops.py --write-docs`` writes the counts into the
training section of docs/opinfo.md; ``-k NAME`` / ``--max-samples N`` explore.
"""
from __future__ import annotations

import argparse
import collections
import dataclasses
import logging
import sys
import time
import warnings

import pytest
import torch
import torch._dynamo
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

from pypto_inductor.backend import pypto_backend
from pypto_inductor.lowering import decomposition_table, lowered_op_names
from pypto_inductor.report import collect
from test_opinfo import (DOCS, EXCLUDED, EXTRA_OPINFOS, TRAINING_MARKER, checking_specs,
                         compare_outputs, describe_error, family_of, op_db, opinfo_name,
                         pick_samples, sample_signature)
import test_opinfo

# Samples per OpInfo: a few, to keep the sweep within a couple of minutes on 2 cores.
MAX_SAMPLES = 2
REGENERATE = "python tests/test_training_ops.py --write-docs"

# Table families whose ATen op never shows up under its own name in op_db, beyond
# test_opinfo's map for lowered families: family -> OpInfos that reach it.
EXTRA_TRAINING_OPINFOS: dict[str, list[str]] = {
    "native_layer_norm": ["nn.functional.layer_norm"],
    "native_batch_norm": ["nn.functional.batch_norm"],
    "_native_batch_norm_legit": ["nn.functional.batch_norm", "nn.functional.instance_norm"],
    "_native_batch_norm_legit_functional": ["nn.functional.batch_norm"],
    "_native_batch_norm_legit_no_training": ["nn.functional.batch_norm"],
    "native_group_norm": ["nn.functional.group_norm"],
    "nll_loss_forward": ["nn.functional.nll_loss", "nn.functional.cross_entropy"],
    "nll_loss2d_forward": ["nn.functional.nll_loss"],
    "log_sigmoid_forward": ["nn.functional.logsigmoid"],
    "_prelu_kernel": ["nn.functional.prelu"],
    "_fused_rms_norm": ["nn.functional.rms_norm"],
    "_softmax": ["softmax", "nn.functional.softmin"],
    "_log_softmax": ["log_softmax"],
    "_safe_softmax": ["softmax"],
    "_scaled_dot_product_attention_math": ["nn.functional.scaled_dot_product_attention"],
}

# OpInfos matched but not run, with why (beyond test_opinfo.EXCLUDED).
EXCLUDED_TRAINING: dict[str, str] = {}


def _table_families() -> set[str]:
    return {op_family(op) for op in decomposition_table()
            if isinstance(op, torch._ops.OpOverload)}


def op_family(op) -> str:
    """'aten.native_layer_norm.default' -> 'native_layer_norm'."""
    return op._schema.name.split("::")[-1]


def _lowered_families() -> set[str]:
    return {name.split(".", 1)[1] for name in lowered_op_names()}


def training_plan() -> list[tuple[str, object]]:
    """(family, OpInfo) for every differentiable float32 OpInfo that reaches a family."""
    if op_db is None:
        return []
    families = _table_families() | _lowered_families()
    by_name = {opinfo_name(op): op for op in op_db}
    extra = collections.defaultdict(list)
    for table in (EXTRA_OPINFOS, EXTRA_TRAINING_OPINFOS):
        for fam, names in table.items():
            for name in names:
                assert name in by_name, f"no OpInfo {name!r} in op_db"
                extra[name].append(fam)
    plan, seen = [], set()

    def add(fam, op):
        name = opinfo_name(op)
        if name in seen or name in EXCLUDED or name in EXCLUDED_TRAINING:
            return
        if not op.supports_autograd or torch.float32 not in op.supported_dtypes("cpu"):
            return
        plan.append((fam, op))
        seen.add(name)

    backward_of = {f.removesuffix("_backward_data").removesuffix("_backward"): f
                   for f in families if f.endswith(("_backward", "_backward_data"))}
    for op in op_db:
        fam = family_of(op, families) or family_of(op, set(backward_of))
        if fam is not None:
            add(fam if fam in families else backward_of[fam], op)
    for name, fams in extra.items():
        if any(f in families for f in fams):
            add(next(f for f in fams if f in families), by_name[name])
    plan.sort(key=lambda p: (p[0], opinfo_name(p[1])))
    return plan


@dataclasses.dataclass
class Outcome:
    status: str  # "pass" | "fallback" | "fail", as in tests/test_opinfo.py
    detail: str = ""
    # ATen families eager's forward and backward of the sample dispatched to (below
    # autograd and CompositeImplicitAutograd), e.g. "native_layer_norm_backward"
    reached: frozenset = frozenset()


class _Dispatched(TorchDispatchMode):
    """Records the family of every ATen op dispatched while it is active."""

    def __init__(self):
        super().__init__()
        self.families: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.families.add(op_family(func))
        return func(*args, **(kwargs or {}))


def _tensors(tree) -> list[torch.Tensor]:
    return [x for x in tree_flatten(tree)[0] if isinstance(x, torch.Tensor)]


def _leaf_copy(sample):
    """The sample's tensors as fresh leaves (requires_grad kept)."""
    def copy(x):
        if not isinstance(x, torch.Tensor):
            return x
        return x.detach().clone().requires_grad_(x.requires_grad)
    return tree_map(copy, (sample.input, sample.args, sample.kwargs))


def _forward_backward(fn, leaves):
    """fn() and the gradients of its differentiable outputs, with seeded cotangents."""
    torch.manual_seed(1)  # random ops (dropout) draw alike in both runs
    out = fn()
    diff = [t for t in _tensors(out) if t.requires_grad and t.is_floating_point()]
    torch.manual_seed(2)  # contiguous cotangents: the same values whatever the outputs' strides
    cotangents = [torch.randn(t.shape, dtype=t.dtype) for t in diff]
    grads = torch.autograd.grad(diff, leaves, cotangents, allow_unused=True,
                                materialize_grads=True)
    return tree_map(lambda t: t.detach() if isinstance(t, torch.Tensor) else t, out), grads


def run_training_sample(op, sample) -> Outcome | None:
    """Compile one sample's forward and backward, compare with eager, classify (None:
    the sample has nothing to differentiate, or eager itself rejects it)."""
    inp, args, kwargs = _leaf_copy(sample)
    leaves = [t for t in _tensors((inp, args, kwargs)) if t.requires_grad]
    if not leaves:
        return None
    dispatched = _Dispatched()
    try:
        with warnings.catch_warnings(), dispatched:
            warnings.simplefilter("ignore")
            expected = _forward_backward(lambda: op.op(inp, *args, **kwargs), leaves)
    except Exception:  # noqa: BLE001 - not a training sample (e.g. no differentiable output)
        return None
    reached = frozenset(dispatched.families)
    if not _tensors(expected[1]):
        return None

    c_inp, c_args, c_kwargs = _leaf_copy(sample)
    c_leaves = [t for t in _tensors((c_inp, c_args, c_kwargs)) if t.requires_grad]
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    options = {"target": test_opinfo.TARGET}
    compiled = torch.compile(lambda: op.op(c_inp, *c_args, **c_kwargs),
                             backend=lambda gm, ex: pypto_backend(gm, ex, options=options),
                             dynamic=False)
    try:
        with collect() as graphs, checking_specs(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            actual = _forward_backward(compiled, c_leaves)
        compare_outputs(actual[0], expected[0])
        for i, (a, e) in enumerate(zip(actual[1], expected[1])):
            try:
                compare_outputs(a, e)
            except AssertionError as err:
                raise AssertionError(f"gradient {i}: {err}") from None
    except Exception as e:  # noqa: BLE001 - any error is a failure of this sample
        return Outcome("fail", f"{sample_signature(sample)}: {describe_error(e)}", reached)

    reasons = []
    for g in graphs:
        d = g.to_dict()
        if d.get("eager_reason"):
            reasons.append(f"graph ran eagerly: {d['eager_reason']}")
        reasons += sorted(set(d.get("extern_reasons", {}).values()))
    breaks = torch._dynamo.utils.counters["graph_break"]
    if breaks:
        first = " ".join(sorted(breaks)[0].split())
        reasons.append("graph break: " + first.split(" Explanation:")[0][:120])
    kinds = {g.name.rsplit("_", 1)[-1] for g in graphs}
    if "backward" not in kinds:
        reasons.append("no backward graph reached the pypto compiler (a graph break, or "
                       "outputs that are views of the inputs, which AOTAutograd replays)")
    return Outcome("fallback" if reasons else "pass", "; ".join(reasons), reached)


def run_training_opinfo(op, max_samples: int = MAX_SAMPLES) -> list[Outcome]:
    torch.manual_seed(0)
    samples = list(op.sample_inputs("cpu", torch.float32, requires_grad=True))
    spread = pick_samples(samples, max_samples)  # first and last, then the others in order
    outcomes = []
    for sample in spread + [s for s in samples if all(s is not t for t in spread)]:
        if len(outcomes) == max_samples:
            break
        outcome = run_training_sample(op, sample)
        if outcome is not None:
            outcomes.append(outcome)
    return outcomes


# --- pytest ----------------------------------------------------------------------------
_PLAN = training_plan()


@pytest.mark.skipif(op_db is None, reason="torch.testing._internal needs expecttest")
@pytest.mark.parametrize("family,op", _PLAN, ids=[f"{f}:{opinfo_name(o)}" for f, o in _PLAN])
def test_training(family, op):
    fails = [o.detail for o in run_training_opinfo(op) if o.status == "fail"]
    assert not fails, f"{opinfo_name(op)}: {len(fails)} samples failed:\n" + "\n".join(fails)


# --- docs/opinfo.md --------------------------------------------------------------------
def sweep(max_samples: int = MAX_SAMPLES, verbose: bool = True):
    results = []
    for fam, op in _PLAN:
        start = time.perf_counter()
        outcomes = run_training_opinfo(op, max_samples)
        results.append((fam, opinfo_name(op), outcomes))
        if verbose:
            counts = dict(collections.Counter(o.status for o in outcomes))
            print(f"{fam:28s} {opinfo_name(op):36s} {counts} "
                  f"{time.perf_counter() - start:.1f}s", flush=True)
            for o in outcomes:
                if o.status == "fail":
                    print(f"    FAIL {o.detail}", flush=True)
    return results


def render(results, seconds: float) -> str:
    """The docs section: per family, the samples that reach it (the OpInfos matched to
    it by name, and every sample whose eager forward + backward dispatched to it)."""
    table, lowered = _table_families(), _lowered_families()
    counts = collections.defaultdict(collections.Counter)
    names = collections.defaultdict(set)
    total = collections.Counter()
    for fam, name, outcomes in results:
        for o in outcomes:
            total[o.status] += 1
            for f in ({fam} | o.reached) & (table | lowered):
                counts[f][o.status] += 1
                names[f].add(name)
    rows = ["| family | from | OpInfos | pass | fallback | fail |",
            "| --- | --- | --- | ---: | ---: | ---: |"]
    for fam in sorted(counts):
        source = " + ".join(s for s, fams in (("table", table), ("lowering", lowered))
                            if fam in fams)
        c = counts[fam]
        ops = sorted(names[fam])
        shown = ", ".join(ops[:4]) + (f" (+{len(ops) - 4})" if len(ops) > 4 else "")
        rows.append(f"| `{fam}` | {source} | {shown} | {c['pass']} | {c['fallback']} | "
                    f"{c['fail']} |")
    n = sum(total.values())
    uncovered = sorted((table | lowered) - set(counts))
    notes = []
    for fam, name, outcomes in results:
        for status in ("fail", "fallback"):
            why = collections.Counter(o.detail for o in outcomes if o.status == status)
            for detail, k in sorted(why.items()):
                notes.append(f"| {name} | {status} | {k} | {detail.replace('|', '/')[:400]} |")
    lines = [
        TRAINING_MARKER,
        "## Training (forward + backward)",
        "",
        "Every op family the decomposition table rewrites or the lowering registry lowers, "
        "through the differentiable OpInfos that reach it: those matched to it by name "
        "(a `*_backward` family through its forward's) and every sample whose eager forward "
        f"and backward dispatch to it. Up to {MAX_SAMPLES} float32 samples per OpInfo with "
        "`requires_grad=True`, compiled with `torch.compile(backend=\"pypto\")` (target "
        f"`{test_opinfo.TARGET}`); the outputs and every input gradient (a seeded random "
        "cotangent through `torch.autograd.grad`) are compared with eager. pass / "
        "fallback / fail as above; a fallback also counts a sample whose backward graph "
        "never reached the backend. A sample counts once in the totals and once for each "
        f"family it reaches. Regenerate with `{REGENERATE}` (about "
        f"{max(1, round(seconds / 60))} minutes on 2 cores); `pytest "
        "tests/test_training_ops.py` runs the same sweep and fails on any fail.",
        "",
        f"**Totals: {total['pass']} pass, {total['fallback']} fallback, {total['fail']} fail "
        f"({n} samples, {len(results)} OpInfos, {len(counts)} of the "
        f"{len(table | lowered)} families reached).**",
        "",
        *rows,
        "",
        f"Families no sample reaches ({len(uncovered)}: in-place, out=, integer, quantized, "
        "sparse, collective or CUDA-only ops, ops with no differentiable float32 OpInfo, "
        "and composite ops whose OpInfo has another name): "
        + ", ".join(f"`{f}`" for f in uncovered) + ".",
    ]
    if notes:
        lines += ["", "### Training fallbacks and failures", "",
                  "| OpInfo | status | samples | why |", "| --- | --- | ---: | --- |", *notes]
    return "\n".join(lines) + "\n"


def write_docs(section: str) -> None:
    text = DOCS.read_text() if DOCS.exists() else ""
    at = text.find(TRAINING_MARKER)
    head = (text[:at] if at >= 0 else text).rstrip("\n")
    DOCS.write_text(head + "\n\n" + section)


def main(argv=None) -> int:
    global _PLAN
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write-docs", action="store_true", help=f"update {DOCS}")
    parser.add_argument("-k", default=None, help="only OpInfos or families containing this")
    parser.add_argument("--max-samples", type=int, default=MAX_SAMPLES)
    args = parser.parse_args(argv)
    if args.write_docs and (args.k or args.max_samples != MAX_SAMPLES
                            or test_opinfo.TARGET != "reference"):
        parser.error("--write-docs records the default sweep only")
    if op_db is None:
        print("cannot import op_db (torch.testing._internal needs expecttest)", file=sys.stderr)
        return 2
    if args.k:
        _PLAN = [(f, o) for f, o in _PLAN if args.k in opinfo_name(o) or args.k in f]
    logging.getLogger("torch._dynamo").setLevel(logging.ERROR)
    start = time.perf_counter()
    results = sweep(args.max_samples)
    seconds = time.perf_counter() - start
    section = render(results, seconds)
    print(section)
    print(f"sweep took {seconds:.0f}s")
    if args.write_docs:
        write_docs(section)
        print(f"wrote {DOCS}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
