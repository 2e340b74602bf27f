"""The torch.compile entry: ``torch.compile(model, backend="pypto", options={...})``.

Dynamo hands us an FX graph; AOTAutograd (with our decomposition table) turns
it into functional ATen forward and backward graphs, and each of those is
lowered, planned and compiled here into a CompiledGraph. The hardware model the
planner uses comes from here, with this machine's calibrated numbers for the
host (:mod:`.calibrate`).
"""
from __future__ import annotations

import itertools
import warnings
from pathlib import Path

import torch
import torch.fx as fx
from torch._dynamo import exc as dynamo_exc
from torch._dynamo.backends.common import aot_autograd
from functorch.compile import make_boxed_func

from . import graph_cache, precompile, training_cache
from .calibrate import hardware_model
from .codegen import get_target
from .config import Config, ConfigError, check_mode, parse_options
from .fusion import plan_cache, plan_fusion
from .fusion import Decision, RoiEstimate
from .ir import ExternOp
from .lowering import GraphNotLowerable, decomposition_table, lower_graph
from .lowering.attention import rewrite_attention
from .lowering.conv import rewrite_convolutions
from .lowering.conv_layout import (compute_channels_last, keep_eager_output_layouts,
                                   use_channels_last)
from .lowering.identity_ops import drop_identity_ops
from .lowering.patch_conv import patchify_convolutions
from .lowering.unbacked import split_at_unbacked
from .lowering.cse import cse
from .lowering.decompositions import python_decompositions_bypassed
from .lowering.graph import FORCED
from .lowering.saved_layouts import note_forward, restride, traced_noncontiguous
from .report import GraphReport, publish
from .runtime import CompiledGraph, KernelBuildError, unsupported_device

_graph_ids = itertools.count()


class UnsupportedOpsError(RuntimeError):
    """fallback='error' and the graph has ops that would run eagerly."""


# Inference graphs get torch's common-subexpression pass before lowering (AOTAutograd runs
# it on training graphs only): each SDPA call's bool-to-float mask conversion is its own
# `where` otherwise, one identical float mask written per layer
CSE_INFERENCE = True
# AOTAutograd calls the graph's generated function itself (the benchmark turns it off)
DIRECT_CALL = True
# Errors that are the answer the user asked for (fallback='error', a bad option), and
# Dynamo's control flow raised through a backend (output_graph lets these through: a
# restart of its analysis, e.g. to trace a float scalar as a tensor under dynamic=True, or
# a frame to skip): never turned into an eager fallback
_DELIBERATE = (UnsupportedOpsError, KernelBuildError, ConfigError,
               dynamo_exc.RestartAnalysis, dynamo_exc.ShortenTraceback, dynamo_exc.SkipFrame)


def _unexpected(where: str, e: Exception, config: Config, name: str,
                gm: fx.GraphModule) -> None:
    """An unexpected exception while compiling: re-raised in strict mode (the tests and the
    fuzzer: a bug must not hide), else a warning naming it and an eager graph ``name`` in
    the report, and the caller runs eagerly."""
    if isinstance(e, _DELIBERATE) or config.raise_compile_errors:
        raise e
    reason = (f"compiling it raised {type(e).__name__}: {e} (a bug in pypto_inductor; "
              "options={'strict': True} raises it instead)")
    warnings.warn(f"pypto_inductor: {where} runs eagerly: {reason}", stacklevel=3)
    publish(GraphReport.eager(name, reason, gm), config,
            hardware_model(config.hardware_name, config.capacity_bytes))


def compile_graph(gm: fx.GraphModule, example_inputs, config: Config, kind: str,
                  attention: list | None = None, convs: list | None = None,
                  record: dict | None = None):
    """Lower, plan and compile one ATen graph; returns the boxed callable. ``attention``:
    the attention decisions made on the Dynamo graph, reported with the first graph.
    ``record``: gets the plan, its CompiledGraph and ``saved_from`` under "plan",
    "compiled" and "saved_from" when the graph compiled; with "inputs" in it (an inference
    graph for graph_cache) only when graph_cache may store it.
    An unexpected exception makes the graph run eagerly (:func:`_unexpected`)."""
    name = f"g{next(_graph_ids)}_{kind}"
    if kind == "backward":
        _donate_nothing()
    try:
        return _compile_graph(gm, config, name, attention, convs, record)
    except Exception as e:  # noqa: BLE001 - see _unexpected
        _unexpected(f"graph {name}", e, config, name, gm)
        return make_boxed_func(gm.forward)


