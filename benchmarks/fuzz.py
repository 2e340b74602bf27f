"""``python -m benchmarks.fuzz --cases 5000 --seed S``: the long differential fuzz run.

Case ``i`` is ``tests.fuzz.generator.generate(S + i)``, run in every configuration
(targets cpu and reference, static and dynamic=True at two sizes; backward where
the case has it) and compared with eager by ``tests/fuzz/check.py``'s rule.
Cases run in worker processes (``--jobs``), so a native crash or a hang
(``--timeout``) is recorded against its case and the run goes on. Every failure
is shrunk and written as a standalone repro under ``--out``. A worker that dies
(a signal, an abort) is attributed by running the case's eager side alone (the
generator's validation and the reference runs, ``--eager-only``) in a fresh process:
if that dies too, the death is upstream (torch's eager), else it is ours; a SIGKILL (from
outside: the OOM killer, a harness) first re-runs the case once in a fresh worker. A case
that times out is traced and run without our backend (``backend="eager"``, then
``decomposed_eager``) under the same timeout: hanging there too it is upstream, else
ours (docs/fuzz.md, "Failures"). The summary counts
cases, configurations, crashes and mismatches by category; ``--markdown PATH``
puts it between the result markers of PATH (docs/fuzz.md), ``--json PATH`` keeps
every case's record.
"""
from __future__ import annotations

import argparse
import collections
import datetime
import json
import os
import platform
import queue
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

MARK = "@@fuzz "
ROOT = Path(__file__).resolve().parents[1]  # the tree whose tests.fuzz and backend run
START, END = "<!-- fuzz-results:start -->", "<!-- fuzz-results:end -->"


# --- worker ------------------------------------------------------------------------------
def _worker(out: Path, shrink_s: float) -> None:
    """Reads seeds from stdin, writes one JSON record per case to stdout."""
    import warnings

    warnings.simplefilter("ignore")
    from tests.fuzz.runner import run_case

    for line in sys.stdin:
        seed = int(line)
        try:
            r = run_case(seed, shrink_budget_s=shrink_s, repro_dir=out, shrinks_per_key=20)
            record = {"seed": seed, "statements": len(r.program.statements),
                      "families": sorted(r.families), "backward": r.program.backward,
                      "special": r.program.special, "seconds": round(r.seconds, 2),
                      "failures": r.failures}
        except Exception as e:  # noqa: BLE001 - the fuzzer itself broke on this seed
            record = {"seed": seed, "error": f"{type(e).__name__}: {e}"}
        print(MARK + json.dumps(record), flush=True)


def _eager_only(seed: int) -> None:
    """The eager side of case ``seed`` alone, no compile: the generator (which validates
    the program in eager, float64 and nudged runs at both sizes) and the reference runs.
    Prints a stage marker before each step, so a parent that sees this process die knows
    where; then the program's record fields."""
    import warnings

    warnings.simplefilter("ignore")
    print(MARK + json.dumps({"stage": "the generator's eager validation"}), flush=True)
    from tests.fuzz import check
    from tests.fuzz.generator import generate

    program = generate(seed)
    for v in (0, 1):
        print(MARK + json.dumps({"stage": f"the eager reference runs at size variant {v}"}),
              flush=True)
        check.reference(program.case(), v)
    print(MARK + json.dumps({"statements": len(program.statements),
                             "families": sorted(program.families),
                             "backward": program.backward, "special": program.special,
                             "source": program.source}), flush=True)


def _env() -> dict:
    # PCH: the prelude's headers precompiled (codegen/cpp/pch.py: the same libraries, g++
    # ~3x faster on the fuzz kernels)
    return {"PYPTO_INDUCTOR_PCH": "1", **os.environ, "PYPTO_INDUCTOR_NO_CALIBRATE": "1",
            "PYPTO_INDUCTOR_COMPILE_JOBS": "1", "PYTHONPATH": str(ROOT)}


