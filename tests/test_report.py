"""FusionReport: the dict layout the issue specifies, JSON round trip, text, HTML, files."""
from __future__ import annotations

import json
import warnings

import pytest
import torch

import pypto_inductor
from pypto_inductor import models
from pypto_inductor.lowering import GraphNotLowerable

TILE_KEYS = {"name", "ops", "dtype", "tile_shape", "footprint_bytes", "footprint_expr",
             "capacity_bytes"}
DECISION_KEYS = {"producer", "consumer", "fused", "reason", "roi"}
ROI_KEYS = {"bandwidth_saving_pct", "launch_overhead_reduction_pct",
            "l1_pressure_increase_pct", "roi_score"}
SUMMARY_KEYS = {"kernels_unfused", "kernels_fused", "gm_bytes_unfused", "gm_bytes_fused",
                "predicted_speedup", "fallback_op_count"}
GRAPH_KEYS = {"name", "num_ops", "fallback_ops", "fusion_tiles", "decisions"}


def _check_layout(d: dict) -> None:
    assert {"target", "hardware", "graphs", "summary"} <= set(d)
    assert {"name", "capacity_bytes"} <= set(d["hardware"])
    assert isinstance(d["hardware"]["capacity_bytes"], int)
    assert SUMMARY_KEYS <= set(d["summary"])
    for g in d["graphs"]:
        assert GRAPH_KEYS <= set(g), set(g)
        assert isinstance(g["num_ops"], int)
        assert isinstance(g["fallback_ops"], dict)
        for t in g["fusion_tiles"]:
            assert TILE_KEYS <= set(t), set(t)
            assert isinstance(t["footprint_bytes"], int)
            assert isinstance(t["footprint_expr"], str)
            assert isinstance(t["capacity_bytes"], int)
            assert isinstance(t["ops"], list) and t["ops"]
            assert isinstance(t["tile_shape"], list)
            assert all(isinstance(s, int) for s in t["tile_shape"])
        for x in g["decisions"]:
            assert DECISION_KEYS <= set(x), set(x)
            assert isinstance(x["fused"], bool) and isinstance(x["reason"], str)
            if x["roi"] is not None:
                assert ROI_KEYS <= set(x["roi"])
                assert all(isinstance(x["roi"][k], (int, float)) for k in ROI_KEYS)


@pytest.fixture
def transformer():
    torch.manual_seed(0)
    return models.TransformerBlock().eval(), torch.randn(2, 8, 64)


def test_report_layout_and_json_round_trip(transformer, run_both):
    model, x = transformer
    run_both(model, x)  # the compiled model is correct
    torch._dynamo.reset()
    rep = pypto_inductor.report(model, x)
    d = rep.to_dict()
    _check_layout(d)
    assert d["target"] == "cpu"
    assert len(d["graphs"]) == 1
    g = d["graphs"][0]
    assert g["fusion_tiles"] and g["decisions"]
    assert any(x["roi"] is not None for x in g["decisions"])
    assert any(x["fused"] for x in g["decisions"]) and any(not x["fused"] for x in g["decisions"])
    s = d["summary"]
    assert s["kernels_fused"] == len(g["fusion_tiles"])
    assert s["fallback_op_count"] == sum(g["fallback_ops"].values())
    # Plain JSON: no sympy, torch or numpy objects anywhere.
    assert json.loads(json.dumps(d)) == d


def test_report_save_json_and_html(transformer, tmp_path):
    model, x = transformer
    rep = pypto_inductor.report(model, x)
    j = rep.save(tmp_path / "out" / "report.json")
    h = rep.save(tmp_path / "report.html")
    assert j.exists() and h.exists()
    assert json.loads(j.read_text()) == json.loads(json.dumps(rep.to_dict()))
    html = h.read_text()
    assert html.startswith("<!doctype html>") and html.rstrip().endswith("</html>")
    for t in rep.to_dict()["graphs"][0]["fusion_tiles"]:
        assert t["name"] in html
    assert "summary" in html
    with pytest.raises(ValueError, match=".json or .html"):
        rep.save(tmp_path / "report.txt")


