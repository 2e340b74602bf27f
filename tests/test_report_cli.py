"""``python -m pypto_inductor report``: a user's FILE.py:factory, a zoo model, clear errors;
decisions on the ``pypto_inductor`` logger; the progress bar's terminal-only output."""
from __future__ import annotations

import io
import json
import logging
import textwrap

import pytest
import torch

from pypto_inductor.__main__ import main
from pypto_inductor.progress import Progress

USER_FILE = textwrap.dedent("""
    import torch
    import torch.nn as nn

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc, self.norm = nn.Linear(32, 32), nn.LayerNorm(32)

        def forward(self, x, scale=None):
            y = torch.nn.functional.gelu(self.norm(self.fc(x)))
            return x + (y if scale is None else y * scale)

    def make():
        torch.manual_seed(0)
        return Net().eval(), (torch.randn(4, 8, 32),)

    def make_kwargs():
        torch.manual_seed(0)
        return Net().eval(), {"x": torch.randn(4, 8, 32), "scale": torch.rand(32)}

    def broken():
        return 3
""")


@pytest.fixture
def user_file(tmp_path):
    path = tmp_path / "my_model.py"
    path.write_text(USER_FILE)
    return path


def test_report_of_a_user_factory(user_file, tmp_path, capsys):
    out = tmp_path / "r.html"
    assert main(["report", f"{user_file}:make", "--save", str(out), "-o", "roi_threshold=1.1"]) == 0
    text = capsys.readouterr().out
    assert text.startswith("pypto fusion report: target=cpu") and "report written to" in text
    page = out.read_text()
    assert "<title>pypto fusion report: my_model:make</title>" in page
    assert "class='tile-graph'" in page and "id='chart-times'" in page
    # keyword inputs, backward, dynamic and JSON
    js = tmp_path / "r.json"
    assert main(["report", f"{user_file}:make_kwargs", "--backward", "--dynamic",
                 "--save", str(js)]) == 0
    d = json.loads(js.read_text())
    assert [g["name"].rsplit("_", 1)[-1] for g in d["graphs"]] == ["forward", "backward"]
    assert any("tile_rows" in t["footprint_expr"] for t in d["graphs"][0]["fusion_tiles"])


@pytest.mark.parametrize("target, message", [
    ("{dir}/missing.py:make", "no such file"),
    ("{file}:nope", "has no function 'nope'; functions defined there: Net, broken, make"),
    ("{file}", "expected FILE.py:FACTORY"),
    ("{file}:broken", "must return (model, example_inputs), got int"),
])
def test_report_cli_errors(user_file, target, message):
    spec = target.format(dir=user_file.parent, file=user_file)
    with pytest.raises(SystemExit) as e:
        main(["report", spec])
    assert message in str(e.value)


def test_report_of_a_zoo_model(tmp_path):
    out = tmp_path / "gpt2.json"
    assert main(["report", "--transformers", "gpt2", "--save", str(out)]) == 0
    d = json.loads(out.read_text())
    assert d["graphs"] and d["summary"]["kernels_fused"] > 0
    # inference: no labels, so no loss and no backward graph
    assert [g["name"].rsplit("_", 1)[-1] for g in d["graphs"]] == ["inference"]
    with pytest.raises(SystemExit, match="one of"):
        main(["report", "x.py:make", "--transformers", "gpt2"])


def test_decisions_are_logged(caplog):
    import pypto_inductor

    caplog.set_level(logging.DEBUG, logger="pypto_inductor")
    torch.manual_seed(0)
    lin = torch.nn.Linear(16, 16)
    d = pypto_inductor.report(lambda x: torch.relu(lin(x)) * 2 + 1, torch.randn(4, 16)).to_dict()
    lines = [r.getMessage() for r in caplog.records if r.name.startswith("pypto_inductor")]
    g = d["graphs"][0]
    assert any(line.startswith(f"graph {g['name']}: ") and "kernels" in line for line in lines)
    for x in g["decisions"]:
        assert any(f"{x['producer']} -> {x['consumer']}: {x['reason']}" in line for line in lines)


class _Tty(io.StringIO):
    def isatty(self):
        return True


def test_progress_only_on_a_terminal():
    quiet = io.StringIO()
    with Progress(3, "simulating", stream=quiet) as p:
        for _ in range(3):
            p.update(1)
    assert quiet.getvalue() == ""
    tty = _Tty()
    with Progress(3, "simulating", stream=tty) as p:
        p.update(2)
        p.update(1, failed=1)
    text = tty.getvalue()
    assert "3/3" in text  # the bar
    assert text.rstrip().splitlines()[-1].startswith("simulating: 3/3 tiles, 1 failed in ")
