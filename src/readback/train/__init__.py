"""The trainer: components wired by :class:`~readback.train.trainer.Trainer`.

* :mod:`~readback.train.settings` -- the ``trainer`` and ``logger`` schemas and ``Config``, a run's typed config
* :mod:`~readback.train.contract` -- what the trainer needs from a model and a data stream; the builders
* :mod:`~readback.train.launch` -- ``run(cfg, run_dir)``: process group, determinism, preemption guard
* :mod:`~readback.train.trainer` -- builds the components and runs the steps
* :mod:`~readback.train.optim` -- AdamW, its warmup-stable-decay LR, gradient norm/clip, non-finite check
* :mod:`~readback.train.parallel` -- DDP or FSDP2 over the ranks
* :mod:`~readback.train.instruments` -- the measurements a step may carry (probe, bias meter)
* :mod:`~readback.train.validator` -- validation loss split over the ranks
* :mod:`~readback.train.dry_run` -- the model's size and per-GPU memory without weights; the memory check
* :mod:`~readback.train.divergence` -- NaN stop, loss blow-up marking, skipped updates
* :mod:`~readback.train.preemption` -- a scheduler's signal: finish the step, checkpoint, exit for requeue
* :mod:`~readback.train.distributed` -- torchrun/Slurm process groups (gloo on CPU, NCCL on CUDA)
* :mod:`~readback.train.checkpoint` -- saving, verifying and resuming; one writer per run directory
* :mod:`~readback.train.records` -- what a run writes down: ``metrics.jsonl``, wandb, ``summary.json``

Entry point: ``summary = run(cfg, run_dir)``.
"""

from typing import TYPE_CHECKING, Any

from readback.train.contract import Builders

if TYPE_CHECKING:
    from readback.train.launch import run

__all__ = ["Builders", "run"]


def __getattr__(name: str) -> Any:
    """``run``, imported on first use: the config's schemas (``readback.train.settings``) load
    without the trainer, so a bad command line is refused before the checkpoint code
    (``torch.distributed.checkpoint``) loads."""
    if name == "run":
        from readback.train.launch import run

        return run
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