def test_report_text(transformer):
    model, x = transformer
    rep = pypto_inductor.report(model, x)
    text = str(rep)
    d = rep.to_dict()
    assert text.startswith("pypto fusion report: target=cpu")
    assert "not fused:" in text and "summary:" in text
    assert "eager ops: aten." in text or d["summary"]["fallback_op_count"] == 0
    for t in d["graphs"][0]["fusion_tiles"]:
        assert t["name"] in text


def test_report_with_backward(run_both):
    torch.manual_seed(0)
    model = models.MLP()
    x = torch.randn(8, 64)
    rep = pypto_inductor.report(model, x, backward=True)
    d = rep.to_dict()
    _check_layout(d)
    kinds = [g["name"].rsplit("_", 1)[-1] for g in d["graphs"]]
    assert kinds == ["forward", "backward"]
    assert all(p.grad is None for p in model.parameters())  # report() does not accumulate
    torch._dynamo.reset()
    run_both(model.eval(), x)


def test_report_dynamic_has_symbolic_footprints(run_both):
    model = models.LayerNormGeluResidual(64)
    x = torch.randn(3, 5, 64)
    rep = pypto_inductor.report(model, x, dynamic=True)
    d = rep.to_dict()
    _check_layout(d)
    assert json.loads(json.dumps(d)) == d
    (tile,) = d["graphs"][0]["fusion_tiles"]
    assert "tile_rows" in tile["footprint_expr"]
    torch._dynamo.reset()
    run_both(model, x, dynamic=True)


def test_report_options_flow_into_the_report(run_both):
    model = models.LayerNormGeluResidual(64)
    x = torch.randn(3, 5, 64)
    rep = pypto_inductor.report(model, x, options={"capacity_bytes": 2048, "target": "reference"})
    d = rep.to_dict()
    assert d["target"] == "reference"
    assert d["hardware"]["capacity_bytes"] == 2048
    assert all(t["capacity_bytes"] == 2048 for t in d["graphs"][0]["fusion_tiles"])
    torch._dynamo.reset()
    run_both(model, x, options={"capacity_bytes": 2048, "target": "reference"})


def test_report_counts_fallback_ops(run_both):
    torch.manual_seed(0)
    model, (x,) = models.build("conv_bn_relu")
    x = torch.randn_like(x)
    d = pypto_inductor.report(model, x).to_dict()
    _check_layout(d)
    assert d["graphs"][0]["fallback_ops"] == {"aten.convolution.default": 1}
    assert d["summary"]["fallback_op_count"] == 1
    assert "oneDNN" in d["graphs"][0]["extern_reasons"]["convolution"]  # eager by choice
    torch._dynamo.reset()
    run_both(model, x)


def test_graph_that_cannot_be_lowered_runs_eagerly(monkeypatch, tmp_path):
    import pypto_inductor.backend as backend

    def refuse(gm, config, name):
        raise GraphNotLowerable("test: refused")

    monkeypatch.setattr(backend, "lower_graph", refuse)

    def f(x):
        return torch.relu(x) * 2

    x = torch.randn(4, 8)
    with pytest.warns(UserWarning, match="runs eagerly"):
        compiled = torch.compile(f, backend="pypto")
        out = compiled(x)
    torch.testing.assert_close(out, f(x))
    with pytest.warns(UserWarning, match="runs eagerly"):
        rep = pypto_inductor.report(f, x)
    d = rep.to_dict()
    _check_layout(d)
    assert d["summary"]["eager_graphs"] == 1
    assert d["graphs"][0]["eager_reason"] == "test: refused"
    assert "runs eagerly (test: refused)" in str(rep)
    assert "test: refused" in rep.save(tmp_path / "eager.html").read_text()
    torch._dynamo.reset()
    path = tmp_path / "eager.json"
    with pytest.warns(UserWarning, match="runs eagerly"):
        compiled = torch.compile(f, backend="pypto", options={"report_path": path})
        torch.testing.assert_close(compiled(x), f(x))
    d = json.loads(path.read_text())
    _check_layout(d)  # the hardware is known even when no graph was planned
    assert d["summary"]["eager_graphs"] == 1
    torch._dynamo.reset()
    compiled = torch.compile(f, backend="pypto", options={"fallback": "error"})
    with pytest.raises(Exception, match="cannot be lowered"):
        compiled(x)


