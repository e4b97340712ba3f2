"""The bias meter's records as the tables over many runs read them (``readback.bias.shapes``,
``readback.bias.onset``): a run folder with its config, metrics and measurements, one layer each."""

from __future__ import annotations

import json

from readback.bias.attribution import D_READ


def measured_run(root, name, *, heads, seq_len, seed, debiased, z):
    """A trained run of a FOG with ``heads`` heads (d_model 128) at ``seq_len``: its config, its
    metrics with a last ``attn_rowsum/z`` of ``z``, and the meter's ``bias/width`` at K 14."""
    run = root / name
    (run / ".hydra").mkdir(parents=True)
    (run / ".hydra" / "config.yaml").write_text(
        f"seed: {seed}\nmodel:\n  d_model: 128\n  n_heads: {heads}\n  seq_len: {seq_len}\n"
    )
    measure(run, "bias/width", margin=14, debiased=debiased, projection=0.01 * seed, rel_err=0.2 + seed)
    records = [{"step": 20, "attn_rowsum/z/layers.0.attn.core": 1.0}, {"step": 40}]
    records.append({"step": 60, "attn_rowsum/z/layers.0.attn.core": z})
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return run


def measure(run, measured, *, margin, debiased, projection=0.0, rel_err=0.2, log2_rms_scaled=-8.0):
    """A meter's ``bias.json`` in ``run/measured``, made under O's margin ``margin``."""
    stats = {
        "debiased_sq": debiased,
        "debiased_sq_se": 0.0004,
        "projection": projection,
        "projection_se": 0.002,
        "bias": 0.1,
        "bias_se": 0.03,
        "floor": 0.03,
    }
    o = {"underflow": 0.99, "rel_err": rel_err, "amax_to_rms": 8.0, "log2_rms_scaled": log2_rms_scaled}
    bias = {
        "policy": "reuse_rounded",
        "batches": 16,
        "site_margin": {"attn.core.output": margin},
        "o_rounding": {"layers.0.attn": o},
        "stats": {D_READ: {"layers.0.attn.qkv": stats}},
    }
    (run / measured).mkdir(parents=True)
    (run / measured / "bias.json").write_text(json.dumps(bias))
