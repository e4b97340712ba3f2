"""The probe: how far is each gradient the configured backward produced from the reference?

The reference is plain autograd over a replay of the executed forward in which every rounding
site returns the exact bits the forward produced (``Numerics.replay``). No read rule of ours is
involved in it. With ``repeats = K > 1`` the same batch is executed K times with independent
forward roundings (each against its own reference), so the error splits into a bias (the
error of the mean gradient) and noise (the spread around it).
"""

from __future__ import annotations

import fnmatch
import math
from dataclasses import dataclass

import torch

from readback.errors import require, some_of
from readback.probe.settings import DTYPES, Probe

WATCHED = ("dq", "dk", "dv")  # the op inputs' gradients the attention op watches: {core}.dq, ...


def probed(name: str, patterns: list[str]) -> bool:
    """The rule of ``probe.params``: a glob over the whole parameter or watched gradient name."""
    return any(fnmatch.fnmatch(name, pattern) for pattern in patterns)


def check_params(settings: Probe, model: torch.nn.Module) -> None:
    """``ConfigError`` for a ``probe.params`` pattern that names nothing of ``model``: none of its
    trainable parameters, nor any ``{module}.dq|dk|dv`` (which module is an attention core shows
    only once it runs, so any module's name counts)."""
    params = [n for n, p in model.named_parameters() if p.requires_grad]
    watched = [f"{m}.{d}" for m, _ in model.named_modules() if m for d in WATCHED]
    for pattern in settings.params:
        require(
            any(probed(n, [pattern]) for n in params + watched),
            "probe.params",
            pattern,
            "globs over whole parameter names, e.g. "
            + some_of(params)
            + "; or an attention core's {core}.dq, .dk, .dv",
        )


class GradientProbe:
    """The probe the ``probe`` group sets: ``every`` (steps, 0 = off), ``repeats``, ``dtype``,
    ``params`` (glob patterns over parameter and site names)."""

    def __init__(self, settings: Probe) -> None:
        self.settings = settings

    def due(self, step: int) -> bool:
        every = self.settings.every
        return every > 0 and step % every == 0

    def measure(
        self, model, inputs: torch.Tensor, targets: torch.Tensor, trained: TapedStep | None = None
    ) -> dict[str, float]:
        """Error statistics of one batch, logged as ``grad_error/<stat>/<name>``.

        Leaves the model, its gradients, its numerics (scales, histories, random streams) and
        every global random state as they were. Repeat 0 uses the step's own random streams;
        ``trained`` is the step's own taped backward of this batch (``train_taped``), which
        repeat 0 then takes instead of executing the batch again (every repeat differentiates
        the loss divided by the step's micro-batches, as that backward did).
        """
        numerics = model.numerics
        params = {n: p for n, p in model.named_parameters() if p.requires_grad}
        saved_grads = {n: p.grad for n, p in params.items()}
        micro_batches = 1 if trained is None else trained.micro_batches
        errors, references = [], []
        try:
            for repeat in range(self.settings.repeats):
                if repeat == 0 and trained is not None:
                    executed, reference = self._against_reference(model, params, trained, inputs, targets)
                else:
                    with numerics.isolated(stream_salt="" if repeat == 0 else f"/probe{repeat}"):
                        for p in params.values():
                            p.grad = None
                        _, taped = train_taped(model, inputs, targets, micro_batches)
                        executed, reference = self._against_reference(model, params, taped, inputs, targets)
                keep = [n for n in reference if probed(n, self.settings.params)]
                errors.append({n: executed[n] - reference[n] for n in keep})
                references.append({n: reference[n] for n in keep})
        finally:
            for n, p in params.items():
                p.grad = saved_grads[n]
        return compare(errors, references)

    def _against_reference(self, model, params, taped: TapedStep, inputs, targets):
        """(executed, reference) gradients by name: parameters, and watched op inputs."""
        with model.numerics.watching():
            reference = reference_gradients(
                model,
                {n: params[n] for n in taped.executed if n in params},
                taped.tape,
                inputs,
                targets,
                DTYPES[self.settings.dtype],
                taped.micro_batches,
            )
        return {n: taped.executed[n].detach().double() for n in reference}, reference


@dataclass(frozen=True)
class TapedStep:
    """A forward and backward of one batch with the executed forward's tape: the gradients it
    left (parameters and watched op inputs, by name) and the micro-batches its loss was divided by."""

    tape: list
    executed: dict[str, torch.Tensor]
    micro_batches: int


