"""Every program, each ``python -m readback.cli.NAME`` (README.md's table lists them): the command
lines, on top of every layer like ``train.py``; the library packages they drive parse no command
line and import nothing above themselves.

* :mod:`~readback.cli.analysis` -- the plots, tables and report of a sweep's runs
* :mod:`~readback.cli.sync` -- the upload of offline wandb runs
* :mod:`~readback.cli.bias` -- the bias meter on a checkpoint (its options as data:
  :mod:`~readback.cli.bias_options`); :mod:`~readback.cli.bias_attribution`,
  :mod:`~readback.cli.bias_onset`, :mod:`~readback.cli.bias_shapes` -- its tables over checkpoints and runs
* :mod:`~readback.cli.decide` -- a pre-registered test's decision (:mod:`readback.analysis.decisions`)
* :mod:`~readback.cli.audit`, :mod:`~readback.cli.audit_model` -- the read-rule audit of single ops, the
  saved tensors of a model
* :mod:`~readback.cli.prepare` -- a local corpus prepared ahead of training
* :mod:`~readback.cli.te_table` -- docs/te_backend.md's TE table
"""
