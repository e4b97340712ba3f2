"""The bias meter: what each read of the backward costs the gradient, against the gradient of
the executed forward (``python -m readback.cli.bias CHECKPOINT_OR_RUN_DIR``)."""

from readback.bias.estimators import STATS
from readback.bias.meter import BiasResult, group_of, measure_bias
from readback.bias.variants import Variant, applied, variant_spec, variants

__all__ = ["STATS", "BiasResult", "Variant", "applied", "group_of", "measure_bias", "variant_spec", "variants"]