def _donate_nothing() -> None:
    """Tell AOTAutograd that this backward reuses no saved tensor's storage (Inductor's
    may, torch then forbids ``retain_graph``). Ours never does (its buffer pool takes only
    buffers nothing else references), so ``backward(retain_graph=True)`` stays legal even
    when the backward compiled with the forward (training_cache's non-lazy mode)."""
    context = torch._guards.TracingContext.try_get()
    if context is not None and context.fw_metadata is not None:
        context.fw_metadata.bw_donated_idxs = []


def _compile_graph(gm: fx.GraphModule, config: Config, name: str, attention: list | None,
                   convs: list | None, record: dict | None = None):
    hw = hardware_model(config.hardware_name, config.capacity_bytes)
    found = split_at_unbacked(gm)
    if found is not None:  # data-dependent sizes: compiled in parts (lowering/unbacked.py)
        return _compile_parts(*found, config, name)
    try:
        device = unsupported_device(gm, get_target(config.target))
        if device:
            raise GraphNotLowerable(device)
        compute_channels_last(gm)
        context = torch._guards.TracingContext.try_get()
        drop_identity_ops(gm, getattr(context and context.fw_metadata, "num_forward", None)
                          if name.endswith("_forward") else None)
        traced = traced_noncontiguous(gm) if name.endswith("_forward") else set()
        if name.endswith(("_forward", "_backward")):  # a training graph: see saved_layouts
            restride(gm, context and context.fw_metadata, name.endswith("_backward"))
        graph = lower_graph(_cse(gm) if CSE_INFERENCE and name.endswith("_inference") else gm,
                            config, name)
    except GraphNotLowerable as e:
        if config.fallback == "error":
            raise UnsupportedOpsError(f"graph {name} cannot be lowered: {e}") from e
        warnings.warn(f"pypto_inductor: graph {name} runs eagerly: {e}", stacklevel=2)
        publish(GraphReport.eager(name, str(e), gm), config, hw)
        return make_boxed_func(gm.forward)
    if config.fallback == "error":
        eager = [f"{n.name} = {n.op_name} ({n.reason})" for n in graph.nodes
                 if isinstance(n, ExternOp) and n.reason != FORCED]
        if eager:
            raise UnsupportedOpsError(
                f"fallback='error' and these ops of graph {name} would run eagerly: "
                + "; ".join(eager)
                + ". Use fallback='eager' to run them eagerly, or list them in fallback_ops.")
    plan = plan_cache.plan(gm, graph, name.split("_", 1)[1], hw, config, plan_fusion)
    if attention:
        plan.decisions[:0] = [_attention_decision(d) for d in attention]
        attention.clear()
    if convs:  # the conv rewrites (lowering/conv.py, patch_conv.py), with the first graph
        plan.decisions[:0] = [Decision(a, b, True, why, c and _conv_roi(c, hw))
                              for a, b, why, c in convs]
        convs.clear()
    context = torch._guards.TracingContext.try_get()
    # a training forward's outputs from here on are saved for the backward (codegen/graph/layouts.py)
    saved_from = getattr(context and context.fw_metadata, "num_forward", None) \
        if name.endswith("_forward") else None
    compiled = CompiledGraph(plan, get_target(config.target), config, eager=gm.forward,
                             saved_from=saved_from)
    note_forward(context and context.fw_metadata, plan, compiled, saved_from, traced)
    if config.debug_dir:
        _dump(Path(config.debug_dir), gm, plan)
    publish(GraphReport(name, plan, compiled), config, hw)
    if record is not None and ("inputs" not in record or graph_cache.storable(
            context and context.fw_metadata, record["inputs"], gm)):
        record.update(plan=plan, compiled=compiled, saved_from=saved_from)

    # the generated function itself (no frames of a closure and CompiledGraph.__call__ per
    # call); boxed: it takes the argument list and empties it. Its globals hold the
    # CompiledGraph (other_device), which lives as long as the function
    if DIRECT_CALL:
        run = compiled.call
    else:  # the benchmark's "before"
        def run(args: list) -> list:
            return compiled(args)
    run._boxed_call = True  # a function attribute: wrappers (functools.wraps) keep it
    return run


