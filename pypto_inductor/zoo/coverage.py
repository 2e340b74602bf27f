"""Coverage table of the real-model zoo (``python -m pypto_inductor models``).

For every zoo model it compiles the eval forward (the inference graph) and one
training step (forward and backward graphs) with backend="pypto", checks them
against eager, and tabulates per graph kind: graphs, graphs run eagerly, kernels
(native or on the reference executor, and why), kernels that failed to build, and
extern ops (run eagerly inside the graph) with counts and reasons. For the causal
LMs it also counts the graphs greedy generation compiles, against Dynamo alone.
"""
from __future__ import annotations

import collections
import copy
import dataclasses
import warnings

import torch
from tabulate import tabulate

from . import CAUSAL_LMS, ZOO, batch, build, generate, output_tensors
from ..report import FusionReport, collect

KINDS = ("inference", "forward", "backward")


@dataclasses.dataclass
class GraphCoverage:
    """What happened to one model's graphs of one kind (inference, forward, backward)."""

    model: str
    kind: str
    graphs: int = 0
    eager_graphs: list[str] = dataclasses.field(default_factory=list)  # reasons
    kernels: int = 0
    reference_tiles: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    build_failures: list[str] = dataclasses.field(default_factory=list)
    externs: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    extern_reasons: dict[str, set] = dataclasses.field(
        default_factory=lambda: collections.defaultdict(set))
    max_error: float | None = None  # outputs (inference) or gradients (training) vs eager,
    # in units of the fp32 tolerance (_tolerance_ratio)
    error: str | None = None  # compiling or running raised

    def add(self, graph: dict) -> None:
        self.graphs += 1
        if graph.get("eager_reason"):
            self.eager_graphs.append(graph["eager_reason"])
        self.kernels += len(graph["fusion_tiles"])
        for tile in graph["fusion_tiles"]:
            if tile["kernel_fallback"]:
                self.build_failures.append(f"{tile['name']}: {tile['kernel_fallback']}")
            native = tile.get("native")
            if native and not native["native"]:
                self.reference_tiles[native["reason"] or "unknown"] += 1
        self.externs.update(graph["fallback_ops"])
        for text in graph.get("extern_reasons", {}).values():
            op, _, reason = text.partition(": ")
            self.extern_reasons[op].add(reason)


# tests/test_real_models.py's fp32 tolerance (two layers of reordered fp32 sums)
ATOL, RTOL = 1e-5, 1e-4


def _tolerance_ratio(out: torch.Tensor, ref: torch.Tensor) -> float:
    """max |out - ref| / (ATOL + RTOL |ref|) over the elements: <= 1 is assert_close's pass.

    Element-wise, as the tests compare: a gradient that is zero in exact arithmetic (an
    attention key bias) is rounding noise on both sides, which a ratio to the tensor's own
    largest value would report as a 100% error."""
    out, ref = out.detach().double(), ref.detach().double()
    return float(((out - ref).abs() / (ATOL + RTOL * ref.abs())).max())


def _by_kind(name: str, reports, error: float | None, errors: str | None) -> list[GraphCoverage]:
    kinds = {}
    for graph in FusionReport(reports).to_dict()["graphs"]:
        kind = graph["name"].rsplit("_", 1)[-1]
        kinds.setdefault(kind, GraphCoverage(name, kind)).add(graph)
    for cov in kinds.values():
        cov.max_error, cov.error = error, errors
    return list(kinds.values())


def inference_coverage(name: str, options: dict | None = None) -> list[GraphCoverage]:
    model, inputs = build(name), batch(name, seed=1)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="pypto", options=options)
    error = failure = None
    with torch.no_grad(), collect() as reports:
        try:
            out = output_tensors(compiled(**inputs))
            ref = output_tensors(model(**inputs))
            error = max(_tolerance_ratio(out[k], ref[k]) for k in ref)
        except Exception as e:  # noqa: BLE001 - the table records it
            failure = f"{type(e).__name__}: {e}"
    torch._dynamo.reset()
    return _by_kind(name, reports, error, failure) or [GraphCoverage(name, "inference",
                                                                     error=failure)]


def training_coverage(name: str, options: dict | None = None) -> list[GraphCoverage]:
    model = build(name).train()
    ref_model = copy.deepcopy(model)
    inputs = batch(name, seed=10)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="pypto", options=options)
    error = failure = None
    with collect() as reports:
        try:
            compiled(**inputs)["loss"].backward()
            ref_model(**inputs)["loss"].backward()
            error = max(_tolerance_ratio(p.grad, r.grad)
                        for p, r in zip(model.parameters(), ref_model.parameters())
                        if r.grad is not None)
        except Exception as e:  # noqa: BLE001 - the table records it
            failure = f"{type(e).__name__}: {e}"
    torch._dynamo.reset()
    return _by_kind(name, reports, error, failure) or [GraphCoverage(name, "forward",
                                                                     error=failure)]


