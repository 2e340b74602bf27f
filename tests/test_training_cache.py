"""Training graphs through AOTAutograd's cache (training_cache.py): a second compile of the
same training step (here, or in a new process: tests/test_compile_cache.py) rebuilds our
forward and backward from the entry without the joint trace, and trains as eager does;
other options miss; a graph with an ATen graph that ran eagerly is not stored."""
import pytest
import torch
from torch._dynamo.utils import counters

from pypto_inductor import backend, graph_cache, training_cache
from pypto_inductor.fusion import plan_cache
from pypto_inductor.lowering import GraphNotLowerable
from pypto_inductor.report import collect


@pytest.fixture
def caches(tmp_path, monkeypatch):
    """Our caches and Inductor's (where AOTAutograd's lives) on, in directories of their own."""
    monkeypatch.setenv("PYPTO_INDUCTOR_PLAN_CACHE", "1")
    monkeypatch.setenv("PYPTO_INDUCTOR_GRAPH_CACHE", "1")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    monkeypatch.setattr(plan_cache, "cache_dir", lambda: tmp_path / "plans")
    monkeypatch.setattr(graph_cache, "cache_dir", lambda: tmp_path / "graphs")
    monkeypatch.setattr(training_cache, "stats", {"loaded": 0})
    return tmp_path


def _model():
    torch.manual_seed(0)  # the same weights for every compile
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(),
                               torch.nn.LayerNorm(32), torch.nn.Linear(32, 8))


def _train_step(options=None):
    """One compiled step on fresh inputs, checked against eager's loss and gradients;
    returns the graphs it reported."""
    torch._dynamo.reset()
    model, ref = _model(), _model()
    x = torch.randn(6, 16)
    target = torch.randn(6, 8)
    with collect() as graphs:
        loss = torch.nn.functional.mse_loss(
            torch.compile(model, backend="pypto", options=options)(x), target)
        loss.backward()
    want = torch.nn.functional.mse_loss(ref(x), target)
    want.backward()
    torch.testing.assert_close(loss, want, atol=1e-5, rtol=1.3e-5)
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, atol=1e-5, rtol=1.3e-5)
    return graphs


def test_second_compile_comes_from_the_cache_and_trains_as_eager(caches):
    cold = _train_step()
    assert counters["aot_autograd"]["autograd_cache_saved"] == 1
    assert training_cache.stats["loaded"] == 0
    warm = _train_step()
    assert counters["aot_autograd"]["autograd_cache_hit"] == 1
    assert training_cache.stats["loaded"] == 2  # the forward and the backward
    # the report still lists both graphs, with the plans the cold compile made
    assert [[t.name.split("_", 2)[2] for t in g.plan.tiles] for g in warm] == \
        [[t.name.split("_", 2)[2] for t in g.plan.tiles] for g in cold]


def test_other_options_miss(caches):
    _train_step()
    _train_step({"fuse_attention": False})
    assert training_cache.stats["loaded"] == 0
    assert counters["aot_autograd"]["autograd_cache_saved"] == 2


def test_a_graph_that_ran_eagerly_is_not_stored(caches, monkeypatch):
    lower_graph = backend.lower_graph

    def no_backward(gm, config, name):
        if name.endswith("_backward"):
            raise GraphNotLowerable("this test's backward")
        return lower_graph(gm, config, name)
    monkeypatch.setattr(backend, "lower_graph", no_backward)
    with pytest.warns(UserWarning, match="runs eagerly"):
        _train_step()
    assert counters["aot_autograd"]["autograd_cache_saved"] == 0
    monkeypatch.setattr(backend, "lower_graph", lower_graph)
    _train_step()
    assert training_cache.stats["loaded"] == 0


def test_inference_and_disabled_cache_go_around_it(caches, monkeypatch):
    model = _model()
    with torch.no_grad():
        torch.compile(model, backend="pypto")(torch.randn(4, 16))
    assert not counters["aot_autograd"]["autograd_cache_saved"]
    monkeypatch.setenv("PYPTO_INDUCTOR_GRAPH_CACHE", "0")
    _train_step()
    assert not counters["aot_autograd"]["autograd_cache_saved"]


@pytest.mark.parametrize("name", ["gpt2", "bert", "resnet"])
def test_real_model_training_step_from_the_cache_matches_eager(caches, name):
    """A transformers model (dropout on) and the conv net (BatchNorm's running statistics
    mutated in the graph): the second compile is a hit, and its step gives eager's loss,
    gradients and buffers on a fresh batch."""
    from pypto_inductor import zoo
    tol = {"atol": 1e-5, "rtol": 1e-4}  # as tests/test_real_models.py
    for seed in (1, 2):
        torch._dynamo.reset()
        model, ref = zoo.build(name).train(), zoo.build(name).train()
        batch = zoo.batch(name, seed=seed)
        torch.manual_seed(seed)  # the same dropout masks in both
        loss = torch.compile(model, backend="pypto")(**batch)["loss"]
        loss.backward()
        torch.manual_seed(seed)
        want = ref(**batch)["loss"]
        want.backward()
        torch.testing.assert_close(loss, want, **tol)
        for (p_name, p), q in zip(model.named_parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, q.grad, **tol, msg=lambda m: f"{p_name}: {m}")
        for b, c in zip(model.buffers(), ref.buffers()):
            torch.testing.assert_close(b, c, **tol)
        if seed == 1:
            stored = counters["aot_autograd"]["autograd_cache_saved"]
    assert stored >= 1 and training_cache.stats["loaded"] == 2 * stored  # forwards, backwards


def _retained_backward_twice():
    """backward(retain_graph=True) then backward(): each gradient twice eager's one."""
    torch._dynamo.reset()
    model, ref = _model(), _model()
    x = torch.randn(6, 16)
    loss = torch.compile(model, backend="pypto")(x).pow(2).mean()
    loss.backward(retain_graph=True)
    loss.backward()
    ref(x).pow(2).mean().backward()
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, 2 * q.grad, atol=1e-5, rtol=1.3e-5)


def test_retain_graph_with_the_backward_compiled_with_the_forward(caches):
    """The cache compiles the backward with the forward (not at the first backward, where
    AOTAutograd would learn of retain_graph): it must not be marked as reusing saved
    tensors, or torch refuses retain_graph. Cold, then loaded from the cache."""
    _retained_backward_twice()
    _retained_backward_twice()
    assert training_cache.stats["loaded"] == 2


def test_retain_graph_without_the_cache(monkeypatch):
    monkeypatch.setenv("PYPTO_INDUCTOR_GRAPH_CACHE", "0")
    _retained_backward_twice()