def _compile_parts(split: fx.GraphModule, eager: set[str], config: Config, name: str):
    """Each part of a graph split at its data-dependent sizes compiled (the ops binding them
    run eagerly, reported so); the parts run in order, as the split module calls them."""
    hw = hardware_model(config.hardware_name, config.capacity_bytes)
    if config.fallback == "error":
        ops = [str(n.target) for sub in sorted(eager)
               for n in split.get_submodule(sub).graph.nodes if n.op == "call_function"]
        raise UnsupportedOpsError(
            f"fallback='error' and these ops of graph {name} would run eagerly: "
            + "; ".join(ops) + " (their result sizes depend on data). Use fallback='eager' to "
            "run them eagerly, or turn off Dynamo's capture_dynamic_output_shape_ops / "
            "capture_scalar_outputs.")
    for sub, part in list(split.named_children()):
        part_name = f"{name}_{sub}"
        if sub in eager:
            ops = ", ".join(str(n.target) for n in part.graph.nodes if n.op == "call_function")
            publish(GraphReport.eager(part_name, f"{ops}: result sizes depend on data (they "
                                      "bind the later parts' sizes)", part), config, hw)
            continue
        out = part.graph.output_node()
        single = not isinstance(out.args[0], (tuple, list))
        if single:  # lowering takes a graph's outputs as a sequence
            out.args = ((out.args[0],),)
            part.recompile()
        run = _compile_graph(part, config, part_name, None, None)
        del split._modules[sub]  # a plain attribute: the split module's code calls it
        setattr(split, sub, _Unboxed(run, single))
    return make_boxed_func(split.forward)


class _Unboxed:
    """A compiled (boxed) part called as the split module calls its submodules."""

    def __init__(self, run, single: bool):
        self.run, self.single = run, single

    def __call__(self, *args):
        outs = self.run(list(args))
        return outs[0] if self.single else tuple(outs)


def _attention_decision(d) -> Decision:
    """An attention decision (lowering/attention.py) as the fusion report's Decision."""
    roi = None if d.flash_us is None else RoiEstimate(
        d.unfused_us, d.flash_us, d.bandwidth_saving_pct, d.launch_overhead_reduction_pct,
        0.0, d.common_us)
    return Decision(d.first, d.last, d.fused, d.reason, roi)


def _conv_roi(c, hw) -> RoiEstimate:
    """A rewritten conv chain (lowering/conv.py) as a roofline of both forms."""
    common = c.conv_flops / hw.cube_flops_per_s * 1e6
    bw = hw.gm_bandwidth_bytes_per_s / 1e6
    unfused = common + c.unfused_bytes / bw + hw.launch_us * (1 + c.launches_saved)
    fused = common + c.fused_bytes / bw + hw.launch_us
    return RoiEstimate(unfused, fused, 100.0 * (1 - c.fused_bytes / c.unfused_bytes),
                       100.0 * c.launches_saved / (1 + c.launches_saved), 0.0, common)


def _dump(root: Path, gm: fx.GraphModule, plan) -> None:
    root.mkdir(parents=True, exist_ok=True)
    name = plan.graph.name
    (root / f"{name}.aten.py").write_text(gm.code)
    (root / f"{name}.tilegraph.txt").write_text(str(plan.graph) + "\n")
    for tile in plan.tiles:
        (root / f"{tile.name}.pto.txt").write_text(tile.pto_text(plan.graph.specs) + "\n")


