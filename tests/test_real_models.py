"""The real-model zoo (pypto_inductor/zoo.py) through backend="pypto", against eager PyTorch.

Per model: the eval forward, three AdamW training steps, greedy generation (causal
LMs), bf16 autocast forward + backward, and a compiled ``opt.step()`` for Adam,
AdamW and SGD with momentum. Every compiled graph must be lowered (no graph runs
eagerly as a whole) and every kernel must build.
"""
from __future__ import annotations

import copy
import warnings

import pytest
import torch

import pypto_inductor
from pypto_inductor import zoo
from pypto_inductor.lowering import EAGER_BY_CHOICE
from pypto_inductor.report import collect

MODELS = list(zoo.ZOO)
FP32 = {"atol": 1e-5, "rtol": 1e-4}  # two layers of reordered fp32 sums
# AdamW normalises each update to about lr (1e-3): a gradient that differs by rounding moves a
# parameter by a small fraction of that; a wrong update moves it by lr.
AFTER_ADAMW = {"atol": 1e-4, "rtol": 1e-4}
NOISE_GRAD = 1e-8  # a gradient of at most this at every step is zero but for rounding ...
AFTER_NOISE = {"atol": 2 * 3 * 1e-3, "rtol": 0}  # ... so 3 AdamW steps move it at most 3 lr
# Under bf16 autocast each op rounds to bf16 in eager; fused kernels keep fp32 between ops,
# so values differ by a few bf16 ulps per op; gradients are compared against their scale.
BF16 = {"atol": 2e-2, "rtol": 4e-2}


def assert_compiled_whole(graphs, kinds: set[str]) -> None:
    assert graphs, "the backend compiled no graph"
    assert {g.name.rsplit("_", 1)[-1] for g in graphs} == kinds
    problems = zoo.compile_problems(graphs)
    assert not problems, "\n".join(problems)
    # an op runs eagerly only where its eager kernel is the implementation chosen
    # (SDPA's CPU kernel, convolution, ...), never for want of a lowering
    chosen = set(EAGER_BY_CHOICE.values())
    unchosen = sorted({r for g in graphs for r in g.to_dict()["extern_reasons"].values()
                       if r.partition(": ")[2] not in chosen})
    assert not unchosen, f"extern ops without a lowering: {unchosen}"


def assert_outputs_close(out, ref, **tol) -> None:
    out, ref = zoo.output_tensors(out), zoo.output_tensors(ref)
    assert out.keys() == ref.keys()
    for key in ref:
        torch.testing.assert_close(out[key], ref[key], **tol, msg=lambda m: f"output {key}: {m}")


def assert_grads_close(model, ref_model, tol, scaled: bool = False, when: str = "",
                       exact: dict | None = None) -> None:
    """Gradients close to the eager model's. With ``exact`` (name -> float64 gradient of the
    same step), a half-type gradient that is not close to eager's passes only if it is no
    further from the float64 one than eager's is (Inductor's tests' fp64 reference check): our
    kernels accumulate in float32 where eager rounds to bf16, so eager is the less exact."""
    for (name, p), r in zip(model.named_parameters(), ref_model.parameters()):
        assert (p.grad is None) == (r.grad is None), f"{when}grad of {name}: one side is None"
        if r.grad is None:
            continue
        # scaled: relative to the gradient's own scale, at least fp32's atol (a gradient that
        # is zero in exact arithmetic, as attention's key bias, is rounding noise on both sides)
        atol = (max(tol["atol"] * float(r.grad.abs().max()), FP32["atol"]) if scaled
                else tol["atol"])
        try:
            torch.testing.assert_close(p.grad, r.grad, atol=atol, rtol=tol["rtol"],
                                       msg=lambda m: f"{when}grad of {name}: {m}")
        except AssertionError:
            if exact is None:
                raise
            ours = float((p.grad.double() - exact[name]).abs().max())
            eagers = float((r.grad.double() - exact[name]).abs().max())
            assert ours <= 1.5 * eagers + atol / 10, (
                f"{when}grad of {name}: {ours:.3g} from float64, eager's {eagers:.3g}")


def float64_grads(model, batch) -> dict:
    """name -> the float64 gradient of ``model``'s loss on ``batch`` (a float64 copy)."""
    exact = copy.deepcopy(model).double()
    kw = {k: v.double() if torch.is_tensor(v) and v.is_floating_point() else v
          for k, v in batch.items()}
    exact(**kw)["loss"].backward()
    return {n: p.grad for n, p in exact.named_parameters() if p.grad is not None}


