"""The pre-registered tests' decisions, one module a test: each ``decide(SWEEP)`` makes the calls
its pre-registration page fixed on the runs a sweep wrote, and ``report(decision)`` words them in
Markdown (``python -m readback.cli.decide NAME SWEEP [--out DIR]``). What they share is in
:mod:`~readback.analysis.decisions.common`."""

from readback.analysis.decisions import (
    bf16_bwd,
    bf16_fix_cost,
    nvfp4_switches,
    parts_ladder,
    spike,
    study_setting,
    te_reads_meter,
)

#: NAME -> its module, each with ``decide``, ``report`` and a docstring naming its page and sweep
DECISIONS = {
    module.__name__.rpartition(".")[2]: module
    for module in (bf16_bwd, bf16_fix_cost, nvfp4_switches, parts_ladder, spike, study_setting, te_reads_meter)
}

__all__ = ["DECISIONS"]