def _cse(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy of ``gm`` with identical pure nodes merged (random ops, mutations and
    outputs' storages kept apart: lowering/cse.py); ``gm`` itself stays the eager fallback."""
    return cse(gm)


def pypto_backend(gm: fx.GraphModule, example_inputs, options=None, mode=None):
    """The Dynamo backend registered as "pypto"."""
    check_mode(mode)
    config = parse_options(options)
    get_target(config.target)  # fail early, with a clear message, if the target is unusable
    saving = precompile.requested()  # inside aot_compile: the result must serialize
    hw = hardware_model(config.hardware_name, config.capacity_bytes)
    key = graph_cache.key(gm, example_inputs, config, hw)
    if key is not None and not saving:
        cached = _from_cache(key, gm, config)
        if cached is not None:
            return cached
    record = {"inputs": len(example_inputs)} if key is not None or (
        saving and graph_cache.storable_graph(gm, example_inputs, config)) else None
    attention = []
    if config.fusion and config.fuse_attention:  # before AOTAutograd: see lowering/attention.py
        attention = rewrite_attention(gm, hw, config.roi_threshold or hw.default_roi_threshold)
    # a convolution forced eager (fallback_ops) stays ATen's convolution
    conv_ok = config.fusion and not config.forced_fallback("aten.convolution.default")
    convs = rewrite_convolutions(gm, example_inputs) if conv_ok else []
    patches = patchify_convolutions(gm) if conv_ok else []
    # (use_channels_last: a training graph's convolutions channels-last)
    if config.fusion and (convs or patches or use_channels_last(gm, example_inputs)):
        keep_eager_output_layouts(gm)
    convs += patches
    compilers = dict(
        fw_compiler=lambda g, ex, rec=None: compile_graph(g, ex, config, "forward",
                                                          attention, convs, rec),
        bw_compiler=lambda g, ex, rec=None: compile_graph(g, ex, config, "backward",
                                                          record=rec),
        inference_compiler=lambda g, ex, rec=record: compile_graph(
            g, ex, config, "inference", attention, convs, rec))
    # a training graph: from AOTAutograd's cache or stored there, or saved by aot_compile
    training = training_cache.training_graph(gm, example_inputs, config) if saving else \
        training_cache.usable(gm, example_inputs, config)
    if training:
        compilers, built = training_cache.output_codes(compilers, config)
    try:
        # AOTAutograd traces forward and backward here
        with python_decompositions_bypassed(), (
                training_cache.cached_aot(
                    config, hw, key and not saving and training_cache.cache_key(key))
                if training
                else precompile.autograd_cache_unbundled()) as loaded:
            compiled = aot_autograd(**compilers, decompositions=decomposition_table(),
                                    keep_inference_input_mutations=True)(gm, example_inputs)
    except Exception as e:  # noqa: BLE001 - tracing or decomposing failed: see _unexpected
        _unexpected("the Dynamo graph", e, config, f"g{next(_graph_ids)}_dynamo", gm)
        if saving:
            raise precompile.PrecompileError(f"compiling the graph raised {e!r}") from e
        return gm.forward
    if key is not None and record and "plan" in record:
        graph_cache.save(key, record["plan"])
    for graph in loaded or ():  # from AOTAutograd's cache: reported under new names
        graph.plan.graph.name = f"g{next(_graph_ids)}_{graph.plan.graph.name.split('_', 1)[1]}"
        publish(GraphReport(graph.plan.graph.name, graph.plan, graph), config, hw)
    if saving:
        return precompile.saved_training(compiled, built) if training else \
            precompile.saved_graph(record, config)
    return compiled


def _from_cache(key: str, gm: fx.GraphModule, config: Config):
    """The Dynamo graph's compiled callable rebuilt from its graph_cache entry (no
    AOTAutograd trace, lowering or planning), or None (a miss, or building it failed: the
    graph is compiled anew, which reports any error the usual way)."""
    plan = graph_cache.load(key)
    if plan is None:
        return None
    try:
        name = plan.graph.name = f"g{next(_graph_ids)}_inference"
        compiled = CompiledGraph(plan, get_target(config.target), config, eager=gm.forward)
    except Exception:  # noqa: BLE001 - see the docstring
        graph_cache.stats["rejected"] += 1
        return None
    publish(GraphReport(name, plan, compiled), config, plan.hardware)
    return graph_cache.inference_call(compiled)


__all__ = ["compile_graph", "pypto_backend", "UnsupportedOpsError"]
