"""Two processes on gloo (``torchrun --nproc_per_node=2``) train the toy model like one process
with the same global batch: same loss curve to ~1e-6, one metrics file, per-rank checkpoint state."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import toys
from readback.train.checkpoint import checkpoint_path, list_checkpoints, load_checkpoint
from readback.train.records.metrics import read_jsonl
from toys import REPO

pytestmark = pytest.mark.distributed  # process groups on local ports: one such module at a time

TESTS = REPO / "tests"
OVERRIDES = {
    "trainer.steps": 8,
    "trainer.log_every": 1,
    "trainer.eval_every": 4,
    "trainer.eval_batches": 3,
    "trainer.ckpt_every": 4,
    "trainer.keep_last": 2,
    "trainer.micro_batch": 2,
}


WORKER = textwrap.dedent(
    """
    import json, sys
    from pathlib import Path

    import toys

    toys.train(toys.make_cfg(**json.loads(sys.argv[2])), Path(sys.argv[1]))
    """
)


def _torchrun(tmp_path: Path, run_dir: Path, overrides: dict, worker: str = WORKER) -> subprocess.CompletedProcess:
    script = tmp_path / "worker.py"
    script.write_text(worker)
    # the workers import the toys as the tests do: tests/ (and src/) on their path
    path = [str(TESTS), str(REPO / "src"), *filter(None, [os.environ.get("PYTHONPATH")])]
    env = dict(os.environ, OMP_NUM_THREADS="1", WANDB_MODE="disabled", PYTHONPATH=os.pathsep.join(path))
    env.pop("WORLD_SIZE", None)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        str(script),
        str(run_dir),
        json.dumps(overrides),
    ]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180, cwd=tmp_path)


@pytest.fixture
def single_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # like the torchrun workers
    yield
    torch.set_num_threads(before)


def test_two_processes_match_one(tmp_path, built, single_thread):
    one, two = tmp_path / "one", tmp_path / "two"
    toys.train(toys.make_cfg(**OVERRIDES), one)  # 1 process: 4 micro-batches of 2 per step
    proc = _torchrun(tmp_path, two, OVERRIDES)  # 2 processes: 2 micro-batches of 2 each
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    a, b = read_jsonl(one / "metrics.jsonl"), read_jsonl(two / "metrics.jsonl")
    assert [r["step"] for r in b] == list(range(1, 9))  # rank 0 alone wrote, once per step
    for ra, rb in zip(a, b, strict=True):
        assert rb["tokens"] == ra["tokens"] and rb["lr"] == ra["lr"]
        assert rb["loss"] == pytest.approx(ra["loss"], rel=1e-6, abs=1e-7)
        assert rb["grad_norm"] == pytest.approx(ra["grad_norm"], rel=1e-5, abs=1e-7)
        assert ("val_loss" in rb) == ("val_loss" in ra)
        if "val_loss" in ra:
            assert rb["val_loss"] == pytest.approx(ra["val_loss"], rel=1e-6, abs=1e-7)
    assert [r["step"] for r in b if "val_loss" in r] == [4, 8]

    summary = json.loads((two / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["world_size"] == 2 and summary["steps"] == 8
    assert summary["final_loss"] == pytest.approx(
        json.loads((one / "summary.json").read_text())["final_loss"], rel=1e-6
    )
    state = load_checkpoint(checkpoint_path(two / "checkpoints", 8))
    assert state["world_size"] == 2 and len(state["ranks"]) == 2
    assert [r["data"] for r in state["ranks"]] == [{"consumed": 64}, {"consumed": 64}]

    # a 2-process checkpoint resumes in one process (same global batch) on the same curve
    resumed = tmp_path / "resumed"
    shutil.copytree(two, resumed)
    shutil.rmtree(checkpoint_path(resumed / "checkpoints", 8))
    assert [s for s, _ in list_checkpoints(resumed / "checkpoints")] == [4]
    toys.train(toys.make_cfg(**OVERRIDES, **{"trainer.resume": True}), resumed)
    c = read_jsonl(resumed / "metrics.jsonl")
    assert [r["step"] for r in c] == list(range(1, 9))
    for rb, rc in zip(b, c, strict=True):
        assert rc["loss"] == pytest.approx(rb["loss"], rel=1e-6, abs=1e-7)


PREEMPT_WORKER = WORKER.replace(
    "toys.train(toys.make_cfg(**json.loads(sys.argv[2])), Path(sys.argv[1]))\n",
    textwrap.dedent(
        """
        import os, signal
        from readback.train.preemption import Preempted

        real_next = toys.ToyStream.next_batch

        def next_batch(self):  # rank 1 alone is signalled, during step 3
            if self.layout.rank == 1 and self.calls == 5:
                os.kill(os.getpid(), signal.SIGTERM)
            return real_next(self)

        toys.ToyStream.next_batch = next_batch
        try:
            toys.train(toys.make_cfg(**json.loads(sys.argv[2])), Path(sys.argv[1]))
        except Preempted as p:  # one file per rank: the ranks share torchrun's stdout, where lines interleave
            rank = int(os.environ["RANK"])
            stopped = Path(sys.argv[1]).parent / ("stopped_rank%d.json" % rank)
            stopped.write_text(json.dumps(dict(rank=rank, step=p.step)))
            sys.exit(p.exit_code)
        """
    ),
)
assert PREEMPT_WORKER != WORKER


def test_a_signal_to_one_rank_stops_every_rank_after_the_same_step(tmp_path, built, single_thread):
    one, two = tmp_path / "one", tmp_path / "two"
    toys.train(toys.make_cfg(**OVERRIDES), one)
    proc = _torchrun(tmp_path, two, OVERRIDES, worker=PREEMPT_WORKER)
    assert proc.returncode != 0  # the workers exit 143: torchrun reports the failure for requeueing
    reports = [json.loads(p.read_text()) for p in sorted(tmp_path.glob("stopped_rank*.json"))]
    stops, steps = [r["rank"] for r in reports], {r["step"] for r in reports}
    assert stops == [0, 1] and steps == {3}, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert [s for s, _ in list_checkpoints(two / "checkpoints")] == [3]
    state = load_checkpoint(checkpoint_path(two / "checkpoints", 3))
    assert state["world_size"] == 2 and [r["data"] for r in state["ranks"]] == [{"consumed": 24}, {"consumed": 24}]
    assert not (two / "summary.json").exists()
    toys.train(toys.make_cfg(**OVERRIDES, **{"trainer.resume": True}), two)  # resumed in one process
    a, b = read_jsonl(one / "metrics.jsonl"), read_jsonl(two / "metrics.jsonl")
    assert [r["step"] for r in b] == list(range(1, 9))
    for ra, rb in zip(a, b, strict=True):
        assert rb["loss"] == pytest.approx(ra["loss"], rel=1e-6, abs=1e-7)
