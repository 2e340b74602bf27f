"""A training backward compiled for the layouts the forward really saves
(lowering/saved_layouts.py): Whisper's front end makes eager's residual stream transposed
([B, C, T] in memory); our forward writes it contiguous, and the backward, compiled for
contiguous saved inputs, copies nothing. Gradients against eager, switches on and off."""
from __future__ import annotations

import copy

import pytest
import torch

from pypto_inductor import backend
from pypto_inductor.codegen.graph import layouts
from pypto_inductor.lowering import saved_layouts
from pypto_inductor.report import collect


class TransposedResidual(torch.nn.Module):
    """Whisper's encoder in small: conv1d + GELU, transposed to [B, T, C] plus a position
    table (eager keeps the transposed layout through the residual adds), then pre-LN
    blocks of LayerNorm, Linear + GELU and a residual add."""

    def __init__(self, c=16, t=12, layers=2):
        super().__init__()
        self.conv = torch.nn.Conv1d(4, c, 3, padding=1)
        self.pos = torch.nn.Parameter(torch.randn(t, c))
        self.norms = torch.nn.ModuleList(torch.nn.LayerNorm(c) for _ in range(layers))
        self.fcs = torch.nn.ModuleList(torch.nn.Linear(c, c) for _ in range(layers))

    def forward(self, x):
        h = torch.nn.functional.gelu(self.conv(x)).permute(0, 2, 1) + self.pos
        for norm, fc in zip(self.norms, self.fcs):
            h = h + torch.nn.functional.gelu(fc(norm(h)))
        return h.pow(2).mean()


def _step(model, compiled, x):
    model.zero_grad(set_to_none=True)
    loss = compiled(x)
    loss.backward()
    return loss.detach(), [p.grad for p in model.parameters()]


def _train_against_eager(monkeypatch, seed, steps, shape, **sizes) -> list:
    """``steps`` training steps of a compiled TransposedResidual against eager's; the shapes
    of the backward inputs copied into their compiled layout (layouts.relayout)."""
    copies = []
    relayout = layouts.relayout
    monkeypatch.setattr(layouts, "relayout",
                        lambda t, *a: copies.append(tuple(t.shape)) or relayout(t, *a))
    torch._dynamo.reset()
    torch.manual_seed(seed)
    model = TransposedResidual(**sizes)
    ref = copy.deepcopy(model)
    compiled = torch.compile(model, backend="pypto")
    with collect() as reports:
        for _ in range(steps):
            x = torch.randn(*shape)
            loss, grads = _step(model, compiled, x)
            want, wgrads = _step(ref, ref, x)
            torch.testing.assert_close(loss, want, rtol=1e-5, atol=1e-5)
            for g, w in zip(grads, wgrads):
                torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)
    backward = [r for r in reports if r.name.endswith("_backward")]
    assert backward and all(r.compiled is not None for r in backward)
    return copies


@pytest.mark.parametrize("on", [True, False])
def test_backward_reads_the_saved_layouts_without_copies(on, monkeypatch):
    monkeypatch.setattr(saved_layouts, "SAVED_CONTIGUOUS", on)
    copies = _train_against_eager(monkeypatch, 0, 3, (3, 4, 12))
    if on:
        assert copies == []
    else:  # the residual stream's saved values, copied into the traced layout per call
        assert copies


def test_a_wrong_guess_is_copied_not_wrong(monkeypatch):
    # the forward's note says "contiguous" for every saved output, right or not (the
    # transposed weight Linear's backward reads is not): the backward's input check
    # copies what arrives in other strides, the gradients hold
    note = saved_layouts.note_forward

    def note_all(fw_metadata, plan, compiled, saved_from, traced):
        note(fw_metadata, plan, compiled, saved_from, traced)
        if fw_metadata is not None and saved_from is not None:
            saved_layouts.note(fw_metadata, {o for o in plan.graph.outputs[saved_from:]
                                             if isinstance(o, str)})

    monkeypatch.setattr(backend, "note_forward", note_all)
    copies = _train_against_eager(monkeypatch, 1, 2, (2, 4, 10), c=8, t=10, layers=1)
    assert copies  # a saved transposed weight: guessed contiguous, copied


def test_dynamic_sizes_are_left_as_traced(tol):
    """Dynamic shapes (symbolic strides) in a training graph: nothing is asked of their
    layout (it would guard on a size), the steps still match eager."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = TransposedResidual()
    ref = copy.deepcopy(model)
    compiled = torch.compile(model, backend="pypto", dynamic=True)
    for batch in (3, 5):
        x = torch.randn(batch, 4, 12)
        loss, grads = _step(model, compiled, x)
        want, wgrads = _step(ref, ref, x)
        torch.testing.assert_close(loss, want, **tol(torch.float32))
        torch.testing.assert_close(grads, wgrads, **tol(torch.float32))
