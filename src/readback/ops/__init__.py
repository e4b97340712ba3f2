"""Autograd ops whose every backward read is declared in a ``READS`` table next to the backward.

Import the functions from their modules: ``readback.ops.linear.linear``,
``readback.ops.norm.rms_norm``, ``readback.ops.attention.attention``, ``readback.ops.activation.xielu``.
``numerics_spec`` resolves a run's settings, the ops' read rules under its policy among them, into
the frozen ``NumericsSpec`` that ``Numerics(spec, seed=...)`` runs.
"""

from readback.numerics import DelayedScaling, ScalingRecipe
from readback.numerics.gemm import BF16_GEMMS
from readback.numerics.spec import ATTENTION_BWD_READS, ATTENTION_KERNELS, NumericsSpec, resolve_accumulation
from readback.numerics.spike import AmaxSpike
from readback.ops import activation, attention, linear, norm

# Every op module (with its READS table), by the name policy tables and the audit use.
OPS = {"linear": linear, "rms_norm": norm, "attention": attention, "xielu": activation}


def read_rules(
    policy: str,
    attention_bwd_reads: str = "forward",
    recipe: ScalingRecipe | None = None,
    qkv: str | None = None,
    probs: str | None = None,
) -> dict[str, dict[str, str]]:
    """``{op: {gradient: read mode}}`` of every op under ``policy``, with the attention backward's
    flavour (``attention.BWD_READS``) and its parts set apart (``qkv``: what dQ, dK, dP read of Q,
    K, V; ``probs``: what dV, dS read of P) laid over attention's row, and the reads ``recipe``
    sets (``linear.recipe_reads``: a block recipe's own copies, a backward_override's) over the
    linear's. ``exact`` takes none: it is every gradient reading what its forward used, whatever
    the backward reads otherwise."""
    for key, value, valid in (
        ("policy", policy, attention.READS),
        ("attention_bwd_reads", attention_bwd_reads, attention.BWD_READS),
    ):
        if value not in valid:
            raise ValueError(f"{key}={value!r}; valid: {list(valid)}")
    rules = {name: dict(op.READS[policy]) for name, op in OPS.items()}
    if policy != "exact":
        laid = dict(attention.BWD_READS[attention_bwd_reads])
        for gradients, part in ((attention.QKV_READERS, qkv), (attention.P_READERS, probs)):
            if part is not None:  # "forward": the policy's own read, whatever the flavour
                laid |= {g: rules["attention"][g] if part == "forward" else part for g in gradients}
        rules["attention"] |= laid
        rules["linear"] |= linear.recipe_reads(recipe)
    return rules


def numerics_spec(
    precision: str = "fp8",
    recipe: ScalingRecipe | None = None,
    policy: str = "exact",
    attention_bwd_precision: str = "fp8",
    attention_bwd_reads: str = ATTENTION_BWD_READS[0],
    attention_recipe: ScalingRecipe | None = None,
    attention_bwd_qkv: str | None = None,
    attention_bwd_probs: str | None = None,
    attention_round_grad_output: bool | None = None,
    attention_round_grad_scores: bool | None = None,
    attention_round_grad_output_in_d: bool | None = None,
    rounding: str = "nearest",
    bf16_sites: tuple[str, ...] = (),
    site_margin: dict[str, int] | None = None,
    accumulation: str = "native",
    accumulation_gemms: dict[str, str] | None = None,
    bf16_gemm: str = BF16_GEMMS[0],
    amax_spike: AmaxSpike | None = None,
    attention_kernel: str = ATTENTION_KERNELS[0],
) -> NumericsSpec:
    """The spec of a run, each argument the config key of the same name (``policy``,
    ``attention.bwd_precision`` as ``attention_bwd_precision``, ...): ``policy``'s reads resolved
    from the ops' tables, the choices made concrete (an FP8 run without a recipe gets
    ``DelayedScaling()``; a BF16 run's FP8 attention backward runs in BF16, an ``off`` run's in
    FP64; only FP8 rounds stochastically; the linears' accumulation, ``spec.resolve_accumulation``,
    applies to FP8 GEMMs only; ``attention_bwd_reads`` lays the attention backward's flavour over
    the policy's reads, and ``attention_bwd_qkv``, ``attention_bwd_probs`` a part of it each;
    ``attention_round_grad_output`` and ``_scores``, None, follow the backward's precision, and
    ``attention_round_grad_output_in_d`` (the dO that D reads), None, ``attention_round_grad_output``;
    ``attention_recipe``, the attention core's own per-tensor recipe, is an FP8 run's only;
    ``attention_kernel`` the core that runs it, ``ops`` or ``triton``). The spec checks its own values."""
    fp8 = precision == "fp8"
    recipe = DelayedScaling() if fp8 and recipe is None else recipe
    return NumericsSpec(
        precision=precision,
        recipe=recipe,
        policy=policy,
        reads=read_rules(policy, attention_bwd_reads, recipe if fp8 else None, attention_bwd_qkv, attention_bwd_probs),
        attention_bwd_precision=_backward_as_run(precision, attention_bwd_precision),
        rounding=rounding if fp8 else "nearest",
        bf16_sites=bf16_sites,
        site_margin=tuple((site_margin or {}).items()),
        accumulation=resolve_accumulation(accumulation, accumulation_gemms),
        bf16_gemm=bf16_gemm,
        amax_spike=amax_spike,
        attention_bwd_reads=attention_bwd_reads,
        attention_recipe=attention_recipe if fp8 else None,
        attention_bwd_qkv=attention_bwd_qkv,
        attention_bwd_probs=attention_bwd_probs,
        attention_bwd_rounds=tuple(
            (gradient, rounds)
            for gradient, rounds in (
                ("grad_output", attention_round_grad_output),
                ("grad_scores", attention_round_grad_scores),
                ("grad_output_in_d", attention_round_grad_output_in_d),
            )
            if rounds is not None
        ),
        attention_kernel=attention_kernel,
    )


def _backward_as_run(precision: str, attention_bwd_precision: str) -> str:
    """The attention backward's precision as a ``precision`` run runs it: a BF16 run's FP8 choice in
    BF16, an ``off`` run's in FP64."""
    if precision == "off":
        return "fp64"
    return "bf16" if precision == "bf16" and attention_bwd_precision == "fp8" else attention_bwd_precision


__all__ = ["OPS", "numerics_spec", "read_rules"]
