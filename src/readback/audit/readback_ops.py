"""readback's own ops under each policy, against their straight-through replay.

Forward in FP8 (E4M3, current scaling); the backward GEMMs run in FP32 (``attention.bwd_precision=fp32``,
``override_linear_precision=(False, True, True)``), so the backward's own arithmetic does not blur
which value it read. The op's ``numerics.tape`` gives the executed bits: the ``rounded``
candidate, and the replay (the reference). ``fresh`` is reproduced exactly: the op's re-rounding
draws from the site's ``fresh`` stream of this step, which is a function of (seed, site, stream,
step); a draw from another seed is a second candidate that must NOT match.
"""

from __future__ import annotations

from typing import Any

import torch

from readback.audit.core import Row, audit
from readback.audit.harness import (
    F64,
    Setup,
    backprop,
    round_fp8,
    value,
    xielu_slope,
)
from readback.numerics import CurrentScaling, QTensor, quantize
from readback.numerics.attention_settings import AttentionSettings
from readback.numerics.precision_settings import fp8_settings_of
from readback.numerics.settings import NumericsSettings
from readback.numerics.state import Numerics
from readback.numerics.streams import RandomStreams
from readback.ops import activation as activation_op
from readback.ops import linear as linear_op
from readback.ops import norm as norm_op
from readback.ops import numerics_spec
from readback.policy import POLICIES

F32 = torch.float32
RECIPE = CurrentScaling(override_linear_precision=(False, True, True))


def audit_numerics(
    policy: str, seed: int, rounding: str = "nearest", bwd_reads: str = "forward", **parts: str
) -> Numerics:
    """The audits' numerics; ``parts``: the attention backward's parts set apart (``qkv``, ``probs``)."""
    attention = AttentionSettings(
        bwd_precision="fp32", bwd_reads=bwd_reads, bwd_qkv=parts.get("qkv"), bwd_probs=parts.get("probs")
    )
    settings = NumericsSettings(fp8_settings_of(RECIPE, rounding=rounding), attention, policy)
    return Numerics(numerics_spec(settings), seed=seed)


def taped_backprop(numerics: Numerics, forward, inputs: dict[str, torch.Tensor], upstream: torch.Tensor):
    """``backprop`` in FP32, and what its ops executed: ``(gradients, {op call: record})``."""
    with numerics.taping() as tape:
        got = backprop(forward, inputs, upstream, F32)
    return got, dict(tape)


def fresh_draw(numerics: Numerics, site: str, original: torch.Tensor, executed: QTensor, seed: int) -> torch.Tensor:
    """A stochastic re-rounding of ``original`` with the forward's scale, from the ``fresh`` stream
    of ``site`` in this step of a run seeded ``seed`` (the op's own draw when ``seed`` is the run's)."""
    streams = RandomStreams(seed)
    streams.reseed(numerics.step, numerics.stream_salt)
    generator = streams.state(site, "fresh", original.device)
    if executed.fmt is None:
        raise ValueError(f"{site} does not round: no fresh draw")
    return quantize(original.detach().float(), executed.fmt, executed.scale, "stochastic", generator).dequantize(F64)


def readings(numerics: Numerics, site: str, original: torch.Tensor, executed: QTensor) -> dict[str, torch.Tensor]:
    """Every value a backward could read for the tensor rounded at ``site`` (float64)."""
    return {
        "rounded": value(executed),
        "original": value(original),
        "fresh": fresh_draw(numerics, site, original, executed, numerics.seed),
        "fresh(other seed)": fresh_draw(numerics, site, original, executed, numerics.seed + 1),
    }


def linear_gradients(numerics: Numerics, x: torch.Tensor, weight: torch.Tensor, upstream: torch.Tensor):
    """The linear ``lin``'s gradients as it runs, its tape record and the reference's: ``(got,
    record, ref)``."""

    def forward(x, weight):
        return linear_op.linear(x, weight, numerics, "lin"), {}

    got, tape = taped_backprop(numerics, forward, {"x": x, "weight": weight}, upstream)
    record = tape["lin"]
    ref = backprop(
        lambda x, weight: (linear_op.replay(x, weight, record, F64), {}), {"x": x, "weight": weight}, upstream, F64
    )
    return got, record, ref


