"""Short seeded differential fuzz run, plus checks that the fuzzer itself can fail.

Each seed's program runs in one configuration, round-robin over (cpu, reference)
x (static, dynamic at two sizes), so the run stays within a few minutes; the long
run (every configuration per case) is ``python -m benchmarks.fuzz``. A failing seed
writes its standalone repro under pytest's tmp_path and names it in the message.
"""
from __future__ import annotations

import json
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


def test_overflow_into_an_opposite_infinity_is_no_mismatch_where_eager_does_it_too():
    """Seed 70931: a float32 sum of [3e38, 3e38, -inf] is NaN in one order (the finite
    run overflows to +inf first) and -inf in another; float64 says -inf. Compiled NaN
    where eager is -inf passes only if eager's own output holds such a NaN elsewhere."""
    inf, nan = float("inf"), float("nan")
    r = torch.tensor([-inf, -inf, inf], dtype=torch.float64)
    e = torch.tensor([-inf, nan, inf])
    assert check.compare(torch.tensor([nan, -inf, inf]), e, r, e) is None
    # no such NaN in eager's output: compiled NaN is a finding
    e = torch.tensor([-inf, -inf, inf])
    assert check.compare(torch.tensor([nan, -inf, inf]), e, r, e) is not None
    # and the NaN must stand where eager and float64 agree on the infinity
    e = torch.tensor([inf, nan, inf])
    assert check.compare(torch.tensor([nan, -inf, inf]), e, r, e) is not None


def test_finite_where_a_nudge_changes_eagers_class_is_no_mismatch():
    """Seed 82280: sum(x) ** -1.5 over a row holding +max, -max and ordinary values. Eager
    and float64 absorb the ordinary terms into the huge partial sums (sum 0, output inf);
    a kernel adding in another order keeps them (exact sum 2.94, output 0.198). Nudged by
    ulps, eager's sum is -4e31 (output NaN): the element is ill-conditioned, and a finite
    compiled value passes; where the nudge keeps eager's class it still fails."""
    inf, nan = float("inf"), float("nan")
    e = torch.tensor([inf, inf])
    r = torch.tensor([inf, inf], dtype=torch.float64)
    p = torch.tensor([nan, inf])
    c = torch.tensor([0.198, inf])
    assert check.compare(c, e, r, p) is None
    assert check.compare(torch.tensor([0.198, 0.198]), e, r, p) is not None
    # a non-finite compiled value of another class still fails
    assert check.compare(torch.tensor([-inf, inf]), e, r, p) is not None


def test_float32_value_cast_to_float64_keeps_float32_tolerance():
    """Seed 82806: bmm(erfc(x), y).to(f64), float32 erfc results an ulp apart from eager's
    and a dot product cancelling 175-fold: 1.4e-6 relative off, inside float32's
    tolerance, outside float64's. The value went through float32, so float32's applies."""
    e = torch.tensor([0.6805338859558105], dtype=torch.float64)
    r = torch.tensor([0.6805336371096069], dtype=torch.float64)
    c = torch.tensor([0.6805329322814941], dtype=torch.float64)
    assert check.compare(c, e, r, e, eps=torch.finfo(torch.float32).eps) is None
    assert check.compare(c, e, r, e) is not None  # computed in float64: a finding


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


@pytest.mark.parametrize("backward", [False, True])
@pytest.mark.parametrize("dynamic", [False, True])
def test_shared_compile_checks_every_target(dynamic, backward, monkeypatch):
    """check_shared compiles one trace for both targets: a fault in one target's graphs
    only (forward, backward or inference) must still fail it, and the fault-free backend
    pass (an inference graph too: compile_graph's ``record`` argument, added later, made
    the shared check raise on every forward-only case, silently falling back to separate
    compiles, until _FanOut took it)."""
    from pypto_inductor import backend

    program = Program(3, _case("")["inputs"],
                      [Statement("v0 = torch.exp(x0) * 0.5", "v0", ["x0"], "unary"),
                       Statement("v1 = v0.sum(0)", "v1", ["v0"], "reduction")],
                      ["v0", "v1"], backward)
    assert check_shared(program, ["cpu", "reference"], dynamic, {})
    real = backend.compile_graph
    for target in ("cpu", "reference"):
        for kind in (("forward", "backward") if backward else ("inference",)):
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