def attribute_death(seed: int, code: int, timeout: float = 600.0) -> dict:
    """The record of a worker that died (exit ``code``) on case ``seed``: its eager side is
    run alone in a fresh process (``_eager_only``); if that dies too the death is upstream
    (``upstream`` True, ``reason`` says in which step and how), else it is ours (a native
    crash in compiled code: the record has the program's source to reproduce it)."""
    record = {"seed": seed, "process": f"worker died (exit code {code})"}
    cmd = [sys.executable, "-m", "benchmarks.fuzz", "--eager-only", str(seed)]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=_env(),
                             cwd=ROOT)
    except subprocess.TimeoutExpired:
        return {**record, "upstream": None,
                "reason": f"eager alone did not finish in {timeout:.0f} s: unattributed"}
    marks = [json.loads(line[len(MARK):]) for line in out.stdout.splitlines()
             if line.startswith(MARK)]
    stage = next((m["stage"] for m in reversed(marks) if "stage" in m), "startup")
    if out.returncode != 0:
        how = (f"signal {-out.returncode}" if out.returncode < 0
               else f"exit code {out.returncode}: {(out.stderr.strip().splitlines() or [''])[-1][:300]}")
        return {**record, "upstream": True,
                "reason": f"eager alone dies too ({how}) in {stage}, before any compile"}
    info = marks[-1] if marks and "stage" not in marks[-1] else {}
    return {**record, **info, "upstream": False,
            "reason": "eager alone runs (generator and reference runs at both sizes): "
                      "the worker died in compiled code"}


def eager_trace(seed: int) -> None:
    """Case ``seed`` traced by Dynamo with ``backend="eager"`` (no backend of ours), static
    and ``dynamic=True`` at both sizes, backward included, then with ``decomposed_eager``
    (AOTAutograd and the decomposition table, graphs run eagerly). A stage marker before
    each step says where a hang is, for ``attribute_timeout``."""
    import warnings

    warnings.simplefilter("ignore")
    print(MARK + json.dumps({"stage": "the generator's eager validation"}), flush=True)
    import torch._dynamo

    from tests.fuzz import check
    from tests.fuzz.generator import generate
    from tests.fuzz.runner import decomposed_eager

    program = generate(seed)
    case = program.case()
    for name, backend in (("eager", "eager"), ("decomposed_eager", decomposed_eager)):
        for dynamic in (False, True):
            print(MARK + json.dumps({"stage": f"backend={name!r}, "
                                              f"{'dynamic' if dynamic else 'static'}"}),
                  flush=True)
            torch._dynamo.reset()
            compiled = torch.compile(check.load(case["source"]), backend=backend,
                                     dynamic=dynamic)
            try:
                for v in ([0, 1] if dynamic else [0]):
                    check.run(compiled, check.inputs_for(case, v), case, v)
            except Exception as e:  # noqa: BLE001 - an error is no hang: go on
                print(MARK + json.dumps({"error": f"{type(e).__name__}: {e}"[:300]}), flush=True)
    print(MARK + json.dumps({"statements": len(program.statements),
                             "families": sorted(program.families),
                             "backward": program.backward, "special": program.special,
                             "source": program.source}), flush=True)


def attribute_timeout(seed: int, timeout: float) -> dict:
    """The record of a case that did not finish in ``timeout`` s: it is traced and run with
    ``backend="eager"`` (Dynamo alone), then ``decomposed_eager`` (AOTAutograd with the
    decomposition table), in a fresh process under the same timeout (``eager_trace``). If
    that does not finish either, or dies, the hang is upstream (``reason`` names the step:
    seed 60034, Dynamo's unbind over a 3,136-long dynamic dim); if it finishes, ours."""
    record = {"seed": seed, "process": f"timeout after {timeout:.0f} s"}
    cmd = [sys.executable, "-m", "benchmarks.fuzz", "--eager-trace", str(seed)]
    start = time.monotonic()
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=_env(),
                             cwd=ROOT)
        stdout, code = out.stdout, out.returncode
    except subprocess.TimeoutExpired as e:
        stdout, code = e.stdout or "", None
        if isinstance(stdout, bytes):
            stdout = stdout.decode(errors="replace")
    marks = [json.loads(line[len(MARK):]) for line in stdout.splitlines()
             if line.startswith(MARK)]
    stage = next((m["stage"] for m in reversed(marks) if "stage" in m), "startup")
    info = marks[-1] if marks and "source" in marks[-1] else {}
    if code is None:
        return {**record, "upstream": True,
                "reason": f"without our backend it does not finish in {timeout:.0f} s "
                          f"either (hangs in {stage})"}
    if code != 0:
        how = f"signal {-code}" if code < 0 else f"exit code {code}"
        return {**record, "upstream": True,
                "reason": f"without our backend it fails too ({how}) in {stage}"}
    return {**record, **info, "upstream": False,
            "reason": f"backend='eager' and decomposed_eager trace and run it in "
                      f"{time.monotonic() - start:.0f} s: the hang is ours"}


