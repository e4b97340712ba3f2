"""Checkpoints: what a run saves so that it can stop anywhere and go on where it stopped.

* :mod:`~readback.train.checkpoint.manager` -- the schema, save, resume, failed saves
* :mod:`~readback.train.checkpoint.states` -- the model's, the optimizer's and the random generators' state
* :mod:`~readback.train.checkpoint.dirs` -- commit, damage check, moving aside, pruning
* :mod:`~readback.train.checkpoint.resumption` -- the resume plan, refused under a config that changes the run
* :mod:`~readback.train.checkpoint.log_gap` -- a log behind its checkpoint: go on with a warning, or rewind
* :mod:`~readback.train.checkpoint.writer_lock` -- one writer per run directory: rank 0's lock, with a lease
* :mod:`~readback.train.checkpoint.io` -- DCP files and their checksums, loading without running code
* :mod:`~readback.train.checkpoint.atomic` -- small files written all at once
"""

from readback.train.checkpoint.atomic import atomic_write_text
from readback.train.checkpoint.dirs import (
    Damaged,
    checkpoint_dir,
    checkpoint_path,
    is_checkpoint,
    list_checkpoints,
    load_latest_checkpoint,
    verify,
)
from readback.train.checkpoint.manager import CheckpointManager, load_checkpoint
from readback.train.checkpoint.resumption import resume_plan
from readback.train.checkpoint.states import RNGState
from readback.train.checkpoint.writer_lock import RunDirTaken, WriterLock, check_not_held, sole_writer

__all__ = [
    "CheckpointManager",
    "Damaged",
    "RNGState",
    "RunDirTaken",
    "WriterLock",
    "atomic_write_text",
    "check_not_held",
    "checkpoint_dir",
    "checkpoint_path",
    "is_checkpoint",
    "list_checkpoints",
    "load_checkpoint",
    "load_latest_checkpoint",
    "resume_plan",
    "sole_writer",
    "verify",
]
