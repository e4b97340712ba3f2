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

DTYPES = {"fp32": torch.float32, "fp64": torch.float64}


@dataclass
class GradientProbe:
    """Config group ``probe``: ``every`` (steps, 0 = off), ``repeats``, ``dtype``, ``params``
    (glob patterns over parameter and site names)."""

    every: int = 0
    repeats: int = 1
    dtype: str = "fp32"
    params: tuple[str, ...] = ("*",)

    @classmethod
    def from_config(cls, cfg) -> GradientProbe:
        """From the ``probe`` config group; off when absent."""
        if cfg is None:
            return cls()
        return cls(every=cfg.every, repeats=cfg.repeats, dtype=cfg.dtype, params=tuple(cfg.params))

    def due(self, step: int) -> bool:
        return self.every > 0 and step % self.every == 0

    def measure(self, model, inputs: torch.Tensor, targets: torch.Tensor) -> dict[str, float]:
        """Error statistics of one batch, logged as ``grad_error/<stat>/<name>``.

        Leaves the model, its gradients, its numerics (scales, histories, random streams) and
        every global random state as they were. Repeat 0 uses the step's own random streams.
        """
        numerics = model.numerics
        params = {n: p for n, p in model.named_parameters() if p.requires_grad}
        saved_grads = {n: p.grad for n, p in params.items()}
        errors, references = [], []
        try:
            for repeat in range(self.repeats):
                with numerics.isolated(stream_salt="" if repeat == 0 else f"/probe{repeat}"):
                    executed, reference = self._gradients(model, params, inputs, targets)
                keep = [n for n in reference if any(fnmatch.fnmatch(n, pat) for pat in self.params)]
                errors.append({n: executed[n] - reference[n] for n in keep})
                references.append({n: reference[n] for n in keep})
        finally:
            for n, p in params.items():
                p.grad = saved_grads[n]
        return compare(errors, references)

    def _gradients(self, model, params, inputs, targets):
        """(executed, reference) gradients by name: parameters, and watched op inputs."""
        numerics = model.numerics
        for p in params.values():
            p.grad = None
        numerics.watched = {}
        try:
            _, tape = taped_backward(model, inputs, targets)
            executed = {n: p.grad for n, p in params.items() if p.grad is not None}
            executed |= {n: t.grad for n, t in numerics.watched.items()}
            numerics.watched = {}
            reference = reference_gradients(
                model, {n: params[n] for n in executed if n in params}, tape, inputs, targets, DTYPES[self.dtype]
            )
        finally:
            numerics.watched = None
        return {n: executed[n].detach().double() for n in reference}, reference


def taped_backward(model, inputs: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, list]:
    """One training forward and backward (gradients into ``.grad``), recording the executed
    forward's tape: ``(loss, tape)``."""
    numerics = model.numerics
    numerics.tape = []
    try:
        loss = model(inputs, targets)
        loss.backward()
        return loss.detach(), numerics.tape
    finally:
        numerics.tape = None


def reference_gradients(model, params: dict, tape: list, inputs, targets, dtype=torch.float32) -> dict:
    """Plain autograd over the replay of ``tape`` (every rounding pinned to the executed bits),
    by name: the parameters in ``params``, and the op inputs in ``numerics.watched`` when on."""
    numerics = model.numerics
    with numerics.replay(tape, dtype):
        loss = model(inputs, targets)
        leaves = {**params, **(numerics.watched or {})}
        grads = torch.autograd.grad(loss, list(leaves.values()), allow_unused=True)
    return {n: g.detach().double() for n, g in zip(leaves, grads) if g is not None}


def compare(errors: list[dict[str, torch.Tensor]], references: list[dict[str, torch.Tensor]]) -> dict[str, float]:
    """``grad_error/{rel_err,cosine}/<name>`` averaged over repeats, and with two or more
    repeats ``grad_error/{bias,noise}/<name>`` with their standard errors under
    ``grad_error_se/{bias,noise}/<name>``. ``total`` is every name's vector concatenated."""
    names = list(errors[0])

    def flat(d: dict[str, torch.Tensor]) -> torch.Tensor:
        return torch.cat([d[n].flatten() for n in names])

    errors = [{**e, "total": flat(e)} for e in errors]
    references = [{**r, "total": flat(r)} for r in references]
    k = len(errors)
    out = {}
    for name in ["total", *names]:
        e = torch.stack([x[name].flatten() for x in errors])
        r = torch.stack([x[name].flatten() for x in references])
        executed = e + r
        r_norm = r.norm(dim=1).clamp_min(1e-300)
        out[f"grad_error/rel_err/{name}"] = (e.norm(dim=1) / r_norm).mean().item()
        cosine = torch.nn.functional.cosine_similarity(executed, r, dim=1, eps=1e-300)
        out[f"grad_error/cosine/{name}"] = cosine.mean().item()
        if k > 1:
            scale = r.mean(0).norm().clamp_min(1e-300).item()
            mean_error = e.mean(0)
            spread = (e - mean_error).pow(2).sum(1)  # per repeat, squared distance to the mean error
            noise = math.sqrt(spread.sum().item() / (k - 1))
            out[f"grad_error/bias/{name}"] = mean_error.norm().item() / scale
            out[f"grad_error/noise/{name}"] = noise / scale
            out[f"grad_error_se/bias/{name}"] = noise / math.sqrt(k) / scale
            out[f"grad_error_se/noise/{name}"] = noise / math.sqrt(2 * (k - 1)) / scale
    return out
