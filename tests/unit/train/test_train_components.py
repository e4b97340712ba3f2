"""The trainer's parts one by one, then end-to-end runs of ``readback.train.run`` on the toy
model and stream of ``toys`` (handed to ``run`` as its builders)."""

from __future__ import annotations

import dataclasses
import itertools
import json
import logging
import math
from pathlib import Path
from typing import ClassVar

import pytest
import torch
from torch import nn

from readback.errors import ConfigError
from readback.outputs import SUMMARY_KEYS
from readback.train.checkpoint import CheckpointManager, load_checkpoint, resume_plan
from readback.train.checkpoint import io as checkpoint_io
from readback.train.checkpoint.dirs import (
    checkpoint_path,
    commit_checkpoint,
    list_checkpoints,
    temp_checkpoint_path,
)
from readback.train.distributed import DistEnv
from readback.train.divergence import DivergenceDetector
from readback.train.optim import WSDSchedule, build_optimizer, clip_gradients, nonfinite_grad_names, param_groups
from readback.train.records.identity import RunIdentity
from readback.train.records.metrics import JsonlWriter, MetricsLogger, read_jsonl
from readback.train.records.tracking import WandbLogger, resolve_wandb_mode
from readback.train.settings import WandbLogger as WandbSettings
from toys import ToyModel, config, make_cfg, train


def detector(**settings) -> DivergenceDetector:
    """A detector of ``conf/trainer/default.yaml``'s divergence settings, with ``settings`` changed."""
    return DivergenceDetector(dataclasses.replace(make_cfg().trainer.divergence, **settings))


# --------------------------------------------------------------------------- schedule
def test_schedule_warmup_stable_cooldown():
    peak, mn = 1e-3, 1e-8
    s = WSDSchedule(peak=peak, steps=100, warmup_steps=10, cooldown_frac=0.2, min_lr=mn)
    assert s.cooldown_start == 80
    assert s(1) == pytest.approx(peak / 10)
    assert s(5) == pytest.approx(peak / 2)
    assert s(10) == pytest.approx(peak)
    assert s(11) == s(50) == s(80) == peak
    for t in (81, 85, 90, 99, 100):
        assert s(t) == pytest.approx(mn + (peak - mn) * (1 - math.sqrt((t - 80) / 20)), rel=1e-12)
    assert s(100) == pytest.approx(mn)
    lrs = [s(t) for t in range(1, 101)]
    assert all(a <= b for a, b in itertools.pairwise(lrs[:11]))
    assert all(a >= b for a, b in itertools.pairwise(lrs[79:]))


def test_schedule_from_config_and_overlap():
    cfg = make_cfg().trainer
    s = WSDSchedule.from_config(cfg.optim, peak=3e-3, steps=cfg.steps)
    assert (s.warmup_steps, s.cooldown_frac, s.min_lr) == (cfg.optim.warmup_steps, 0.2, 1e-8)
    short = WSDSchedule(peak=1.0, steps=4, warmup_steps=4, cooldown_frac=0.5, min_lr=0.0)
    assert short(3) == pytest.approx(min(0.75, 1 - math.sqrt(0.5)))
    with pytest.raises(ConfigError):  # the schema refuses it before any schedule is built
        dataclasses.replace(cfg.optim, cooldown_frac=1.5)


# --------------------------------------------------------------------------- optimizer
def test_param_groups_no_decay_on_1d():
    model = ToyModel(10, 4)
    groups = param_groups(model, 0.1)
    decay, no_decay = groups
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert all(p.ndim >= 2 for p in decay["params"])
    assert all(p.ndim < 2 for p in no_decay["params"])
    ids = {id(p) for g in groups for p in g["params"]}
    assert id(model.frozen) not in ids and id(model.gain) in {id(p) for p in no_decay["params"]}
    assert id(model.fc.bias) in {id(p) for p in no_decay["params"]}
    assert len(ids) == sum(1 for p in model.parameters() if p.requires_grad)
    opt = build_optimizer(model, make_cfg().trainer.optim)
    assert isinstance(opt, torch.optim.AdamW)
    assert opt.defaults["betas"] == (0.9, 0.95) and opt.defaults["eps"] == 1e-8