def test_profile_measures_every_kernel(run_both):
    model = models.LayerNormGeluResidual(64)
    x = torch.randn(3, 5, 64)
    run = run_both(model, x, options={"profile": True})
    d = run.report.to_dict()
    tiles = d["graphs"][0]["fusion_tiles"]
    assert tiles and all(t["measured_us"] > 0 for t in tiles)
    assert d["summary"]["measured_us_fused"] == pytest.approx(
        sum(t["measured_us"] for t in tiles), abs=0.01)
    assert "meas us" in str(run.report)


def test_profiled_report_measures_fused_against_unfused():
    model = models.LayerNormGeluResidual(64)
    x = torch.randn(4, 16, 64)
    d = pypto_inductor.report(model, x, options={"profile": True}, repeats=3).to_dict()
    summary = d["summary"]
    tiles = d["graphs"][0]["fusion_tiles"]
    assert summary["kernels_fused"] < summary["kernels_unfused"]
    assert summary["measured_us_unfused"] > 0 and summary["measured_us_fused"] > 0
    assert summary["measured_speedup"] == pytest.approx(
        summary["measured_us_unfused"] / summary["measured_us_fused"], rel=1e-2)
    for t in tiles:  # predicted and measured side by side, with the roofline's verdict
        assert t["predicted_us"] > 0 and t["measured_us"] > 0
        assert t["bound"] in ("memory", "compute", "launch")
        assert t["measured_GBps"] == pytest.approx(t["gm_bytes"] / t["measured_us"] / 1e3,
                                                   rel=1e-2, abs=0.01)


def test_roofline_bound_of_tiles():
    big = pypto_inductor.report(lambda a, b: a + b, torch.randn(2048, 1024),
                                torch.randn(2048, 1024)).to_dict()
    small = pypto_inductor.report(lambda a, b: a + b, torch.randn(4, 4), torch.randn(4, 4))
    assert big["graphs"][0]["fusion_tiles"][0]["bound"] == "memory"
    assert small.to_dict()["graphs"][0]["fusion_tiles"][0]["bound"] == "launch"


def test_empty_report_is_valid():
    rep = pypto_inductor.FusionReport([])
    d = rep.to_dict()
    assert d["graphs"] == [] and d["summary"]["kernels_fused"] == 0
    assert json.loads(json.dumps(d)) == d
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        str(rep)


def test_html_shows_any_decision_field_as_a_column(transformer, tmp_path, monkeypatch):
    """Fields added to decisions later (an attention choice, say) become columns."""
    import sys

    from pypto_inductor.fusion.planner import Decision

    plain = Decision.to_dict
    monkeypatch.setattr(Decision, "to_dict", lambda self: {
        **plain(self), "attention": {"choice": "flash", "blocks": 4}, "note": "extra"})
    model, x = transformer
    rep = pypto_inductor.report(model, x)
    html = rep.save(tmp_path / "r.html").read_text()
    table = html[html.index("id='decisions-table'"):]
    table = table[:table.index("</table>")]
    head = table[:table.index("</thead>")]
    for col in ("roi_score", "bandwidth_saving_pct", "attention.choice", "attention.blocks",
                "note"):
        assert f"<th>{col}</th>" in head
    assert "<td>flash</td>" in table and "<td class='num' data-v='4'>4</td>" in table
    assert '{"bandwidth_saving_pct"' not in table  # no JSON in a cell
    assert "matplotlib.pyplot" not in sys.modules  # the charts leave pyplot's state alone
