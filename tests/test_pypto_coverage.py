"""Patterns of the real models (pypto_inductor.zoo) on the pypto target: each emitted as
whole pypto kernels (no op split off to run eagerly), simulated, and value-checked by
pypto's host interpreter against the reference executor.

The patterns are those that kept zoo tiles from pypto before: ``arange`` and bool mask
algebra (transformers' causal masks), embedding lookups with broadcast positions,
masks of shape [B, S] against [B, 1, S, S] scores (a broadcast with no 2-D form: the
launcher expands the input), rotate_half's ``cat`` of half-width values, the loss's
integer ``where``, a flat view of a [B, S] domain, the loss's gather of each row's
target, the loss's label pad (int64, a fill block
assembled next to the input) and a classifier's [2, 2] logits (a UB tile row of whole 32-byte blocks). The whole-zoo figures come from
``python -m benchmarks.pypto_coverage`` (docs/pypto_coverage.md). Skips without pypto.
"""
from __future__ import annotations

import importlib.util

import pytest
import torch

if importlib.util.find_spec("pypto") is None:
    pytest.skip("pypto is not installed (pip install 'pypto-inductor[pypto]')",
                allow_module_level=True)

import pypto_inductor  # noqa: E402


def causal_mask(ids):
    s = ids.shape[1]
    pos = torch.arange(s)
    keep = pos[None, :] <= pos[:, None]
    return True & keep[None, None] & (ids != 0)[:, None, None, :]


