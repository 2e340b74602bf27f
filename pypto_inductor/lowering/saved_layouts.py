"""A training backward compiled for the layouts our forward really saves.

AOTAutograd traces the backward with the saved activations' strides of the trace, which
follow eager's layout rules: Whisper's encoder adds its position table to the transposed
convolution output, so eager's residual stream is laid out [B, C, T] (strides
(T*C, 1, T)) and every residual add and clone keeps that. Our kernels write their outputs
contiguous in their logical dims, so the backward got contiguous tensors where it was
compiled for transposed ones: each call copied them into the traced layout
(codegen/graph/layouts.fix_inputs: 5 copies of [4, 128, 64] per Whisper step) and its
kernels then read them transposed.

With ``SAVED_CONTIGUOUS`` the forward's compile notes which saved outputs a native kernel
writes (contiguous) where the trace says otherwise, keyed by the pair's ``fw_metadata``
(the backward compiles later, in the same tracing context); the backward's compile gives
those inputs (the forward's output nodes and the backward's inputs share their names)
contiguous strides and propagates them through the graph with FakeTensorProp before
lowering. Nothing depends on the guess being right: an input of other strides is still
checked and copied into the strides compiled for (fix_inputs), so a wrong guess costs a
copy, never a wrong value. Any failure leaves the graph as traced.
"""
from __future__ import annotations

import weakref

import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

from ..ir import TensorSpec

SAVED_CONTIGUOUS = True  # the benchmarks' switch (read when a graph compiles)

# id(fw_metadata) -> (a weak reference to it, the names of the saved outputs the forward
# writes contiguous); fw_metadata is an unhashable dataclass
_written_contiguous: dict[int, tuple] = {}


def _noted(fw_metadata) -> set:
    entry = _written_contiguous.get(id(fw_metadata))
    return entry[1] if entry is not None and entry[0]() is fw_metadata else set()


def _contiguous_strides(shape) -> tuple:
    strides, n = [], 1
    for d in reversed(shape):
        strides.append(n)
        n = n * d
    return tuple(reversed(strides))


def _is_contiguous(spec) -> bool:
    return all(statically_known_true(d == 1) or statically_known_true(s == c)
               for d, s, c in zip(spec.shape, spec.stride, _contiguous_strides(spec.shape)))


def note_forward(fw_metadata, plan, compiled, saved_from: int | None) -> None:
    """Remember which of a training forward's saved outputs (``saved_from`` on) a native
    kernel writes fresh and contiguous while the trace gives them other strides."""
    if not SAVED_CONTIGUOUS or fw_metadata is None or saved_from is None:
        return
    graph = plan.graph
    written = set()  # the values native inline kernels write fresh (contiguous)
    for tile in plan.tiles:
        kernel = compiled.kernels.get(tile.name)
        launch = getattr(kernel, "launch", None)
        if kernel is None or not kernel.native or launch is None \
                or getattr(launch, "gemm", False):
            continue
        writes = getattr(launch, "writes", None) or {}
        written.update(out for j, out in enumerate(tile.outputs) if j not in writes)
    names = set()
    for out in graph.outputs[saved_from:]:
        spec = graph.specs.get(out) if isinstance(out, str) else None
        if out in written and isinstance(spec, TensorSpec) and not _is_contiguous(spec):
            names.add(out)
    if names:
        key = id(fw_metadata)
        try:
            ref = weakref.ref(fw_metadata, lambda _, key=key: _written_contiguous.pop(key, None))
        except TypeError:  # not weakly referenceable: nothing noted
            return
        _written_contiguous[key] = (ref, names)


def restride_backward(gm: fx.GraphModule, fw_metadata) -> list[str]:
    """Give the backward ``gm``'s inputs that the forward writes contiguous (note_forward)
    contiguous strides, and every node's value the strides that follow; the names changed
    (none: ``gm`` as it was)."""
    if not SAVED_CONTIGUOUS or fw_metadata is None:
        return []
    names = _noted(fw_metadata)
    if not names:
        return []
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    vals = [n.meta.get("val") for n in placeholders]
    changed = [n for n, v in zip(placeholders, vals) if n.name in names
               and isinstance(v, torch.Tensor) and not v.is_contiguous()]
    fake_mode = next((getattr(v, "fake_mode", None) for v in vals
                      if getattr(v, "fake_mode", None) is not None), None)
    if not changed or fake_mode is None:
        return []
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp
    before = {n: n.meta.get("val") for n in gm.graph.nodes}
    inputs = []
    for n, v in zip(placeholders, vals):
        if n in changed:
            with fake_mode:
                v = torch.empty_strided(v.shape, _contiguous_strides(v.shape), dtype=v.dtype,
                                        device=v.device, requires_grad=v.requires_grad)
        inputs.append(v)
    try:
        with fake_mode:
            FakeTensorProp(gm, mode=fake_mode).propagate_dont_convert_inputs(*inputs)
    except Exception:  # noqa: BLE001 - the graph stays as traced
        for n, v in before.items():
            n.meta["val"] = v
        return []
    return [n.name for n in changed]


__all__ = ["SAVED_CONTIGUOUS", "note_forward", "restride_backward"]
