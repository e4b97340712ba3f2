"""readback's attention op under each policy, each flavour of its backward and each part of that
flavour set apart, against its straight-through replay (the harness: ``readback_ops``)."""

from __future__ import annotations

from typing import Any

import torch

from readback.audit.core import Row, audit, cat
from readback.audit.harness import (
    F64,
    Setup,
    attention_grads,
    backprop,
    causal_softmax,
    group_sum,
    heads,
    value,
)
from readback.audit.harness import (
    expand_groups as expand,
)
from readback.audit.readback_ops import audit_numerics, per_policy, readings, taped_backprop
from readback.ops import attention as attention_op
from readback.ops import linear as linear_op
from readback.policy import POLICIES


def rb_attention(
    setup: Setup, policy: str, rounding: str = "nearest", bwd_reads: str = "forward", **parts: str
) -> list[Row]:
    """attention feeding its output projection with ``x_q``. dV reads P; ``dS`` (the P of the
    softmax backward) and the D-term (the O of ``rowsum(dO * O)``, or nothing) are read out of
    (dQ, dK) together, over every pair of candidates (the rows share their rel. error); the
    projection's wgrad reads O. ``rounding="stochastic"`` rounds the forward stochastically too:
    then ``rounded`` and ``fresh`` are two draws of one distribution, from different streams.
    ``bwd_reads="te"`` (the backward's flavour) adds the candidates it reads: P ``rebuilt`` from
    the original Q, K with the forward's LSE, and the original V, K, Q of dP, dQ, dK, which are
    then read out of (dQ, dK) too; so does a part of it set apart (``parts``: ``qkv=original``,
    ``probs=rebuilt``)."""
    g = setup.generator("readback.attention")
    b, h, grp, t, d, c = setup.batch, setup.heads, setup.groups, setup.seq, setup.width, setup.softmax_scale
    q, k, v, w_proj, upstream = setup.attention_inputs(g).values()
    numerics = audit_numerics(policy, setup.seed, rounding, bwd_reads, **parts)
    op = "readback.attention" if rounding == "nearest" else f"readback.attention ({rounding} fwd)"
    op = op if bwd_reads == "forward" else f"{op} (bwd_reads={bwd_reads})"
    op += "".join(f" (bwd_{part}={mode})" for part, mode in parts.items())
    departs = bwd_reads == "te" or bool(parts)  # candidates beyond the forward's operands

    def forward(q, k, v, w_proj):
        o, oq = attention_op.attention(q, k, v, numerics, "attn", c)
        return linear_op.linear(o, w_proj, numerics, "proj", x_q=oq), {"o": o}

    got, tape = taped_backprop(numerics, forward, {"q": q, "k": k, "v": v, "w_proj": w_proj}, upstream)
    rec = tape["attn"]

    def replay(q, k, v, w_proj):
        o = attention_op.replay(q, k, v, rec, c, F64)
        return linear_op.replay(o, w_proj, tape["proj"], F64), {"o": o}

    ref = backprop(replay, {"q": q, "k": k, "v": v, "w_proj": w_proj}, upstream, F64)

    # the Q, K, V each GEMM could read; K, V recorded expanded to H heads
    qs, ks, vs = ({"rounded": value(rec[n])} for n in ("q", "k", "v"))
    probs = causal_softmax(rec["scores"])  # the op's FP32 P, recomputed the way the forward did
    ps = readings(numerics, "attn.probs", probs, rec["probs"])
    if departs:
        qs["original"], ks["original"], vs["original"] = value(q), expand(value(k), h), expand(value(v), h)
        ps["rebuilt"] = rebuilt_probs(qs["original"], ks["original"], rec["scores"], c)
    os: dict[str, torch.Tensor | None] = {
        m: heads(o, b, t, h) for m, o in readings(numerics, "attn.output", rec["out"], rec["output"]).items()
    }
    os["none"] = None
    d_out = heads(value(got["o"]), b, t, h)
    d_proj = value(upstream).reshape(-1, d)
    o_flat = {m: o.transpose(1, 2).reshape(-1, d) for m, o in os.items() if o is not None}
    joint: dict[tuple[str, ...], torch.Tensor] = {
        (mp, mo, mv, mk, mq): cat(*attention_grads(p, d_out, qv, kv, vv, o, c, grp))
        for mp, p in ps.items()
        for mo, o in os.items()
        for mv, vv in vs.items()
        for mk, kv in ks.items()
        for mq, qv in qs.items()
    }
    read_out: tuple[str, ...] = ("dS", "D", "dP", "dQ", "dK")
    if not departs:  # one candidate each for V, K, Q: read out of nothing
        joint, read_out = {key[:2]: grads for key, grads in joint.items()}, read_out[:2]
    common: dict[str, Any] = dict(policy=policy, declared=numerics.spec.reads["attention"], tol=setup.tol)
    return [
        *audit(op, "dV", got["v"], ref["v"], {m: group_sum(p.mT @ d_out, grp) for m, p in ps.items()}, **common),
        *audit(op, read_out, cat(got["q"], got["k"]), cat(ref["q"], ref["k"]), joint, **common),
        *audit(
            f"{op} -> linear(x_q)",
            "wgrad",
            got["w_proj"],
            ref["w_proj"],
            {m: d_proj.mT @ o for m, o in o_flat.items()},
            policy=policy,
            declared=linear_op.READS[policy],
            tol=setup.tol,
        ),
    ]


def rebuilt_probs(q: torch.Tensor, k: torch.Tensor, forward_scores: torch.Tensor, c: float) -> torch.Tensor:
    """``exp(c Q K^T - LSE)`` (float64), LSE the log-sum-exp of the forward's causal scores."""
    mask = torch.ones(q.shape[-2], q.shape[-2], dtype=torch.bool).triu(1)
    lse = torch.logsumexp(value(forward_scores).masked_fill(mask, float("-inf")), -1, keepdim=True)
    return torch.exp((c * q @ k.mT).masked_fill(mask, float("-inf")) - lse)


AUDITS = {
    "readback.attention": per_policy(rb_attention),
    "readback.attention (stochastic fwd)": per_policy(
        rb_attention, ("reuse_rounded", "fresh_reround"), rounding="stochastic"
    ),
    # what TE's BF16 backward reads (exact takes no flavour)
    "readback.attention (bwd_reads=te)": per_policy(
        rb_attention, tuple(p for p in POLICIES if p != "exact"), bwd_reads="te"
    ),
    # each part of TE's BF16 backward's reads set apart alone
    "readback.attention (bwd_qkv=original)": per_policy(
        rb_attention, tuple(p for p in POLICIES if p != "exact"), qkv="original"
    ),
    "readback.attention (bwd_probs=rebuilt)": per_policy(
        rb_attention, tuple(p for p in POLICIES if p != "exact"), probs="rebuilt"
    ),
}
