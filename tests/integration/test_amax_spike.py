"""``precision.amax_spike`` in training, in process on the tiny FOG (seconds): the spike reaches
the run (the scale of the matched sites drops at the right step and is held for
``amax_history_len`` steps, the logged history figures show it), nothing changes before it, a run
resumed before or after the spike's step matches the uninterrupted one, and the config refuses
what it cannot mean (one line each, through the real ``train.py``: ``test_bad_input``)."""

from __future__ import annotations

import json

import pytest
import torch

from readback.audit_model.examples import TINY_FOG
from readback.backends import build_model
from readback.data import build_data
from readback.errors import ConfigError
from readback.numerics import E4M3, compute_scale
from readback.train import Builders, run
from readback.train.checkpoint import checkpoint_path, list_checkpoints, load_checkpoint
from readback.train.records.metrics import read_jsonl
from toys import config

STEPS, T0, K, HISTORY = 12, 5, 8, 4
SITE, OTHER = "layers.1.attn.core.output", "layers.1.attn.core.q"
SPIKE = f"precision.amax_spike={{site:attn.core.output,step:{T0},k:{K}}}"
RUN = (
    *TINY_FOG,
    "seed=3",
    "logger=none",
    "model.global_batch=4",
    "trainer.micro_batch=2",  # 2 micro-batches a step
    f"trainer.steps={STEPS}",
    "trainer.log_every=1",
    f"trainer.eval_every={STEPS}",
    "trainer.eval_batches=1",
    "trainer.ckpt_every=3",
    "trainer.keep_last=4",
    "trainer.optim.warmup_steps=2",
    "trainer.progress=false",
    "trainer.device=cpu",
    f"precision.amax_history_len={HISTORY}",
)
TIMING_KEYS = {"tokens_per_s", "mfu", "mem_gib"}


class Recorded:
    """Builders whose model notes, after every ``end_step``, each site's scale (the one the next
    step uses) and newest history entry; whose data stream can crash at a micro-batch."""

    def __init__(self, crash_at_call: int | None = None):
        self.after: list[dict[str, tuple[float, float]]] = []  # index i: after step i + 1 (from the start or resume)
        self.crash_at_call = crash_at_call

    def model(self, cfg, device):
        model = build_model(cfg, device)
        numerics, end_step = model.numerics, model.numerics.end_step

        def recording_end_step() -> None:
            end_step()
            states = {name: numerics.site(name).state for name in (SITE, OTHER)}
            self.after.append(
                {n: (float(s.scale), float(s.history[(s.steps - 1) % len(s.history)])) for n, s in states.items()}
            )

        numerics.end_step = recording_end_step
        return model

    def data(self, cfg_data, layout):
        stream, calls, crash = build_data(cfg_data, layout), [0], self.crash_at_call
        next_batch = stream.next_batch

        def crashing_next_batch():
            if calls[0] == crash:
                raise RuntimeError("simulated crash")
            calls[0] += 1
            return next_batch()

        stream.next_batch = crashing_next_batch
        return stream

    def builders(self) -> Builders:
        return Builders(model=self.model, data=self.data)


def _train(run_dir, *overrides: str, crash_at_call: int | None = None) -> Recorded:
    recorded = Recorded(crash_at_call)
    run(config(*RUN, *overrides), run_dir, recorded.builders())
    return recorded


def _records(run_dir) -> list[dict]:
    return [{k: v for k, v in r.items() if k not in TIMING_KEYS} for r in read_jsonl(run_dir / "metrics.jsonl")]


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """The uninterrupted runs, with and without the spike: (run dir, what was recorded)."""
    root = tmp_path_factory.mktemp("spike")
    return {name: (root / name, _train(root / name, *extra)) for name, extra in (("plain", ()), ("spiked", (SPIKE,)))}


def test_the_spike_lowers_the_scale_from_the_next_step_for_the_history_length(straight):
    (plain_dir, plain), (spiked_dir, spiked) = straight["plain"], straight["spiked"]
    # Nothing differs before the spike's step is over: every record up to T0, every scale T0 used.
    assert _records(spiked_dir)[:T0] == _records(plain_dir)[:T0]
    assert spiked.after[: T0 - 1] == plain.after[: T0 - 1]
    # Step T0's amax enters the history x 2**K (the same step's amax, both runs identical until then) ...
    amax = plain.after[T0 - 1][SITE][1]
    assert spiked.after[T0 - 1][SITE][1] == amax * 2.0**K
    # ... and sets the scale of steps T0 + 1 .. T0 + HISTORY (after[i]: the scale step i + 2 uses).
    held = float(compute_scale(torch.tensor(amax * 2.0**K), E4M3))
    used = {step: spiked.after[step - 2][SITE][0] for step in range(2, STEPS + 1)}
    assert [step for step, scale in used.items() if scale == held] == list(range(T0 + 1, T0 + HISTORY + 1))
    assert used[T0 + HISTORY + 1] > 2.0 ** (K - 2) * held  # the entry left: back near the spike-free scale
    assert plain.after[T0 - 1][SITE][0] > 2.0 ** (K - 2) * held  # what step T0 + 1 would have used
    # An unmatched site of the same layer keeps its scale at step T0 + 1.
    assert spiked.after[T0 - 1][OTHER] == plain.after[T0 - 1][OTHER]


