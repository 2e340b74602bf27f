"""The pypto flash-attention kernel (codegen/pypto/attention.py): an SDPA call as one kernel.

Each variant (plain, causal, bool mask, additive float mask; fp16, bf16, fp32) is
simulated fused (the flash kernel) and unfused (scores, softmax, probs @ v kernels)
in pypto's simulator and its values are checked by pypto's host interpreter
against eager SDPA on random inputs. The check must be able to fail: the same
kernel with a wrong scale is caught. Skips when pypto is not installed.
"""
from __future__ import annotations

import importlib.util
import math

import pytest
import torch

if importlib.util.find_spec("pypto") is None:
    pytest.skip("pypto is not installed (pip install 'pypto-inductor[pypto]')",
                allow_module_level=True)

import pypto_inductor  # noqa: E402
from pypto_inductor.codegen.pypto import attention as A  # noqa: E402
from pypto_inductor.codegen.pypto import verify  # noqa: E402
from pypto_inductor.codegen.pypto.kernel import PyptoEmitError  # noqa: E402

S = 128
SPECS = [
    A.AttentionSpec(1, 2, S, S, 64, 64, torch.float16, 0.125, name="plain_fp16"),
    A.AttentionSpec(1, 2, S, S, 64, 64, torch.bfloat16, 0.125, causal=True, name="causal_bf16"),
    A.AttentionSpec(2, 2, S, S, 32, 32, torch.float16, 0.2, causal=True, name="causal_fp16"),
    A.AttentionSpec(2, 2, S, S, 64, 64, torch.bfloat16, 0.125, mask_shape=(2, 1, S, S),
                    mask_dtype=torch.bool, name="boolmask_bf16"),
    A.AttentionSpec(2, 2, S, 2 * S, 64, 64, torch.float16, 0.125, mask_shape=(2, 1, 1, 2 * S),
                    mask_dtype=torch.float16, name="padmask_fp16"),
    A.AttentionSpec(1, 2, S, S, 32, 32, torch.float32, 1 / math.sqrt(32), name="plain_fp32"),
    # an odd length (vit: 16 patches + the class token): its tile shapes are rounded up to
    # whole 32-byte blocks / 16x16 fractals ("lastDimBytes % BLOCK_SIZE" before)
    A.AttentionSpec(2, 4, 17, 17, 16, 16, torch.float32, 0.25, name="vit_len17_fp32"),
    A.AttentionSpec(1, 2, 17, 17, 16, 16, torch.float16, 0.25, causal=True,
                    name="len17_causal_fp16"),
]


@pytest.fixture(scope="module")
def simulated():
    return {s.name: s for s in A.simulate_attention(SPECS, verify=True)}


@pytest.mark.parametrize("name", [s.name for s in SPECS])
def test_flash_kernel_simulates_and_verifies(simulated, name):
    sim = simulated[name]
    assert sim.error is None, sim.error
    assert sim.fused_cycles and sim.fused_cycles > 0
    assert sim.unfused_cycles and all(c > 0 for c in sim.unfused_parts.values())
    assert sim.verified is True, (sim.max_abs_err, sim.error)
    assert sim.max_abs_err < 2e-2


def test_unfused_kernels_compute_their_parts():
    """The three kernels each spec is simulated as unfused (the cost baseline: scores,
    softmax, probs @ v) compute their part: pypto's interpreter against torch, each on
    the previous part's expected output."""
    cases, names = [], []
    for spec in SPECS:
        for case, part in zip(A.unfused_cases(spec), ("scores", "softmax", "pv")):
            cases.append(case)
            names.append(f"{spec.name}/{part}")
    checks = verify.verify_kernels(cases)
    bad = {n: (c.verified, c.max_abs_err, c.error) for n, c in zip(names, checks)
           if c.verified is not True}
    assert not bad, bad
    assert len(checks) == 3 * len(SPECS)


