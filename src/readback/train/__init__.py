"""The trainer: one module per concern, wired by :mod:`readback.train.loop`.

* :mod:`~readback.train.schedule` -- warmup-stable-decay LR with 1-sqrt cooldown
* :mod:`~readback.train.optim` -- AdamW param groups, gradient norm/clip, non-finite check
* :mod:`~readback.train.checkpoint` -- atomic checkpoints, resume, pruning, RNG state
* :mod:`~readback.train.metrics` -- ``metrics.jsonl`` and a wandb wrapper that never stops a run
* :mod:`~readback.train.divergence` -- NaN stop, loss blow-up marking, skipped updates
* :mod:`~readback.train.distributed` -- torchrun/Slurm process groups (gloo on CPU, NCCL on CUDA)

Entry point: ``summary = run(cfg, run_dir)``.
"""

from readback.train.loop import accumulation_steps, run

__all__ = ["accumulation_steps", "run"]
