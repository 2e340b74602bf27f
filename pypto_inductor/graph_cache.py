"""On-disk cache of compiled inference graphs, keyed by the Dynamo graph: a warm process
skips AOTAutograd's trace, lowering and planning of such a graph.

On a warm start (a new process, kernels cached) AOTAutograd's trace is ~0.4-0.5 s of a
zoo model's first call and our lowering + planning ~0.3 s (docs/benchmarks.md). The
backend looks the Dynamo graph up here before AOTAutograd runs (:func:`key`): the graph's
code (and its subgraphs'), every input's metadata (dtype, sizes, strides, storage offset,
device, requires_grad), grad mode, the options, the hardware model, torch and Python
versions, a hash of pypto_inductor's sources and module settings (fusion/plan_cache.py's).
A hit (:func:`load`) is the FusionPlan of the ATen graph AOTAutograd made of it, pickled;
the backend builds its CompiledGraph (kernels from the kernel cache) and calls it the way
AOTAutograd's inference wrapper does (grad off during the call, boxed arguments).

Only graphs where that wrapper does nothing else are stored (:func:`storable`): static
sizes (AOTAutograd adds no shape guards), no parameters, constants or called modules on
the graph module,
an inference graph (grad off, or no input requiring grad) with no input mutation, every
output a fresh tensor (no alias of an input or of another output), no tensor subclass,
RNG functionalisation, effect token or grad-mode change, autocast off, and the ATen graph
taking the Dynamo graph's inputs one for one. Anything else takes the usual path (with the
plan cache). Entries are written atomically (temporary + ``os.replace``); an entry that
does not unpickle is ignored and rewritten. ``PYPTO_INDUCTOR_GRAPH_CACHE=0`` (or
``PYPTO_INDUCTOR_PLAN_CACHE=0``) turns it off.
"""
from __future__ import annotations

import dataclasses
import hashlib
import io
import os
import pickle
import sys
from pathlib import Path

import torch
import torch.fx as fx

from . import config as _config
from .fusion import plan_cache
from .fusion.planner import FusionPlan

FORMAT = 2  # 2: TileOp.group (fma within one ATen op call)
stats = {"hits": 0, "misses": 0, "stored": 0, "rejected": 0, "bypassed": 0}


def enabled() -> bool:
    return plan_cache.enabled() and \
        os.environ.get("PYPTO_INDUCTOR_GRAPH_CACHE", "1") not in ("0", "")


def cache_dir() -> Path:
    return _config.cache_dir("graphs")


def _static(x) -> bool:
    if isinstance(x, torch.Tensor):
        return not any(isinstance(s, torch.SymInt)
                       for s in (*x.shape, *x.stride(), x.storage_offset()))
    return type(x) in (int, float, bool)


def storable_graph(gm: fx.GraphModule, example_inputs, cfg) -> bool:
    """Whether a Dynamo graph's compile may be stored (here, or saved by aot_compile:
    precompile.py): everything its plan depends on is in the graph's code and inputs'
    metadata."""
    if cfg.debug_dir or torch._C._is_any_autocast_enabled():
        return False
    if any(True for _ in gm.parameters()) or any(True for _ in gm.buffers()):
        return False
    # constants' values and called modules' settings are not in the graph's code
    return not any(n.op in ("get_attr", "call_module") for m in gm.modules()
                   if isinstance(m, fx.GraphModule) for n in m.graph.nodes) \
        and all(map(_static, example_inputs))


def settings_tag(cfg, hw) -> str:
    """A hash of what a compile depends on besides the graph and its inputs: the entry
    format, pypto_inductor's sources and module settings, the options, the hardware model."""
    h = hashlib.sha256()
    for part in (f"graph format {FORMAT}", plan_cache.code_hash(), plan_cache.settings_hash(),
                 repr(dataclasses.replace(cfg, report_path=None)), repr(hw)):
        h.update(part.encode() + b"\0")
    return h.hexdigest()


