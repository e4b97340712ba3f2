"""``precision.amax_spike`` on the run's rounding state alone: the amax of step t0 is multiplied
by 2**k as it enters the history, so the scale drops by exactly 2**-k at step t0 + 1 (margin 0,
E4M3, a constant tensor) and is back exactly when that entry leaves the history, after
``amax_history_len`` further steps; a checkpoint taken anywhere resumes into the same scales."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from readback.errors import ConfigError
from readback.numerics import E4M3, CurrentScaling, DelayedScaling, compute_scale
from readback.numerics.attention_settings import AttentionSettings
from readback.numerics.precision_settings import fp8_settings_of
from readback.numerics.settings import NumericsSettings
from readback.numerics.spike import AmaxSpike
from readback.numerics.state import Numerics
from specs import make_spec

SPIKED, OTHER = "layers.0.attn.core.output", "layers.0.attn.core.q"  # matched by attn.core.output, and not
STEPS = 24
FP8_BACKWARD = AttentionSettings(bwd_precision="fp8", bwd_reads="forward")


def _numerics(spike: AmaxSpike | None, history: int = 8, algo: str = "max"):
    recipe = DelayedScaling(amax_history_len=history, amax_compute_algo=algo)
    return Numerics(make_spec(recipe=recipe, amax_spike=None if spike is None else dataclasses.asdict(spike)))


def _tensors(constant: bool) -> list[torch.Tensor]:
    """One tensor a step: the same one, or amaxes that vary a little (all below 2)."""
    g = torch.Generator().manual_seed(0)
    if constant:
        return [torch.linspace(-1.5, 1.0, 64)] * STEPS
    return [torch.rand(64, generator=g) * (1 + torch.rand((), generator=g)) for _ in range(STEPS)]


def _scale_of(amax: float) -> float:
    """E4M3's scale for ``amax`` at margin 0 (448 / amax, in FP32 as every recipe computes it)."""
    return float(compute_scale(torch.tensor(amax), E4M3))


def _scales(numerics, tensors, start: int = 0, stop: int = STEPS, micro_batches: int = 1) -> list[dict[str, float]]:
    """Each step's scales (steps ``start + 1`` to ``stop``, counted from 1), each site quantizing
    the step's tensor ``micro_batches`` times, then ``end_step``."""
    out = []
    for x in tensors[start:stop]:
        scales = {}
        for _ in range(micro_batches):
            scales = {name: float(numerics.site(name).quantize(x).scale) for name in (SPIKED, OTHER)}
        out.append(scales)
        numerics.end_step()
    return out


@pytest.mark.parametrize("history", [1, 8])
def test_the_scale_drops_by_2_to_the_minus_k_at_t0_plus_1_and_returns_when_the_entry_leaves(history):
    t0, k = 5, 12
    tensors = _tensors(constant=True)
    plain = _scales(_numerics(None, history), tensors)
    spiked = _scales(_numerics(AmaxSpike("attn.core.output", t0, k), history), tensors)
    amax = float(tensors[0].abs().max())
    for step, (p, s) in enumerate(zip(plain, spiked), start=1):
        assert s[OTHER] == p[OTHER]  # an unmatched site never sees it
        if t0 < step <= t0 + history:  # held while the entry of step t0 is in the history
            assert s[SPIKED] == p[SPIKED] * 2.0**-k == _scale_of(amax * 2.0**k), step
        else:
            assert s[SPIKED] == p[SPIKED], step
    assert spiked[t0 + history][SPIKED] == plain[t0 + history][SPIKED] > spiked[t0 + history - 1][SPIKED]


def test_with_amaxes_that_vary_the_held_entry_sets_the_scale_and_leaves_exactly():
    t0, k, history = 7, 12, 8
    tensors = _tensors(constant=False)
    plain = _scales(_numerics(None, history), tensors)
    spiked = _scales(_numerics(AmaxSpike("attn.core.output", t0, k), history), tensors)
    held = _scale_of(float(tensors[t0 - 1].abs().max()) * 2.0**k)  # the amax of step t0 (from 1), x 2**k
    lowered = [step for step, s in enumerate(spiked, start=1) if s[SPIKED] == held]
    assert lowered == list(range(t0 + 1, t0 + history + 1))
    assert [s[SPIKED] for s in spiked[:t0] + spiked[t0 + history :]] == [
        p[SPIKED] for p in plain[:t0] + plain[t0 + history :]
    ]


def test_one_entry_per_optimizer_step_whatever_the_micro_batches():
    """readback writes one history entry per ``end_step`` (the max over its micro-batches), where
    Transformer Engine writes one per forward: the spike is held for ``amax_history_len`` steps."""
    t0, k, history = 3, 4, 4
    tensors = _tensors(constant=True)
    spiked = _scales(_numerics(AmaxSpike("attn.core.output", t0, k), history), tensors, micro_batches=3)
    low = _scale_of(float(tensors[0].abs().max()) * 2.0**k)
    assert [step for step, s in enumerate(spiked, start=1) if s[SPIKED] == low] == [4, 5, 6, 7]


def test_most_recent_holds_it_for_one_step():
    t0, k = 4, 6
    tensors = _tensors(constant=True)
    plain = _scales(_numerics(None, algo="most_recent"), tensors)
    spiked = _scales(_numerics(AmaxSpike("attn.core.output", t0, k), algo="most_recent"), tensors)
    assert [step for step, (p, s) in enumerate(zip(plain, spiked), start=1) if s != p] == [t0 + 1]


@pytest.mark.parametrize("cut", [0, 3, 4, 5, 6, 9, 13, 20])
def test_a_run_resumed_at_any_step_injects_once_and_matches_the_uninterrupted_one(cut):
    """Resumed before the spike's step it injects it (once); at or after it, the spiked entry comes
    back with the saved history and is not injected again."""
    t0, k = 5, 3
    spike = AmaxSpike("attn.core.output", t0, k)
    tensors = _tensors(constant=False)
    straight = _scales(_numerics(spike), tensors)
    first = _numerics(spike)
    before = _scales(first, tensors, stop=cut)
    resumed = _numerics(spike)
    resumed.load_state_dict(copy.deepcopy(first.state_dict()))  # a checkpoint between steps
    after = _scales(resumed, tensors, start=cut)
    assert before + after == straight
    assert sum(s[SPIKED] < p[SPIKED] for s, p in zip(straight, _scales(_numerics(None), tensors))) == 8


def test_a_spike_needs_delayed_scaling_and_steps_and_k_from_1():
    spike = {"site": "attn.core.output", "step": 5, "k": 3}
    current = NumericsSettings(fp8_settings_of(CurrentScaling(), amax_spike=spike), FP8_BACKWARD, "reuse_rounded")
    with pytest.raises(ConfigError, match="delayed scaling"):
        current.check()
    for step, k in ((0, 3), (5, 0)):
        with pytest.raises(ValueError, match="must be >= 1"):
            AmaxSpike("attn.core.output", step, k)
