"""What the trainer needs from a model, its numerics and its data, and the builders that make them.

The contract is structural (``typing.Protocol``): the FOG of :mod:`readback.model`, the
Transformer Engine FOG of :mod:`readback.backends.te` and a test's toy model all satisfy it
without inheriting from anything. :func:`check_model` checks a built model once, so a missing
member is one clear error at build time instead of a silent skip in the loop.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Protocol, cast

import torch

from readback.data.settings import Data
from readback.data.stream import Layout
from readback.progress import shown
from readback.train.settings import Config


class RunNumerics(Protocol):
    """The model's rounding state: scaling states, random streams, counters not yet logged."""

    def end_step(self) -> None: ...
    def check_scales(self) -> None: ...  # raises readback.errors.NumericsError: the run fails
    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, state: dict[str, Any]) -> None: ...
    def isolated(self) -> AbstractContextManager[Any]: ...
    def measuring(self, on: bool = True) -> AbstractContextManager[Any]: ...  # readback.ops.mechanism

    @property
    def sites(self) -> Mapping[str, object]: ...  # the rounding sites created so far, by name

    def saturation_counts(self) -> dict[str, int]: ...
    def underflow_fractions(self) -> dict[str, float]: ...
    def pop_observations(self) -> dict[str, float]: ...


class TrainableModel(Protocol):
    """An ``nn.Module`` whose ``model(idx, targets)`` is the mean loss, with its numerics, its
    size, and its blocks (FSDP shards each one; ``readback.model.ActivationStats`` hooks them)."""

    @property
    def numerics(self) -> RunNumerics: ...
    @property
    def layers(self) -> torch.nn.ModuleList: ...
    def __call__(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor: ...
    def n_params(self) -> int: ...
    def flops_per_token(self) -> float: ...


class TrainableModule(torch.nn.Module, TrainableModel):
    """The type of what :func:`check_model` returns: an ``nn.Module`` that satisfies
    :class:`TrainableModel` (for annotations; models need not inherit from it)."""


class DataStream(Protocol):
    """Training batches of this rank, the validation batches (the same on every rank), a position."""

    vocab_size: int

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]: ...
    def val_batches(self, n: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]: ...
    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, state: dict[str, Any]) -> None: ...


def _default_model(cfg: Config, device: str) -> TrainableModel:
    from readback.backends import build_model

    return build_model(cfg, device)


def _default_data(cfg_data: Data, layout: Layout) -> DataStream:
    from readback.data import build_data

    return build_data(cfg_data, layout)


@dataclass(frozen=True)
class Builders:
    """``model(cfg, device)`` and ``data(cfg.data, layout)``."""

    model: Callable[[Config, str], TrainableModel] = _default_model
    data: Callable[[Data, Layout], DataStream] = _default_data

    def stream(self, cfg: Config, *, rank: int, world_size: int) -> DataStream:
        """This rank's data stream (``with_vocabulary`` gives a config its vocabulary); what it
        tokenises shows progress unless ``trainer.progress=false``."""
        with shown(cfg.trainer.progress):
            return self.data(cfg.data, cfg.layout(rank=rank, world_size=world_size))


def with_vocabulary(cfg: Config, stream: DataStream) -> Config:
    """``cfg`` with ``model.vocab_size: null`` resolved to the stream's vocabulary, as a new
    config: the run's own is never written."""
    if cfg.model.vocab_size is not None:
        return cfg
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, vocab_size=stream.vocab_size))


def protocol_members(protocol: type) -> dict[str, bool]:
    """The public members ``protocol`` declares, each with whether it is a method (to be called)
    rather than a property or attribute."""
    declared = {name: callable(value) for name, value in vars(protocol).items() if not name.startswith("_")}
    return {**dict.fromkeys(vars(protocol).get("__annotations__", {}), False), **declared}


def lacking(obj: object, protocol: type) -> list[str]:
    """The members of ``protocol`` that ``obj`` lacks, each looked up as the trainer will use it.

    Not ``isinstance`` against a runtime-checkable Protocol: since Python 3.12 that looks members
    up with ``inspect.getattr_static``, which misses what ``nn.Module`` keeps in ``_modules``,
    ``_parameters`` and ``_buffers`` (a model's ``layers``), so every real model would fail it."""
    missing = []
    for name, is_method in protocol_members(protocol).items():
        try:
            value = getattr(obj, name)
        except AttributeError:
            missing.append(name)
            continue
        if is_method and not callable(value):
            missing.append(name)
    return missing


def check_model(model: object) -> TrainableModule:
    """``model`` itself, or a ``TypeError`` naming what it lacks when it is not an ``nn.Module``
    satisfying :class:`TrainableModel` (with :class:`RunNumerics`)."""
    name = type(model).__name__
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"{name} is not an nn.Module, which readback.train.contract.TrainableModel needs")
    missing = lacking(model, TrainableModel)
    if not missing:
        missing = [f"numerics.{member}" for member in lacking(model.numerics, RunNumerics)]
    if missing:
        raise TypeError(
            f"{name} does not satisfy readback.train.contract.TrainableModel: it lacks {', '.join(missing)}"
        )
    return cast(TrainableModule, model)