@dataclasses.dataclass
class GenerationCoverage:
    model: str
    dynamic: bool
    tokens_match: bool | None
    graphs_compiled: dict[str, int]  # backend -> graphs it compiled
    eager_graphs: int = 0
    error: str | None = None


def generation_coverage(name: str, dynamic: bool, backends=("pypto", "eager"),
                        options: dict | None = None) -> GenerationCoverage:
    model = build(name)
    input_ids = batch(name, seed=2)["input_ids"][:, :10]
    with torch.no_grad():
        expected = model.generate(input_ids, attention_mask=torch.ones_like(input_ids),
                                  max_new_tokens=8, min_new_tokens=8, do_sample=False)
    cov = GenerationCoverage(name, dynamic, None, {})
    for backend in backends:
        try:
            tokens, graphs_compiled, reports = generate(model, input_ids, backend, dynamic,
                                               options=options if backend == "pypto" else None)
        except Exception as e:  # noqa: BLE001 - the table records it
            cov.error = f"{backend}: {type(e).__name__}: {e}"
            continue
        cov.graphs_compiled[backend] = graphs_compiled
        if backend == "pypto":
            cov.tokens_match = bool(torch.equal(tokens, expected))
            cov.eager_graphs = FusionReport(reports).to_dict()["summary"]["eager_graphs"]
    return cov


def collect_coverage(models=None, options=None, generation: bool = True,
                     inductor: bool = False, progress=None):
    """(graph coverage rows, generation rows) for ``models`` (default: the whole zoo)."""
    rows, gen_rows = [], []
    backends = ("pypto", "eager", "inductor") if inductor else ("pypto", "eager")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # failures are in the table
        for name in models or list(ZOO):
            if progress:
                progress(name)
            rows += inference_coverage(name, options) + training_coverage(name, options)
            if generation and name in CAUSAL_LMS:
                gen_rows += [generation_coverage(name, dyn, backends, options)
                             for dyn in (False, True)]
    rows.sort(key=lambda r: (list(ZOO).index(r.model), KINDS.index(r.kind)
                             if r.kind in KINDS else len(KINDS)))
    return rows, gen_rows


def _short(op: str) -> str:
    return op.removeprefix("aten.").removesuffix(".default")


def markdown(rows: list[GraphCoverage], gen_rows: list[GenerationCoverage], header: str) -> str:
    out = [header, "", "## Per model and graph", ""]
    table = []
    for r in rows:
        table.append([
            r.model, r.kind, r.graphs, len(r.eager_graphs), r.kernels,
            sum(r.reference_tiles.values()), len(r.build_failures),
            ", ".join(f"{_short(op)} x{n}" for op, n in sorted(r.externs.items())) or "-",
            "-" if r.max_error is None else f"{r.max_error:.1e}",
            r.error or "",
        ])
    out.append(tabulate(table, tablefmt="github", headers=[
        "model", "graph", "graphs", "eager graphs", "kernels", "on reference", "build failures",
        "extern ops (count)", "error / tolerance", "error"]))
    out += ["", "`error / tolerance`: the largest |compiled - eager| / (1e-5 + 1e-4 |eager|) over "
            "the elements of the outputs (inference) or of the parameter gradients of one "
            "training step (forward, backward); at most 1 passes torch.testing.assert_close "
            "with the fp32 tolerance tests/test_real_models.py uses.", ""]

    out += ["## Extern ops and why", ""]
    externs: dict[tuple, list] = collections.defaultdict(list)
    for r in rows:
        for op, n in r.externs.items():
            key = (op, "; ".join(sorted(r.extern_reasons.get(op, {"?"}))))
            externs[key].append(f"{r.model} {r.kind} x{n}")
    out.append(tabulate([[_short(op), reason, ", ".join(where)]
                         for (op, reason), where in sorted(externs.items())],
                        tablefmt="github", headers=["op", "reason", "where (count)"])
               if externs else "None.")

    out += ["", "## Kernels on the reference executor and why", ""]
    reference: dict[str, list] = collections.defaultdict(list)
    for r in rows:
        for reason, n in r.reference_tiles.items():
            reference[reason].append(f"{r.model} {r.kind} x{n}")
    out.append(tabulate([[reason, ", ".join(where)] for reason, where in sorted(reference.items())],
                        tablefmt="github", headers=["reason", "where (count)"])
               if reference else "None.")

    problems = [[r.model, r.kind, "graph runs eagerly", reason]
                for r in rows for reason in r.eager_graphs]
    problems += [[r.model, r.kind, "kernel failed to build", f] for r in rows
                 for f in r.build_failures]
    out += ["", "## Graphs run eagerly and kernels that failed to build", ""]
    out.append(tabulate(problems, tablefmt="github", headers=["model", "graph", "what", "why"])
               if problems else "None.")

    if gen_rows:
        order = ["pypto", "eager", "inductor"]
        backends = sorted({b for g in gen_rows for b in g.graphs_compiled}, key=order.index)
        out += ["", "## Generation (`generate(max_new_tokens=8, do_sample=False)`, "
                "`model.forward` compiled)", ""]
        out.append(tabulate(
            [[g.model, "dynamic" if g.dynamic else "static",
              {True: "yes", False: "NO", None: "-"}[g.tokens_match], g.eager_graphs]
             + [g.graphs_compiled.get(b, "-") for b in backends] + [g.error or ""]
             for g in gen_rows],
            tablefmt="github", headers=["model", "shapes", "tokens equal eager",
                                        "eager graphs (pypto)"]
            + [f"graphs compiled ({b})" for b in backends] + ["error"]))
        out += ["", "Graphs compiled: graphs the backend compiled during generation (first "
                "compiles, graph breaks, recompiles; a restart of Dynamo's analysis is not one). "
                "`eager` is Dynamo alone: recompiles are Dynamo's decision, so a backend matches "
                "it unless it adds shape guards of its own."]
    out += ["", NOTES]
    return "\n".join(out) + "\n"