def test_clip_gradients_is_torchs_clip_and_names_nonfinite_grads():
    torch.manual_seed(0)
    a, b = nn.Linear(3, 4), nn.Linear(3, 4)
    b.load_state_dict(a.state_dict())
    x = torch.randn(5, 3) * 10
    for m in (a, b):
        m(x).square().sum().backward()
    expected = torch.nn.utils.clip_grad_norm_(list(b.parameters()), 1.0)
    norm = clip_gradients(list(a.parameters()), 1.0)
    assert norm > 1.0 and torch.equal(norm, expected)
    for pa, pb in zip(a.parameters(), b.parameters()):
        assert torch.equal(pa.grad, pb.grad)
    assert torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in a.parameters()])) <= 1.0 + 1e-6
    a.bias.grad[0] = math.inf
    kept = a.weight.grad.clone()
    assert not math.isfinite(clip_gradients(list(a.parameters()), 1.0))
    assert torch.equal(a.weight.grad, kept)  # a non-finite norm leaves the gradients alone
    assert nonfinite_grad_names(a.named_parameters()) == ["bias"]


# --------------------------------------------------------------------------- divergence
def test_divergence_nan_stops():
    d = detector(factor=2.0, patience=3)
    assert not d.check_loss(1, 3.0)
    assert d.check_loss(2, math.nan) and d.diverged_at_step == 2 and d.reason.startswith("non-finite loss")
    assert detector().check_loss(7, math.inf)


def test_divergence_factor_patience_marks_first_step_of_streak():
    d = detector(factor=2.0, patience=3, stop=False)
    for step, loss in [(10, 5.0), (20, 3.0), (30, 2.0), (40, 4.5), (50, 2.5), (60, 4.1), (70, 5.0)]:
        assert not d.observe_logged(step, loss)
    assert not d.diverged  # 40 alone, then a streak of two
    assert not d.observe_logged(80, 9.0)  # third in a row: marked, but stop=False
    assert d.diverged_at_step == 60 and "60" in d.reason
    stopper = detector(factor=1.5, patience=2, stop=True)
    assert not stopper.observe_logged(1, 2.0)
    assert not stopper.observe_logged(2, 3.5)
    assert stopper.observe_logged(3, 3.5) and stopper.diverged_at_step == 2


def test_divergence_no_false_positive_on_falling_curve():
    d = detector(factor=1.2, patience=1, stop=True)
    for step in range(1, 500):
        noisy = 10.0 * math.exp(-step / 100) + 2.0 + 0.05 * math.sin(step)
        assert not d.observe_logged(step, noisy)
        assert not d.check_loss(step, noisy)
    assert d.diverged_at_step is None


def test_divergence_state_roundtrip():
    d = detector(factor=2.0, patience=2)
    d.observe_logged(1, 1.0)
    d.observe_logged(2, 3.0)
    d.record_nonfinite_grads(2, ["w"])
    e = detector(factor=2.0, patience=2)
    e.load_state_dict(d.state_dict())
    e.observe_logged(3, 3.0)
    assert e.diverged_at_step == 2 and e.skipped == [{"step": 2, "params": ["w"]}]


# --------------------------------------------------------------------------- checkpoints
def _manager(
    run_dir: Path, shared: dict | None = None, model: nn.Module | None = None, **settings
) -> CheckpointManager:
    """The checkpoint manager of a toy model in one process; ``settings``: config overrides."""
    model = model or ToyModel(8)
    optimizer = torch.optim.AdamW(model.parameters())
    cfg = make_cfg(**settings)
    return CheckpointManager(
        run_dir, cfg, DistEnv(), model=model, optimizer=optimizer, shared=shared or {}, per_rank={}
    )


def _resumed(run_dir: Path) -> tuple[int, str | None]:
    return _manager(run_dir, **{"trainer.resume": True}).resume()


