"""The rounding state of one run: every rounding site, under the run's frozen ``NumericsSpec``.

A ``Site`` (``readback.numerics.site``) is one named tensor the run rounds (``layer0.attn.output``,
``layer0.mlp.up.weight``, ...): it owns the tensor's format and scaling state and draws from the
run's random streams (``readback.numerics.streams``). ``Numerics`` creates sites on first use and
advances them together at the end of each optimizer step. A run's spec, the ops' read rules
resolved, is ``readback.ops.numerics_spec``'s.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from readback.numerics import BF16, BlockQTensor, DelayedScalingState, FP8Format, QTensor
from readback.numerics.observations import Observations
from readback.numerics.scale_state import new_state
from readback.numerics.site import ScalingState, Site, UnitScale, check_scales
from readback.numerics.site_patterns import site_matches
from readback.numerics.spec import NumericsSpec
from readback.numerics.streams import RandomStreams

Record = tuple[str, dict[str, Any]]  # one op call on a tape: its name and what it executed


class Numerics:
    """The run's rounding state under a frozen ``NumericsSpec`` (``spec``): its sites, random
    streams, tape and statistics. Its modes change only through its own context managers
    (``using``, ``taping``, ``watching``, ``measuring``, ``replay``, ``isolated``)."""

    def __init__(self, spec: NumericsSpec, seed: int = 0):
        self._spec, self.seed = spec, seed
        self.step = 0
        self.sites: dict[str, Site] = {}
        self.saved_bytes: dict[str, int] = {}
        self._tape: list[Record] | None = None
        self._watched: dict[str, torch.Tensor] | None = None
        self.observations = Observations()  # the ops' mechanism statistics (readback.ops.mechanism)
        self._mechanism = False  # ops measure their mechanism statistics (readback.ops.mechanism)
        self.stream_salt = ""
        self.streams = RandomStreams(seed)
        self._replay: tuple[Iterator[Record], torch.dtype] | None = None  # (records, dtype) while replaying a tape

    @property
    def spec(self) -> NumericsSpec:
        return self._spec

    # The spec's settings, read-only, under the names the ops use.
    precision = property(lambda self: self._spec.precision.name)
    recipe = property(lambda self: self._spec.recipe)
    policy = property(lambda self: self._spec.policy)
    bwd_gemm_precision = property(lambda self: self._spec.bwd_gemm_precision)
    rounding = property(lambda self: self._spec.rounding)
    bf16_gemm = property(lambda self: self._spec.bf16_gemm)
    tape = property(lambda self: self._tape)
    watched = property(lambda self: self._watched)
    mechanism = property(lambda self: self._mechanism)

    def read(self, op: str, gradient: str) -> str:
        return self._spec.read(op, gradient)

    def linear_precision(self, gemm: str) -> str:
        """GEMM precision of a linear's ``fprop``, ``dgrad`` or ``wgrad``."""
        return self._spec.linear_precision(gemm)

    def linear_accumulation(self, gemm: str) -> str:
        """How a linear's ``fprop``, ``dgrad`` or ``wgrad`` FP8 GEMM accumulates."""
        return self._spec.linear_accumulation(gemm)

    def linear_gemm(self, gemm: str) -> tuple[str, str, str]:
        """``matmul``'s ``(precision, accumulation, bf16_gemm)`` for a linear's ``fprop``, ``dgrad`` or ``wgrad``."""
        return self._spec.linear_gemm(gemm)

    @contextlib.contextmanager
    def using(self, spec: NumericsSpec) -> Iterator[None]:
        """Run the block under ``spec`` (a bias-meter variant's backward); the run's own spec after."""
        saved, self._spec = self._spec, spec
        try:
            yield
        finally:
            self._spec = saved

    @contextlib.contextmanager
    def taping(self) -> Iterator[list[Record]]:
        """Record what every op executes in the block, on the list it yields (references replay it)."""
        self._tape = tape = list[Record]()
        try:
            yield tape
        finally:
            self._tape = None

    @contextlib.contextmanager
    def watching(self) -> Iterator[dict[str, torch.Tensor]]:
        """Keep the gradients of the ops' inputs (``watch``) in the block, in the dict it yields."""
        self._watched = watched = dict[str, torch.Tensor]()
        try:
            yield watched
        finally:
            self._watched = None

    @contextlib.contextmanager
    def measuring(self, on: bool = True) -> Iterator[None]:
        """The ops measure their mechanism statistics (``readback.ops.mechanism``) in the block when ``on``."""
        saved, self._mechanism = self._mechanism, on
        try:
            yield
        finally:
            self._mechanism = saved

    @property
    def dtype(self) -> torch.dtype:
        """Precision of everything that is not rounded (softmax, norms, row sums)."""
        if self._replay is not None:
            return self._replay[1]
        return torch.float64 if self.precision == "off" else torch.float32

    @property
    def replaying(self) -> bool:
        return self._replay is not None

    @contextlib.contextmanager
    def replay(self, tape: list[Record], dtype: torch.dtype = torch.float32) -> Iterator[None]:
        """Run the model as the reference: each op runs its plain-autograd ``replay`` with its
        roundings pinned to the records of ``tape`` (one executed forward), in ``dtype``."""
        self._replay = (iter(tape), dtype)
        try:
            yield
        finally:
            self._replay = None

    def next_record(self, name: str) -> dict[str, Any]:
        """The executed forward's record of op call ``name``, in call order."""
        if self._replay is None:
            raise RuntimeError(f"{name}: no tape is being replayed")
        site, record = next(self._replay[0])
        if site != name:
            raise RuntimeError(f"replay out of order: tape has {site!r}, model called {name!r}")
        return record

    def watch(self, name: str, **tensors: torch.Tensor) -> None:
        """Keep the gradients of an op's inputs (e.g. attention dQ/dK/dV) inside ``watching``."""
        if self._watched is not None:
            for key, tensor in tensors.items():
                if tensor.requires_grad:
                    tensor.retain_grad()
                    self._watched[f"{name}.d{key}"] = tensor

    @contextlib.contextmanager
    def isolated(self, stream_salt: str = "") -> Iterator[None]:
        """Run extra executions (probes) without moving the run: scaling states, sites,
        random streams and observations are restored on exit. ``stream_salt`` gives the
        executions inside their own random streams, from the start of the step (an empty salt
        reuses the step's own)."""
        state, names, salt, streams = self.state_dict(), set(self.sites), self.stream_salt, self.streams.snapshot()
        pending = [  # the step's amaxes so far (a checkpoint, taken between steps, has none)
            (site.state, site.state.pending_amax.clone())
            for site in self.sites.values()
            if isinstance(site.state, DelayedScalingState)
        ]
        self.stream_salt = stream_salt
        self.streams.reseed(self.step, stream_salt)
        try:
            yield
        finally:
            for name in set(self.sites) - names:
                del self.sites[name]
            self.stream_salt = salt
            self.load_state_dict(state)
            self.streams.restore(streams)
            for scaling, amax in pending:
                scaling.pending_amax.copy_(amax)

    def site(self, name: str, direction: str = "fwd") -> Site:
        """The site ``name``; ``direction`` ``fwd`` (activations, weights) or ``bwd`` (gradients)
        picks the format of its recipe (``NumericsSpec.recipe_for``) on first use."""
        if name not in self.sites:
            fmt: FP8Format | None
            state: ScalingState
            if self.precision == "off":
                fmt, state = None, UnitScale()
            elif self._spec.is_bf16_site(name):
                fmt, state = BF16, UnitScale()
            else:
                recipe = self._spec.recipe_for(name)  # the attention core's own recipe at its sites, if any
                fmt = recipe.fp8_format.fwd if direction == "fwd" else recipe.fp8_format.bwd
                state = new_state(recipe, fmt)
            margin = sum(k for pattern, k in self._spec.site_margin if site_matches(name, pattern))
            self.sites[name] = Site(self.streams, name, direction, fmt, state, margin if fmt not in (None, BF16) else 0)
        return self.sites[name]

    def random_stream(self, site: str, stream: str, device: torch.device) -> torch.Tensor:
        """The random stream (site, stream) of this step, as a generator state that each draw
        advances (``readback.numerics.streams``)."""
        return self.streams.state(site, stream, device)

    def account(self, op: str, **saved: torch.Tensor | QTensor | BlockQTensor | None) -> None:
        """Add the bytes an op saved for its backward, per saved tensor, to ``saved_bytes``.

        Eager executions only: a compiled graph that read the running count would be
        specialised on its value and compiled again at every step."""
        if torch.compiler.is_compiling():
            return
        for name, tensor in saved.items():
            if tensor is not None:
                nbytes = tensor.numel() * tensor.element_size() if isinstance(tensor, torch.Tensor) else tensor.nbytes
                key = f"{op}.{name}"
                self.saved_bytes[key] = self.saved_bytes.get(key, 0) + nbytes

    def record(self, site: str, **tensors: Any) -> None:
        """Keep what an op executed inside ``taping`` (references and probes replay it)."""
        if self._tape is not None:
            self._tape.append((site, tensors))

    def saturation_counts(self) -> dict[str, int]:
        """Elements saturated to the format's max at each FP8 site since the last call: a run
        that diverges from FP8 overflow shows it here first."""
        counts = {name: int(site.saturated) for name, site in self.sites.items()}
        for site in self.sites.values():
            site.saturated.zero_()
        return {name: n for name, n in counts.items() if n}

    def underflow_fractions(self) -> dict[str, float]:
        """Fraction of the nonzero elements that each FP8 site rounded to zero or to a subnormal
        since the last call: how much of a tensor a too small scale (a margin, an amax set by
        rare outliers) pushes off the format's normal range."""
        fractions = {
            name: float(site.underflowed) / float(site.nonzero)
            for name, site in self.sites.items()
            if float(site.nonzero) > 0
        }
        for site in self.sites.values():
            site.underflowed.zero_()
            site.nonzero.zero_()
        return fractions

    def check_scales(self) -> None:
        """``NumericsError`` for the sites whose own scale was unusable since the last call."""
        check_scales(self.sites, self.step + 1)

    def observe(self, key: str, values: torch.Tensor) -> None:
        self.observations.observe(key, values)

    def observe_moments(self, key: str, moments: torch.Tensor) -> None:
        self.observations.observe_moments(key, moments)

    def observe_max(self, key: str, value: torch.Tensor) -> None:
        self.observations.observe_max(key, value)

    def pop_observations(self) -> dict[str, float]:
        return self.observations.pop()

    def end_step(self) -> None:
        """After the optimizer step: update every scaling state (an ``amax_spike`` due at this
        step first), start the next step's streams.

        With several processes the step's amaxes are first reduced (max) over all of them, as
        Transformer Engine does, so every rank keeps the same scales as one process would.
        """
        delayed = [site.state for site in self.sites.values() if isinstance(site.state, DelayedScalingState)]
        if delayed and torch.distributed.is_available() and torch.distributed.is_initialized():
            amaxes = torch.stack([state.pending_amax for state in delayed])
            torch.distributed.all_reduce(amaxes, op=torch.distributed.ReduceOp.MAX)
            for state, amax in zip(delayed, amaxes):
                state.pending_amax.copy_(amax)
        if self._spec.amax_spike is not None:  # into the step's amax, before it is written
            self._spec.amax_spike.inject(self.sites, self.step)
        for site in self.sites.values():
            site.state.end_step()
        self.step += 1
        self.streams.reseed(self.step, self.stream_salt)

    def state_dict(self) -> dict[str, Any]:
        """Step, scaling states, and what was counted or observed since the last log record
        (so a resume between two records logs what the uninterrupted run would have)."""
        sites = {
            name: {
                "direction": s.direction,
                "state": s.state.state_dict(),
                "saturated": s.saturated.clone(),
                "underflow": (s.underflowed.clone(), s.nonzero.clone()),
            }
            for name, s in self.sites.items()
        }
        return {"step": self.step, "sites": sites, **self.observations.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = state["step"]
        self.streams.reseed(self.step, self.stream_salt)
        for name, saved in state["sites"].items():
            site = self.site(name, saved["direction"])
            site.state.load_state_dict(saved["state"])
            site.saturated.fill_(saved.get("saturated", 0))
            for counter, value in zip((site.underflowed, site.nonzero), saved.get("underflow", (0, 0))):
                counter.fill_(value)
        self.observations.load_state_dict(state)
