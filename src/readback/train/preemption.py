"""Preemption: finish the step, checkpoint, exit so that the scheduler requeues the job.

Slurm warns a job before it ends it: ``--signal=USR2@90`` (what submitit requests; the signal
is ``$SUBMITIT_PREEMPT_SIGNAL``, ``USR2`` by default), ``SIGUSR1`` in many sbatch scripts, and
``SIGTERM`` at the time limit or on preemption, ``KillWait`` seconds (30 by default) before
``SIGKILL``. While :func:`readback.train.run` trains, :class:`PreemptionGuard` turns each of
``trainer.preempt_signals`` into a request: the current optimizer step finishes, a checkpoint is
written and the trainer raises :class:`Preempted`. No ``summary.json`` is written: the run is
not over, and the requeued job writes it when it ends.

The entry point then calls :func:`exit_for_requeue`:

* Under submitit (the Hydra submitit launcher), submitit's own handler of its preemption
  signal is still installed outside the guard. It is called as if that signal had arrived now:
  it asks the launcher for its checkpoint (the same Hydra job, same overrides, same run
  directory), runs ``scontrol requeue`` and exits; the requeued job starts again with
  ``trainer.resume=true`` (or is resumed anyway, see below) and continues from the checkpoint.
  Without the guard, submitit would requeue from inside the signal handler, in the middle of
  a step, and the work since the last periodic checkpoint would be lost.
* Otherwise (plain ``python train.py`` or ``torchrun``, e.g. in an sbatch script with
  ``--requeue``) the process exits with ``128 + signal``, like a process the signal killed;
  requeueing is then the scheduler's (or the batch script's) business.

A requeued Slurm job (``SLURM_RESTART_COUNT > 0``), like workers that torchrun restarted
(``TORCHELASTIC_RESTART_COUNT > 0``), resumes from its checkpoints even when ``trainer.resume`` is
false, so a sweep cannot restart a preempted job from step 0 by mistake.

In a multi-process run every rank sees the request in the same step: the flag travels with
the step's loss all-reduce.

Ctrl-C (``SIGINT``) is a person stopping the run, caught whatever ``trainer.preempt_signals``
says: the first one is a request like the signals above (the step finishes, a checkpoint is
written), but the job is never requeued: the process exits with 130 after one line saying where
the checkpoint is and how to continue. A second ``SIGINT`` (after any request) stops at once, in
the middle of a save too: :class:`Interrupted` is raised where the program is, and the save's
temporary directory is left for the next resume to clear; the newest complete checkpoint was
committed by a rename, so it is whole.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading
from collections.abc import Iterable
from pathlib import Path
from types import FrameType
from typing import Any

log = logging.getLogger(__name__)


class Preempted(BaseException):
    """The run stopped on a signal after checkpointing ``step`` (or, ``at_once`` on a second
    Ctrl-C, in the middle of step ``step + 1`` or its save; ``checkpoint`` is then the newest
    complete one).

    A ``BaseException``, like ``KeyboardInterrupt``: code that catches ``Exception`` to record a
    failure must let it through, since the run has not failed.
    """

    def __init__(self, signum: int, step: int, checkpoint: str | None, *, at_once: bool = False):
        self.signum, self.step, self.checkpoint, self.at_once = int(signum), int(step), checkpoint, at_once
        if at_once:
            newest = f"the newest complete checkpoint is {checkpoint}" if checkpoint else "no checkpoint was written"
            text = f"{signal_name(signum)} again: stopped at once after step {step}; {newest}"
        else:
            where = f"checkpoint {checkpoint}" if checkpoint else "no new checkpoint"
            text = f"{signal_name(signum)} received: stopped after step {step}, {where}"
        super().__init__(text)

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def parse_signals(names: Iterable[Any] | None) -> list[int]:
    """Signal numbers from names (``SIGTERM``, ``TERM``, ``usr1``) or numbers; unknown names raise
    ``ValueError``."""
    out: list[int] = []
    for name in names or ():
        if isinstance(name, int) and not isinstance(name, bool):
            num = int(signal.Signals(name))
        else:
            text = str(name).strip().upper()
            text = text if text.startswith("SIG") else f"SIG{text}"
            sig = getattr(signal, text, None)
            if not isinstance(sig, signal.Signals):
                raise ValueError(f"unknown signal {name!r}")
            num = int(sig)
        if num not in out:
            out.append(num)
    return out


# Set above 0 in a job started again: a requeued Slurm job; workers that torchrun restarted
# (``--max-restarts``) after one of them failed.
RESTART_COUNTS = ("SLURM_RESTART_COUNT", "TORCHELASTIC_RESTART_COUNT")


def requeued() -> str | None:
    """``NAME=count`` of the variable saying this job was started again (:data:`RESTART_COUNTS`
    above 0), else ``None``."""
    for name in RESTART_COUNTS:
        try:
            if int(os.environ.get(name, "0") or 0) > 0:
                return f"{name}={os.environ[name]}"
        except ValueError:
            continue
    return None


class Interrupted(KeyboardInterrupt):
    """A second Ctrl-C: stop at once, wherever the program is."""


class PreemptionGuard:
    """Catches ``signals`` and ``SIGINT`` while active; ``requested`` is the first one caught (or
    ``None``); a ``SIGINT`` after it raises :class:`Interrupted` (``interrupted`` then holds).

    Handlers can only be installed from the main thread; elsewhere the guard stays inactive
    (and ``requested`` stays ``None``).
    """

    def __init__(self, signals: Iterable[Any]):
        self.signals = parse_signals([*parse_signals(signals), signal.SIGINT])
        self.requested: int | None = None
        self.interrupted = False
        self._previous: dict[int, Any] = {}

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.requested is not None and signum == signal.SIGINT:
            self.interrupted = True
            raise Interrupted
        if self.requested is None:
            self.requested = signum
            said = {
                int(signal.SIGINT): "Ctrl-C (SIGINT) received: saving a checkpoint after this step; Ctrl-C again "
                "stops at once, keeping the newest complete checkpoint",
            }.get(signum, f"{signal_name(signum)} received: checkpointing after this step")
            # logging from a signal handler can deadlock on the handler's lock: write directly
            with contextlib.suppress(OSError):
                os.write(2, f"{said}\n".encode())

    def install(self) -> PreemptionGuard:
        if threading.current_thread() is not threading.main_thread():
            return self
        for signum in self.signals:
            try:
                self._previous[signum] = signal.signal(signum, self._handle)
            except (OSError, ValueError) as e:  # e.g. a signal this platform does not deliver
                log.debug("cannot catch %s: %s", signal_name(signum), e)
        return self

    def uninstall(self) -> None:
        for signum, previous in self._previous.items():
            with contextlib.suppress(OSError, ValueError):
                signal.signal(signum, previous if previous is not None else signal.SIG_DFL)
        self._previous.clear()

    def __enter__(self) -> PreemptionGuard:
        return self.install()

    def __exit__(self, *exc: object) -> None:
        self.uninstall()


def _submitit_requeue_handler() -> Any:
    """submitit's handler of its preemption signal, if this process runs a submitit job."""
    name = "SIG" + os.environ.get("SUBMITIT_PREEMPT_SIGNAL", "USR2").upper().removeprefix("SIG")
    signum = getattr(signal, name, None)
    if signum is None:
        return None
    handler = signal.getsignal(signum)
    if callable(handler) and getattr(handler, "__name__", "") == "checkpoint_and_try_requeue":
        return handler
    return None


def exit_for_requeue(preempted: Preempted, run_dir: Path | None = None) -> None:
    """Leave the process so that the job is requeued (see the module docstring); after Ctrl-C,
    one or two lines on stderr (where the run stopped, how to continue ``run_dir``) and exit 130.
    Never returns."""
    if preempted.signum == signal.SIGINT:
        print(preempted, file=sys.stderr)
        if run_dir is not None and preempted.checkpoint:
            print(f"continue it with: python train.py hydra.run.dir={run_dir} trainer.resume=true", file=sys.stderr)
        sys.exit(preempted.exit_code)
    handler = _submitit_requeue_handler()
    if handler is not None:
        log.warning("%s; asking submitit to requeue the job", preempted)
        handler(preempted.signum, None)  # checkpoints the launcher call, requeues, exits
    else:
        log.warning("%s; exiting with code %d for the scheduler to requeue", preempted, preempted.exit_code)
    sys.exit(preempted.exit_code)
