"""``model=hf``: a Hugging Face ``transformers`` causal LM, built from a small config (nothing is
downloaded), converted by ``readback.convert`` and trained by readback's trainer.

``HFCausalLM`` gives the trainer and the probe what they use of FOG: ``model(idx, targets)``
returns the mean next-token loss, ``model.numerics`` holds the run's rounding sites, ``layers``
are its blocks, ``n_params`` and ``flops_per_token`` size the run. transformers is an optional
extra (``.[hf]``).
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from omegaconf import MISSING

from readback.backends.convert import ConvertReport, convert
from readback.backends.emulated import READBACK_SITES, attention_reads
from readback.backends.settings import ModelSettings
from readback.errors import ConfigError
from readback.fields import one_of
from readback.model.fog import Linear
from readback.model.settings import Model
from readback.numerics.state import Numerics
from readback.ops import numerics_spec

UNAVAILABLE = "needs transformers (pip install -e .[hf]); use model=tiny for readback's FOG"


def check_available() -> None:
    """Raise the one-line ``ConfigError`` unless transformers can be imported."""
    if importlib.util.find_spec("transformers") is None:
        raise ConfigError("model", "hf", UNAVAILABLE)


@dataclass
class HfModel(Model):
    """``model=hf``: a transformers causal LM of these sizes, converted by ``readback.convert``."""

    architecture: str = one_of(("llama",))
    filter: list[str] = MISSING  # module-name patterns left in high precision

    def check(self) -> None:
        super().check()
        check_available()


def hf_model(cfg: ModelSettings) -> HfModel:
    """The ``model`` group of a ``model=hf`` run."""
    if not isinstance(cfg.model, HfModel):
        raise TypeError(f"model={cfg.model.name} is not a transformers model (model=hf)")
    return cfg.model


class HFCausalLM(nn.Module):
    """A converted transformers causal LM with FOG's interface; ``report`` says what was swapped."""

    def __init__(self, lm: nn.Module, report: ConvertReport, seq_len: int):
        super().__init__()
        self.report, self.numerics, self.seq_len = report, report.numerics, seq_len
        self.lm: Any = lm  # a transformers causal LM: its .model.layers and .config are read

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean next-token cross-entropy (FP32) of ``idx`` against ``targets``, both (B, T)."""
        logits = self.lm(input_ids=idx).logits
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())

    @property
    def layers(self) -> nn.ModuleList:
        """The decoder blocks (what FSDP shards, what the activation statistics hook)."""
        return self.lm.model.layers

    def n_params(self) -> int:
        return sum(p.numel() for p in self.parameters() if p.requires_grad)

    def flops_per_token(self) -> float:
        """6 per GEMM weight (every linear, the LM head included) plus the causal attention
        products, as FOG counts them."""
        c = self.lm.config
        modules: list[Any] = list(self.lm.modules())
        linears = [m for m in modules if isinstance(m, Linear) or hasattr(m, "in_features")]  # TE's too
        gemm_weights = sum(m.weight.numel() for m in linears)
        return 6 * gemm_weights + 6 * c.num_hidden_layers * self.seq_len * c.hidden_size


# Llama's name for each of the ``Sizes`` (a size without one is a KeyError, not a size left out).
LLAMA_NAMES = {
    "n_layers": "num_hidden_layers",
    "d_model": "hidden_size",
    "n_heads": "num_attention_heads",
    "n_kv_groups": "num_key_value_heads",
    "ffn_dim": "intermediate_size",
    "vocab_size": "vocab_size",
    "seq_len": "max_position_embeddings",
}


def llama(m: HfModel) -> nn.Module:
    """A Llama-style causal LM of the ``model`` group's sizes, randomly initialised."""
    from transformers import LlamaConfig, LlamaForCausalLM

    assert m.vocab_size is not None, "train.contract.with_vocabulary resolves it before a model is built"
    config = LlamaConfig(
        **{LLAMA_NAMES[size]: value for size, value in m.sizes().items()},
        tie_word_embeddings=m.tied,
        attn_implementation="sdpa",  # type: ignore[call-arg]  # PretrainedConfig reads it; the signature omits it
        use_cache=False,
    )
    return LlamaForCausalLM(config)


def build_hf_model(cfg: ModelSettings, device: str | torch.device = "cpu") -> HFCausalLM:
    """The ``cfg.model`` transformers LM on ``device``, converted with the run's precision,
    policy and backend; ``cfg.model.filter`` names the modules left in high precision."""
    check_available()
    m = hf_model(cfg)
    with torch.device(device):
        lm = llama(m)
    numerics = Numerics(numerics_spec(cfg.numerics), seed=cfg.seed)
    try:
        report = convert(lm, numerics, backend=cfg.backend.name, filter=tuple(m.filter))
    except ConfigError as error:
        if error.key != "filter":
            raise
        raise ConfigError("model.filter", error.value, error.valid) from None  # the run's key for it
    return HFCausalLM(lm, report, m.seq_len)


def site_implementations(cfg: ModelSettings) -> dict[str, str]:
    """``{site: implementation}`` of a ``model=hf`` run, for the run's summary."""
    m = hf_model(cfg)
    if cfg.backend.name == "te":
        sites = {
            "linear": "transformer_engine.pytorch.Linear",
            "norm": "transformer_engine.pytorch.RMSNorm",
            "attention_core": "torch SDPA",
        }
        reads: dict[str, str] = {}
    else:
        sites = {
            "linear": READBACK_SITES["linear"],
            "norm": READBACK_SITES["norm"],
            "attention_core": READBACK_SITES["attention_core"] + " (routed SDPA)",
            "embedding": "torch.nn.Embedding",
        }
        reads = attention_reads(cfg.numerics)
    return {"model": f"transformers {m.architecture}", **sites, "left_in_high_precision": ", ".join(m.filter), **reads}
