"""What ``launch.json`` keeps of a run's launches, and which sweep's overrides a job records."""

import json

from readback.train.records.identity import sweep_overrides
from readback.train.records.launches import close_launch, read_launches, record_launch


def _context(commit, cpu):
    return {"code": {"commit": commit, "dirty": False}, "cpu_model": cpu, "cpu_capability": "AVX2", "host": "h"}


def test_every_launch_is_kept_with_its_commit_cpu_and_steps_trained(tmp_path):
    record_launch(tmp_path, _context("aaa", "AMD EPYC"), from_step=0)
    close_launch(tmp_path, to_step=1200)  # preempted at step 1,200
    record_launch(tmp_path, _context("aaa", "AMD EPYC"), from_step=1000)  # its newest checkpoint
    close_launch(tmp_path, to_step=2000)
    record_launch(tmp_path, _context("bbb", "Intel Xeon"), from_step=2000)  # a resume of a finished run
    close_launch(tmp_path, to_step=2000)
    history = read_launches(tmp_path)
    assert [(e["commit"], e["cpu_model"], e["from_step"], e["steps_trained"]) for e in history] == [
        ("aaa", "AMD EPYC", 0, 1200),
        ("aaa", "AMD EPYC", 1000, 1000),
        ("bbb", "Intel Xeon", 2000, 0),
    ]
    doc = json.loads((tmp_path / "launch.json").read_text())
    assert doc["cpu_model"] == "Intel Xeon" and doc["code"]["commit"] == "bbb"  # the newest launch on top


def test_a_launch_killed_outright_stays_open_and_is_closed_only_once(tmp_path):
    record_launch(tmp_path, _context("aaa", "AMD EPYC"), from_step=0)  # SIGKILL: never closed
    record_launch(tmp_path, _context("aaa", "AMD EPYC"), from_step=500)
    close_launch(tmp_path, to_step=900)
    close_launch(tmp_path, to_step=950)  # nothing open any more
    first, second = read_launches(tmp_path)
    assert first["to_step"] is None and first["steps_trained"] is None
    assert (second["to_step"], second["steps_trained"]) == (900, 400)


def test_a_file_from_before_the_history_counts_as_one_launch_of_unknown_start(tmp_path):
    (tmp_path / "launch.json").write_text(json.dumps(_context("old", "AMD EPYC")))
    record_launch(tmp_path, _context("new", "AMD EPYC"), from_step=1500)
    old, new = read_launches(tmp_path)
    assert (old["commit"], old["from_step"], new["commit"], new["from_step"]) == ("old", None, "new", 1500)
    close_launch(tmp_path / "nowhere", to_step=3)  # no file: nothing to close, nothing raised


def _multirun_yaml(sweep_dir, overrides):
    sweep_dir.mkdir(parents=True, exist_ok=True)
    (sweep_dir / "multirun.yaml").write_text(json.dumps({"hydra": {"overrides": {"task": overrides}}}))


def test_a_job_records_its_own_sweep_not_another_stream_s(tmp_path):
    """Two streams of seeds launched into one sweep directory: the second overwrote multirun.yaml."""
    mine = ["+experiment=reuse_rounded,no_saved_copy", "seed=300,302"]
    other = ["+experiment=reuse_rounded,no_saved_copy", "seed=301,303"]
    _multirun_yaml(tmp_path, other)
    job = ["+experiment=no_saved_copy", "seed=302"]
    argv = ["train.py", "--multirun", "hydra.sweep.dir=x", *mine]
    assert sweep_overrides(tmp_path, job, argv) == mine
    assert sweep_overrides(tmp_path, job, ["python"]) == []  # argv says nothing; the file is the other's
    _multirun_yaml(tmp_path, mine)
    assert sweep_overrides(tmp_path, job, ["python"]) == mine  # a launcher whose jobs run elsewhere
