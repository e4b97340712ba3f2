"""Timing shared by the benchmark scripts (run them from the repository root)."""

import statistics
import time


def median_ms(fn, repeats: int) -> float:
    """Median wall time of ``fn()`` in milliseconds over ``repeats`` runs, after one warm-up."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)