KILLED = "killed externally (SIGKILL), passed on re-run"


def after_kill(first: dict, again: dict) -> dict:
    """The record of a case whose worker was killed by SIGKILL (-9: from outside the
    process, the OOM killer or a harness) and that was run once more in a fresh worker
    (``again``). Completed there: the re-run's record, counted as any case, with the first
    death kept (``killed``); else the re-run's own death or timeout record, attributed as
    usual, with the first death kept too."""
    return {**again, "killed": first["process"],
            **({"note": KILLED} if "failures" in again else {})}


# --- driver -----------------------------------------------------------------------------
class Worker:
    def __init__(self, args, cmd=None):
        self.args = args
        env = _env()
        cmd = cmd or [sys.executable, "-m", "benchmarks.fuzz", "--worker", "--out",
                      str(args.out), "--shrink-seconds", str(args.shrink_seconds)]
        self.cmd = cmd
        self.cases = 0
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.DEVNULL, text=True, env=env)
        self.lines: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for line in self.proc.stdout:
            if line.startswith(MARK):
                self.lines.put(json.loads(line[len(MARK):]))
        self.lines.put(None)  # the process ended

    def run(self, seed: int, timeout: float, rerun_killed: bool = True) -> dict:
        """Case ``seed``'s record; a hang or death is attributed (``attribute_timeout``,
        ``attribute_death``), a SIGKILL first re-runs the case in a fresh worker."""
        self.cases += 1
        try:
            self.proc.stdin.write(f"{seed}\n")
            self.proc.stdin.flush()
            record = self.lines.get(timeout=timeout)
        except (BrokenPipeError, OSError):
            record = None
        except queue.Empty:
            self.proc.kill()
            self.proc.wait()
            return attribute_timeout(seed, timeout)
        if record is None:
            code = self.proc.wait()
            if code == -9 and rerun_killed:
                fresh = Worker(self.args, self.cmd)
                try:
                    again = fresh.run(seed, timeout, rerun_killed=False)
                finally:
                    fresh.close()
                return after_kill({"process": f"worker died (exit code {code})"}, again)
            return attribute_death(seed, code, timeout)
        return record

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def close(self):
        if self.alive:
            try:
                self.proc.stdin.close()
                self.proc.wait(timeout=60)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()


