"""Training speed on 1 and 2 intra-op threads, alone and beside one busy process.

    python benchmarks/threads.py                       # tiny reuse_rounded, batch 8, 5 rounds of 3 s
    python benchmarks/threads.py --size small --batch 4 --seconds 6 --rounds 3

What ``trainer.threads: auto`` is chosen from (``readback.train.threads.AUTO_THREADS``). A
measurement trains for ``--seconds`` (steps as in ``benchmarks/step.py``: forward + backward +
``numerics.end_step()``, on fixed random tokens) and gives tokens/s. Each round measures every
thread count quiet, then starts the busy process (a second Python process multiplying matrices
on ``--busy-threads`` threads without a pause, as a second training would keep a core) and
measures them again beside it, then stops it; the rounds interleave the conditions, so other work
on the machine slows them alike. "Quiet" is the machine as it is: the load average, printed
before and after, says what else ran. The table gives the median tokens/s of each condition over
the rounds, their min and max, and each count's speed beside the busy process against alone.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

import torch

from readback.stopping import ends_on_ctrl_c
from readback.train.launch import keep_freed_memory
from step import build, cpu_description

# A process that keeps ``argv[1]`` cores busy with torch's ops until it is stopped.
BUSY = """
import sys, torch
torch.set_num_threads(int(sys.argv[1]))
a = torch.randn(256, 256)
while True:
    a = torch.tanh(a @ a)
"""
CONDITIONS = ("quiet", "busy")


def tokens_per_s(step, tokens: int, threads: int, seconds: float) -> float:
    """Tokens/s of ``step`` on ``threads`` intra-op threads over at least ``seconds`` (and one step)."""
    torch.set_num_threads(threads)
    step()  # warm-up: the thread pool at its new size
    steps, start = 0, time.perf_counter()
    while steps == 0 or time.perf_counter() - start < seconds:
        step()
        steps += 1
    return steps * tokens / (time.perf_counter() - start)


def measure(step, tokens: int, threads: list[int], rounds: int, seconds: float, busy_threads: int) -> dict:
    """``{(condition, threads): [tokens/s of each round]}``."""
    speeds: dict = {(c, t): [] for c in CONDITIONS for t in threads}
    for _ in range(rounds):
        for t in threads:
            speeds["quiet", t].append(tokens_per_s(step, tokens, t, seconds))
        busy = subprocess.Popen([sys.executable, "-c", BUSY, str(busy_threads)])
        try:
            time.sleep(0.5)  # its import of torch done, it multiplies
            for t in threads:
                speeds["busy", t].append(tokens_per_s(step, tokens, t, seconds))
        finally:
            busy.terminate()
            busy.wait()
    return speeds


def print_table(speeds: dict, threads: list[int]) -> None:
    print(f"  {'threads':<9}{'condition':<11}{'tok/s':>9}{'min':>9}{'max':>9}{'/ quiet':>9}{'/ 1 quiet':>11}")
    base = statistics.median(speeds["quiet", threads[0]])
    for t in threads:
        quiet = statistics.median(speeds["quiet", t])
        for c in CONDITIONS:
            runs = speeds[c, t]
            median = statistics.median(runs)
            spread = f"{min(runs):9.0f}{max(runs):9.0f}"
            print(f"  {t:<9}{c:<11}{median:9.0f}{spread}{median / quiet:9.3f}{median / base:11.3f}")


@ends_on_ctrl_c("benchmarks/threads.py")
def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="tiny")
    parser.add_argument("--experiment", default="reuse_rounded")
    parser.add_argument("--batch", type=int, default=8, help="micro-batch (the tiny default run's: 8)")
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seconds", type=float, default=3.0, help="of training per measurement")
    parser.add_argument("--busy-threads", type=int, default=1, help="threads of the busy process")
    args = parser.parse_args(argv)
    keep_freed_memory()
    step, fog = build(args.experiment, args.size, args.batch)
    tokens = args.batch * fog.cfg.seq_len
    print(f"CPU: {cpu_description()}; {len(os.sched_getaffinity(0))} cores; load {os.getloadavg()[0]:.1f}")
    print(
        f"{args.size} {args.experiment}, batch {args.batch} x {fog.cfg.seq_len}, {args.rounds} interleaved rounds "
        f"of {args.seconds:g} s; the busy process on {args.busy_threads} thread(s)"
    )
    print_table(measure(step, tokens, args.threads, args.rounds, args.seconds, args.busy_threads), args.threads)
    print(f"load {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
