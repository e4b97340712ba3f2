"""Two nodes as they fail, emulated on one machine: two torchrun agents (``--nnodes 2 --node-rank
0|1 --nproc-per-node 1``, static rendezvous on 127.0.0.1, gloo) train ``train.py`` into one shared
run directory, as on a cluster's shared file system.

Ranks that disagree (in the experiment, in the seed alone) are refused on both nodes and train
nothing; a frozen rank (SIGSTOP) stops the other within the short timeout; a lost node (agent and
worker killed) ends the other in one line, and both relaunched resume; torchrun's own restart
(``--max-restarts``) resumes too. Where a run resumes, every logged value equals the
uninterrupted run's, which is also one node of two processes against two nodes of one.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from readback.train.checkpoint import list_checkpoints
from readback.train.records.metrics import read_jsonl
from toys import REPO, TOY_RUN

pytestmark = pytest.mark.distributed  # process groups on local ports: one such module at a time

STEPS = 12
FAULT_BATCH = 8  # rank 1's 8th batch: step 8, after the checkpoint of step 6
EXPERIMENT = "+experiment=reuse_rounded"
TINY = [
    "data=synthetic",
    "data.n_tokens=65536",
    "model.n_layers=2",
    *TOY_RUN,  # global batch 4 = micro-batch 2 x 2 ranks: one micro-batch a step
    f"trainer.steps={STEPS}",
    "trainer.log_every=1",
    "trainer.eval_every=6",
    "trainer.eval_batches=2",
    "trainer.ckpt_every=3",
    "trainer.progress=false",
    "trainer.timeouts.startup_s=60",
    "trainer.timeouts.step_s=3",
]
TIMING_KEYS = {"tokens_per_s", "mfu", "mem_gib"}  # wall-clock measurements, not results

# train.py itself, with rank 1 frozen (SIGSTOP), lost (its agent and itself SIGKILLed) or killed
# alone in the first attempt (torchrun restarts it) as it takes batch FAULT_BATCH.
FAULTY = """
import os, runpy, signal, sys
from readback.data.stream import PackedStream

fault, batches, next_batch = os.environ.get("FAULT"), [0], PackedStream.next_batch

def faulty_next_batch(self):
    batches[0] += 1
    if os.environ["RANK"] == "1" and batches[0] == {batch} and os.environ["TORCHELASTIC_RESTART_COUNT"] == "0":
        if fault == "lost":
            os.kill(os.getppid(), signal.SIGKILL)  # the node's torchrun agent
        if fault == "frozen":
            with open(os.environ["FROZEN_PID"], "w") as f:  # for the test to end it: a worker has its own session
                f.write(str(os.getpid()))
        os.kill(os.getpid(), signal.SIGSTOP if fault == "frozen" else signal.SIGKILL)
    return next_batch(self)

PackedStream.next_batch = faulty_next_batch
sys.argv = ["train.py"] + sys.argv[1:]
runpy.run_path("train.py", run_name="__main__")
""".replace("{batch}", str(FAULT_BATCH))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(run_dir: Path, fault: str | None = None) -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", WANDB_MODE="disabled", PYTHONPATH=str(REPO / "src"))
    for key in ("WORLD_SIZE", "RANK", "SLURM_RESTART_COUNT", "SLURM_JOB_ID", "TORCHELASTIC_RESTART_COUNT"):
        env.pop(key, None)
    return env | ({"FAULT": fault, "FROZEN_PID": str(_frozen_pid_file(run_dir))} if fault else {})


def _frozen_pid_file(run_dir: Path) -> Path:
    return run_dir.parent / "frozen.pid"


def _torchrun(launch: list[str], run_dir: Path, args: list[str], fault: str | None) -> subprocess.Popen:
    script = [str(run_dir.parent / "faulty.py")] if fault else ["train.py"]
    if fault:
        Path(script[0]).write_text(FAULTY)
    cmd = [sys.executable, "-m", "torch.distributed.run", *launch, *script, *TINY, *args, f"hydra.run.dir={run_dir}"]
    return subprocess.Popen(
        cmd,
        cwd=REPO,
        env=_env(run_dir, fault),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def _two_nodes(
    run_dir: Path, *args: str, node1: tuple[str, ...] = (EXPERIMENT,), fault: str | None = None
) -> list[subprocess.Popen]:
    """Node 0 and node 1, each a torchrun agent with one worker; ``node1``: its experiment and
    overrides, where they differ from node 0's (``EXPERIMENT``)."""
    port = str(_free_port())
    launch = ["--nnodes", "2", "--nproc-per-node", "1", "--master-addr", "127.0.0.1", "--master-port", port]
    return [
        _torchrun([*launch, "--node-rank", str(node)], run_dir, [*own, *args], fault)
        for node, own in enumerate([(EXPERIMENT,), node1])
    ]


def _finish(proc: subprocess.Popen, timeout: float = 120) -> tuple[int, str]:
    try:
        _, err = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None or proc.returncode != 0:
            _kill_group(proc)
    return proc.returncode, err


