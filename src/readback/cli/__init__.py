"""Programs run with ``python -m``: they compose a run's config or load its checkpoint, so they sit
on top of every layer, like ``train.py``, and the library packages they drive import nothing above
themselves.

* :mod:`~readback.cli.bias` -- ``python -m readback.cli.bias CHECKPOINT_OR_RUN_DIR``: the bias meter on a checkpoint
  (its options as data: :mod:`~readback.cli.bias_options`)
* :mod:`~readback.cli.te_table` -- ``python -m readback.cli.te_table``: docs/te_backend.md's TE table
"""