def _fake_worker(tmp_path, behaviour: str) -> list[str]:
    """A stand-in for the fuzz worker process (no torch): reads seeds, and per
    ``behaviour`` kills itself with SIGKILL on its first case only ("kill-once", a marker
    file tells a fresh worker), always ("kill-always"), or never answers ("hang")."""
    from benchmarks import fuzz

    marker = tmp_path / "killed-once"
    script = f"""
import json, os, signal, sys, time
for line in sys.stdin:
    seed = int(line)
    if {behaviour!r} == "hang":
        time.sleep(600)
    if {behaviour!r} == "kill-always" or not os.path.exists({str(marker)!r}):
        open({str(marker)!r}, "w").close()
        os.kill(os.getpid(), signal.SIGKILL)
    record = dict(seed=seed, statements=3, families=["unary"], backward=False,
                  special=False, seconds=0.1, failures=[])
    print({fuzz.MARK!r} + json.dumps(record), flush=True)
"""
    return [sys.executable, "-c", script]


def _fuzz_module():
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from benchmarks import fuzz

    return fuzz


def test_sigkilled_case_reruns_in_a_fresh_worker(tmp_path, monkeypatch):
    """Run 8's seed 60169: a worker killed by SIGKILL (from outside: the OOM killer, a
    harness) passed alone. The case runs once more in a fresh worker; passing there it is
    a case like any other, 'killed externally, passed on re-run', the first death kept."""
    fuzz = _fuzz_module()
    args = type("Args", (), {"out": tmp_path, "shrink_seconds": 0.0, "cases": 1, "seed": 5})
    worker = fuzz.Worker(args, _fake_worker(tmp_path, "kill-once"))
    record = worker.run(5, timeout=60)
    worker.close()
    assert record["note"] == fuzz.KILLED and record["failures"] == []
    assert record["killed"] == "worker died (exit code -9)"
    # killed on the re-run too: attributed as any death, both deaths on record
    monkeypatch.setattr(fuzz, "attribute_death", lambda seed, code, timeout: {
        "seed": seed, "process": f"worker died (exit code {code})", "upstream": False,
        "reason": "eager alone runs"})
    worker = fuzz.Worker(args, _fake_worker(tmp_path, "kill-always"))
    twice = worker.run(6, timeout=60)
    worker.close()
    assert twice["killed"] == "worker died (exit code -9)" and "note" not in twice
    assert twice["process"] == "worker died (exit code -9)" and twice["upstream"] is False
    text = fuzz.summarize([record, twice], args, 0.0)
    assert f"| {fuzz.KILLED} (not a failure) | 1 |" in text
    assert "| worker deaths: ours / upstream (eager alone dies too) / unattributed | 1 / 0 / 0 |" in text
    assert f"| {fuzz.KILLED} | 1 | 5 |" in text
    assert "| cases (programs of 3-15 ops) | 1 |" in text


def test_timeout_attributed_by_tracing_with_the_eager_backend(tmp_path, monkeypatch):
    """Run 8's seed 60034: Dynamo alone spends 20+ minutes in a 3,136-way unbind under
    dynamic=True. A case that times out is traced and run with backend='eager' (then
    decomposed_eager) in a fresh process under the same timeout: still hanging ->
    upstream, with the step; finishing -> ours. The hang and the eager run are faked."""
    fuzz = _fuzz_module()
    args = type("Args", (), {"out": tmp_path, "shrink_seconds": 0.0, "cases": 2, "seed": 60034})
    stages = "".join(fuzz.MARK + json.dumps({"stage": s}) + "\n" for s in
                     ("the generator's eager validation", "backend='eager', static",
                      "backend='eager', dynamic"))

    def hangs(cmd, **kw):
        assert "--eager-trace" in cmd and kw["timeout"] == 1
        raise subprocess.TimeoutExpired(cmd, kw["timeout"], output=stages)
    monkeypatch.setattr(fuzz.subprocess, "run", hangs)
    worker = fuzz.Worker(args, _fake_worker(tmp_path, "hang"))
    upstream = worker.run(60034, timeout=1)
    assert not worker.alive  # killed: the driver starts a fresh one
    assert upstream["process"] == "timeout after 1 s" and upstream["upstream"] is True
    assert "backend='eager', dynamic" in upstream["reason"]
    done = stages + fuzz.MARK + json.dumps({"statements": 4, "source": "def fn(x0): ..."}) + "\n"
    monkeypatch.setattr(fuzz.subprocess, "run", lambda cmd, **kw: subprocess.CompletedProcess(
        cmd, 0, stdout=done, stderr=""))
    ours = fuzz.attribute_timeout(7, 1)
    assert ours["upstream"] is False and ours["source"] == "def fn(x0): ..."
    old = {"seed": 8, "process": "timeout after 1200 s"}  # run 8's record, not attributed
    text = fuzz.summarize([upstream, ours, old], args, 0.0)
    assert ("| timeouts: ours / upstream (backend='eager' does not finish either) / "
            "unattributed | 1 / 1 / 1 |") in text
    assert "| timeout in our backend (backend='eager' finishes) | 1 | 7 |" in text
    assert "| timeout, backend='eager' does not finish either (upstream) | 1 | 60034 |" in text