def _drive(args) -> list[dict]:
    records, lock = [], threading.Lock()
    if args.resume and args.json and os.path.exists(args.json):
        with open(args.json) as f:  # a run that was stopped: keep its cases
            records = [json.loads(line) for line in f if line.strip()]
        old = [i for i, r in enumerate(records) if unsettled(r)]
        for i in old:  # deaths and timeouts recorded before they were attributed
            records[i] = settle(records[i], args)
        if old:
            tmp = f"{args.json}.tmp"
            with open(tmp, "w") as f:
                f.writelines(json.dumps(r) + "\n" for r in records)
            os.replace(tmp, args.json)
    finished = {r["seed"] for r in records}
    seeds = queue.Queue()
    for i in range(args.cases):
        if args.seed + i not in finished:
            seeds.put(args.seed + i)
    start = time.monotonic()

    def loop():
        worker = Worker(args)
        while True:
            try:
                seed = seeds.get_nowait()
            except queue.Empty:
                break
            record = worker.run(seed, args.timeout)
            if not worker.alive or (args.recycle and worker.cases >= args.recycle):
                worker.close()  # a fresh process after a death, a hang or N cases
                worker = Worker(args)
            with lock:
                records.append(record)
                done = len(records)
                if args.json:
                    with open(args.json, "a") as f:
                        f.write(json.dumps(record) + "\n")
            bad = record.get("failures") or record.get("process") or record.get("error")
            if bad or done % 50 == 0:
                print(f"[{done}/{args.cases} {time.monotonic() - start:.0f}s] seed {seed}: "
                      f"{_one_line(record)}", flush=True)
        worker.close()

    threads = [threading.Thread(target=loop) for _ in range(args.jobs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sorted(records, key=lambda r: r["seed"])


def _death_code(record: dict) -> int | None:
    found = re.search(r"worker died \(exit code (-?\d+)\)", record.get("process", ""))
    return int(found.group(1)) if found else None


def unsettled(record: dict) -> bool:
    """A death or timeout that an older runner recorded without this one's attribution:
    any death or timeout without ``upstream``, and a SIGKILL that was not re-run."""
    process = record.get("process", "")
    if not process or "killed" in record:
        return False
    return "upstream" not in record or _death_code(record) == -9


def settle(record: dict, args) -> dict:
    """Attributes an older record as the runner does now (``--resume``)."""
    seed, code = record["seed"], _death_code(record)
    if code == -9:
        worker = Worker(args)
        try:
            again = worker.run(seed, args.timeout, rerun_killed=False)
        finally:
            worker.close()
        return after_kill({"process": record["process"]}, again)
    if code is not None:
        return attribute_death(seed, code, args.timeout)
    return attribute_timeout(seed, args.timeout)


def _one_line(record: dict) -> str:
    if record.get("note"):
        return f"{record['killed']}; {record['note']}: " + (
            "ok" if not record["failures"] else f"{len(record['failures'])} failure(s)")
    if "process" in record or "error" in record:
        if "reason" in record:
            return f"{record['process']}; {record['reason']}"
        return record.get("process") or record["error"][:200]
    if not record["failures"]:
        return "ok"
    f = record["failures"][0]
    return (f"{len(record['failures'])} failure(s); {f['kind']} on {f['target']} "
            f"{'dynamic' if f['dynamic'] else 'static'}: {f['message'][:160]}")


# --- summary ----------------------------------------------------------------------------
def signature(f: dict) -> str:
    """Groups failures that are likely one bug: crash message shape, or the ops of the
    shrunk program."""
    if f["kind"] == "crash":
        from tests.fuzz.runner import failure_key

        return failure_key(f)
    source = f.get("shrunk")
    if source:
        calls = sorted(set(re.findall(r"(?:torch\.|F\.|\.)(\w+)\(", source)) - {"shape"})
        return "mismatch: " + " ".join(calls)
    got = re.search(r"compiled (\S+), eager (\S+),", f["message"])
    if not got:
        return "mismatch: " + f["message"].split(":")[0]
    c, e = got.groups()
    special = {"nan", "inf", "-inf"}
    if c in special or e in special:
        what = f"compiled {c if c in special else 'finite'}, eager {e if e in special else 'finite'}"
    elif c in ("True", "False") or (c.lstrip("-").isdigit() and e.lstrip("-").isdigit()):
        what = "integer or bool values"
    else:
        what = "float values"
    where = f["message"].split("[")[0]
    return f"mismatch ({f['target']}): {where}, {what}"


def summarize(records: list[dict], args, seconds: float) -> str:
    cases = [r for r in records if "failures" in r]
    broken = [r for r in records if "failures" not in r]
    n_configs = 4
    lines = []
    when = datetime.datetime.now().strftime("%Y-%m-%d %H:%M")
    commit = os.environ.get("FUZZ_COMMIT") or subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    lines.append(f"Run {when} on {platform.node() or 'this machine'} ({os.cpu_count()} CPUs), "
                 f"commit {commit}, {seconds / 3600:.1f} h: "
                 f"`python -m benchmarks.fuzz --cases {args.cases} --seed {args.seed}`.\n")
    backward = sum(r["backward"] for r in cases)
    special = sum(r["special"] for r in cases)
    failing = [r for r in cases if r["failures"]]
    fails = [f for r in cases for f in r["failures"]]
    ours = [f for f in fails if not f.get("upstream")]

    def count(kind, target=None, dynamic=None, upstream=False):
        return len({(f["seed"], f["target"], f["dynamic"]) for f in fails
                    if f["kind"] == kind and bool(f.get("upstream")) == upstream
                    and (target is None or f["target"] == target)
                    and (dynamic is None or f["dynamic"] == dynamic)})

    for r in cases:
        for f in r["failures"]:
            f["seed"] = r["seed"]
    deaths = {False: [], True: [], None: []}  # ours, upstream, not attributed (older runs)
    timeouts = {False: [], True: [], None: []}
    for r in broken:
        if "died" in r.get("process", ""):
            deaths[r.get("upstream")].append(r["seed"])
        elif "timeout" in r.get("process", ""):
            timeouts[r.get("upstream")].append(r["seed"])
    killed = [r["seed"] for r in cases if r.get("note") == KILLED]
    lines += [
        "| | count |", "| --- | --- |",
        f"| cases (programs of 3-15 ops) | {len(cases)} |",
        f"| compiled configurations run (cpu, reference) x (static, dynamic) | "
        f"{len(cases) * n_configs} |",
        f"| size variants checked (static 1, dynamic 2) | {len(cases) * 6} |",
        f"| cases with backward (gradients compared) | {backward} |",
        f"| cases with special input values | {special} |",
        f"| cases with a failure (any configuration) | {len(failing)} |",
        f"| crashes (case x configuration) | {count('crash')} |",
        f"| mismatches (case x configuration) | {count('mismatch')} |",
        f"| upstream (decomposed eager fails alike): crashes / mismatches | "
        f"{count('crash', upstream=True)} / {count('mismatch', upstream=True)} |",
        f"| worker deaths: ours / upstream (eager alone dies too) / unattributed | "
        f"{len(deaths[False])} / {len(deaths[True])} / {len(deaths[None])} |",
        f"| timeouts: ours / upstream (backend='eager' does not finish either) / "
        f"unattributed | {len(timeouts[False])} / {len(timeouts[True])} / "
        f"{len(timeouts[None])} |",
        f"| {KILLED} (not a failure) | {len(killed)} |",
        f"| generator errors | {sum('error' in r for r in broken)} |",
        "",
        "| configuration | crashes | mismatches |", "| --- | --- | --- |",
    ]
    for target in ("cpu", "reference"):
        for dynamic in (False, True):
            lines.append(f"| {target} {'dynamic' if dynamic else 'static'} | "
                         f"{count('crash', target, dynamic)} | "
                         f"{count('mismatch', target, dynamic)} |")
    lines += ["", "| op family | cases | cases failing |", "| --- | --- | --- |"]
    by_family = collections.Counter(fam for r in cases for fam in r["families"])
    failing_family = collections.Counter(fam for r in cases
                                         if any(not f.get("upstream") for f in r["failures"])
                                         for fam in r["families"])
    for fam, n in sorted(by_family.items(), key=lambda kv: -kv[1]):
        lines.append(f"| {fam} | {n} | {failing_family[fam]} |")
    lines.append(f"| backward | {backward} | "
                 f"{sum(1 for r in failing if r['backward'])} |")
    lines.append(f"| special values | {special} | "
                 f"{sum(1 for r in failing if r['special'])} |")
    groups = collections.defaultdict(set)
    for f in ours:
        groups[signature(f)].add(f["seed"])
    for seed in deaths[False]:
        groups["worker died in compiled code"].add(seed)
    for seed in deaths[None]:
        groups["worker died (not attributed: --resume attributes it)"].add(seed)
    for seed in timeouts[False]:
        groups["timeout in our backend (backend='eager' finishes)"].add(seed)
    for seed in timeouts[None]:
        groups["timeout (not attributed: --resume attributes it)"].add(seed)
    if groups:
        lines += ["", "| failure signature (shrunk) | cases | seeds (first 6) |",
                  "| --- | --- | --- |"]
        for sig, seeds in sorted(groups.items(), key=lambda kv: -len(kv[1])):
            lines.append(f"| {sig.replace('|', '/')} | {len(seeds)} | "
                         f"{', '.join(map(str, sorted(seeds)[:6]))} |")
    excused = {"worker died, eager alone dies too (upstream)": deaths[True],
               "timeout, backend='eager' does not finish either (upstream)": timeouts[True],
               KILLED: killed}
    if any(excused.values()):
        lines += ["", "| not counted as failures of ours | cases | seeds (first 6) |",
                  "| --- | --- | --- |"]
        for what, seeds in excused.items():
            if seeds:
                lines.append(f"| {what} | {len(seeds)} | "
                             f"{', '.join(map(str, sorted(seeds)[:6]))} |")
    return "\n".join(lines) + "\n"


def _shrink_repro(path: Path, seconds: float) -> int:
    import warnings

    warnings.simplefilter("ignore")
    from tests.fuzz.program import Program
    from tests.fuzz.runner import check_program, failure_key, repro_source, shrink

    ns: dict = {"__name__": "repro"}
    exec(compile(path.read_text(), str(path), "exec"), ns)
    program = Program.from_case(ns["CASE"])
    if "TARGET" in ns:
        target, dynamic = ns["TARGET"], ns["DYNAMIC"]
    else:  # named seed<S>_<target>_<static|dynamic>.py
        target, mode = re.search(r"_(cpu|reference)_(static|dynamic)", path.name).groups()
        dynamic = mode == "dynamic"
    found = check_program(program, target, dynamic)
    if not found:
        print("the repro passes: nothing to shrink")
        return 1
    small = shrink(program, target, dynamic, failure_key(found[0]), seconds)
    out = path.with_suffix(".shrunk.py")
    out.write_text(repro_source(small, target, dynamic, check_program(small, target, dynamic)))
    print(small.source + f"written to {out}")
    return 0


def _write_markdown(path: Path, text: str) -> None:
    doc = path.read_text() if path.exists() else f"{START}\n{END}\n"
    if START not in doc:
        doc += f"\n{START}\n{END}\n"
    head, rest = doc.split(START, 1)
    tail = rest.split(END, 1)[1]
    path.write_text(f"{head}{START}\n{text}{END}{tail}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cases", type=int, default=5000)
    p.add_argument("--seed", type=int, default=0, help="first seed")
    p.add_argument("--jobs", type=int, default=1, help="worker processes")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per case")
    p.add_argument("--shrink-seconds", type=float, default=30.0,
                   help="time to shrink each failing configuration (0: keep it whole)")
    p.add_argument("--out", type=Path, default=Path("fuzz-repros"),
                   help="where repro scripts go")
    p.add_argument("--markdown", type=Path, help="write the summary into this file")
    p.add_argument("--json", help="append every case's record (JSON lines)")
    p.add_argument("--resume", action="store_true",
                   help="skip the seeds the --json file already has")
    p.add_argument("--summarize", metavar="JSONL",
                   help="no run: summarize the records a --json run wrote")
    p.add_argument("--shrink", metavar="REPRO",
                   help="no run: shrink a repro script's case, written next to it as .shrunk.py")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--eager-only", type=int, metavar="SEED", help=argparse.SUPPRESS)
    p.add_argument("--eager-trace", type=int, metavar="SEED", help=argparse.SUPPRESS)
    p.add_argument("--recycle", type=int, default=100,
                   help="a fresh worker process after this many cases (0: never)")
    args = p.parse_args(argv)
    if args.worker:
        _worker(args.out, args.shrink_seconds)
        return 0
    if args.eager_only is not None:
        _eager_only(args.eager_only)
        return 0
    if args.eager_trace is not None:
        eager_trace(args.eager_trace)
        return 0
    if args.shrink:
        return _shrink_repro(Path(args.shrink), args.shrink_seconds)
    start = time.monotonic()
    if args.summarize:
        with open(args.summarize) as f:
            records = sorted((json.loads(line) for line in f), key=lambda r: r["seed"])
        args.cases, args.seed = len(records), records[0]["seed"] if records else args.seed
        seconds = sum(r.get("seconds", 0) for r in records) / max(args.jobs, 1)
    else:
        records = _drive(args)
        seconds = time.monotonic() - start
    text = summarize(records, args, seconds)
    print(text)
    if args.markdown:
        _write_markdown(args.markdown, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
