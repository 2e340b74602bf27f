"""The HTML report as a person sees it: rendered by headless Chromium (Debian's
``chromium``), driven over the DevTools protocol (tests/report_browser.py).

Without a Chromium the test is skipped on a developer's machine, but fails where
``CI`` is set (.ci/run installs Chromium and sets it): the check must run there.
"""
from __future__ import annotations

import json
import os

import pytest
import torch

import pypto_inductor
from pypto_inductor import models

from report_browser import Browser, find_chromium

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def page(tmp_path_factory):
    if find_chromium() is None:
        if os.environ.get("CI"):
            pytest.fail("CI needs chromium for the report's browser test (apt-get install chromium)")
        pytest.skip("no chromium (apt-get install chromium); CI runs this test")
    torch.manual_seed(0)
    model, x = models.TransformerBlock().eval(), torch.randn(2, 8, 64)
    rep = pypto_inductor.report(model, x, options={"profile": True}, repeats=3)
    rep.model = "TransformerBlock"
    path = rep.save(tmp_path_factory.mktemp("report") / "report.html")
    with Browser(width=1280, height=900) as browser:
        browser.open(path)
        yield browser, rep.to_dict()


def test_page_loads_without_errors_or_requests(page):
    browser, d = page
    assert browser.errors() == []
    # self-contained: the page's own file is all it asks for
    assert [u for u in browser.requests() if not u.startswith("file:")] == []
    assert browser.eval("document.title") == "pypto fusion report: TransformerBlock"
    embedded = json.loads(browser.eval("document.getElementById('report-data').textContent"))
    assert embedded == json.loads(json.dumps(d, default=str))


def test_summary_numbers_match_to_dict(page):
    browser, d = page
    shown = browser.eval("""Array.from(document.querySelectorAll('#summary [data-key]')).map(
        e => [e.dataset.key, JSON.parse(e.dataset.value), e.textContent,
              e.getBoundingClientRect().width > 0])""")
    by_key = {k: (v, text, visible) for k, v, text, visible in shown}
    s = d["summary"]
    for key in ("kernels_unfused", "kernels_fused", "gm_bytes_unfused", "gm_bytes_fused",
                "predicted_speedup", "measured_speedup", "fallback_op_count"):
        assert by_key[key][0] == s[key], key
        assert by_key[key][2], key  # drawn, not hidden
    assert by_key["kernels_fused"][1] == str(s["kernels_fused"])
    assert by_key["predicted_speedup"][1] == f"{s['predicted_speedup']}x"
    assert all(v == s[k] for k, (v, _, _) in by_key.items())


def test_graph_picture_and_charts_are_drawn(page):
    browser, d = page
    g = d["graphs"][0]
    pic = browser.eval("""(() => { const s = document.querySelector('svg.tile-graph');
        const b = s.getBBox();
        return {w: b.width, h: b.height, tiles: s.querySelectorAll('g.tile').length,
                ops: s.querySelectorAll('g.op').length,
                edges: Array.from(s.querySelectorAll('path.unfused')).map(
                    p => p.querySelector('title').textContent)}; })()""")
    assert pic["w"] > 100 and pic["h"] > 50
    assert pic["tiles"] == len(g["fusion_tiles"])
    assert pic["ops"] == len(g["nodes"]) == g["num_ops"]
    unfused = [e for e in g["edges"] if e["reason"]]
    assert len(pic["edges"]) == len(unfused) > 0
    for e, title in zip(unfused, pic["edges"]):  # every unfused edge says why
        assert e["reason"] in title
    charts = browser.eval("""Array.from(document.querySelectorAll('svg.chart')).map(
        s => [s.id, s.getBoundingClientRect().width, s.querySelectorAll('text').length])""")
    ids = {c[0] for c in charts}
    assert ids == {"chart-times", "chart-roofline", "chart-top"}
    assert all(w > 200 and texts > 5 for _, w, texts in charts)
    # measured and predicted side by side in the per-tile chart
    legend = browser.eval("document.getElementById('chart-times').textContent")
    assert "predicted" in legend and "measured" in legend


def test_decisions_sort_and_filter(page):
    browser, d = page
    decisions = [x for g in d["graphs"] for x in g["decisions"]]
    heads = browser.eval("Array.from(document.querySelectorAll('#decisions-table th'))"
                         ".map(th => th.textContent)")
    for col in ("producer", "consumer", "fused", "reason", "roi_score", "bandwidth_saving_pct",
                "launch_overhead_reduction_pct", "l1_pressure_increase_pct"):
        assert col in heads
    col = heads.index("roi_score")

    def click_and_read():
        return browser.eval(f"""(() => {{
            document.querySelectorAll('#decisions-table th')[{col}].click();
            return Array.from(document.querySelectorAll('#decisions-table tbody tr')).map(
                r => r.cells[{col}].dataset.v); }})()""")

    up = [float(v) for v in click_and_read() if v is not None]
    assert up == sorted(up) and len(up) == sum(1 for x in decisions if x["roi"])
    down = [float(v) for v in click_and_read() if v is not None]
    assert down == sorted(up, reverse=True)
    assert browser.eval(f"document.querySelectorAll('#decisions-table th')[{col}]"
                        ".getAttribute('aria-sort')") == "descending"
    shown = browser.eval("""(() => { const f = document.getElementById('fused-filter');
        f.value = 'no'; f.dispatchEvent(new Event('change'));
        return Array.from(document.querySelectorAll('#decisions-table tbody tr'))
            .filter(r => r.style.display !== 'none').map(r => r.dataset.fused); })()""")
    assert shown == ["no"] * sum(1 for x in decisions if not x["fused"])
    assert browser.errors() == []
