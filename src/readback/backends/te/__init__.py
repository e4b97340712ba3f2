"""``backend=te``: Transformer Engine where it can run the experiment. This package imports
nothing: only :mod:`~readback.backends.te.parts` imports TE, when a model is built, after the
run's TE environment variables are set; everything else here plans without TE or a GPU.

* :mod:`~readback.backends.te.parts` -- FOG's parts from TE modules; the TE environment
* :mod:`~readback.backends.te.plan` -- what ``backend=te`` runs for a config, refused before a run starts
* :mod:`~readback.backends.te.recipe` -- readback's recipe as a TE recipe, with its refusals
* :mod:`~readback.backends.te.attention` -- what TE's attention core runs and reads
* :mod:`~readback.backends.te.linear` -- what ``te.Linear``'s GEMMs read
* :mod:`~readback.backends.te.facts` -- what TE can run, by version, GPU and cuDNN
* :mod:`~readback.backends.te.dry_run` -- the plan a dry run prints, on any machine
* :mod:`~readback.backends.te.convert` -- ``convert(..., backend="te")``: TE modules for any model
* :mod:`~readback.backends.te.table` -- docs/te_backend.md's experiment table, rendered from the plan
"""
