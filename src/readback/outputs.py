"""What a run writes for its readers, declared once: the keys of ``summary.json`` and the metric
families of ``metrics.jsonl``, for the writers, ``readback.analysis`` and the docs to agree on.

A metric key is ``<family>`` (one number a record) or ``<family>/<where>`` (``where``: a site, a
layer, a parameter, a variant and group, with a statistic first where the family has several).
The writers refuse a key these tables lack (:func:`check_declared`), and
``tests/unit/train/test_outputs.py`` fails when a table declares one no run writes.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

# summary.json, in the order a run writes it (in_summary_order; a dry run's are its own, last here).
SUMMARY_KEYS = {
    "status": "completed, diverged or failed (dry_run for a dry run)",
    "final_loss": "the last logged window's mean training loss (null when not finite)",
    "val_loss": "the last validation loss",
    "steps": "optimizer steps taken",
    "tokens": "training tokens seen",
    "diverged_at_step": "the step the divergence detector stopped the run at, else null",
    "divergence_reason": "why it stopped, in words",
    "skipped_updates": "steps whose update was dropped (non-finite gradients under nonfinite_grads=skip)",
    "nonfinite_tensors": "the tensors found not finite at the stopping step",
    "wall_time_s": "seconds of wall time, over all sessions of a resumed run",
    "n_params": "trainable parameters",
    "site_implementations": "which implementation runs each kind of site (readback's ops, TE's modules)",
    "flops_per_token": "training FLOPs per token, for MFU",
    "world_size": "processes the run trained on",
    "experiment": "the experiment's name (custom without one)",
    "error": "the exception of a failed run, in one line",
    "memory_gb": "dry run: the per-GPU memory estimate of each parallel layout, in GB",
    "te_plan": "dry run under backend=te: what TE runs and how, on the GPU and TE it plans for",
}

# Every family metrics.jsonl holds, with what it measures.
METRIC_FAMILIES = {
    "step": "the optimizer step of the record",
    "loss": "mean training loss over the steps since the last record",
    "lr": "the learning rate of the step",
    "tokens": "training tokens seen up to the step",
    "grad_norm": "the gradients' global norm before clipping",
    "tokens_per_s": "training throughput since the last record",
    "skipped_updates": "updates dropped so far (non-finite gradients)",
    "mfu": "model FLOPs utilisation against the GPU's BF16 peak (CUDA only)",
    "mem_gib": "the GPU's peak allocated memory (CUDA only)",
    "val_loss": "validation loss (evaluation steps)",
    "diverged": "true on the record of a step whose loss or gradients were not finite",
    "fp8_saturation": "per site: elements clipped to the FP8 maximum since the last record",
    "fp8_underflow": "per site: the fraction of nonzero elements rounded to zero or a subnormal",
    "attn_rowsum": "per attention layer, mean and z: the row sums of dS (zero under the exact rule)",
    "attn_logit": "per attention layer, max and mean: the causal attention logits",
    "attn_entropy": "per attention layer, mean: the attention rows' entropy",
    "attn_dq_dterm_cos": "per attention layer, mean: cosine of dQ's D-term with the mean attended key",
    "attn_out_rel_err": "per attention layer, mean: |O - O8| / |O|",
    "attn_out_amax_to_rms": "per attention layer, mean: max|O| / rms(O)",
    "attn_out_log2_rms_scaled": "per attention layer, mean: log2(rms(O) * scale), where O lands on the grid",
    "attn_out_history_amax_to_rms": "per attention layer, mean: the history amax behind O8's scale over rms(O)",
    "attn_grad_flushed": "per attention layer and gradient (dO, dS), mean: the share of nonzero elements rounded to 0",
    "attn_grad_subnormal": "per attention layer and gradient (dO, dS), mean: the share rounded to a subnormal",
    "attn_grad_amax_to_rms": "per attention layer and gradient (dO, dS), mean: max|x| / rms(x) of what is rounded",
    "kurtosis": "the largest kurtosis over layers of a block's tensor (attn_out_max, ...)",
    "grad_error": "probe, per parameter and total: rel_err, cosine, bias and noise against the reference",
    "grad_error_se": "probe: the standard errors of grad_error's bias and noise",
    "grad_bias": "bias meter, per variant and group: the gradient's bias over |G|",
    "grad_bias_cos": "bias meter: cosine of the mean error with the exact gradient",
    "grad_bias_projection": "bias meter: the share of the gradient the bias removes",
    "grad_bias_se": "bias meter: grad_bias's standard error (2 batches or more)",
    "grad_bias_projection_se": "bias meter: grad_bias_projection's standard error (2 batches or more)",
    "grad_bias_debiased_sq": "bias meter: the squared bias less its noise (2 batches or more)",
    "grad_bias_debiased_sq_se": "bias meter: grad_bias_debiased_sq's standard error (4 batches or more)",
}


def family(key: str) -> str:
    """The family of a metric key: what comes before its first ``/``."""
    return key.split("/", 1)[0]


def check_declared(keys: Iterable[str], table: Mapping[str, str]) -> None:
    """Refuse ``keys`` (metric keys by family) that ``table`` does not declare: a run writes
    nothing its readers cannot look up here."""
    undeclared = sorted({family(key) for key in keys} - table.keys())
    if undeclared:
        raise ValueError(f"keys not declared in readback.outputs: {', '.join(undeclared)}")


def in_summary_order(values: Mapping[str, Any]) -> dict[str, Any]:
    """``values`` as ``summary.json`` holds them: in :data:`SUMMARY_KEYS`' order, each declared."""
    check_declared(values, SUMMARY_KEYS)
    return {key: values[key] for key in SUMMARY_KEYS if key in values}
