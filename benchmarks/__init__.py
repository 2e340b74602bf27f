"""Benchmarks: eager vs Inductor vs pypto, side by side in one process."""
import argparse
import statistics
import time

# The clock median_us reads. ``time.thread_time`` (the calling thread's CPU time, the
# benchmarks' --cpu-time) is only meaningful at 1 thread; it ignores the time other
# processes hold the core, which on a shared machine swamps the wall clock.
CLOCK = time.perf_counter


def own_code(fn):
    """``fn`` behind a function with a code object of its own: compile that, one per
    compiled variant. Dynamo keeps its compiled frames per code object: variants sharing
    one (copies of one model class, whose ``forward`` is one code object) are looked up in
    one list, and a variant pays for evaluating the guards of those found before it
    (measured: two identical pypto variants of the zoo ResNet 1251 and 951 us). Frames
    called after a graph break inside ``fn`` are still shared. ``__wrapped__`` gives it
    ``fn``'s signature (transformers' ``generate`` inspects ``forward``'s)."""
    scope = {"fn": fn}
    exec("def call(*args, **kwargs):\n    return fn(*args, **kwargs)\n", scope)  # noqa: S102 - a fixed source
    call = scope["call"]
    call.__wrapped__ = fn
    return call


def median_us(fn, args, repeats: int) -> float:
    """Median wall time of ``fn(*args)`` over ``repeats`` calls, in microseconds."""
    times = []
    for _ in range(repeats):
        start = CLOCK()
        fn(*args)
        times.append((CLOCK() - start) * 1e6)
    return statistics.median(times)


def interleaved_medians(variants: dict, call, rounds: int, repeats: int) -> dict:
    """Per label, the median over ``rounds`` of ``median_us(call, (variant,), repeats)``;
    one round times every variant in turn, so machine noise hits them all alike."""
    times = {label: [] for label in variants}
    for _ in range(rounds):
        for label, f in variants.items():
            times[label].append(median_us(call, (f,), repeats))
    return {label: statistics.median(t) for label, t in times.items()}


def md_table(cols: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols),
            *("| " + " | ".join(r) + " |" for r in rows)]


def timing_parser(doc: str, threads: int = 1, repeats: int = 20,
                  cpu_time: bool = True) -> argparse.ArgumentParser:
    """The options every micro-benchmark takes: --threads, --rounds, --repeats (and
    --cpu-time); read them with :func:`parse_timing`."""
    p = argparse.ArgumentParser(description=doc.splitlines()[0])
    p.add_argument("--threads", type=int, default=threads)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--repeats", type=int, default=repeats)
    if cpu_time:
        p.add_argument("--cpu-time", action="store_true",
                       help="time the calling thread's CPU time (1 thread only): robust to load")
    return p


def parse_timing(p: argparse.ArgumentParser, argv=None) -> argparse.Namespace:
    """Parsed options; --cpu-time switches :data:`CLOCK` to the thread's CPU time."""
    global CLOCK
    a = p.parse_args(argv)
    if getattr(a, "cpu_time", False):
        if a.threads != 1:
            p.error("--cpu-time needs --threads 1")
        CLOCK = time.thread_time
    return a
