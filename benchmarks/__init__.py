"""Benchmarks: eager vs Inductor vs pypto, side by side in one process."""
import statistics
import time


def median_us(fn, args, repeats: int) -> float:
    """Median wall time of ``fn(*args)`` over ``repeats`` calls, in microseconds."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn(*args)
        times.append((time.perf_counter() - start) * 1e6)
    return statistics.median(times)