def test_resume_attributes_older_timeouts_and_reruns_sigkills(monkeypatch):
    """Records of an older runner (run 8's 60034 and 60169) are attributed on --resume."""
    fuzz = _fuzz_module()
    timeout = {"seed": 60034, "process": "timeout after 1200 s"}
    killed = {"seed": 60169, "process": "worker died (exit code -9)", "upstream": False}
    segv = {"seed": 50417, "process": "worker died (exit code -11)", "upstream": True}
    assert fuzz.unsettled(timeout) and fuzz.unsettled(killed) and not fuzz.unsettled(segv)
    monkeypatch.setattr(fuzz, "attribute_timeout", lambda seed, t: {**timeout, "upstream": True})

    class Passing:
        def __init__(self, args):
            pass

        def run(self, seed, timeout, rerun_killed=True):
            assert not rerun_killed
            return {"seed": seed, "failures": []}

        def close(self):
            pass
    monkeypatch.setattr(fuzz, "Worker", Passing)
    args = type("Args", (), {"timeout": 1200})
    assert fuzz.settle(timeout, args)["upstream"] is True
    again = fuzz.settle(killed, args)
    assert again["note"] == fuzz.KILLED and again["killed"] == killed["process"]
    assert not fuzz.unsettled(again)


def test_eager_trace_runs_a_case_without_our_backend(capsys):
    """The attribution's own run (``--eager-trace``): every stage, then the program."""
    fuzz = _fuzz_module()
    fuzz.eager_trace(1000)
    out = [json.loads(line[len(fuzz.MARK):]) for line in capsys.readouterr().out.splitlines()
           if line.startswith(fuzz.MARK)]
    assert [m["stage"] for m in out if "stage" in m] == [
        "the generator's eager validation", "backend='eager', static",
        "backend='eager', dynamic", "backend='decomposed_eager', static",
        "backend='decomposed_eager', dynamic"]
    assert "def fn" in out[-1]["source"]


def test_unbind_and_split_stay_short():
    """Dynamo traces every piece of an unbind or split (under dynamic=True with symbolic
    guards per piece): seed 60034's 3,136-way unbind took over 20 minutes. The generator
    keeps them to MAX_PIECES pieces."""
    import re

    from . import generator

    b = generator.Builder(1, 0)
    for dims in ([(64, 48), (3, 5)], [(1000, 257)]):
        name = b.new_input(dims, "f32")
        spec = b._pending.pop()
        b.inputs.append(spec)
        b.names.append(name)
        b.values[name] = [check.make_input(spec, v, b.seed) for v in (0, 1)]
    seen = set()
    for attempt in range(300):
        b.rng.seed(attempt)
        before = len(b.statements)
        try:
            generator.BUILDERS["cat"](b)
        except generator.Rejected:
            continue
        if len(b.statements) == before:
            continue
        s = b.statements.pop()
        b.names.remove(s.defines)
        got = re.search(r"(\w+)\.unbind\((-?\d)\)|torch\.split\((\w+), 2, dim=(-?\d)\)", s.text)
        if got:
            name, d = (got.group(1), got.group(2)) if got.group(1) else got.group(3, 4)
            size = max(b.shapes(name)[v][int(d)] for v in (0, 1))
            pieces = size if "unbind" in s.text else (size + 1) // 2
            assert pieces <= generator.MAX_PIECES, s.text
            seen.add("unbind" if "unbind" in s.text else "split")
    assert seen == {"unbind", "split"}  # the short ones are still generated