def test_atomic_checkpoint_survives_a_kill_after_the_shards(tmp_path, built, monkeypatch):
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.api import CheckpointException

    manager = _manager(tmp_path)
    manager.save(1, wandb_run_id=None)

    def killed(self, metadata, results):
        raise RuntimeError("killed after the shards, before the index")

    with monkeypatch.context() as patched, pytest.raises(CheckpointException):  # DCP's wrapper
        patched.setattr(FileSystemWriter, "finish", killed)
        manager.save(2, wandb_run_id=None)
    assert [s for s, _ in list_checkpoints(manager.dir)] == [1]
    torn = temp_checkpoint_path(manager.dir, 2)
    assert sorted(p.name for p in torn.iterdir()) == ["__0_0.distcp", "__0_checksums.json"]  # no index: never committed
    with pytest.raises(FileNotFoundError, match=r"no \.metadata"):
        commit_checkpoint(manager.dir, 2)
    assert _resumed(tmp_path) == (1, None) and not torn.exists()  # resumed from 1, what 2 left removed


def test_corrupt_newest_checkpoint_is_moved_aside(tmp_path, built, caplog):
    manager = _manager(tmp_path)
    for step in (1, 2):
        manager.save(step, wandb_run_id=None)
    checkpoint_path(manager.dir, 3).mkdir()
    (checkpoint_path(manager.dir, 3) / checkpoint_io.INDEX).write_bytes(b"garbage")
    with caplog.at_level(logging.WARNING):
        assert _resumed(tmp_path) == (2, None)
    assert "step_0000003 is damaged" in caplog.text
    assert resume_plan(tmp_path / "missing", make_cfg()) is None


class _Mkdir:
    """Pickles as a call of ``os.mkdir(path)``: what a crafted checkpoint could run on load."""

    def __init__(self, path: Path):
        self.path = str(path)

    def __reduce__(self):
        import os

        return os.mkdir, (self.path,)


class _Crafted:
    """A component whose state holds a :class:`_Mkdir`."""

    def __init__(self, path: Path):
        self.path = path

    def state_dict(self) -> dict:
        return {"note": _Mkdir(self.path)}

    def load_state_dict(self, state: dict) -> None:
        pass


def test_a_crafted_index_or_blob_is_refused_unread(tmp_path, built):
    import pickle

    _manager(tmp_path, shared={"crafted": _Crafted(tmp_path / "blob")}).save(1, wandb_run_id=None)
    with pytest.raises(ConfigError, match=r"refused unread \(Trying to load unsupported GLOBAL posix.mkdir") as e:
        _resumed(tmp_path)
    assert "\n" not in str(e.value)
    path = checkpoint_path(tmp_path / "checkpoints", 1)
    (path / checkpoint_io.INDEX).write_bytes(pickle.dumps(_Mkdir(tmp_path / "index")))
    with pytest.raises(ConfigError, match=r"unsupported GLOBAL posix.mkdir"):
        load_checkpoint(path)
    assert not (tmp_path / "blob").exists() and not (tmp_path / "index").exists()


def test_keep_last_prunes(tmp_path, built):
    manager = _manager(tmp_path, **{"trainer.keep_last": 2})
    for step in (4, 8, 12, 16):
        manager.save(step, wandb_run_id=None)
    assert sorted(p.name for p in manager.dir.iterdir()) == ["step_0000012", "step_0000016"]


def test_async_save_commits_when_the_next_save_or_the_end_waits(tmp_path, built):
    model = ToyModel(8)
    manager = _manager(tmp_path, model=model, **{"trainer.ckpt_async": True})
    before = model.fc.weight.detach().clone()
    manager.save(1, wandb_run_id=None)
    with torch.no_grad():
        model.fc.weight.add_(1.0)  # while the first save may still be writing
    assert list_checkpoints(manager.dir) == []  # written in the background, not committed yet
    manager.save(2, wandb_run_id=None)  # waits for the first, commits it
    assert [s for s, _ in list_checkpoints(manager.dir)] == [1]
    manager.wait()
    assert [s for s, _ in list_checkpoints(manager.dir)] == [1, 2]
    first, second = (load_checkpoint(p)["model"]["fc.weight"] for _, p in list_checkpoints(manager.dir))
    assert torch.equal(first, before) and torch.equal(second, before + 1.0)  # copied when the save started


