"""The trainer: components wired by :class:`~readback.train.trainer.Trainer`.

* :mod:`~readback.train.contract` -- what the trainer needs from a model and a data stream; the builders
* :mod:`~readback.train.launch` -- ``run(cfg, run_dir)``: process group, determinism, preemption guard
* :mod:`~readback.train.trainer` -- builds the components and runs the steps
* :mod:`~readback.train.optim` -- AdamW, its warmup-stable-decay LR, gradient norm/clip, non-finite check
* :mod:`~readback.train.checkpoint` -- saving, verifying and resuming; one writer per run directory
* :mod:`~readback.train.metrics_processor` -- loss/throughput windows, MFU, records, progress bar
* :mod:`~readback.train.metrics` -- ``metrics.jsonl`` and a wandb wrapper that never stops a run
* :mod:`~readback.train.validator` -- validation loss split over the ranks
* :mod:`~readback.train.summary` -- ``summary.json``
* :mod:`~readback.train.dry_run` -- the model's size and per-GPU memory without weights; the memory check
* :mod:`~readback.train.divergence` -- NaN stop, loss blow-up marking, skipped updates
* :mod:`~readback.train.distributed` -- torchrun/Slurm process groups (gloo on CPU, NCCL on CUDA)

Entry point: ``summary = run(cfg, run_dir)``.
"""

from readback.train.contract import Builders
from readback.train.launch import accumulation_steps, run

__all__ = ["Builders", "accumulation_steps", "run"]
