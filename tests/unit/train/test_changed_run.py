"""Resuming a run directory under another config than its checkpoints hold
(``readback.train.checkpoint.resumption``): a key that changes the run is refused naming every changed key
with its old and new value, unless ``trainer.resume_changed_config=true``; the model's shape never
changes; keys that only say how the run is run, logged or checkpointed may change. On the toy
model, in-process; through ``train.py`` in tests/integration/test_bad_input.py."""

from __future__ import annotations

import json
import logging
from dataclasses import replace
from pathlib import Path

import pytest
import torch

import toys
from readback.data.stream import PackedStream
from readback.data.synthetic import synthetic_split
from readback.errors import ConfigError
from readback.train import Builders, run
from readback.train.checkpoint import list_checkpoints, load_checkpoint, resume_plan
from readback.train.records.metrics import read_jsonl
from readback.train.settings import config_changes, plain_config

RESUME = {"trainer.resume": True}


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("changed") / "run"
    with pytest.MonkeyPatch.context() as mp:
        for key in ("WANDB_MODE", "WORLD_SIZE", "SLURM_RESTART_COUNT"):
            mp.delenv(key, raising=False)
        toys.train(toys.make_cfg(), run_dir)
    return run_dir


def test_another_policy_recipe_and_length_are_refused_naming_each_change(finished):
    changed = {"policy": "fresh_reround", "precision.recipe": "current", "trainer.steps": 16, "seed": 4}
    with pytest.raises(ConfigError) as refused:
        resume_plan(finished, toys.make_cfg(**RESUME, **changed))
    line = str(refused.value)
    assert "\n" not in line
    for part in (
        "policy 'exact' -> 'fresh_reround'",
        "precision.recipe 'delayed' -> 'current'",
        "trainer.steps 12 -> 16",
        "seed 3 -> 4",
        "trainer.resume_changed_config=true to go on",
    ):
        assert part in line, (part, line)


def test_the_override_goes_on_with_the_new_values(finished, tmp_path, caplog, built):
    run_dir = tmp_path / "run"
    import shutil

    shutil.copytree(finished, run_dir)
    cfg = toys.make_cfg(**RESUME, **{"trainer.steps": 16, "trainer.resume_changed_config": True})
    with caplog.at_level(logging.WARNING):
        assert resume_plan(run_dir, cfg)[1]["step"] == 12
    assert "trainer.steps 12 -> 16" in caplog.text
    assert toys.train(cfg, run_dir)["steps"] == 16
    assert [r["step"] for r in read_jsonl(run_dir / "metrics.jsonl")] == list(range(2, 17, 2))


def test_the_models_shape_is_refused_even_with_the_override(finished):
    cfg = toys.make_cfg(**RESUME, **{"model.d_model": 32, "model.lr": 0.01, "trainer.resume_changed_config": True})
    with pytest.raises(ConfigError) as refused:
        resume_plan(finished, cfg)
    line = str(refused.value)
    assert line.startswith("model.d_model=32 is not valid; valid: 16, the value")
    assert "model.lr 0.03 -> 0.01" in line and "the model's shape cannot change" in line


def test_how_a_run_is_run_logged_measured_or_checkpointed_may_change(finished):
    how = {
        "probe.every": 7,
        "probe.bias_every": 5,
        "trainer.log_every": 3,
        "trainer.ckpt_every": 2,
        "trainer.keep_last": 5,
        "trainer.micro_batch": 4,
        "trainer.ckpt_async": True,
        "trainer.progress": True,
        "trainer.eval_batches": 1,
    }
    assert resume_plan(finished, toys.make_cfg(**RESUME, **how))[1]["step"] == 12
    assert resume_plan(finished, toys.make_cfg("wandb", **RESUME))[1]["step"] == 12


def test_keys_the_checkpoint_lacks_or_resolves_are_not_compared():
    cfg = toys.make_cfg()
    saved = plain_config(cfg)
    assert config_changes(saved, cfg) == []
    del saved["trainer"]["resume_changed_config"], saved["probe"]  # a checkpoint older than those keys
    saved["model"]["vocab_size"] = 24  # model.vocab_size: null, resolved when the run started
    assert config_changes(saved, cfg) == []
    saved["model"]["d_model"], saved["policy"] = 8, "no_saved_copy"
    assert config_changes(saved, cfg) == [("model.d_model", 8, 16), ("policy", "no_saved_copy", "exact")]