# --------------------------------------------------------------------------- metrics
def test_jsonl_writer_and_resume_truncation(tmp_path):
    path = tmp_path / "metrics.jsonl"
    w = JsonlWriter(path)
    for step in (2, 4, 6, 8):
        w.write({"step": step, "loss": 1.0 / step, "t": torch.tensor(0.5), "bad": math.nan})
    w.close()
    lines = path.read_text().splitlines()
    assert len(lines) == 4 and json.loads(lines[0]) == {"step": 2, "loss": 0.5, "t": 0.5, "bad": None}
    with open(path, "a") as f:
        f.write('{"step": 4, "loss": 0.3}\n{"step": 6, "loss": 0.2}\n')  # logged twice (an older resume)
        f.write('{"step": 10, "loss"')  # torn by a crash
    w = JsonlWriter(path)
    w.truncate_after(6)
    w.write({"step": 8, "loss": 0.0})
    w.close()
    assert [(r["step"], r["loss"]) for r in read_jsonl(path)] == [(2, 0.5), (4, 0.3), (6, 0.2), (8, 0.0)]
    assert path.read_text().endswith("}\n")


TOY_RUN = RunIdentity(name="toy s0", group="toy", job_type="train", config={"a": 1})


def wandb_logger(run_dir: Path, mode: str, **kwargs) -> WandbLogger:
    """The run wrapper as a run with ``logger=wandb`` (conf/logger/wandb.yaml) and ``mode`` builds it."""
    settings = config().logger
    assert isinstance(settings, WandbSettings)
    return WandbLogger(
        run_dir=run_dir,
        identity=TOY_RUN,
        project=settings.project,
        entity=settings.entity,
        mode=mode,
        init_timeout=settings.init_timeout,
        **kwargs,
    )


def test_wandb_mode_resolution(monkeypatch):
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.delenv("WANDB_DISABLED", raising=False)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("NETRC", "/nonexistent")
    monkeypatch.setenv("HOME", "/nonexistent")
    assert resolve_wandb_mode("auto") == "offline"
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    assert resolve_wandb_mode("auto") == "online"
    assert resolve_wandb_mode("offline") == "offline"
    monkeypatch.setenv("WANDB_MODE", "disabled")
    assert resolve_wandb_mode("online") == "disabled"


