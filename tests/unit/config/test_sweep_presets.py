"""Every sweep preset composes into a checked config with the experiments its script runs."""

from __future__ import annotations

import pytest

from toys import REPO, config

PRESETS = sorted(p.stem for p in (REPO / "conf" / "sweep").glob("*.yaml"))


@pytest.mark.parametrize("preset", PRESETS)
def test_a_sweep_preset_composes_and_passes_the_schema(preset):
    cfg = config(f"+sweep={preset}", "+experiment=reuse_rounded")
    assert cfg.trainer.steps > 0 and cfg.policy == "reuse_rounded"


def test_the_width_preset_trains_the_shapes_its_script_sets():
    for heads, seq_len in ((8, 128), (1, 1024)):
        cfg = config(
            "+sweep=d_term_width",
            "+experiment=reuse_rounded",
            f"model.n_heads={heads}",
            f"model.n_kv_groups={heads}",
            f"model.seq_len={seq_len}",
            f"trainer.micro_batch={2048 // seq_len}",
            f"model.global_batch={2048 // seq_len}",
            "precision.site_margin={attn.core.output:14}",
        )
        assert cfg.model.d_model // cfg.model.n_heads == 128 // heads
        assert cfg.trainer.micro_batch * cfg.model.seq_len == 2048
