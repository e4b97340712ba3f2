"""The intra-op threads of a run (``trainer.threads``), set once when it starts.

On 2 cores beside one busy process, a tiny FOG's intra-op threads waited at every small op for a
sibling the scheduler had parked: 60-80x slower than on one thread (``docs/performance.md``). So
``auto`` takes the count measured fastest for the model's size, and never more threads than the
cores this process may run on (a Slurm job's ``cpus_per_task``, a ``taskset``).

Which wins: an integer ``trainer.threads`` is used as given; ``auto`` takes ``OMP_NUM_THREADS``
where the environment sets it (how a sweep gives each of the jobs it runs at once its share of the
cores), else :data:`AUTO_THREADS`. The thread count can change the order of float reductions, so
it can change the last bits of a run's numbers: the runs of one comparison keep one count.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping

import torch

log = logging.getLogger(__name__)

AUTO = "auto"
ENV = "OMP_NUM_THREADS"
# model.name -> the threads ``auto`` gives it, measured with benchmarks/threads.py on 2 cores shared
# with other work, where one thread was the fastest for both, quiet or not (docs/performance.md); a
# size not named here (the GPU sizes: the host side of a rank) gets every core this process may run on.
AUTO_THREADS = {"tiny": 1, "small": 1}


def is_thread_count(value: str) -> bool:
    """Whether ``value`` is ``auto`` or an integer >= 1 (``trainer.threads``)."""
    return value == AUTO or (value.isdigit() and int(value) >= 1)


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity, which Slurm and taskset narrow)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def choose_threads(setting: str, model_name: str, environ: Mapping[str, str], cores: int) -> tuple[int, str]:
    """``(threads, why)`` for ``trainer.threads=setting`` (the rule: this module's docstring)."""
    if setting != AUTO:
        return int(setting), "trainer.threads"
    from_env = environ.get(ENV, "")
    if from_env.isdigit() and int(from_env) >= 1:
        return int(from_env), f"auto: {ENV}"
    return min(AUTO_THREADS.get(model_name, cores), cores), f"auto: model {model_name} on {cores} cores"


def apply_threads(setting: str, model_name: str) -> int:
    """Set torch's intra-op threads for this run and return the count; the run's start line says
    it (``MetricsProcessor.log_start``), why it is that one only at debug level, so that a run
    that fails at once still says so in three lines."""
    threads, why = choose_threads(setting, model_name, os.environ, usable_cores())
    torch.set_num_threads(threads)
    log.debug("intra-op threads: %d (%s)", threads, why)
    return threads