@pytest.fixture
def quiet():
    """The backend's fallback warnings are checked through the report, not printed."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


@pytest.mark.parametrize("name", MODELS)
def test_eval_forward_matches_eager(name, quiet):
    model = zoo.build(name)
    batch = zoo.batch(name, seed=1)
    compiled = torch.compile(model, backend="pypto")
    with torch.no_grad(), collect() as graphs:
        out = compiled(**batch)
    with torch.no_grad():
        ref = model(**batch)
    assert_outputs_close(out, ref, **FP32)
    assert_compiled_whole(graphs, {"inference"})


@pytest.mark.parametrize("name", MODELS)
def test_fallback_error_names_every_op_that_would_run_eagerly(name, quiet):
    """fallback="error" passes, or its error names each extern op of the first such graph."""
    model = zoo.build(name)
    batch = zoo.batch(name, seed=1)
    with torch.no_grad(), collect() as graphs:
        torch.compile(model, backend="pypto")(**batch)
    externs = [set(g["fallback_ops"]) for g in pypto_inductor.FusionReport(graphs).to_dict()[
        "graphs"] if g["fallback_ops"]]
    torch._dynamo.reset()
    strict = torch.compile(model, backend="pypto", options={"fallback": "error"})
    if not externs:
        with torch.no_grad():
            strict(**batch)
        return
    with torch.no_grad(), pytest.raises(Exception) as raised:
        strict(**batch)
    assert "UnsupportedOpsError" in repr(raised.value) or "fallback='error'" in str(raised.value)
    missing = [op for op in sorted(externs[0]) if op not in str(raised.value)]
    assert not missing, f"the error does not name {missing}: {raised.value}"


@pytest.mark.parametrize("name", MODELS)
def test_training_three_adamw_steps_match_eager(name, quiet):
    model = zoo.build(name).train()
    ref_model = copy.deepcopy(model)
    compiled = torch.compile(model, backend="pypto")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ref_opt = torch.optim.AdamW(ref_model.parameters(), lr=1e-3)
    noise = {n for n, _ in ref_model.named_parameters()}  # zero gradients but for rounding
    with collect() as graphs:
        for step in range(3):
            batch = zoo.batch(name, seed=10 + step)
            loss = compiled(**batch)["loss"]
            loss.backward()
            ref_loss = ref_model(**batch)["loss"]
            ref_loss.backward()
            torch.testing.assert_close(loss, ref_loss, **FP32,
                                       msg=lambda m: f"step {step} loss: {m}")
            assert_grads_close(model, ref_model, FP32, when=f"step {step}: ")
            noise -= {n for n, r in ref_model.named_parameters()
                      if r.grad is None or r.grad.abs().max() > NOISE_GRAD}
            for o in (opt, ref_opt):
                o.step()
                o.zero_grad()
    for (pname, p), r in zip(model.state_dict().items(), ref_model.state_dict().values()):
        # AdamW turns a gradient of pure rounding noise (an attention key's bias: softmax
        # ignores it, ~1e-10) into updates of about lr whatever its value: the bound then
        torch.testing.assert_close(p, r, **(AFTER_NOISE if pname in noise else AFTER_ADAMW),
                                   msg=lambda m: f"{pname} after 3 steps: {m}")
    assert_compiled_whole(graphs, {"forward", "backward"})


# None: Dynamo's default, what users run: sizes become symbolic once they change (Mistral's
# sliding-window cache then returns its length, a size, among the graph's outputs)
@pytest.mark.parametrize("dynamic", [None, False, True], ids=["default", "static", "dynamic"])
@pytest.mark.parametrize("name", zoo.CAUSAL_LMS)
def test_generate_matches_eager_without_extra_recompiles(name, dynamic, quiet):
    model = zoo.build(name)
    input_ids = zoo.batch(name, seed=2)["input_ids"][:, :10]
    with torch.no_grad():
        expected = model.generate(input_ids, attention_mask=torch.ones_like(input_ids),
                                  max_new_tokens=8, min_new_tokens=8, do_sample=False)
    tokens, graph_count, graphs = zoo.generate(model, input_ids, "pypto", dynamic)
    assert tokens.shape == (input_ids.shape[0], input_ids.shape[1] + 8)
    torch.testing.assert_close(tokens, expected, atol=0, rtol=0)
    # Dynamo decides recompiles from its guards, so backend="eager" compiles no more graphs
    # than Inductor, which may add shape guards of its own (compiling Inductor here is slow;
    # docs/models.md has its counts from `models --inductor`: LLaMA static 8 / dynamic 3,
    # Dynamo alone 8 / 2). A backend that specialises a size shows up as an extra graph.
    _, eager_graph_count, _ = zoo.generate(model, input_ids, "eager", dynamic)
    assert graph_count <= eager_graph_count, (
        f"pypto compiled {graph_count} graphs, Dynamo alone {eager_graph_count}")
    assert_compiled_whole(graphs, {"inference"})


@pytest.mark.parametrize("name", MODELS)
def test_bf16_autocast_forward_backward_matches_eager(name, quiet):
    model = zoo.build(name).train()
    ref_model = copy.deepcopy(model)
    ref_model_f64 = copy.deepcopy(model)
    batch = zoo.batch(name, seed=3)
    compiled = torch.compile(model, backend="pypto")
    with collect() as graphs:
        with torch.autocast("cpu", torch.bfloat16):
            out = compiled(**batch)
        out["loss"].backward()
    with torch.autocast("cpu", torch.bfloat16):
        ref = ref_model(**batch)
    ref["loss"].backward()
    assert_outputs_close(out, ref, **BF16)
    assert_grads_close(model, ref_model, BF16, scaled=True,
                       exact=float64_grads(ref_model_f64, batch))
    assert_compiled_whole(graphs, {"forward", "backward"})


# Activation checkpointing wraps each layer's random ops (SDPA, for its dropout) in
# AOTAutograd's RNG-state higher-order ops, which sent the whole graph eagerly:
# causal SDPA (LLaMA), a padding mask (BERT), a vision encoder (ViT).
@pytest.mark.parametrize("name", ["llama", "bert", "vit"])
def test_gradient_checkpointing_training_matches_eager(name, quiet):
    model = zoo.build(name).train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    ref_model = copy.deepcopy(model)
    batch = zoo.batch(name, seed=4)
    with collect() as graphs:
        loss = torch.compile(model, backend="pypto")(**batch)["loss"]
        loss.backward()
    ref_loss = ref_model(**batch)["loss"]
    ref_loss.backward()
    torch.testing.assert_close(loss, ref_loss, **FP32)
    assert_grads_close(model, ref_model, FP32)
    assert_compiled_whole(graphs, {"forward", "backward"})
    # no dropout: SDPA's forward, its recompute and its backward run the native kernels
    native = [e for g in graphs for e in g.to_dict()["extern_native"].values()]
    assert len(native) >= 3 and all(e["native"] for e in native), native


# dynamic=True training over sequence lengths: GPT-2's ``hidden[:, -logits_to_keep:]``
# (an int input, 0) segfaulted in the backward's fused LayerNorm (test_dynamic has the
# small case); BERT's padding mask and token types change length with it.
@pytest.mark.parametrize("name", ["gpt2", "bert"])
def test_dynamic_training_over_lengths_matches_eager(name, quiet):
    model = zoo.build(name).train()
    ref_model = copy.deepcopy(model)
    compiled = torch.compile(model, backend="pypto", dynamic=True)
    with collect() as graphs:
        for length in (32, 48, 40):
            batch = {k: v[:, :length] if torch.is_tensor(v) and v.dim() == 2 else v
                     for k, v in zoo.batch(name, seed=length).items()}
            for m in (model, ref_model):
                m.zero_grad()
            loss = compiled(**batch)["loss"]
            loss.backward()
            ref_loss = ref_model(**batch)["loss"]
            ref_loss.backward()
            torch.testing.assert_close(loss, ref_loss, **FP32)
            assert_grads_close(model, ref_model, FP32, when=f"length {length}: ")
    assert_compiled_whole(graphs, {"forward", "backward"})


OPTIMIZERS = {
    "adam": lambda params: torch.optim.Adam(params, lr=1e-2),
    "adamw": lambda params: torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1),
    "sgd_momentum": lambda params: torch.optim.SGD(params, lr=1e-2, momentum=0.9),
}


# The compiled step's graph depends only on the parameter list. Its compile time grows
# faster than linearly with the number of parameters (the fusion planner: 47 of 72 s for
# GPT-2's 28 parameters, 500 s for Whisper's 89, on this machine), so three models cover
# the kinds of parameter lists: tied embeddings (GPT-2), GQA projections and RMSNorm
# weights (LLaMA), 4-D conv weights and BatchNorm (ResNet).
OPTIMIZER_MODELS = ["gpt2", "llama", "resnet"]


@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
@pytest.mark.parametrize("name", OPTIMIZER_MODELS)
def test_compiled_optimizer_step_matches_eager(name, optimizer, quiet):
    model = zoo.build(name)
    ref_model = copy.deepcopy(model)
    opt = OPTIMIZERS[optimizer](model.parameters())
    ref_opt = OPTIMIZERS[optimizer](ref_model.parameters())
    step = torch.compile(opt.step, backend="pypto")
    gen = torch.Generator().manual_seed(4)
    with collect() as graphs:
        for i in range(3):
            for p, r in zip(model.parameters(), ref_model.parameters()):
                p.grad = torch.randn(p.shape, generator=gen)
                r.grad = p.grad.clone()
            step()
            ref_opt.step()
            for (pname, p), r in zip(model.named_parameters(), ref_model.parameters()):
                torch.testing.assert_close(p, r, **FP32, msg=lambda m: f"step {i}: {pname}: {m}")
    for state, ref_state in zip(opt.state.values(), ref_opt.state.values()):
        for key in ref_state:
            torch.testing.assert_close(state[key], ref_state[key], **FP32, msg=key)
    assert_compiled_whole(graphs, {"inference"})