def train_taped(model, inputs: torch.Tensor, targets: torch.Tensor, micro_batches: int = 1):
    """A training micro-step (``loss / micro_batches`` backward, gradients into ``.grad``) that
    tapes the forward and watches the op inputs: ``(loss, TapedStep)``. Its gradients are this
    batch's alone when none had accumulated before (the first micro-batch of a step)."""
    with model.numerics.watching() as watched:
        loss, tape = taped_backward(model, inputs, targets, micro_batches)
        executed = {n: p.grad for n, p in model.named_parameters() if p.requires_grad and p.grad is not None}
        executed |= {n: t.grad for n, t in watched.items()}
    return loss, TapedStep(tape, executed, micro_batches)


def taped_backward(model, inputs: torch.Tensor, targets: torch.Tensor, micro_batches: int = 1):
    """One training forward and backward of ``loss / micro_batches`` (gradients into ``.grad``),
    recording the executed forward's tape: ``(loss, tape)``."""
    with model.numerics.taping() as tape:
        loss = model(inputs, targets)
        (loss / micro_batches).backward()  # as the trainer's micro-steps do
    return loss.detach(), tape


def reference_gradients(
    model, params: dict, tape: list, inputs, targets, dtype=torch.float32, micro_batches: int = 1
) -> dict:
    """Plain autograd over the replay of ``tape`` (every rounding pinned to the executed bits)
    of ``loss / micro_batches``, by name: the parameters in ``params``, and the op inputs in
    ``numerics.watched`` when on."""
    numerics = model.numerics
    with numerics.replay(tape, dtype):
        loss = model(inputs, targets)
        leaves = {**params, **(numerics.watched or {})}
        grads = torch.autograd.grad(loss / micro_batches, list(leaves.values()), allow_unused=True)
    return {n: g.detach().double() for n, g in zip(leaves, grads) if g is not None}


def compare(errors: list[dict[str, torch.Tensor]], references: list[dict[str, torch.Tensor]]) -> dict[str, float]:
    """``grad_error/{rel_err,cosine}/<name>`` averaged over repeats, and with two or more
    repeats ``grad_error/{bias,noise}/<name>`` with their standard errors under
    ``grad_error_se/{bias,noise}/<name>``. ``total`` is every name's vector concatenated.

    Every statistic is a ratio of sums of squares and products, so ``total`` adds those of the
    names instead of concatenating the vectors (a model's worth of FP64 copies)."""
    names, k = list(errors[0]), len(errors)
    sums = {name: _sums([e[name] for e in errors], [r[name] for r in references]) for name in names}
    sums["total"] = {key: torch.stack([s[key] for s in sums.values()]).sum(0) for key in sums[names[0]]}
    out = {}
    for name in ["total", *names]:
        s = sums[name]
        ee, er, rr = s["ee"], s["er"], s["rr"]  # per repeat: |e|^2, e.r, |r|^2
        executed = (ee + 2 * er + rr).clamp_min(0)  # |e + r|^2
        out[f"grad_error/rel_err/{name}"] = (ee.sqrt() / rr.sqrt().clamp_min(1e-300)).mean().item()
        cosine = (er + rr) / (executed * rr).sqrt().clamp_min(1e-300)
        out[f"grad_error/cosine/{name}"] = cosine.mean().item()
        if k > 1:
            scale = max(math.sqrt(float(s["mean_rr"])), 1e-300)
            noise = math.sqrt(float(s["spread"]) / (k - 1))  # sample spread of the errors around their mean
            out[f"grad_error/bias/{name}"] = math.sqrt(float(s["mean_ee"])) / scale
            out[f"grad_error/noise/{name}"] = noise / scale
            out[f"grad_error_se/bias/{name}"] = noise / math.sqrt(k) / scale
            out[f"grad_error_se/noise/{name}"] = noise / math.sqrt(2 * (k - 1)) / scale
    return out


def _sums(errors: list[torch.Tensor], references: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """One name's sums over its elements: per repeat ``ee``, ``er``, ``rr`` (tensors of K); with
    K > 1 also ``mean_ee``, ``mean_rr`` (squared norms of the mean error and mean reference) and
    ``spread`` (squared distances of the errors to their mean, summed over repeats)."""
    e, r = torch.stack([t.flatten() for t in errors]), torch.stack([t.flatten() for t in references])
    sums = {"ee": (e * e).sum(1), "er": (e * r).sum(1), "rr": (r * r).sum(1)}
    if len(e) > 1:
        mean_e, mean_r = e.mean(0), r.mean(0)
        sums |= {"mean_ee": mean_e @ mean_e, "mean_rr": mean_r @ mean_r, "spread": (e - mean_e).square().sum()}
    return sums
