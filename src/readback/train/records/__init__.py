"""What a run writes down besides its checkpoints: metrics, its summary, who it is.

* :mod:`~readback.train.records.metrics_processor` -- loss/throughput windows, MFU, records, progress bar
* :mod:`~readback.train.records.metrics` -- ``metrics.jsonl`` and a wandb wrapper that never stops a run
* :mod:`~readback.train.records.tracking` -- wandb: mode, offline runs, resuming the one run
* :mod:`~readback.train.records.identity` -- the run's name, group, tags and launch context (host, Slurm job, commit)
* :mod:`~readback.train.records.summary` -- ``summary.json``
"""