def key(gm: fx.GraphModule, example_inputs, cfg, hw) -> str | None:
    """The cache key of a Dynamo graph, or None when its compile is never stored."""
    if not enabled() or not storable_graph(gm, example_inputs, cfg):
        return None
    h = hashlib.sha256()
    for part in (settings_tag(cfg, hw), torch.__version__, sys.version,
                 f"grad {torch.is_grad_enabled()}"):
        h.update(part.encode() + b"\0")
    for name, mod in gm.named_modules():
        if isinstance(mod, fx.GraphModule):
            h.update(f"{name}\0{mod.code}\0".encode())
    for x in example_inputs:
        h.update(plan_cache.meta(x).encode() + b"\0")
    return h.hexdigest()


def storable(fw_metadata, n_inputs: int, aten_gm: fx.GraphModule) -> bool:
    """Whether AOTAutograd's inference wrapper around this graph only turns grad off
    (see the module docstring)."""
    m = fw_metadata
    if m is None or m.num_intermediate_bases or m.is_rng_op_functionalized or m.tokens \
            or m.grad_enabled_mutation is not None or m.dynamic_outputs:
        return False
    if any(i.mutates_data or i.mutates_metadata or i.mutates_storage_metadata
           for i in m.input_info):
        return False
    if any(o.output_type.name != "non_alias" or not isinstance(o.raw_type, type) or
           not issubclass(o.raw_type, torch.Tensor) for o in m.output_info):
        return False
    if not all(type(x).__name__ == "PlainTensorMeta" or isinstance(x, int)
               for x in (*m.subclass_inp_meta, *m.subclass_fw_graph_out_meta)):
        return False
    placeholders = [n for n in aten_gm.graph.nodes if n.op == "placeholder"]
    return len(placeholders) == n_inputs == len(m.input_info)


class _Pickler(pickle.Pickler):
    def reducer_override(self, obj):
        if isinstance(obj, torch._ops.OpOverload):  # pickled by name
            return _op, (obj._schema.name, obj._overloadname)
        if isinstance(obj, (torch._ops.HigherOrderOperator, fx.GraphModule)):
            raise pickle.PicklingError(f"{type(obj).__name__} is not stored")
        return NotImplemented


def _op(qualified: str, overload: str):
    namespace, name = qualified.split("::")
    return getattr(getattr(getattr(torch.ops, namespace), name), overload)


def dumps(obj) -> bytes:
    """``obj`` (a FusionPlan, or a tuple holding one) pickled with ops by name; raises
    pickle.PicklingError for what is not stored (a higher-order op's subgraph, say)."""
    buf = io.BytesIO()
    _Pickler(buf, protocol=pickle.HIGHEST_PROTOCOL).dump((FORMAT, obj))
    return buf.getvalue()


def loads(data: bytes):
    """What :func:`dumps` pickled; ValueError for another format's entry."""
    fmt, obj = pickle.loads(data)
    if fmt != FORMAT:
        raise ValueError(f"a graph entry of format {fmt}, not {FORMAT}")
    return obj


def load(k: str) -> FusionPlan | None:
    path = cache_dir() / f"{k}.pkl"
    try:
        data = path.read_bytes()
    except OSError:
        stats["misses"] += 1
        return None
    try:
        plan = loads(data)
        if not isinstance(plan, FusionPlan):
            raise ValueError("not an entry of this format")
    except Exception:  # noqa: BLE001 - corrupt or stale: compiled anew and rewritten
        stats["rejected"] += 1
        stats["misses"] += 1
        return None
    stats["hits"] += 1
    return plan


def save(k: str, plan: FusionPlan) -> None:
    """Atomic (plan_cache.write_atomic); a plan that does not pickle (a higher-order op's
    subgraph, say) is not stored."""
    try:
        plan_cache.write_atomic(cache_dir() / f"{k}.pkl", dumps(plan))
        stats["stored"] += 1
    except Exception:  # noqa: BLE001 - not storable or a read-only cache: compiled anyway
        stats["bypassed"] += 1


def inference_call(compiled):
    """``compiled`` (a CompiledGraph) called as AOTAutograd's inference wrapper calls its
    compiled graph: the arguments as a list, grad off during the call."""
    set_grad = torch._C._set_grad_enabled
    is_grad = torch.is_grad_enabled

    def run(*args):
        grad = is_grad()
        if grad:
            set_grad(False)
        try:
            return compiled(list(args))
        finally:
            if grad:
                set_grad(True)
    return run