def test_the_log_shows_the_held_amax_and_where_o_lands(straight):
    """The history amax over O's rms jumps by about 2**K at step T0 + 1 and O's rms lands about K
    binades lower on O8's grid; both come back once the entry leaves."""
    records = {r["step"]: r for r in _records(straight["spiked"][0])}
    layer = SITE.removesuffix(".output")
    held = [records[s][f"attn_out_history_amax_to_rms/mean/{layer}"] for s in range(2, STEPS + 1)]
    grid = [records[s][f"attn_out_log2_rms_scaled/mean/{layer}"] for s in range(2, STEPS + 1)]
    assert "attn_out_history_amax_to_rms/mean/" + layer not in records[1]  # no history entry at step 1
    inside = range(T0 + 1 - 2, T0 + HISTORY + 1 - 2)  # indices of steps T0 + 1 .. T0 + HISTORY
    assert min(held[i] for i in inside) > 2.0 ** (K - 2) * max(h for i, h in enumerate(held) if i not in inside)
    for before, after in ((T0 - 2, T0 + 1 - 2), (T0 + HISTORY + 1 - 2, T0 + HISTORY - 2)):
        assert grid[before] - grid[after] == pytest.approx(K, abs=1.0)


@pytest.mark.parametrize("crash_step", [5, 8], ids=["resumed_before_t0", "resumed_after_t0"])
def test_a_resumed_run_matches_the_uninterrupted_one(tmp_path, straight, crash_step):
    """Crashed in step 5 (last checkpoint: step 3, before T0) or 8 (step 6, inside the spike's
    window) and resumed: the same records, scales and weights as the uninterrupted run."""
    spiked_dir, spiked = straight["spiked"]
    run_dir = tmp_path / "run"
    with pytest.raises(RuntimeError, match="simulated crash"):
        _train(run_dir, SPIKE, crash_at_call=2 * (crash_step - 1))  # the first micro-batch of crash_step
    resumed_at = list_checkpoints(run_dir / "checkpoints")[-1][0]
    assert resumed_at == 3 * ((crash_step - 1) // 3)
    resumed = _train(run_dir, SPIKE, "trainer.resume=true")
    assert json.loads((run_dir / "summary.json").read_text())["status"] == "completed"
    assert _records(run_dir) == _records(spiked_dir)
    assert resumed.after == spiked.after[resumed_at:]  # injected once: at T0 if resumed before it, never again after
    a = load_checkpoint(checkpoint_path(run_dir / "checkpoints", STEPS))["model"]
    b = load_checkpoint(checkpoint_path(spiked_dir / "checkpoints", STEPS))["model"]
    assert all(torch.equal(a[k], b[k]) for k in b)


@pytest.mark.parametrize(
    ("overrides", "key", "says"),
    [
        ((SPIKE, "precision.recipe=current"), "precision.amax_spike", "null under precision.recipe=current"),
        (("precision.amax_spike={site:attn.kore.output,step:5,k:8}",), "precision.amax_spike.site", "attn.core.output"),
        (("precision.amax_spike={site:lm_head.input,step:5,k:8}",), "precision.amax_spike.site", "matching FP8 sites"),
        (("precision.amax_spike={site:attn.core.output,step:12,k:8}",), "precision.amax_spike.step", "[1, 11]"),
        (("precision.amax_spike={site:attn.core.output,step:0,k:8}",), "precision.amax_spike.step", ">= 1"),
        (("precision.amax_spike={site:attn.core.output,step:5,k:0}",), "precision.amax_spike.k", ">= 1"),
        (("precision.amax_spike={site:attn.core.output,step:5,k:19}",), "precision.amax_spike.k", "at most 18"),
        (("precision.amax_spike={site:attn.core.output,k:3}",), "precision.amax_spike", "{site: PATTERN"),
    ],
)
def test_what_the_config_refuses(overrides, key, says):
    with pytest.raises(ConfigError) as error:
        config(*RUN, *overrides)
    assert error.value.key == key and says in error.value.valid, str(error.value)
