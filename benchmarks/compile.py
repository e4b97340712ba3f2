"""What ``torch.compile`` costs a CPU run once and saves it every step, and the run length from
which compiling pays (``trainer.compile: auto``, ``readback.train.compile_choice``).

    OMP_NUM_THREADS=1 python benchmarks/compile.py                    # tiny and small, 3 rounds
    OMP_NUM_THREADS=1 python benchmarks/compile.py --sizes tiny --rounds 5

The step is ``benchmarks/step.py``'s (forward + backward + ``numerics.end_step()``) of one
experiment, at the trainer's micro-batch for the size, ``accum`` of them an optimizer step. Each
round first compiles it in two fresh processes: one with an empty inductor cache (a new
``TORCHINDUCTOR_CACHE_DIR``: cold), then one with the cache the first filled (warm, as every run
after the first of a sweep finds it). A compile's cost is the time from importing the inductor
to the end of the first compiled step, less one compiled step. Then, in this process, eager and
compiled steps take turns (interleaved, so a busy machine slows both alike). The break-even is
the cost over what an optimizer step saves, where only ``1 - 1/log_every`` of a run's steps run
compiled (the trainer's statistics steps stay eager).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

from readback.stopping import ends_on_ctrl_c
from readback.train.launch import keep_freed_memory
from step import COMPILED, build, cpu_description

BATCH = {"tiny": (16, 1), "small": (8, 4)}  # (micro-batch, accum): the study presets' and the trainer's defaults
STEPS = {"tiny": 20, "small": 2}  # interleaved steps of each mode a round


def compile_cost(variant: str, size: str, batch: int, steps: int = 3) -> dict:
    """In this (fresh) process: the seconds from importing the inductor to the end of the first
    compiled step, less the median of ``steps`` compiled steps after it."""
    start = time.perf_counter()
    import torch._inductor.config  # noqa: F401  (a fresh process pays its import too)

    imported = time.perf_counter() - start
    fn, _ = build(variant + COMPILED, size, batch)  # builds, one eager step, then wraps (compiles on first use)
    start = time.perf_counter()
    fn()
    first = time.perf_counter() - start
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return {"cost_s": imported + first - statistics.median(times)}


def compile_in_process(variant: str, size: str, batch: int, cache_dir: str) -> float:
    """:func:`compile_cost` in a fresh process whose inductor cache is ``cache_dir``."""
    out = subprocess.run(
        [sys.executable, __file__, "--cost-of", variant, size, str(batch)],
        check=True,
        capture_output=True,
        text=True,
        env={**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache_dir},
    ).stdout
    return json.loads(out.splitlines()[-1])["cost_s"]


def measure(variant: str, size: str, rounds: int, steps: int) -> dict:
    """Cold and warm compile costs and eager and compiled step times (seconds), interleaved by round."""
    batch, _ = BATCH[size]
    costs: dict[str, list[float]] = {"cold": [], "warm": []}
    times: dict[str, list[float]] = {"eager": [], "compiled": []}
    with tempfile.TemporaryDirectory() as caches:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(caches, "timed")  # this process's own compile
        built = {"eager": build(variant, size, batch)[0], "compiled": build(variant + COMPILED, size, batch)[0]}
        for fn in built.values():
            fn()  # the compiled one compiles here, outside the timed steps
        for r in range(rounds):
            cache = os.path.join(caches, f"round{r}")
            costs["cold"].append(compile_in_process(variant, size, batch, cache))
            costs["warm"].append(compile_in_process(variant, size, batch, cache))
            for _ in range(steps):
                for mode, fn in built.items():
                    start = time.perf_counter()
                    fn()
                    times[mode].append(time.perf_counter() - start)
    return {"costs": costs, "times": times}


def break_even(cost_s: float, eager_s: float, compiled_s: float, accum: int, log_every: int) -> float:
    """Optimizer steps after which a compiled run has caught up with an eager one."""
    saved = accum * (eager_s - compiled_s) * (1 - 1 / log_every)
    return cost_s / saved if saved > 0 else math.inf


def report(size: str, variant: str, rounds: int, result: dict, log_every: int) -> dict:
    batch, accum = BATCH[size]
    eager, compiled = (statistics.median(result["times"][m]) for m in ("eager", "compiled"))
    print(f"\n{size}, {variant}, micro-batch {batch} x accum {accum}, {rounds} rounds")
    print(
        f"  step: eager {1e3 * eager:.1f} ms, compiled {1e3 * compiled:.1f} ms (median of "
        f"{len(result['times']['eager'])} each); compiled / eager {compiled / eager:.2f}"
    )
    figures = {"eager_ms": 1e3 * eager, "compiled_ms": 1e3 * compiled}
    for cache, costs in result["costs"].items():
        cost = statistics.median(costs)
        steps = break_even(cost, eager, compiled, accum, log_every)
        print(
            f"  compile, cache {cache}: {cost:.1f} s (rounds {', '.join(f'{c:.1f}' for c in costs)}); "
            f"pays after {steps:.0f} optimizer steps (every {log_every}th eager)"
        )
        figures |= {f"{cache}_s": cost, f"{cache}_break_even_steps": steps}
    return figures


@ends_on_ctrl_c("benchmarks/compile.py")
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", nargs="+", default=["tiny", "small"], choices=sorted(BATCH))
    parser.add_argument("--variant", default="reuse_rounded")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, help="interleaved steps of each mode a round (default: tiny 20, small 2)")
    parser.add_argument("--log-every", type=int, default=10, help="the trainer's: its statistics steps stay eager")
    parser.add_argument("--json", help="also write the results here")
    parser.add_argument("--cost-of", nargs=3, metavar=("VARIANT", "SIZE", "BATCH"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(1)
    keep_freed_memory()
    if args.cost_of:
        variant, size, batch = args.cost_of
        print(json.dumps(compile_cost(variant, size, int(batch))))
        return
    cpu = cpu_description()
    print(f"CPU: {cpu}; one thread")
    results: dict = {"cpu": cpu}
    for size in args.sizes:
        result = measure(args.variant, size, args.rounds, args.steps or STEPS[size])
        results[size] = result | report(size, args.variant, args.rounds, result, args.log_every)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
