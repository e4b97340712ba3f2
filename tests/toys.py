"""Toy stand-ins shared by the tests, imported by name (``pyproject.toml`` puts ``tests/`` on the path).

A toy model and data stream that satisfy the trainer's contract (``readback.train.contract``:
``TrainableModel``, ``RunNumerics``, ``DataStream``), handed to ``readback.train.run`` as its
builders; ``make_cfg`` gives them the real typed config at toy sizes, ``compose`` the real
composed ``train`` config (Hydra) with overrides and ``config`` the same, typed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import math
from pathlib import Path

import torch
import torch.nn.functional as F
from hydra import compose as hydra_compose
from hydra import initialize_config_dir
from omegaconf import DictConfig
from torch import nn

from readback.config import CONF_DIR, typed
from readback.data.settings import Data
from readback.data.stream import Layout
from readback.numerics.spec import NumericsSpec
from readback.ops import read_rules
from readback.probe import GradientProbe
from readback.train import Builders, run
from readback.train.settings import Config

REPO = Path(__file__).resolve().parents[1]
CONF = CONF_DIR
# The study's experiments (conf/experiment/*.yaml).
ALL_EXPERIMENTS = sorted(p.stem for p in (CONF / "experiment").glob("*.yaml"))
# The toy FOG's width and batch in a real training run (the tests add depth, steps and data).
TOY_RUN = (
    "model.d_model=32",
    "model.n_heads=2",
    "model.n_kv_groups=1",
    "model.ffn_dim=64",
    "model.seq_len=32",
    "model.global_batch=4",
    "trainer.micro_batch=2",
)
# A whole train.py run of two steps (one layer, synthetic data, no logger, validated at the end).
TWO_STEP_RUN = (
    "data=synthetic",
    "logger=none",
    "trainer.progress=false",
    "model.n_layers=1",
    *TOY_RUN,
    "trainer.steps=2",
    "trainer.log_every=1",
    "trainer.eval_every=2",
    "trainer.eval_batches=1",
)


def compose(*overrides: str, **kwargs) -> DictConfig:
    """``conf/train.yaml`` composed with ``overrides``, as ``train.py`` would (not validated)."""
    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        return hydra_compose("train", overrides=list(overrides), **kwargs)


def config(*overrides: str) -> Config:
    """``compose(*overrides)`` as the typed config the components take (what this machine has is
    not checked: ``backend=te`` plans compose here too)."""
    return typed(compose(*overrides))


def train_on_one_batch(model, idx: torch.Tensor, steps: int, lr: float = 3e-3) -> list[float]:
    """``steps`` AdamW steps of ``model`` on the batch ``idx`` (next-token targets), each ended as
    the trainer ends it (``numerics.end_step``); the losses."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    losses = []
    for _ in range(steps):
        loss = model(idx, idx.roll(-1, 1))
        loss.backward()
        opt.step()
        opt.zero_grad()
        model.numerics.end_step()
        losses.append(loss.item())
    return losses


def probe(**settings) -> GradientProbe:
    """The gradient probe of ``conf/probe/default.yaml`` with ``settings`` changed, e.g. ``every=1``."""
    return GradientProbe(dataclasses.replace(config().probe, **settings))


def load_data_cfg(name: str, **overrides) -> Data:
    """The typed ``data`` group of ``conf/data/<name>.yaml`` with ``overrides`` (its keys) set."""
    return dataclasses.replace(config(f"data={name}").data, **overrides)


class ToyNumerics:
    """Step counter, plus state that forwards in eval mode change and that feeds back into the
    loss (like amax histories and random streams): evaluation must not leak into training."""

    def __init__(self) -> None:
        self.step = 0
        self.eval_forwards = 0
        self.sites: dict[str, object] = {}  # no rounding sites

    def end_step(self) -> None:
        self.step += 1

    def check_scales(self) -> None:
        pass  # no scales

    def measuring(self, on: bool = True) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()  # no mechanism to measure

    def state_dict(self) -> dict:
        return {"step": self.step, "eval_forwards": self.eval_forwards}

    def load_state_dict(self, state: dict) -> None:
        self.step = int(state["step"])
        self.eval_forwards = int(state["eval_forwards"])

    def saturation_counts(self) -> dict[str, int]:
        return {"toy.out": self.step % 3}

    def underflow_fractions(self) -> dict[str, float]:
        return {"toy.out": 0.0}

    def pop_observations(self) -> dict[str, float]:
        return {}

    @contextlib.contextmanager
    def isolated(self):
        """Like ``Numerics.isolated``: whatever happens inside is undone on exit."""
        state = self.state_dict()
        try:
            yield
        finally:
            self.load_state_dict(state)


