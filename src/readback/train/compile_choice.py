"""Whether a run's steps are compiled (``trainer.compile``), decided once when it starts.

On one CPU thread a tiny FOG's compiled step takes about half the time of an eager one, but the
compile costs minutes first on 2 busy cores, several times more with inductor's cache empty than
with the graph already in it (``docs/performance.md``, "Compiling: when it pays"). So ``auto``
compiles a CPU run of one process whose ``trainer.steps`` reach :data:`AUTO_COMPILE_STEPS` for its
model size: the steps after which a compiled run has caught up with an eager one even with a cold
cache. Anywhere else it keeps eager, as every run did before ``auto``: a size with no measured
break-even, a GPU, several processes.

The choice reads only settings a resume keeps (the total ``trainer.steps``, not the steps left),
so a run and its resume choose alike. A resume that lengthens a run (``trainer.steps`` changed under
``trainer.resume_changed_config``) may cross the threshold: giving ``trainer.compile`` the run's
mode as well keeps it. Compiled losses agree with eager ones to about 1e-7 relative, not bit for
bit (``readback.ops.compiled``): the runs of one comparison keep one mode, and a resume refuses
another setting, as for ``trainer.threads``.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from readback.ops.compiled import compiled
from readback.train.distributed import DistEnv

log = logging.getLogger(__name__)

AUTO = "auto"
# model.name -> the trainer.steps from which ``auto`` compiles a CPU run: the break-even measured
# with a cold inductor cache by benchmarks/compile.py on 2 shared cores, one thread (EPYC,
# docs/performance.md, every 10th step eager: tiny 1,433 steps of 16 x 128 tokens, small 91 of
# 4 x 8 x 256), rounded up; a size not named here stays eager.
AUTO_COMPILE_STEPS = {"tiny": 1500, "small": 100}


def is_compile_setting(value: object) -> bool:
    """Whether ``value`` is ``auto``, ``true`` or ``false`` (``trainer.compile``)."""
    return value is True or value is False or value == AUTO


def choose_compile(setting: bool | str, model_name: str, steps: int, device: str, world_size: int) -> tuple[bool, str]:
    """``(compiled, why)`` for ``trainer.compile=setting`` (the rule: this module's docstring)."""
    if setting != AUTO:
        return bool(setting), "trainer.compile"
    if device != "cpu" or world_size > 1:
        return False, f"auto: {device}, {world_size} process(es)"
    least = AUTO_COMPILE_STEPS.get(model_name)
    if least is None:
        return False, f"auto: no break-even measured for model {model_name}"
    return steps >= least, f"auto: {steps} steps, {'>=' if steps >= least else '<'} {least} for model {model_name}"


class CompiledStep:
    """A run's choice and, where it compiles, its compiled forward: the first step that runs it
    compiles it, and the log says what that step took (what compiling cost)."""

    def __init__(self, forward: torch.nn.Module, setting: bool | str, model_name: str, steps: int, env: DistEnv):
        self.chosen, self.why = choose_compile(setting, model_name, steps, env.device.type, env.world_size)
        self.forward: Any = compiled(forward) if self.chosen else None  # compiles on its first call
        self.first_step: int | None = None

    def describe(self) -> str:
        """The run's start line's words for the choice: ``compiled (why)`` or ``eager (why)``."""
        return f"{'compiled' if self.chosen else 'eager'} ({self.why})"

    def at(self, step: int) -> Any:
        """The compiled forward, for step ``step``."""
        self.first_step = self.first_step or step
        return self.forward

    def step_done(self, step: int, seconds: float, is_main: bool) -> None:
        if step == self.first_step and is_main:
            log.info("step %d compiled the forward and backward: %.1f s", step, seconds)
