"""Models the audit ships with: readback's FOG (its executed FP8 forward), a Hugging Face
``transformers`` Llama from a tiny config (no download) and a torchao float8-training MLP
(emulated, CPU). Each returns ``(model, loss_fn)``; ``loss_fn()`` runs one forward."""

from __future__ import annotations

import importlib.util
from collections.abc import Callable

import torch


def missing(package: str) -> str | None:
    """Why an example cannot run here, or None."""
    if importlib.util.find_spec(package) is None:
        return f"{package} is not installed (pip install 'readback[audit]')"
    return None


def fog_loss(model, inputs: torch.Tensor, targets: torch.Tensor, dtype=torch.float64):
    """The FOG's executed forward as a plain-autograd graph: the forward runs once with its FP8
    roundings (taped, run state restored), and ``loss_fn`` replays it with every rounding pinned,
    so its saved tensors are exactly what the reference gradient needs."""
    numerics = model.numerics
    with numerics.isolated("/audit"), torch.no_grad(), numerics.taping() as tape:
        model(inputs, targets)

    def loss_fn():
        with numerics.replay(tape, dtype):
            return model(inputs, targets)

    return loss_fn


# conf/model/tiny.yaml narrowed: 2 layers of width 32, 2 heads, sequences of 16 tokens of a 64-token
# vocabulary, which the synthetic data's matches (nothing is read from it); the tests' tiny FOG too.
TINY_FOG = (
    "data=synthetic",
    "data.vocab_size=64",
    "model.vocab_size=64",
    "model.seq_len=16",
    "model.d_model=32",
    "model.n_heads=2",
    "model.n_kv_groups=1",
    "model.ffn_dim=48",
)

# A model and its loss closure.
Example = tuple[torch.nn.Module, Callable[[], torch.Tensor]]


def fog_example(policy: str = "exact", seed: int = 0, *overrides: str) -> Example:
    from hydra import compose, initialize_config_dir

    from readback.backends import build_model
    from readback.config import CONF_DIR, typed

    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        composed = compose(
            "train",
            overrides=[
                f"policy={policy}",
                *TINY_FOG,
                "precision.recipe=current",
                "precision.bf16_layers=[]",
                *overrides,
            ],
        )
    cfg = typed(composed)
    torch.manual_seed(seed)
    model = build_model(cfg)
    idx = torch.randint(0, 64, (2, 17), generator=torch.Generator().manual_seed(seed))
    inputs, targets = idx[:, :-1], idx[:, 1:]
    # A current-scaling attention scales P and dS by a one-step delayed recipe (TE's): one step on
    # this batch, weights untouched, gives them this batch's own amax, as every other site has.
    model(inputs, targets).backward()
    model.zero_grad(set_to_none=True)
    model.numerics.end_step()
    return model, fog_loss(model, inputs, targets)


def hf_example(seed: int = 0) -> Example:
    """A 2-layer Llama (GQA, RoPE, RMSNorm, SwiGLU) from a tiny config, eager attention (so the
    softmax is an autograd op whose saved output the audit sees)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=32,
        attn_implementation="eager",  # type: ignore[call-arg]  # PretrainedConfig reads it; the signature omits it
    )
    model = LlamaForCausalLM(config)
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(seed))
    return model, lambda: model(input_ids=ids, labels=ids).loss


def torchao_example(seed: int = 0) -> Example:
    """A two-linear MLP converted by torchao's ``convert_to_float8_training`` (tensorwise
    scaling, ``emulate=True``): the rows show which value its linear backward reads."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(32, 64, bias=False), torch.nn.GELU(), torch.nn.Linear(64, 32, bias=False)
    )
    convert_to_float8_training(model, config=Float8LinearConfig(emulate=True))
    x = torch.randn(16, 32, generator=torch.Generator().manual_seed(seed))
    return model, lambda: model(x).pow(2).mean()


EXAMPLES: dict[str, tuple[Callable[..., Example], str | None]] = {
    "fog": (fog_example, None),
    "hf": (hf_example, "transformers"),
    "torchao": (torchao_example, "torchao"),
}
