"""Training through backend="pypto": loss and every gradient match eager PyTorch."""
from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F

import pypto_inductor
from pypto_inductor import models
from pypto_inductor.report import collect


def _pair(name: str, dtype=torch.float32, seed: int = 0):
    """(model for pypto, identical model for eager, fresh inputs)."""
    model, inputs = models.build(name, seed=seed)
    model = model.train().to(dtype)
    torch.manual_seed(seed + 1)
    inputs = tuple(torch.randn_like(x).to(dtype) for x in inputs)
    return model, copy.deepcopy(model), inputs


def _loss_fn(kind: str, out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    if kind == "cross_entropy":  # classes along the last dim
        return F.cross_entropy(out.reshape(-1, out.shape[-1]).float(), target.reshape(-1))
    return F.mse_loss(out.float(), target.float())


def _target(kind: str, out: torch.Tensor) -> torch.Tensor:
    if kind == "cross_entropy":
        return torch.randint(0, out.shape[-1], out.shape[:-1])
    return torch.randn_like(out)


def _loss_and_grads(model, inputs, kind, target, compiled: bool, input_grad: bool = True):
    fn = torch.compile(model, backend="pypto") if compiled else model
    inputs = [x.clone().requires_grad_(input_grad) for x in inputs]
    params = [p for p in model.parameters() if p.requires_grad]
    loss = _loss_fn(kind, fn(*inputs), target)
    wrt = params + (inputs if input_grad else [])
    grads = torch.autograd.grad(loss, wrt)
    return loss, grads


@pytest.mark.parametrize("kind", ["mse", "cross_entropy"])
@pytest.mark.parametrize("name", ["mlp", "transformer", "llama"])
def test_loss_and_every_gradient_match_eager(name, kind, tol):
    model, eager, inputs = _pair(name)
    with torch.no_grad():
        target = _target(kind, eager(*inputs))
    with collect() as graphs, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loss, grads = _loss_and_grads(model, inputs, kind, target, compiled=True)
    ref_loss, ref_grads = _loss_and_grads(eager, inputs, kind, target, compiled=False)

    torch.testing.assert_close(loss, ref_loss, **tol(torch.float32))
    names = [n for n, p in model.named_parameters()] + ["input"]
    assert len(grads) == len(ref_grads) == len(names)
    for pname, g, r in zip(names, grads, ref_grads):
        torch.testing.assert_close(g, r, **tol(torch.float32), msg=lambda m: f"grad of {pname}: {m}")
    # Both the forward and the backward graph were compiled by the backend.
    kinds = sorted(g.name.rsplit("_", 1)[-1] for g in graphs)
    assert kinds == ["backward", "forward"]
    report = pypto_inductor.FusionReport(graphs).to_dict()
    assert report["summary"]["eager_graphs"] == 0
    assert report["summary"]["kernels_fused"] < report["summary"]["kernels_unfused"]


@pytest.mark.parametrize("name", ["mlp", "transformer"])
def test_training_loop_with_optimizer_matches_eager(name, tol):
    """Three SGD steps with .backward() and .grad accumulation, then compare weights."""
    model, eager, inputs = _pair(name, seed=4)
    compiled = torch.compile(model, backend="pypto")
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    ref_opt = torch.optim.SGD(eager.parameters(), lr=0.05, momentum=0.9)
    for step in range(3):
        torch.manual_seed(10 + step)
        x = torch.randn_like(inputs[0])
        target = torch.randn_like(eager(x))
        for fn, o in ((compiled, opt), (eager, ref_opt)):
            o.zero_grad()
            loss = F.mse_loss(fn(x), target)
            loss.backward()
            if fn is compiled:
                compiled_loss = loss.detach()
            else:
                torch.testing.assert_close(compiled_loss, loss.detach(), **tol(torch.float32))
            o.step()
        for (pname, p), r in zip(model.named_parameters(), eager.parameters()):
            torch.testing.assert_close(p.grad, r.grad, atol=1e-5, rtol=1e-4,
                                       msg=lambda m: f"step {step} grad of {pname}: {m}")
    for p, r in zip(model.parameters(), eager.parameters()):
        torch.testing.assert_close(p, r, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_mlp_gradients_in_half_precision(dtype, tol):
    model, eager, inputs = _pair("mlp", dtype)
    target = _target("mse", eager(*inputs)).detach()
    loss, grads = _loss_and_grads(model, inputs, "mse", target, compiled=True)
    ref_loss, ref_grads = _loss_and_grads(eager, inputs, "mse", target, compiled=False)
    torch.testing.assert_close(loss, ref_loss, **tol(dtype))
    for g, r in zip(grads, ref_grads):
        assert g.dtype == r.dtype == dtype
        torch.testing.assert_close(g, r, **tol(dtype))


def test_ln_gelu_residual_gradients(tol):
    """The fused LayerNorm -> GELU -> residual chain, differentiated through."""
    model, eager, _ = _pair("ln_gelu_residual")
    x = torch.randn(3, 8, 256)
    target = torch.randn(3, 8, 256)
    loss, grads = _loss_and_grads(model, (x,), "mse", target, compiled=True)
    ref_loss, ref_grads = _loss_and_grads(eager, (x,), "mse", target, compiled=False)
    torch.testing.assert_close(loss, ref_loss, **tol(torch.float32))
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, **tol(torch.float32))
