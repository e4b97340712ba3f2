"""A rank that stops answering (frozen, or lost with its node) ends the run in one line.

A collective that the other ranks cannot complete fails in each rank that still waits in it: at
once where the lost rank's connections closed, after ``trainer.timeouts`` where it froze (a hung
GPU, a file system read that never returns, a network partition). Each rank that sees such a
failure takes a roll call in the run's rendezvous store: it writes its own key, waits
:data:`ROLL_CALL_S` for the others', and names the ranks (with their hosts) that wrote none.
Then it raises :class:`RankLost`: the step, the timeout, the newest checkpoint and how to resume,
which ``train.py`` prints as one line, exiting with :data:`RankLost.exit_code` so that a
requeue (Slurm, or torchrun's ``--max-restarts``) resumes the run.

On NCCL a collective's timeout is its watchdog's business: it ends the process itself (with the
flight recorder's dump, :func:`readback.train.distributed.record_nccl_collectives`); the ranks
whose collectives fail before their own timeout still end here.
"""

from __future__ import annotations

import time
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

from readback.train.checkpoint import checkpoint_dir, list_checkpoints
from readback.train.distributed import DistEnv
from readback.train.settings import Timeouts

ROLL_CALL_S = 5.0  # how long a rank that saw a collective fail waits for the others to say they live
# What gloo's and NCCL's errors say when a peer stopped answering (torch raises them as RuntimeError
# or torch.distributed.DistError): the peer's connection closed or reset, or the wait timed out.
PEER_GONE = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "Connection refused")
TIMED_OUT = ("Timed out waiting", "Watchdog caught collective operation timeout")


class RankLost(RuntimeError):
    """The run stopped because another rank stopped answering; the checkpoints are intact."""

    exit_code = 3


def peer_failure(error: BaseException) -> str | None:
    """``"timeout"`` or ``"lost"`` where ``error`` is a collective that another rank left
    unfinished, else ``None`` (an error of this rank's own)."""
    if not isinstance(error, (RuntimeError, dist.DistError)):
        return None
    text = str(error)
    if any(marker in text for marker in PEER_GONE):
        return "lost"
    if any(marker in text for marker in TIMED_OUT):
        return "timeout"
    return None


def roll_call(env: DistEnv, wait_s: float = ROLL_CALL_S) -> list[int] | None:
    """The ranks that did not answer within ``wait_s`` (this one answers), or ``None`` when the
    rendezvous store itself does not answer (its host, rank 0's node, is lost too)."""
    store = dist.distributed_c10d._get_default_store()
    key = "readback/alive/{}".format
    try:
        store.set_timeout(timedelta(seconds=wait_s))
        store.set(key(env.rank), "1")
        deadline = time.monotonic() + wait_s
        while True:
            absent = [r for r in range(env.world_size) if not store.check([key(r)])]
            if not absent or time.monotonic() > deadline:
                return absent
            time.sleep(0.2)
    except (RuntimeError, dist.DistError):
        return None


def lost_rank(
    error: BaseException,
    env: DistEnv,
    step: int,
    after_first: bool,
    timeouts: Timeouts,
    hosts: list[str],
    run_dir: Path,
) -> RankLost | None:
    """:class:`RankLost` in readback's words where ``error`` is another rank's silence, after the
    roll call, else ``None``. ``step``: the last step this rank finished; ``after_first``: whether this
    process finished a step (the tighter timeout applies); ``hosts``: each rank's host (from the
    rank agreement; [] before it)."""
    kind = peer_failure(error) if env.distributed else None
    if kind is None:
        return None
    absent = roll_call(env)
    if absent is None:
        who = "the rendezvous store (rank 0's node) does not answer"
    elif absent:
        named = ", ".join(f"rank {r}" + (f" (host {hosts[r]})" if r < len(hosts) else "") for r in absent)
        who = f"{named} stopped answering"
    else:
        who = "every rank answers the roll call but a collective failed"
    setting, seconds = ("step_s", timeouts.step_s) if after_first else ("startup_s", timeouts.startup_s)
    how = f"waited trainer.timeouts.{setting}={seconds:g} s" if kind == "timeout" else "lost its connection"
    found = list_checkpoints(checkpoint_dir(run_dir))
    newest = f"step {found[-1][0]} ({found[-1][1]})" if found else "none (the run starts again from step 0)"
    return RankLost(
        f"{who} after step {step} (a collective {how}); newest checkpoint: {newest}; relaunch every node with the "
        "same command and trainer.resume=true (a requeued Slurm job or torchrun's --max-restarts resumes by itself)"
    )
