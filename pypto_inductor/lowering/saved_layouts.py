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
contiguous strides and re-propagates the graph's fake values (fx's FakeTensorProp) before
lowering. Nothing depends on the guess being right: an input of other strides is still
checked and copied into the strides compiled for (fix_inputs), so a wrong guess costs a
copy, never a wrong value. Any failure leaves the graph as traced.
"""
from __future__ import annotations

import weakref

import torch
import torch.fx as fx
from torch.fx.passes.fake_tensor_prop import FakeTensorProp
from torch._prims_common import make_contiguous_strides_for
from torch.fx.experimental.symbolic_shapes import free_symbols

SAVED_CONTIGUOUS = True  # the benchmarks' switch (read when a graph compiles)

# id(fw_metadata) -> (a weak reference to it, the names of the saved outputs the forward
# writes contiguous); fw_metadata is an unhashable dataclass
_written_contiguous: dict[int, tuple] = {}


def _noted(fw_metadata) -> set:
    entry = _written_contiguous.get(id(fw_metadata))
    return entry[1] if entry is not None and entry[0]() is fw_metadata else set()


def _strided(v) -> bool:
    """``v`` a traced tensor of static sizes and strides that is not contiguous. Symbolic
    ones are left as traced: asking would guard on a size (or fail, an unbacked one)."""
    return isinstance(v, torch.Tensor) and not free_symbols(v) and not v.is_contiguous()


def traced_noncontiguous(gm: fx.GraphModule) -> set[str]:
    """The names of ``gm``'s outputs whose traced strides are not contiguous (before
    :func:`restride` makes them what our kernels write)."""
    out = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    return {a.name for a in out.all_input_nodes if _strided(a.meta.get("val"))}


def note_forward(fw_metadata, plan, compiled, saved_from: int | None,
                 traced: set[str]) -> None:
    """Remember which of a training forward's saved outputs (``saved_from`` on) a native
    kernel writes fresh and contiguous while the trace gave them other strides
    (``traced``: :func:`traced_noncontiguous`)."""
    if not SAVED_CONTIGUOUS or fw_metadata is None or saved_from is None:
        return
    written = set()  # the values native inline kernels write fresh (contiguous)
    for tile in plan.tiles:
        kernel = compiled.kernels.get(tile.name)
        launch = getattr(kernel, "launch", None)
        if kernel is None or not kernel.native or launch is None \
                or getattr(launch, "gemm", False):
            continue
        writes = getattr(launch, "writes", None) or {}
        written.update(out for j, out in enumerate(tile.outputs) if j not in writes)
    note(fw_metadata, {out for out in plan.graph.outputs[saved_from:]
                       if out in written and out in traced})


def note(fw_metadata, names: set[str]) -> None:
    """Note ``names`` as saved outputs the backward of ``fw_metadata`` gets contiguous."""
    if names:
        key = id(fw_metadata)
        try:
            ref = weakref.ref(fw_metadata, lambda _, key=key: _written_contiguous.pop(key, None))
        except TypeError:  # not weakly referenceable: nothing noted
            return
        _written_contiguous[key] = (ref, names)


def restride(gm: fx.GraphModule, fw_metadata, backward: bool) -> list[str]:
    """A backward's fake values made the layouts our forward produces, before lowering: its
    inputs that the forward writes contiguous (note_forward, ``SAVED_CONTIGUOUS``) get
    contiguous strides, every other value's strides follow (fx's FakeTensorProp). The inputs
    changed; ``gm`` as it was when nothing changes or the propagation fails."""
    names = _noted(fw_metadata) if backward and SAVED_CONTIGUOUS and fw_metadata is not None \
        else set()
    if not names:
        return []
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    vals = [n.meta.get("val") for n in placeholders]
    fake_mode = next((getattr(v, "fake_mode", None) for v in vals
                      if getattr(v, "fake_mode", None) is not None), None)
    if fake_mode is None:
        return []
    changed = [n for n, v in zip(placeholders, vals) if n.name in names and _strided(v)]
    if not changed:
        return []
    before = {n: n.meta.get("val") for n in gm.graph.nodes}
    inputs = []
    with fake_mode:
        for n, v in zip(placeholders, vals):
            if n in changed:
                v = torch.empty_strided(v.shape, make_contiguous_strides_for(v.shape),
                                        dtype=v.dtype, device=v.device,
                                        requires_grad=v.requires_grad)
            inputs.append(v)
        try:
            FakeTensorProp(gm, fake_mode).propagate_dont_convert_inputs(*inputs)
        except Exception:  # noqa: BLE001 - the graph stays as traced
            for n, v in before.items():
                n.meta["val"] = v
            return []
    return [n.name for n in changed]


__all__ = ["SAVED_CONTIGUOUS", "note", "note_forward", "restride",
           "traced_noncontiguous"]