class ToyModel(nn.Module):
    """Embedding -> gated residual MLP -> head. Deterministic, tiny, with a 1-D gain, a frozen
    1-D parameter and switches that poison the loss or one gradient at a chosen step."""

    def __init__(self, vocab: int, d: int = 16, nan_loss_at: int | None = None, nan_grad_at: int | None = None):
        super().__init__()
        self.vocab = vocab
        self.emb = nn.Embedding(vocab, d)
        self.gain = nn.Parameter(torch.ones(d))
        self.frozen = nn.Parameter(torch.ones(d), requires_grad=False)
        self.fc = nn.Linear(d, d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.numerics = ToyNumerics()
        self.nan_loss_at, self.nan_grad_at = nan_loss_at, nan_grad_at
        self.layers = nn.ModuleList([nn.Module()])  # layers.0.attn.core: watched by the stats hooks
        self.layers[0].attn = nn.Module()
        self.layers[0].attn.core = nn.Identity()

    def _this_step(self) -> int:
        return self.numerics.step + 1

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        gain = self.gain
        if self.training and self.nan_grad_at == self._this_step():
            gain = gain + 0.0
            gain.register_hook(lambda g: torch.full_like(g, math.nan))
        h = self.emb(idx)
        if self.training:  # a leak of evaluation state into training would change the loss
            h = h * (1.0 + 0.01 * self.numerics.eval_forwards)
        else:
            self.numerics.eval_forwards += 1
        h = h + torch.tanh(self.fc(h * gain * self.frozen))
        h = self.layers[0].attn.core(h)
        loss = F.cross_entropy(self.head(h).flatten(0, 1), targets.flatten())
        if self.training and self.nan_loss_at == self._this_step():
            loss = loss * math.nan
        return loss

    def n_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def flops_per_token(self) -> float:
        return 6.0 * self.n_params()


class ToyStream:
    """Sequences ``start, start+k, start+2k, ... (mod vocab)``, ``k`` in 1..3, one per global index;
    rank ``r`` takes its share of every global batch (like the real stream)."""

    def __init__(self, vocab: int, layout: Layout, crash_at_call: int | None = None):
        self.vocab_size, self.layout = vocab, layout
        self.tokens_per_batch = layout.tokens_per_batch
        self.consumed = 0
        self.calls = 0
        self.crash_at_call = crash_at_call

    def _seq(self, index: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(self.layout.seed * 1_000_003 + index)
        start = int(torch.randint(0, self.vocab_size, (1,), generator=g))
        k = int(torch.randint(1, 4, (1,), generator=g))
        return (start + k * torch.arange(self.layout.seq_len + 1)) % self.vocab_size

    def _batch(self, first: int) -> tuple[torch.Tensor, torch.Tensor]:
        seqs = torch.stack([self._seq(first + j) for j in range(self.layout.micro_batch)])
        return seqs[:, :-1].contiguous(), seqs[:, 1:].contiguous()

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.crash_at_call is not None and self.calls == self.crash_at_call:
            raise RuntimeError("simulated crash")
        self.calls += 1
        batch = self._batch(self.consumed + self.layout.rank * self.layout.micro_batch)
        self.consumed += self.layout.micro_batch * self.layout.world_size
        return batch

    def val_batches(self, n: int):
        for i in range(n):
            yield self._batch(10**6 + i * self.layout.micro_batch)

    def state_dict(self) -> dict:
        return {"consumed": self.consumed}

    def load_state_dict(self, state: dict) -> None:
        self.consumed = int(state["consumed"])


BUILT: list[ToyModel] = []


def toy_build_model(cfg, device, nan_loss_at=None, nan_grad_at=None):
    m = cfg.model
    with torch.device(device):
        model = ToyModel(m.vocab_size, m.d_model, nan_loss_at, nan_grad_at)
    BUILT.append(model)
    return model


def toy_build_data(cfg_data, layout: Layout, crash_at_call=None, forbid_build=False):
    if forbid_build:
        raise AssertionError("build_data must not be called")
    return ToyStream(cfg_data.vocab_size, layout, crash_at_call)


TOYS = Builders(model=toy_build_model, data=toy_build_data)


def toy_builders(*, nan_loss_at=None, nan_grad_at=None, crash_at_call=None, forbid_build=False) -> Builders:
    """The toy builders, with a fault planted: a NaN loss or gradient at a step, a data crash."""
    return Builders(
        model=functools.partial(toy_build_model, nan_loss_at=nan_loss_at, nan_grad_at=nan_grad_at),
        data=functools.partial(toy_build_data, crash_at_call=crash_at_call, forbid_build=forbid_build),
    )


def train(cfg, run_dir, **faults):
    """``readback.train.run`` with the toy builders (``faults``: see :func:`toy_builders`)."""
    return run(cfg, run_dir, toy_builders(**faults))


# The toy trainer's sizes: its model reads vocab_size and d_model; n_layers, n_heads and ffn_dim
# size its activations in the memory estimate.
TOY_TRAINER = {
    "seed": 3,
    "model.seq_len": 8,
    "model.global_batch": 8,
    "model.lr": 3e-2,
    "model.vocab_size": None,
    "model.d_model": 16,
    "model.n_layers": 1,
    "model.n_heads": 1,
    "model.n_kv_groups": 1,
    "model.ffn_dim": 16,
    "data.vocab_size": 24,
    "trainer.steps": 12,
    "trainer.micro_batch": 2,
    "trainer.log_every": 2,
    "trainer.eval_every": 4,
    "trainer.eval_batches": 2,
    "trainer.ckpt_every": 4,
    "trainer.keep_last": 2,
    "trainer.progress": False,
    "trainer.device": "cpu",
    "trainer.optim.warmup_steps": 3,
}


def make_cfg(logger: str = "none", **settings) -> Config:
    """The real typed config (synthetic data, no logger) at the toy trainer's sizes, with
    ``settings`` (dotted keys) on top."""
    values = {**TOY_TRAINER, **settings}
    return config("data=synthetic", f"logger={logger}", *(f"{k}={json.dumps(v)}" for k, v in values.items()))


# A test-only declaration: the softmax backward reads the FP8 copy P8 instead of the original P.
PLANTED_READS = {**read_rules("exact"), "attention": {**read_rules("exact")["attention"], "dS": "rounded"}}


def planted_spec(spec: NumericsSpec) -> NumericsSpec:
    """``spec`` reading as ``PLANTED_READS`` says, labelled ``planted``."""
    return spec.with_reads("planted", PLANTED_READS)