# Why the tables look as they do (kept with the generator, so a regenerated page keeps them).
NOTES = """## Notes

**Extern ops.** Every extern op in the zoo is one whose eager kernel is the implementation
chosen (`EAGER_BY_CHOICE` in `pypto_inductor/lowering/graph.py`; tests/test_real_models.py
fails on any other): SDPA's fused CPU kernel and its backward, kept whole because decomposing
it changed what its backward receives (the logsumexp), which gave wrong gradients; convolution
and its backward (oneDNN / GEMM libraries, as in Inductor's CPU backend; in inference graphs a
conv -> BatchNorm -> add/ReLU chain is one oneDNN call with the BatchNorm folded into its
weights, `pypto_inductor.conv_fused`, lowering/conv.py); ResNet's max pooling
(a window op like convolution, no window tile; the cpu target runs native kernels for it,
codegen/cpp/pooling.py). All other ops of every zoo graph are
lowered: embedding and gathers, arange, padding, scatters, `copy_` mutations, the optimizer
chain. tests/test_decompositions.py checks SDPA causal, boolean-masked and additive-masked,
forward and backward, fp32 and bf16 autocast, against eager.

**Kernels on the reference executor** (lowered tile ops run through their ATen op by the
reference executor, not as generated C++; results are eager's own): none in any zoo graph.
The last ones were a causal-LM forward's small tile over the [batch, seq] inputs, reshaped
across its last dim (a row kernel now admits a value only when its last dim splits into
the rows: `fusion/capacity.ROW_LAST_DIM_SPLITS`), LLaMA, Qwen2 and Mistral's GQA
`repeat_kv` backward into RoPE's (a view of a computed value that only adds or removes 1s
is native inside a column reduction), and ResNet's BatchNorm training statistics and their
backward sums (over N, H, W of an NCHW tensor, C kept: codegen/cpp/emit_mixed.py). Writes
at data-dependent positions are native too: embedding backward's
`index_put(accumulate=True)` is a native loop (codegen/cpp/index_put.py) and
cross-entropy's backward scatter an elementwise `where`.

**Graphs run eagerly.** None: no zoo graph has data-dependent sizes. A graph that has them
(`nonzero` under Dynamo's `capture_dynamic_output_shape_ops`) runs eagerly, and the report's
reason and the warning name the first node with such a size
(tests/test_graph_constants.py).

**torchvision's ResNet-18.** Not in the zoo: the only torchvision built for torch 2.13.0
(0.28.0 on the package index) is a CUDA build whose `torchvision/_C.so` links
`libc10_cuda.so`, absent from the pinned CPU torch, so `import torchvision` fails
(`operator torchvision::nms does not exist`); 0.29.x requires torch>=2.14, and installing it
would replace torch. The zoo's `resnet` is ResNet-18's structure at toy size (stem with max
pooling, BasicBlocks with BatchNorm and projected shortcuts, average pooling, fc).
"""


__all__ = ["GraphCoverage", "GenerationCoverage", "collect_coverage", "generation_coverage",
           "inference_coverage", "markdown", "training_coverage"]