def _kill_group(proc: subprocess.Popen) -> None:
    """The agent and the workers it started (its own session), a stopped one included."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def _results(run_dir: Path) -> list[dict]:
    return [{k: v for k, v in r.items() if k not in TIMING_KEYS} for r in read_jsonl(run_dir / "metrics.jsonl")]


def _assert_same_run(run_dir: Path, reference: Path) -> None:
    got, want = _results(run_dir), _results(reference)
    assert [r["step"] for r in got] == list(range(1, STEPS + 1))
    for g, w in zip(got, want, strict=True):
        assert g == w, {k: (g.get(k), w.get(k)) for k in set(g) | set(w) if g.get(k) != w.get(k)}
    assert json.loads((run_dir / "summary.json").read_text())["status"] == "completed"


def _error_line(err: str) -> str:
    """The one ``error: `` line of a node's stderr; the failure shows the stderr if there is not one."""
    lines = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1, err[-3000:]
    return lines[0]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("nodes") / "uninterrupted"
    for proc in _two_nodes(run_dir):
        rc, err = _finish(proc)
        assert rc == 0, err[-3000:]
    return run_dir


# node 1's experiment and overrides, and what the refusal names: the issue's launch, and the seed alone
DISAGREEING = {
    "experiment": (("+experiment=fresh_reround", "seed=7"), "policy reuse_rounded on rank 0, fresh_reround on rank 1"),
    "seed": ((EXPERIMENT, "seed=7"), "seed 0 on rank 0, 7 on rank 1"),
}


def test_ranks_that_disagree_are_refused_on_every_rank_and_train_nothing(tmp_path):
    launched = {case: _two_nodes(tmp_path / case, node1=node1) for case, (node1, _) in DISAGREEING.items()}  # at once
    for case, nodes in launched.items():
        for proc in nodes:
            rc, err = _finish(proc)
            assert rc != 0, err[-3000:]
            line = _error_line(err)
            assert line.startswith("error: ranks disagree: ") and DISAGREEING[case][1] in line, line
            assert "trainer.py" not in err  # no traceback from the trainer
        if case == "seed":  # the one key that differs, alone
            assert line == f"error: ranks disagree: seed 0 on rank 0, 7 on rank 1; {line.split('; ', 2)[-1]}"
        run_dir = tmp_path / case
        assert not (run_dir / "metrics.jsonl").exists() and not (run_dir / "summary.json").exists()
        assert not list_checkpoints(run_dir / "checkpoints")


def test_a_frozen_rank_stops_the_other_within_the_timeout(tmp_path):
    run_dir = tmp_path / "run"
    node0, node1 = _two_nodes(run_dir, fault="frozen")
    rc, err = _finish(node0, timeout=60)
    os.kill(int(_frozen_pid_file(run_dir).read_text()), signal.SIGKILL)
    _kill_group(node1)
    assert rc != 0, err[-3000:]
    line = _error_line(err)
    assert line.startswith("error: rank 1 (host ") and f"stopped answering after step {FAULT_BATCH - 1}" in line, line
    assert "waited trainer.timeouts.step_s=3 s" in line and "newest checkpoint: step 6" in line, line
    assert "exitcode  : 3" in err and "trainer.py" not in err
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "failed" and "stopped answering" in summary["error"]
    assert [s for s, _ in list_checkpoints(run_dir / "checkpoints")] == [3, 6]


def test_a_lost_node_ends_the_other_in_one_line_and_both_relaunched_resume(tmp_path, uninterrupted):
    run_dir = tmp_path / "run"
    node0, node1 = _two_nodes(run_dir, fault="lost")
    rc, err = _finish(node0, timeout=60)
    _kill_group(node1)
    assert rc != 0, err[-3000:]
    line = _error_line(err)
    assert line.startswith("error: rank 1 (host ") and f"stopped answering after step {FAULT_BATCH - 1}" in line, line
    assert "lost its connection" in line and "newest checkpoint: step 6" in line and "trainer.resume=true" in line
    assert "trainer.py" not in err
    for proc in _two_nodes(run_dir, "trainer.resume=true"):
        rc, err = _finish(proc)
        assert rc == 0, err[-3000:]
    _assert_same_run(run_dir, uninterrupted)


def test_torchrun_restarting_its_workers_resumes_the_run(tmp_path, uninterrupted):
    """One node of two processes, rank 1 killed in step 8; ``--max-restarts 1`` starts both again
    (``TORCHELASTIC_RESTART_COUNT=1``), and they resume from step 6 without ``trainer.resume``."""
    run_dir = tmp_path / "run"
    launch = ["--standalone", "--nproc-per-node", "2", "--max-restarts", "1"]
    rc, err = _finish(_torchrun(launch, run_dir, [EXPERIMENT], fault="killed"))
    assert rc == 0, err[-3000:]
    assert "job started again (TORCHELASTIC_RESTART_COUNT=1): resuming from" in err
    _assert_same_run(run_dir, uninterrupted)
