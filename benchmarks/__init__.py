"""Benchmarks: eager vs Inductor vs pypto, side by side in one process."""
import statistics
import time

# The clock median_us reads. ``time.thread_time`` (the calling thread's CPU time, the
# benchmarks' --cpu-time) is only meaningful at 1 thread; it ignores the time other
# processes hold the core, which on a shared machine swamps the wall clock.
CLOCK = time.perf_counter


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