def test_wandb_disabled_is_a_noop(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_MODE", raising=False)
    wb = wandb_logger(tmp_path, "disabled")
    assert wb.mode == "noop" and wb.run_id
    logger = MetricsLogger(JsonlWriter(tmp_path / "metrics.jsonl"), wb)
    logger.log({"step": 1, "loss": 2.0})
    logger.close()
    assert read_jsonl(tmp_path / "metrics.jsonl") == [{"step": 1, "loss": 2.0}]
    assert not (tmp_path / "wandb").exists()


def test_wandb_offline_writes_into_run_dir(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.setenv("WANDB_SILENT", "true")
    wb = wandb_logger(tmp_path, "offline", run_id="abc123xy")
    assert wb.mode == "offline"
    logger = MetricsLogger(JsonlWriter(tmp_path / "metrics.jsonl"), wb)
    logger.log({"step": 1, "loss": 2.0})
    logger.close()
    runs = list((tmp_path / "wandb").glob("offline-run-*abc123xy"))
    assert runs, list((tmp_path / "wandb").iterdir())
    assert read_jsonl(tmp_path / "metrics.jsonl") == [{"step": 1, "loss": 2.0}]


def test_wandb_init_and_log_failures_never_raise(tmp_path, monkeypatch):
    import wandb

    monkeypatch.delenv("WANDB_MODE", raising=False)
    calls = []

    def broken_init(**kwargs):
        calls.append(kwargs["mode"])
        raise RuntimeError("no network / bad key")

    monkeypatch.setattr(wandb, "init", broken_init)
    wb = wandb_logger(tmp_path, "online")
    assert calls == ["online", "offline"] and wb.mode == "noop"
    wb.log({"loss": 1.0}, step=1)
    wb.finish()

    class CrashingRun:
        summary: ClassVar[dict] = {}

        def log(self, *a, **k):
            raise OSError("wandb service died")

        def finish(self, *a, **k):
            raise OSError("still dead")

    monkeypatch.setattr(wandb, "init", lambda **kwargs: CrashingRun())
    wb = wandb_logger(tmp_path, "offline")
    logger = MetricsLogger(JsonlWriter(tmp_path / "m.jsonl"), wb)
    logger.log({"step": 1, "loss": 1.0})
    logger.log({"step": 2, "loss": 0.5})
    logger.close()
    assert [r["step"] for r in read_jsonl(tmp_path / "m.jsonl")] == [1, 2]


# --------------------------------------------------------------------------- end to end
BASE_KEYS = {"step", "loss", "lr", "tokens", "grad_norm", "tokens_per_s"}
CURVE_KEYS = ("step", "loss", "lr", "tokens", "grad_norm", "val_loss")


def _curve(run_dir: Path) -> list[tuple]:
    return [tuple(r.get(k) for k in CURVE_KEYS) for r in read_jsonl(run_dir / "metrics.jsonl")]


def test_run_end_to_end_contracts(tmp_path, built):
    cfg = make_cfg()
    summary = train(cfg, tmp_path)
    records = read_jsonl(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in records] == [2, 4, 6, 8, 10, 12]
    for r in records:
        assert r.keys() >= BASE_KEYS
        assert r["tokens"] == r["step"] * 8 * 8
        assert "kurtosis/attn_out_max" in r and "fp8_saturation/toy.out" in r
    assert [r["step"] for r in records if "val_loss" in r] == [4, 8, 12]
    assert records[-1]["loss"] < records[0]["loss"]
    assert records[0]["lr"] == pytest.approx(2e-2) and records[1]["lr"] == pytest.approx(3e-2)  # warmup 3
    assert records[-1]["lr"] == pytest.approx(1e-8)
    on_disk = json.loads((tmp_path / "summary.json").read_text())
    assert on_disk == json.loads(json.dumps(summary))
    assert on_disk.keys() == SUMMARY_KEYS.keys() - {"error", "memory_gb", "te_plan"}  # a failed run's, a dry run's
    assert on_disk["status"] == "completed" and on_disk["diverged_at_step"] is None
    assert on_disk["steps"] == 12 and on_disk["tokens"] == 12 * 64
    assert on_disk["final_loss"] == records[-1]["loss"] and on_disk["val_loss"] == records[-1]["val_loss"]
    assert on_disk["n_params"] == built[0].n_params() and on_disk["experiment"] == "custom"
    assert cfg.model.vocab_size is None  # the run's config is not written ...
    assert [s for s, _ in list_checkpoints(tmp_path / "checkpoints")] == [8, 12]
    state = load_checkpoint(checkpoint_path(tmp_path / "checkpoints", 12))
    assert {"model", "optimizer", "schedule", "ranks", "divergence", "wandb_run_id", "step"} <= state.keys()
    assert state["config"]["model"]["vocab_size"] == 24  # ... the run's resolved copy takes the stream's
    assert state["ranks"][0]["numerics"] == {"step": 12, "eval_forwards": 0} and state["ranks"][0]["data"] == {
        "consumed": 96
    }


def test_resume_reproduces_the_uninterrupted_curve_bit_exactly(tmp_path, built):
    straight, crashed = tmp_path / "straight", tmp_path / "crashed"
    train(make_cfg(), straight)
    # 4 micro-batches per step: call 40 is the first of step 11, after step 10 was logged
    with pytest.raises(RuntimeError, match="simulated crash"):
        train(make_cfg(), crashed, crash_at_call=40)
    failed = json.loads((crashed / "summary.json").read_text())
    assert failed["status"] == "failed" and "simulated crash" in failed["error"] and failed["steps"] == 10
    assert [r["step"] for r in read_jsonl(crashed / "metrics.jsonl")][-1] == 10
    assert [s for s, _ in list_checkpoints(crashed / "checkpoints")] == [4, 8]
    summary = train(make_cfg(**{"trainer.resume": True}), crashed)
    assert summary["status"] == "completed"
    assert [r["step"] for r in read_jsonl(crashed / "metrics.jsonl")] == [2, 4, 6, 8, 10, 12]
    assert _curve(crashed) == _curve(straight)  # exact equality, floats included
    a = load_checkpoint(checkpoint_path(straight / "checkpoints", 12))["model"]
    b = load_checkpoint(checkpoint_path(crashed / "checkpoints", 12))["model"]
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_async_checkpoints_give_the_same_run(tmp_path, built):
    train(make_cfg(), tmp_path / "sync")
    train(make_cfg(**{"trainer.ckpt_async": True}), tmp_path / "async")
    assert _curve(tmp_path / "async") == _curve(tmp_path / "sync")
    ckpts = [list_checkpoints(tmp_path / d / "checkpoints") for d in ("sync", "async")]
    assert [s for s, _ in ckpts[0]] == [s for s, _ in ckpts[1]] == [8, 12]
    a, b = (load_checkpoint(c[-1][1]) for c in ckpts)
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
    assert (
        [r["numerics"] for r in a["ranks"]] == [r["numerics"] for r in b["ranks"]] == [{"step": 12, "eval_forwards": 0}]
    )


def test_evaluation_leaves_training_untouched(tmp_path, built):
    train(make_cfg(**{"trainer.eval_every": 2}), tmp_path / "often")
    train(make_cfg(**{"trainer.eval_every": 12}), tmp_path / "once")
    train_curve = [(s, loss, lr, g) for s, loss, lr, _, g, _ in _curve(tmp_path / "often")]
    assert train_curve == [(s, loss, lr, g) for s, loss, lr, _, g, _ in _curve(tmp_path / "once")]


def test_nan_loss_stops_without_applying_the_update(tmp_path, built):
    cfg = make_cfg(**{"trainer.log_every": 1, "trainer.ckpt_every": 5})
    summary = train(cfg, tmp_path, nan_loss_at=6)
    assert summary["status"] == "diverged" and summary["diverged_at_step"] == 6 and summary["steps"] == 6
    assert "non-finite loss" in summary["divergence_reason"]
    records = read_jsonl(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]
    assert records[-1]["loss"] is None and records[-1]["diverged"] is True
    on_disk = json.loads((tmp_path / "summary.json").read_text())
    assert on_disk["final_loss"] is None and on_disk["nonfinite_tensors"][0] == "loss"
    # no checkpoint of the diverged step; the weights are exactly those after step 5
    assert [s for s, _ in list_checkpoints(tmp_path / "checkpoints")] == [5]
    after_five = load_checkpoint(checkpoint_path(tmp_path / "checkpoints", 5))["model"]
    final = built[0].state_dict()
    assert all(torch.equal(final[k], after_five[k]) for k in final)


def test_nonfinite_gradients_skip_the_update(tmp_path, built):
    summary = train(make_cfg(**{"trainer.divergence.nonfinite_grads": "skip"}), tmp_path, nan_grad_at=3)
    assert summary["status"] == "completed"
    assert summary["skipped_updates"] == [{"step": 3, "params": ["gain"]}]
    assert all(torch.isfinite(v).all() for v in built[0].state_dict().values())
    assert read_jsonl(tmp_path / "metrics.jsonl")[1]["skipped_updates"] == 1


def test_nonfinite_gradients_stop_as_divergence_by_default(tmp_path, built):
    cfg = make_cfg(**{"trainer.log_every": 1, "trainer.ckpt_every": 2})
    summary = train(cfg, tmp_path, nan_grad_at=3)
    assert summary["status"] == "diverged" and summary["diverged_at_step"] == 3 and summary["steps"] == 3
    assert summary["nonfinite_tensors"] == ["gain.grad"] and "gain" in summary["divergence_reason"]
    on_disk = json.loads((tmp_path / "summary.json").read_text())
    assert on_disk["nonfinite_tensors"] == ["gain.grad"] and on_disk["final_loss"] is not None
    records = read_jsonl(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2, 3] and records[-1]["diverged"] is True
    assert "fp8_saturation/toy.out" in records[-1]
    after_two = load_checkpoint(checkpoint_path(tmp_path / "checkpoints", 2))["model"]
    final = built[0].state_dict()
    assert all(torch.equal(final[k], after_two[k]) for k in final)  # step 3 was not applied
    assert [s for s, _ in list_checkpoints(tmp_path / "checkpoints")] == [2]


def test_patience_divergence_can_stop(tmp_path, built):
    cfg = make_cfg(**{"trainer.divergence.patience": 2, "trainer.divergence.stop": True, "trainer.log_every": 1})
    cfg.trainer.divergence.factor = 0.5  # below the schema's range: every logged loss counts as a blow-up
    summary = train(cfg, tmp_path)
    # every loss is above 0.5 x the running minimum: marked at step 2, stopped at step 3
    assert summary["status"] == "diverged" and summary["diverged_at_step"] == 2 and summary["steps"] == 3
    assert "val_loss" in read_jsonl(tmp_path / "metrics.jsonl")[-1]


def test_wandb_failure_does_not_stop_training(tmp_path, built, monkeypatch, capsys):
    import wandb

    def broken_init(**kwargs):
        raise RuntimeError("wandb is down")

    monkeypatch.setattr(wandb, "init", broken_init)
    cfg = make_cfg(logger="wandb", **{"trainer.steps": 4, "trainer.progress": True})
    summary = train(cfg, tmp_path)
    assert summary["status"] == "completed"
    bar = capsys.readouterr().err
    assert "4/4" in bar and "loss=" in bar and "tok_s=" in bar
    assert [r["step"] for r in read_jsonl(tmp_path / "metrics.jsonl")] == [2, 4]
    run_id = load_checkpoint(checkpoint_path(tmp_path / "checkpoints", 4))["wandb_run_id"]
    assert isinstance(run_id, str) and run_id


def test_dry_run_builds_on_meta_and_skips_data(tmp_path, built, capsys):
    cfg = make_cfg(**{"trainer.dry_run": True, "model.vocab_size": 24})
    summary = train(cfg, tmp_path, forbid_build=True)
    assert summary["status"] == "dry_run" and summary["n_params"] == built[0].n_params()
    assert summary["flops_per_token"] == 6.0 * summary["n_params"]
    assert all(p.is_meta for p in built[0].parameters())
    assert "parameters" in capsys.readouterr().out
    assert json.loads((tmp_path / "summary.json").read_text())["status"] == "dry_run"
    assert not (tmp_path / "metrics.jsonl").exists() and not (tmp_path / "checkpoints").exists()


def test_indivisible_global_batch_is_a_config_error(tmp_path, built):
    with pytest.raises(ConfigError, match=r"model.global_batch"):
        train(make_cfg(**{"trainer.micro_batch": 3}), tmp_path / "run")
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(("name", "dtype"), [("fp32", torch.float32), ("fp64", torch.float64)])
def test_the_training_bias_meter_replays_in_the_probes_dtype(monkeypatch, name, dtype):
    import readback.bias
    from readback.probe.settings import Probe
    from readback.train.instruments import TrainingBiasMeter, instruments

    seen = []

    class _Result:
        def metrics(self):
            return {"grad_bias/x/total": 1.0}

    def measure_bias(model, batches, dtype):
        seen.append((len(batches), dtype))
        return _Result()

    class _Stream:
        def val_batches(self, n):
            return [(torch.zeros(1, 2, dtype=torch.long), torch.zeros(1, 2, dtype=torch.long))] * n

    monkeypatch.setattr(readback.bias, "measure_bias", measure_bias)
    settings = Probe(every=0, repeats=1, dtype=name, params=["*"], bias_every=5, bias_batches=3)
    meter = next(i for i in instruments(settings, distributed=False) if isinstance(i, TrainingBiasMeter))
    assert meter.due(10) and not meter.due(11)
    meter.measure(nn.Linear(2, 2), None, None, _Stream())
    assert seen == [(3, dtype)] and meter.pop() == {"grad_bias/x/total": 1.0}