class Embed(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.wte, self.wpe = torch.nn.Embedding(256, 64), torch.nn.Embedding(16, 64)
        self.ln = torch.nn.LayerNorm(64)

    def forward(self, ids):
        pos = torch.arange(ids.shape[1]).unsqueeze(0)
        return self.ln(self.wte(ids) + self.wpe(pos))


def padding_mask(scores, mask):
    return scores.masked_fill(mask[:, None, None, :] == 0, -1e9).softmax(-1)


def rotate_half(x1, x2):
    return torch.cat((-x2, x1), dim=-1)


def labels(y):
    y = y.view(-1)
    return torch.where(y != -100, y, 0)


def shift_labels(labels):
    # transformers' causal LM loss: labels padded with the ignore index, shifted by one
    return torch.nn.functional.pad(labels, (0, 1), value=-100)[..., 1:].contiguous()


def nll(logp, target):
    return -logp.gather(1, target[:, None]).squeeze(1).sum()


CASES = {
    "loss_gather_dim1": (nll, lambda: (torch.randn(8, 32).log_softmax(-1),
                                       torch.randint(0, 32, (8,)))),
    "arange_bool_mask": (causal_mask, lambda: (torch.randint(0, 5, (2, 16)),)),
    "embedding_positions_layernorm": (Embed(), lambda: (torch.randint(0, 256, (2, 16)),)),
    "mask_BS_against_B1SS": (padding_mask, lambda: (torch.randn(2, 4, 16, 16),
                                                    torch.randint(0, 2, (2, 16)))),
    "rotate_half_cat": (rotate_half, lambda: (torch.randn(2, 4, 16, 8),
                                              torch.randn(2, 4, 16, 8))),
    "tiny_logits_log_softmax": (lambda h, w, b: torch.log_softmax(h @ w + b, -1),
                                lambda: (torch.randn(2, 64), torch.randn(64, 2), torch.randn(2))),
    "loss_label_pad_int64": (shift_labels, lambda: (torch.randint(0, 32, (2, 16)),)),
    "float_pad_both_sides_exp": (lambda x: torch.nn.functional.pad(x * 2, (1, 2), value=1.5).exp(),
                                 lambda: (torch.randn(4, 13),)),
    "int_where_flat_view": (labels, lambda: (torch.randint(-100, 100, (2, 16)),)),
}


@pytest.mark.parametrize("name", list(CASES))
def test_pattern_is_whole_and_verified(name):
    fn, make = CASES[name]
    inputs = make()
    torch.manual_seed(0)
    rep = pypto_inductor.report(fn, *inputs, options={"hardware": "ascend-a2", "verify": True})
    tiles = [t for g in rep.to_dict()["graphs"] for t in g["fusion_tiles"]]
    assert tiles
    for t in tiles:
        assert not t.get("split_ops"), (t["name"], t["split_ops"])
        assert t.get("simulated_cycles_fused"), (t["name"], t.get("simulation_error"))
        assert t.get("verified") is True, (t["name"], t.get("max_abs_err"),
                                           t.get("verify_error"))


def test_unsupported_gather_still_names_its_op():
    """A gather with no pypto form here (along dim 0) is split off and named, not emitted
    wrong."""
    def rows(x, idx):
        return x.gather(0, idx) * 2.0
    rep = pypto_inductor.report(rows, torch.randn(8, 32), torch.randint(0, 8, (4, 32)),
                                options={"hardware": "ascend-a2", "verify": True})
    tiles = [t for g in rep.to_dict()["graphs"] for t in g["fusion_tiles"]]
    assert any("gather" in (t.get("split_ops") or []) for t in tiles), tiles
    assert all(t.get("verified") is not False for t in tiles)


def rotate_half(x):
    return torch.cat((-x[..., x.shape[-1] // 2:], x[..., :x.shape[-1] // 2]), dim=-1)


def test_equal_size_chains_take_the_placeable_domain():
    """phi3's planner puts the q half's ``neg`` ([2, 4, 16, 8]) and k's rotary ([2, 2, 16, 16],
    cos/sin [1, 1, 16, 16]) in one tile: two chains of 1024 elements. The domain must be
    k's (the cos broadcast has no 2-D form against [2, 4, 16, 8]); the tile is built here
    from the two planned tiles, emitted whole and value-checked."""
    import dataclasses

    from pypto_inductor.codegen.pypto.verify import verify_tiles
    from pypto_inductor.codegen.pypto.writer import emit_tile

    def apply(q, k, cos, sin):
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
    rep = pypto_inductor.report(apply, torch.randn(2, 4, 16, 16), torch.randn(2, 2, 16, 16),
                                torch.randn(1, 16, 16), torch.randn(1, 16, 16),
                                options={"hardware": "ascend-a2"})
    plan = rep.graphs[0].plan
    shape = lambda v: list(plan.graph.specs[v].shape)  # noqa: E731
    neg = next(t for t in plan.tiles if [o.op for o in t.ops] == ["neg"]
               and shape(t.inputs[0]) == [2, 4, 16, 8])
    k_rot = next(t for t in plan.tiles if [o.op for o in t.ops] == ["mul", "mul", "add"]
                 and [2, 2, 16, 16] in [shape(v) for v in t.inputs])
    both = dataclasses.replace(k_rot, name="neg_and_k_rotary", ops=neg.ops + k_rot.ops,
                               inputs=neg.inputs + k_rot.inputs,
                               outputs=neg.outputs + k_rot.outputs)
    assert "set_vec_tile_shapes" in emit_tile(both, plan.graph).source
    (check,) = verify_tiles([both], plan.graph).values()
    assert check.verified is True, (check.max_abs_err, check.verify_error)


def test_unfused_cost_kernels_of_the_patterns_verify():
    """The one-op kernels the reports above simulate as each multi-op tile's unfused
    alternative (cost baselines, never shipped) compute their ops too: pypto's
    interpreter against the reference executor, in one batch."""
    from pypto_inductor.codegen.pypto import verify
    cases, names = [], []
    for name, (fn, make) in CASES.items():
        inputs = make()
        torch.manual_seed(0)
        rep = pypto_inductor.report(fn, *inputs, options={"hardware": "ascend-a2"})
        for plan in (g.plan for g in rep.graphs if g.plan is not None):
            for tile in plan.tiles:
                for case in verify.unfused_cases(tile, plan.graph, plan.hardware):
                    cases.append(case)
                    names.append(f"{name}/{tile.name}/{case[0].tile_name}")
    checks = verify.check_unfused(cases)
    assert len(checks) >= len(CASES), names
    # pypto rejects a one-op kernel of a 16-wide bool view (a 16-byte tile row; the fused
    # kernel computes in fp32): no value and no unfused cost, the simulation says why
    rejected = {n for n, c in zip(names, checks)
                if c.verified is None and c.error.startswith("rejected by pypto")}
    assert all(n.startswith("arange_bool_mask/") for n in rejected), rejected
    bad = {n: (c.verified, c.max_abs_err, c.error) for n, c in zip(names, checks)
           if c.verified is not True and n not in rejected}
    assert not bad, bad
    print(f"{len(checks) - len(rejected)} of {len(checks)} one-op kernels verified, "
          f"rejected by pypto: {sorted(rejected)}")