def test_a_checkpoint_saved_before_a_key_was_renamed_is_read_under_the_new_name():
    """``policy.name`` and ``precision.attention_recipe`` became ``policy`` and ``attention.recipe``:
    an older checkpoint's values are compared under the new keys, not as keys gone."""
    cfg = toys.make_cfg()
    saved = plain_config(cfg)
    saved["policy"] = {"name": "exact"}
    saved["precision"]["attention_recipe"] = saved["attention"].pop("recipe")
    assert config_changes(saved, cfg) == []
    saved["policy"] = {"name": "original"}
    assert config_changes(saved, cfg) == [("policy", "original", "exact")]


# The toy model on the real data stream (synthetic, or a text file), for where a resume under a
# changed seed or data puts the stream.
REAL_DATA = Builders(model=toys.toy_build_model)
PER_STEP = toys.TOY_TRAINER["model.global_batch"]  # sequences a step takes


def _consumed(run_dir: Path) -> int:
    """The data stream's position (sequences taken) in the run's newest checkpoint."""
    return load_checkpoint(list_checkpoints(run_dir / "checkpoints")[-1][1])["ranks"][0]["data"]["consumed"]


@pytest.mark.parametrize(
    ("change", "consumed", "warned"),
    [({"seed": 4}, 16 * PER_STEP, False), ({"data.n_tokens": 30000}, 4 * PER_STEP, True)],
    ids=["seed", "data"],
)
def test_a_new_seed_keeps_the_datas_place_and_new_data_starts_from_its_beginning(
    tmp_path, caplog, built, change, consumed, warned
):
    """Under ``trainer.resume_changed_config=true``, 12 steps resumed to 16."""
    run(toys.make_cfg(), tmp_path, REAL_DATA)
    assert _consumed(tmp_path) == 12 * PER_STEP
    cfg = toys.make_cfg(**RESUME, **change, **{"trainer.steps": 16, "trainer.resume_changed_config": True})
    with caplog.at_level(logging.WARNING):
        assert run(cfg, tmp_path, REAL_DATA)["status"] == "completed"
    assert _consumed(tmp_path) == consumed
    assert ("data: the new data starts from its beginning" in caplog.text) == warned


def test_a_new_seed_goes_on_in_its_own_order_from_the_same_place():
    cfg = toys.make_cfg()
    train, val = synthetic_split(cfg.data)[:2]
    layout = cfg.layout(rank=0, world_size=1)
    old = PackedStream(train, val, vocab_size=24, layout=layout)
    for _ in range(5):
        old.next_batch()
    resumed, fresh = (PackedStream(train, val, vocab_size=24, layout=replace(layout, seed=4)) for _ in range(2))
    resumed.load_state_dict(old.state_dict())
    for _ in range(5):
        fresh.next_batch()
    assert all(torch.equal(a, b) for a, b in zip(resumed.next_batch(), fresh.next_batch(), strict=True))


def test_text_that_changed_under_the_same_config_is_refused_in_words(tmp_path, built):
    text = tmp_path / "corpus.txt"
    text.write_text("".join(f"Line {i} of the first text, with words to learn.\n" for i in range(400)))
    files = {
        "data.files": [str(text)],
        "data.cache_dir": str(tmp_path / "cache"),
        "data.vocab_size": 300,
        "data.block_lines": 10,
    }
    cfg = toys.config(
        "data=shakespeare", "logger=none", *(f"{k}={json.dumps(v)}" for k, v in {**toys.TOY_TRAINER, **files}.items())
    )
    run(cfg, tmp_path / "run", REAL_DATA)
    text.write_text("".join(f"Another line {i}, of an edited text that says other things.\n" for i in range(400)))
    with pytest.raises(ConfigError) as refused:
        run(replace(cfg, trainer=replace(cfg.trainer, resume=True)), tmp_path / "run", REAL_DATA)
    line = str(refused.value)
    assert line.startswith("data='text:") and "the text of data.files, the tokenizer or model.seq_len changed" in line
    assert line.endswith("trainer.resume_changed_config=true to start the new data from its beginning")
