"""Short seeded differential fuzz run, plus checks that the fuzzer itself can fail.

Each seed's program runs in one configuration, round-robin over (cpu, reference)
x (static, dynamic at two sizes), so the run stays within a few minutes; the long
run (every configuration per case) is ``python -m benchmarks.fuzz``. A failing seed
writes its standalone repro under pytest's tmp_path and names it in the message.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from . import check
from .generator import generate
from .program import Program, Statement
from .runner import CONFIGS, check_shared, failure_key, repro_source, run_case

SEEDS = range(1000, 1100)

# Seeds failing on faults being fixed: strict xfails naming the repro, so a fix turns them
# red until they are removed from here (none open).
KNOWN: dict[int, str] = {}


@pytest.mark.parametrize("seed", [pytest.param(s, marks=pytest.mark.xfail(
    reason=KNOWN[s], strict=True)) if s in KNOWN else s for s in SEEDS])
def test_fuzz_case(seed, tmp_path):
    target, dynamic = CONFIGS[seed % len(CONFIGS)]
    result = run_case(seed, configs=[(target, dynamic)], repro_dir=tmp_path)
    # upstream: torch's own tracing or decompositions differ alike (counted by the long run)
    if any(not f["upstream"] for f in result.failures):
        lines = [f"{f['kind']} ({target}, dynamic={dynamic}, size variant {f['variant']}"
                 f"{', upstream' if f['upstream'] else ''}): {f['message'][:600]}"
                 for f in result.failures]
        pytest.fail(f"seed {seed}:\n{result.program.source}\n" + "\n".join(lines)
                    + f"\nrepro: {result.failures[0]['repro']}")


def test_generator_is_deterministic_and_covers_the_families():
    assert generate(5).source == generate(5).source
    families = set().union(*(generate(s).families for s in range(40)))
    assert families >= {"unary", "binary", "reduction", "softmax", "view", "cat", "matmul",
                        "cast", "where", "inplace", "index"}
    programs = [generate(s) for s in range(40)]
    assert any(p.backward for p in programs) and any(p.special for p in programs)
    assert all(3 <= len(p.statements) <= 15 for p in programs)


def _shifted(by: float):
    """A backend whose graphs add ``by`` to every floating output."""
    def backend(gm, example_inputs):
        def run(*args):
            out = gm(*args)
            return tuple(o + by if isinstance(o, torch.Tensor) and o.is_floating_point() else o
                         for o in out)
        return run
    return backend


def _case(source: str, dtype: str = "f32", special: bool = False) -> dict:
    return {"seed": 3, "source": source, "backward": False,
            "inputs": [{"name": "x0", "index": 0, "dtype": dtype, "kind": "normal",
                        "shapes": [[6, 40], [9, 33]], "special": special}]}


def test_comparison_flags_wrong_values_and_accepts_rounding():
    case = _case("def fn(x0):\n    return (torch.exp(x0) * 0.5,)\n")
    assert check.check(case, backend=_shifted(0.0)) == []
    found = check.check(case, backend=_shifted(1e-3))
    assert found and found[0]["kind"] == "mismatch"
    # a half-type result computed without the per-op rounding eager does is not wrong,
    # nor one rounding off where eager happens to be exact
    e = torch.randn(64, dtype=torch.float16)
    r = e.double() + torch.randn(64, dtype=torch.float64) * 1e-3
    c = (r + (e.double() - r) * 0.5).half()  # closer to float64 than eager
    assert check.compare(c, e, r, e) is None
    assert check.compare(e + 0.25, e, r, e) is not None
    one = torch.tensor([0.78125], dtype=torch.float16)
    assert check.compare(one - 2 ** -11, one, one.double(), one) is None
    assert check.compare(one - 2 ** -8, one, one.double(), one) is not None
    nan = torch.tensor([float("nan"), 1.0])
    assert check.compare(nan, nan, nan.double(), nan) is None
    assert check.compare(torch.tensor([0.0, 1.0]), nan, nan.double(), nan) is not None


def _computing(fn):
    """A backend whose graphs return ``fn(*inputs)`` instead."""
    return lambda gm, example_inputs: (lambda *args: (fn(*args),))


def test_one_rounding_fewer_than_eager_passes_a_wrong_sum_does_not():
    """Seeds 20881, 21460, 22390: float16 ``a @ b.mT + b @ a.mT`` in one float32 accumulator
    (our fused GEMM) skips eager's two roundings of the products. The rerounded run (eager
    with each half matmul/arithmetic result an ulp up) sizes that; a product left out, or
    a shift of a few term-ulps, still fails."""
    case = _case("def fn(x0):\n    a, b = x0[:, :20], x0[:, 20:]\n"
                 "    return (a @ b.mT + b @ a.mT,)\n", dtype="f16")
    case["inputs"][0]["shapes"] = [[96, 40], [9, 33]]

    def fused(x, drop=False, by=0.0):  # the first product rounded, the second added to it
        a, b = x[:, :20].float(), x[:, 20:].float()  # in float32 (before: 1-5 of 9216
        first = (a @ b.mT).half().float()  # elements failed for each of seeds 0-11)
        return ((first + (0 if drop else b @ a.mT)) + by).half()
    for seed in range(3):
        case["seed"] = seed
        assert check.check(case, backend=_computing(fused)) == []
        assert check.check(case, backend=_computing(lambda x: fused(x, drop=True)))
        assert check.check(case, backend=_computing(lambda x: fused(x, by=0.125)))


def test_a_sum_in_another_order_passes_a_wrong_sum_does_not():
    """Seeds 33028, 33342: a float32 column sum of 384 terms in 16 lanes (as the column
    kernel) is farther from float64 than eager's, by far more than an ulp of the result
    but within eps * sum(|terms|), which the rerounded run (every summand an ulp up)
    measures. A summand left out still fails."""
    case = _case("def fn(x0):\n    return (torch.sum(x0 - 1e-3, dim=(0,)),)\n", dtype="i64")
    case["inputs"][0]["shapes"] = [[384, 40], [9, 33]]

    def lanes(x, skip=False):  # 16 accumulators taking every 16th row, then added up
        y = (x - 1e-3)[: -1 if skip else None]
        acc = torch.zeros(16, x.shape[1])
        for i in range(0, y.shape[0], 16):
            acc[: len(y[i:i + 16])] += y[i:i + 16]
        out = torch.zeros(x.shape[1])
        for lane in acc:
            out = out + lane
        return out
    assert check.check(case, backend=_computing(lanes)) == []
    assert check.check(case, backend=_computing(lambda x: lanes(x, skip=True)))


def test_libm_ulp_passes_32_ulps_do_not():
    """Seeds 34130, 34821: float32 log_softmax/logsumexp an ulp or two from eager's (two
    libms, neither correctly rounded), amplified by a cancelling add or tan near its
    pole. The rerounded run moves float32 transcendental results an ulp; 32 ulps on exp
    (rule 1 takes 11) still fail."""
    case = _case("def fn(x0):\n    return (torch.exp(x0) * 0.5,)\n")
    assert check.check(case, backend=_computing(lambda x: torch.exp(x.double()).float() * 0.5)) == []
    assert check.check(case, backend=_computing(lambda x: torch.exp(x) * (1 + 2 ** -18) * 0.5))


def test_both_overflowing_is_no_mismatch():
    """Seeds 34164, 34762: a gradient summing two overflowing products is NaN (inf - inf)
    in eager and -inf compiled, where float64 is finite: both overflowed, the order
    decides which non-finite value; a non-finite answer where eager is finite still fails
    unless eager's value is within a factor 4 of the max and of the infinity's sign."""
    e, r = torch.tensor([float("nan"), 2.0]), torch.tensor([1e30, 2.0], dtype=torch.float64)
    assert check.compare(torch.tensor([-float("inf"), 2.0]), e, r, e) is None
    assert check.compare(torch.tensor([-float("inf"), -float("inf")]), e, r, e) is not None
    # seeds 34762, 20625: eager finite within a factor 4 of the max, compiled overflowed
    big = torch.finfo(torch.float32).max
    e, r = torch.tensor([-big / 2, big / 8]), torch.tensor([-big / 2, big / 8], dtype=torch.float64)
    assert check.compare(torch.tensor([-float("inf"), big / 8]), e, r, e) is None
    assert check.compare(torch.tensor([float("inf"), big / 8]), e, r, e) is not None
    assert check.compare(torch.tensor([-big / 2, float("inf")]), e, r, e) is not None
    e, r = torch.tensor([float("inf")] * 2), torch.tensor([big * 1.1, big * 5], dtype=torch.float64)
    assert check.compare(torch.tensor([float("nan"), float("inf")]), e, r, e) is None
    assert check.compare(torch.tensor([float("inf"), float("nan")]), e, r, e) is not None
    e = torch.tensor([float("inf"), float("inf")])
    assert check.compare(torch.tensor([big / 2, float("inf")]), e, r, e) is None
    assert check.compare(torch.tensor([big / 8, float("inf")]), e, r, e) is not None


def test_float64_run_rounds_at_explicit_casts():
    f = check.load("def fn(x0):\n    v0 = x0.to(f16)\n    return (v0,)\n", f64=True)
    x = torch.tensor([0.1], dtype=torch.float64)
    assert f(x)[0].dtype == torch.float64 and f(x)[0].item() == torch.tensor(0.1).half().item()


def test_comparison_excuses_what_an_ulp_can_flip():
    """A floor right at an integer may land either side: the nudged run shows it."""
    e = torch.tensor([3.0, 5.0])
    c = torch.tensor([2.0, 5.0])
    assert check.compare(c, e, e.double(), torch.tensor([2.0, 5.0])) is None
    assert check.compare(c, e, e.double(), e) is not None
    ints = torch.tensor([1, 2])
    assert check.compare(torch.tensor([1, 3]), ints, ints, ints) is not None
    assert check.compare(torch.tensor([1, 3]), ints, ints, torch.tensor([1, 3])) is None


def test_compile_time_crashes_of_two_backends_share_a_key():
    """Seed 33723: a crash while AOTAutograd traced is upstream when decomposed_eager
    raises the same exception; Dynamo names the backend in the first line."""
    def crash(backend, error):
        return {"kind": "crash", "message": f"BackendCompilerFailed: backend='{backend}' "
                f"raised:\n{error}\n\nWhile executing %setitem"}
    bools = "RuntimeError: Subtraction, the `-` operator, with two bool tensors"
    assert failure_key(crash("pypto", bools)) == failure_key(crash("decomposed_eager", bools))
    assert (failure_key(crash("pypto", "IndexError: list index out of range"))
            != failure_key(crash("decomposed_eager", bools)))


def test_special_values_reach_the_inputs():
    spec = _case("", special=True)["inputs"][0]
    x = check.make_input(spec, 0, seed=11)
    assert x.isnan().any() and x.isinf().any()
    nudged = check.make_input(spec, 0, seed=11, mode="nudge")
    same = x.isnan() | (x == nudged)
    assert not same.all() and (x.isnan() == nudged.isnan()).all()


def test_nudge_moves_the_finite_special_values_toward_zero():
    """Seeds 33345, 32768: a sum cancelling +max against -max is decided by an ulp of the
    max; the nudged run moves finite special values (never to inf) so it shows that."""
    spec = _case("", special=True)["inputs"][0]
    x = check.make_input(spec, 1, seed=5)
    nudged = check.make_input(spec, 1, seed=5, mode="nudge")
    big = x.abs() == torch.finfo(x.dtype).max
    assert big.any() and torch.isfinite(nudged[big]).all()
    assert (nudged[big].abs() < x[big].abs()).all()
    keep = ~torch.isfinite(x) | (x == 0)
    assert_equal = torch.testing.assert_close
    assert_equal(nudged[keep], x[keep], equal_nan=True, atol=0, rtol=0)


def test_inputs_do_not_depend_on_the_default_dtype():
    """The float64 run sets the default dtype to float64: its inputs must stay the same."""
    specs = [_case("", dtype=d, special=True)["inputs"][0] for d in ("f32", "b8", "i32")]
    before = [check.make_input(s, 1, seed=4) for s in specs]
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        after = [check.make_input(s, 1, seed=4) for s in specs]
    finally:
        torch.set_default_dtype(default)
    for x, y in zip(before, after):
        torch.testing.assert_close(x, y, equal_nan=True, atol=0, rtol=0)


def test_repro_script_runs_standalone(tmp_path):
    program = Program(1, _case("")["inputs"],
                      [Statement("v0 = torch.sigmoid(x0) * 2.0", "v0", ["x0"], "unary")],
                      ["v0"], False)
    path = tmp_path / "repro.py"
    path.write_text(repro_source(program, "reference", True, []))
    root = str(Path(__file__).resolve().parents[2])  # this tree's package, not an installed one
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [root, *filter(None, [os.environ.get("PYTHONPATH")])])}
    out = subprocess.run([sys.executable, str(path)], capture_output=True, text=True,
                         timeout=300, cwd=tmp_path, env=env)
    assert out.returncode == 0 and out.stdout.strip().endswith("OK"), out.stderr[-2000:]


@pytest.mark.parametrize("dynamic", [False, True])
def test_shared_compile_checks_every_target(dynamic, monkeypatch):
    """check_shared compiles one trace for both targets: a fault in one target's graphs
    only (forward or backward) must still fail it, and the fault-free backend pass."""
    from pypto_inductor import backend

    program = Program(3, _case("")["inputs"],
                      [Statement("v0 = torch.exp(x0) * 0.5", "v0", ["x0"], "unary"),
                       Statement("v1 = v0.sum(0)", "v1", ["v0"], "reduction")],
                      ["v0", "v1"], True)
    assert check_shared(program, ["cpu", "reference"], dynamic, {})
    real = backend.compile_graph
    for target in ("cpu", "reference"):
        for kind in ("forward", "backward"):
            def faulty(gm, ex, config, k, *rest, target=target, kind=kind):
                run = real(gm, ex, config, k, *rest)
                if config.target != target or k != kind:
                    return run

                def shifted(args):
                    return [o + 1e-3 if isinstance(o, torch.Tensor) and o.is_floating_point()
                            else o for o in run(args)]
                shifted._boxed_call = True
                return shifted
            monkeypatch.setattr(backend, "compile_graph", faulty)
            assert not check_shared(program, ["cpu", "reference"], dynamic, {}), (target, kind)
    monkeypatch.setattr(backend, "compile_graph", real)


def _backward_shifted(by: float):
    """A backend whose backward graphs add ``by`` to every floating gradient."""
    from torch._dynamo.backends.common import aot_autograd

    def fw(gm, example_inputs):
        return gm.forward

    def bw(gm, example_inputs):
        def run(*args):
            return [o + by if isinstance(o, torch.Tensor) and o.is_floating_point() else o
                    for o in gm(*args)]
        return run
    return aot_autograd(fw_compiler=fw, bw_compiler=bw)


def test_nudged_grad_outputs_still_flag_a_wrong_gradient():
    """The nudged run moves the grad_outputs too (a gradient summing them with
    cancellation moves by their ulps as by the inputs'); a gradient 1e-3 off still fails."""
    case = dict(_case("def fn(x0):\n    return (torch.tanh(x0).expand(5, -1, -1),)\n"),
                backward=True)
    ref = check.reference(case, 0)
    assert not torch.equal(ref["nudged"]["gradients"][0], ref["eager"]["gradients"][0])
    assert check.check(case, backend=_backward_shifted(0.0)) == []
    found = check.check(case, backend=_backward_shifted(1e-3))
    assert found and "gradients" in found[0]["message"]


def test_worker_death_attributed_by_running_eager_alone(monkeypatch):
    """A worker that dies on a case: its eager side alone runs in a fresh process. Eager
    alive: ours (seed 1000 runs in eager); eager dead too (faked here: run 7's seed 50417
    is torch 2.13 segfaulting in its own float64 backward during the generator's
    validation): upstream, with the step it died in; both counted by the summary."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from benchmarks import fuzz

    ours = fuzz.attribute_death(1000, -11)
    assert ours["upstream"] is False and "def fn" in ours["source"], ours
    stage = fuzz.MARK + '{"stage": "the generator\'s eager validation"}\n'
    monkeypatch.setattr(fuzz.subprocess, "run", lambda cmd, **kw: subprocess.CompletedProcess(
        cmd, -11, stdout=stage, stderr=""))
    upstream = fuzz.attribute_death(50417, -11)
    assert upstream["upstream"] is True and "signal 11" in upstream["reason"]
    assert "generator's eager validation" in upstream["reason"]
    old = {"seed": 7, "process": "worker died (exit code -11)"}  # a record of an older run
    args = type("Args", (), {"cases": 3, "seed": 7})
    text = fuzz.summarize([ours, upstream, old], args, 0.0)
    assert "| worker deaths: ours / upstream (eager alone dies too) / unattributed | 1 / 1 / 1 |" in text
    assert "| worker died in compiled code | 1 | 1000 |" in text