def test_reference_is_eager_sdpa():
    """The oracle itself: the causal kernel's extra input and the lse match torch."""
    spec = SPECS[1]
    inputs = A.random_inputs(spec, 3)
    out, lse = A.reference(spec, inputs)
    q, k, v = inputs[:3]
    want = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float(),
                                                            is_causal=True, scale=spec.scale)
    torch.testing.assert_close(out.float(), want, rtol=1e-2, atol=1e-2)
    assert torch.equal(inputs[3], torch.ones(S, S, dtype=torch.bool).tril())
    assert lse.shape == (1, 2, S)


def test_wrong_scale_is_caught():
    spec = SPECS[0]
    inputs = A.random_inputs(spec, 1)
    expected = A.reference(spec, inputs)
    wrong = A.emit_flash(spec, scale=spec.scale * 1.5)
    right = A.emit_flash(spec)
    checks = verify.verify_kernels([(wrong, inputs, expected), (right, inputs, expected)])
    assert checks[0].verified is False and checks[0].max_abs_err > 0.05, checks[0]
    assert checks[1].verified is True, checks[1]


@pytest.mark.parametrize("name", ["causal_bf16", "padmask_fp16", "plain_fp32"])
def test_key_blocks_plain_and_online_verify(name):
    """Key blocks of 32: the plain form unrolls up to 4 of them (S=128), the padding-mask
    case (256 keys: 8 blocks) and the forced ``online`` kernels run the online softmax
    (running max and sum, rescaled accumulator); all against eager SDPA."""
    spec = next(s for s in SPECS if s.name == name)
    inputs = A.random_inputs(spec, 2)
    expected = A.reference(spec, inputs)
    blocked = A.emit_flash(spec, tq=32, tk=32)
    online = [A.emit_flash(spec, tq=32, tk=32, online=True), A.emit_flash(spec, online=True)]
    assert ("alpha" in blocked.source) == (spec.Sk // 32 > A.MAX_UNROLLED_KEY_BLOCKS)
    assert all("alpha" in k.source for k in online)
    cases = [(k, inputs, expected) for k in [blocked] + online]
    for check in verify.verify_kernels(cases):
        assert check.verified is True and check.max_abs_err < 2e-2, check


def test_few_key_blocks_are_the_plain_softmax():
    """Every key in one block: no running max/sum and no rescale (fewer vector ops)."""
    source = A.emit_flash(SPECS[0]).source
    assert "alpha" not in source and "pypto.amax(s0, -1, True)" in source


def test_unsupported_calls_say_why():
    with pytest.raises(PyptoEmitError, match="mask of shape"):
        A.AttentionSpec(2, 2, S, S, 64, 64, torch.float16, 0.125, mask_shape=(3, 1, S, S),
                        mask_dtype=torch.bool)
    with pytest.raises(PyptoEmitError, match="dtype"):
        A.AttentionSpec(1, 1, S, S, 64, 64, torch.int32, 0.125)


class _Attn(torch.nn.Module):
    """Eager attention written out op by op: the rewrite makes it one SDPA call."""

    def forward(self, q, k, v):
        s = q @ k.transpose(-1, -2) * 0.125
        s = s.masked_fill(torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool).tril()
                          .logical_not(), float("-inf"))
        return torch.softmax(s, -1) @ v


def test_report_lists_the_attention_kernel():
    q, k, v = (torch.randn(1, 2, 64, 64) for _ in range(3))
    rep = pypto_inductor.report(_Attn(), q, k, v, options={"hardware": "ascend-a2",
                                                           "verify": True})
    calls = [a for g in rep.to_dict()["graphs"] for a in g.get("attention", [])]
    assert len(calls) == 1, calls
    call = calls[0]
    assert call["causal"] is True and call["verified"] is True, call
    assert call["simulated_cycles_fused"] and call["simulated_cycles_unfused"]
    assert call["simulated_work_cycles_fused"] and call["simulated_work_cycles_unfused"]
