"""Composite ATen ops lowered through a traced decomposition (lowering/composite.py).

nn.TransformerEncoderLayer in eval takes PyTorch's fast path, one
``aten._transformer_encoder_layer_fwd`` call; compiled, it becomes matmul,
softmax and LayerNorm tiles and matches eager.
"""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn

import pypto_inductor
from pypto_inductor.codegen.cpp import compiler as cpp_build
from pypto_inductor.report import collect


@pytest.fixture(autouse=True)
def _cache(tmp_path_factory, monkeypatch):
    root = tmp_path_factory.getbasetemp() / "cpp_cache"
    monkeypatch.setenv("PYPTO_INDUCTOR_CACHE_DIR", str(root))
    monkeypatch.setattr(cpp_build, "loaded", dict(cpp_build.loaded))


@pytest.mark.parametrize("dynamic", [False, True])
@pytest.mark.parametrize("norm_first,activation", [(False, "relu"), (True, "gelu")])
def test_transformer_encoder_layer_fast_path_is_lowered(norm_first, activation, dynamic):
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(32, 4, 64, batch_first=True, norm_first=norm_first,
                                       activation=activation).eval()
    compiled = torch.compile(layer, backend="pypto", dynamic=dynamic,
                             options={"fallback": "error"})
    with torch.no_grad(), collect() as graphs, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for shape in ((2, 5, 32), (3, 7, 32)) if dynamic else ((2, 5, 32),):
            x = torch.randn(*shape)
            torch.testing.assert_close(compiled(x), layer(x), atol=1e-5, rtol=1e-4)
    rep = pypto_inductor.FusionReport(graphs).to_dict()
    assert rep["summary"]["fallback_op_count"] == 0 and rep["summary"]["eager_graphs"] == 0
    kinds = {k for g in rep["graphs"] for t in g["fusion_tiles"] for k in t["op_kinds"]}
    assert {"matmul", "softmax", "var"} <= kinds
    assert len(graphs) == 1  # one graph, and for dynamic no recompile at the second size


MASKS = {
    "key padding": lambda L: {"src_key_padding_mask": torch.tensor(
        [[False] * L, [False] * (L - 2) + [True] * 2])},
    "key padding, a row fully masked": lambda L: {"src_key_padding_mask": torch.tensor(
        [[False] * L, [True] * L])},
    "causal float": lambda L: {"src_mask": torch.triu(torch.full((L, L), float("-inf")), 1)},
    "causal bool": lambda L: {"src_mask": torch.triu(torch.ones(L, L, dtype=torch.bool), 1)},
    "both": lambda L: {"src_mask": torch.triu(torch.full((L, L), float("-inf")), 1),
                       "src_key_padding_mask": torch.tensor([[False] * L,
                                                             [False] * (L - 1) + [True]])},
}


@pytest.mark.parametrize("case", list(MASKS))
def test_transformer_encoder_layer_with_masks(case):
    """Masked scores as the fast path masks them (a fully masked row is NaN in both)."""
    torch.manual_seed(1)
    layer = nn.TransformerEncoderLayer(16, 2, 32, batch_first=True).eval()
    x, masks = torch.randn(2, 5, 16), MASKS[case](5)
    names = list(masks)

    def fn(x, *ms):
        return layer(x, **dict(zip(names, ms)))

    with torch.no_grad(), collect() as graphs, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = torch.compile(fn, backend="pypto", options={"fallback": "error"})(x, *masks.values())
        ref = fn(x, *masks.values())
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-4, equal_nan=True)
    rep = pypto_inductor.FusionReport(graphs).to_dict()
    assert rep["summary"]["fallback_op_count"] == 0


# --- _foreach_* ---------------------------------------------------------------------------
def _foreach_opinfos():
    try:
        from torch.testing._internal import common_methods_invocations as cmi
    except ImportError:  # pragma: no cover - needs expecttest
        return []
    from pypto_inductor.lowering import lowered_op_names

    lowered = {name.split(".", 1)[1] for name in lowered_op_names()}
    dbs = cmi.foreach_unary_op_db + cmi.foreach_binary_op_db + cmi.foreach_pointwise_op_db \
        + cmi.foreach_other_op_db
    return [op for op in dbs if op.name in lowered]


FOREACH = _foreach_opinfos()


@pytest.mark.parametrize("op", FOREACH, ids=[op.name for op in FOREACH])
def test_foreach_opinfo_samples_match_eager(op):
    """Each foreach op's OpInfo samples (lists of tensors with scalar, list or tensor
    operands), on the reference executor as tests/test_opinfo.py runs op_db."""
    from test_opinfo import pick_samples, run_sample

    def eager_runs(sample):  # a few samples pair float lists with a bool tensor operand
        try:
            op.op(sample.input, *sample.args, **sample.kwargs)
            return True
        except RuntimeError:
            return False

    samples = [s for s in op.sample_inputs("cpu", torch.float32, requires_grad=False,
                                           num_input_tensors=[2]) if eager_runs(s)]
    samples = pick_samples(samples, 4)
    outcomes = [run_sample(op, s) for s in samples]
    fails = [o.detail for o in outcomes if o.status == "fail"]
    assert samples and not fails, fails


@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_foreach_optimizer_steps_compile_to_kernels(momentum):
    """Adam and SGD with foreach=True: every _foreach_* op becomes tile ops, updates in place."""
    import copy

    torch.manual_seed(2)
    for cls, kwargs in ((torch.optim.Adam, {"lr": 0.01}),
                        (torch.optim.SGD, {"lr": 0.1, "momentum": momentum})):
        model = nn.Sequential(nn.Linear(16, 32), nn.Linear(32, 4))
        ref = copy.deepcopy(model)
        opt = cls(model.parameters(), foreach=True, **kwargs)
        ref_opt = cls(ref.parameters(), foreach=True, **kwargs)
        step = torch.compile(opt.step, backend="pypto", options={"fallback": "error"})
        with collect() as graphs, warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for _ in range(3):
                x = torch.randn(8, 16)
                for m, o in ((model, opt), (ref, ref_opt)):
                    o.zero_grad()
                    m(x).square().mean().backward()
                step()
                ref_opt.step()
        for p, r in zip(model.parameters(), ref.parameters()):
            torch.testing.assert_close(p, r, atol=1e-6, rtol=1e-5)
        rep = pypto_inductor.FusionReport(graphs).to_dict()
        assert rep["summary"]["fallback_op_count"] == 0