def rb_linear(setup: Setup, policy: str) -> list[Row]:
    g = setup.generator("readback.linear")
    d = setup.width
    x = Setup.randn(g, setup.batch, setup.seq, d)
    weight = Setup.randn(g, d // 2, d, std=d**-0.5)
    upstream = Setup.randn(g, setup.batch, setup.seq, d // 2)
    numerics = audit_numerics(policy, setup.seed)
    got, record, ref = linear_gradients(numerics, x, weight, upstream)

    dy = value(upstream).reshape(-1, d // 2)
    xs = readings(numerics, "lin.input", x.reshape(-1, d), record["input"])
    ws = readings(numerics, "lin.weight", weight, record["weight"])
    common: dict[str, Any] = dict(policy=policy, declared=linear_op.READS[policy], tol=setup.tol)
    return [
        *audit(
            "readback.linear",
            "dgrad",
            got["x"],
            ref["x"],
            {m: (dy @ w).reshape(x.shape) for m, w in ws.items()},
            **common,
        ),
        *audit(
            "readback.linear", "wgrad", got["weight"], ref["weight"], {m: dy.mT @ v for m, v in xs.items()}, **common
        ),
    ]


def rb_rms_norm(setup: Setup, policy: str) -> list[Row]:
    """rms_norm(round_output=True) feeding a linear with ``x_q``: the gain reads the normalised
    value, the linear's wgrad the rounded output."""
    g = setup.generator("readback.rms_norm")
    d, eps = setup.width, 1e-6
    x = Setup.randn(g, setup.batch, setup.seq, d, std=3.0) + 0.5
    gain = 1 + Setup.randn(g, d, std=0.3)
    weight = Setup.randn(g, d // 2, d, std=d**-0.5)
    upstream = Setup.randn(g, setup.batch, setup.seq, d // 2)
    numerics = audit_numerics(policy, setup.seed)

    def forward(x, gain, weight):
        y, yq = norm_op.rms_norm(x, gain, numerics, "norm", eps, round_output=True)
        return linear_op.linear(y, weight, numerics, "next", x_q=yq), {"y": y}

    got, tape = taped_backprop(numerics, forward, {"x": x, "gain": gain, "weight": weight}, upstream)

    def replay(x, gain, weight):
        y = norm_op.replay(x, gain, tape["norm"], eps, F64)
        return linear_op.replay(y, weight, tape["next"], F64), {"y": y}

    ref = backprop(replay, {"x": x, "gain": gain, "weight": weight}, upstream, F64)
    y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * gain  # the op's FP32 output before rounding
    ys = {m: v.reshape(-1, d) for m, v in readings(numerics, "norm.output", y, tape["norm"]["output"]).items()}
    dy, d_out = value(got["y"]).reshape(-1, d), value(upstream).reshape(-1, d // 2)
    return [
        *audit(
            "readback.rms_norm",
            "gain",
            got["gain"],
            ref["gain"],
            {m: (dy * v / value(gain)).sum(0) for m, v in ys.items()},
            policy=policy,
            declared=norm_op.READS[policy],
            tol=setup.tol,
        ),
        *audit(
            "readback.rms_norm -> linear(x_q)",
            "wgrad",
            got["weight"],
            ref["weight"],
            {m: d_out.mT @ v for m, v in ys.items()},
            policy=policy,
            declared=linear_op.READS[policy],
            tol=setup.tol,
        ),
    ]


def rb_xielu(setup: Setup, policy: str) -> list[Row]:
    """xIELU's input gradient: the slope at the original input, or at an FP8 rounding of it."""
    g = setup.generator("readback.xielu")
    x = Setup.randn(g, setup.batch, setup.seq, setup.width, std=2.0)
    upstream = Setup.randn(g, *x.shape)
    alpha = torch.tensor(0.8)
    numerics = audit_numerics(policy, setup.seed)
    got = backprop(lambda x: (activation_op.xielu(x, alpha, alpha, numerics), {}), {"x": x}, upstream, F32)
    ref = backprop(lambda x: (activation_op.replay(x, alpha.to(F64), alpha.to(F64)), {}), {"x": x}, upstream, F64)
    xs = {"rounded": value(round_fp8(x)), "original": value(x)}
    return audit(
        "readback.xielu",
        "dx",
        got["x"],
        ref["x"],
        {m: value(upstream) * xielu_slope(v, 0.8, 0.8) for m, v in xs.items()},
        policy=policy,
        declared=activation_op.READS[policy],
        tol=setup.tol,
    )


def per_policy(audit_one, policies=tuple(POLICIES), **kwargs):
    def run(setup: Setup) -> list[Row]:
        return [row for policy in policies for row in audit_one(setup, policy, **kwargs)]

    run.__doc__ = audit_one.__doc__
    return run


AUDITS = {
    "readback.linear": per_policy(rb_linear),
    "readback.rms_norm": per_policy(rb_rms_norm),
    "readback.xielu": per_policy(rb_xielu),
}
