"""The pieces of a multi-node run that need no second process: what the ranks compare and how a
disagreement reads, which errors mean another rank stopped answering, the collective timeouts as
settings, NCCL's flight recorder switched on, and torchrun's restart taken for a requeue. Two
torchrun agents as two nodes: tests/integration/test_nodes.py."""

from __future__ import annotations

import os

import pytest

from readback.errors import ConfigError
from readback.train.agreement import RanksDisagree, disagreements, ranks_text, sources_digest, what_runs
from readback.train.distributed import FLIGHT_RECORDER, FLIGHT_RECORDER_FILE, DistEnv, record_nccl_collectives
from readback.train.lost_ranks import lost_rank, peer_failure
from readback.train.preemption import requeued
from readback.train.settings import config_leaves

GLOO_LOST = "[gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:37807. This is typically caused"
GLOO_TIMEOUT = "[gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 3000ms for recv operation to complete"


def test_what_a_rank_runs_is_every_config_key_the_code_the_versions_and_the_data(tiny_cfg):
    cfg = tiny_cfg()
    described = what_runs(cfg, "fineweb:HuggingFaceFW/fineweb-edu:sample:rank1/4:workers2")
    assert [k for k in described if not k.startswith(("code.", "version.", "data.fingerprint"))] == [
        k
        for k, _ in config_leaves(cfg)
        if k != "data.cache_dir"  # a node's own folder
    ]
    assert described["seed"] == cfg.seed and described["policy"] == cfg.policy
    assert {"code.commit", "code.dirty", "code.sources", "version.torch"} <= set(described)
    assert {"version.transformer_engine", "version.triton"} <= set(described)  # None where not installed
    assert described["data.fingerprint"] == "fineweb:HuggingFaceFW/fineweb-edu:sample:workers2"  # not the rank's share


def test_the_sources_digest_sees_any_edit_of_the_package(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "a.py").write_text("x = 1\n")
    (tmp_path / "sub" / "b.py").write_text("y = 2\n")
    before = sources_digest.__wrapped__(tmp_path)
    (tmp_path / "sub" / "b.py").write_text("y = 3\n")
    assert sources_digest.__wrapped__(tmp_path) != before
    (tmp_path / "sub" / "b.py").write_text("y = 2\n")
    assert sources_digest.__wrapped__(tmp_path) == before


def test_disagreements_name_each_differing_key_with_its_values_and_their_ranks():
    described = [
        {"seed": 0, "policy": "reuse_rounded", "model.n_layers": 2},
        {"seed": 7, "policy": "fresh_reround", "model.n_layers": 2},
        {"seed": 0, "policy": "reuse_rounded", "model.n_layers": 2},
    ]
    assert disagreements(described) == [
        ("seed", [(0, [0, 2]), (7, [1])]),
        ("policy", [("reuse_rounded", [0, 2]), ("fresh_reround", [1])]),
    ]
    assert disagreements(described[:1] * 4) == []
    assert disagreements([{"a": 1}, {}]) == [("a", [(1, [0]), ("(absent)", [1])])]


def test_a_disagreement_is_one_line_exit_2_naming_keys_values_and_ranks():
    error = RanksDisagree(
        disagreements([{"policy": "reuse_rounded", "seed": 0}, {"policy": "fresh_reround", "seed": 7}])
    )
    assert isinstance(error, ConfigError)  # train.py: one line on stderr, exit 2
    line = str(error)
    assert line.startswith(
        "ranks disagree: policy reuse_rounded on rank 0, fresh_reround on rank 1; seed 0 on rank 0, 7 on rank 1; "
    )
    assert "\n" not in line
    many = RanksDisagree(disagreements([{f"k{i}": 0 for i in range(9)}, {f"k{i}": 1 for i in range(9)}]))
    assert "k5 0 on rank 0" in str(many) and "k6" not in str(many) and "... (9 keys in all)" in str(many)


@pytest.mark.parametrize(
    ("ranks", "text"), [([3], "rank 3"), ([0, 2], "ranks 0, 2"), ([0, 1], "ranks 0, 1"), ([4, 5, 6, 7], "ranks 4-7")]
)
def test_ranks_read_as_a_list_or_a_run(ranks, text):
    assert ranks_text(ranks) == text


@pytest.mark.parametrize(
    ("error", "kind"),
    [
        (RuntimeError(GLOO_LOST), "lost"),
        (RuntimeError("[gloo/transport/tcp/pair.cc:534] Read error [127.0.0.1]:1: Connection reset by peer"), "lost"),
        (RuntimeError(GLOO_TIMEOUT), "timeout"),
        (RuntimeError("Watchdog caught collective operation timeout: WorkNCCL(SeqNum=9, OpType=ALLREDUCE)"), "timeout"),
        (RuntimeError("CUDA out of memory"), None),  # this rank's own error
        (ValueError("Connection closed by peer"), None),  # no collective raises that
        (KeyboardInterrupt(), None),
    ],
)
def test_which_errors_mean_another_rank_stopped_answering(error, kind):
    assert peer_failure(error) == kind


def test_one_process_has_no_other_rank_to_lose(tiny_cfg, tmp_path):
    timeouts = tiny_cfg().trainer.timeouts
    assert lost_rank(RuntimeError(GLOO_LOST), DistEnv(), 5, True, timeouts, ["h"], tmp_path) is None


def test_the_timeouts_are_settings_refused_at_zero(tiny_cfg):
    timeouts = tiny_cfg("trainer.timeouts.startup_s=20", "trainer.timeouts.step_s=2.5").trainer.timeouts
    assert (timeouts.startup_s, timeouts.step_s) == (20, 2.5)
    with pytest.raises(ConfigError, match=r"^trainer\.timeouts\.step_s=0"):
        tiny_cfg("trainer.timeouts.step_s=0")


def test_the_flight_recorder_dumps_into_the_run_directory_unless_set(monkeypatch, tmp_path):
    for name in [*FLIGHT_RECORDER, FLIGHT_RECORDER_FILE]:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("TORCH_FR_BUFFER_SIZE", "50")  # the user's own
    record_nccl_collectives(tmp_path)
    assert os.environ["TORCH_FR_BUFFER_SIZE"] == "50" and os.environ["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"
    assert os.environ[FLIGHT_RECORDER_FILE] == str(tmp_path / "nccl_trace_rank_")


@pytest.mark.parametrize(
    ("env", "said"),
    [
        ({}, None),
        ({"SLURM_RESTART_COUNT": "0", "TORCHELASTIC_RESTART_COUNT": "0"}, None),
        ({"SLURM_RESTART_COUNT": "2"}, "SLURM_RESTART_COUNT=2"),
        ({"TORCHELASTIC_RESTART_COUNT": "1"}, "TORCHELASTIC_RESTART_COUNT=1"),
        ({"TORCHELASTIC_RESTART_COUNT": "x"}, None),
    ],
)
def test_a_torchrun_restart_resumes_like_a_slurm_requeue(monkeypatch, env, said):
    for name in ("SLURM_RESTART_COUNT", "TORCHELASTIC_RESTART_COUNT"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert requeued() == said
