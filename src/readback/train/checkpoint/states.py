"""The state a checkpoint holds beside the run's own components, as torch's ``Stateful``: the model
and the optimizer (sharded as this rank holds them, loaded into any sharding) and this process's
random generators; :func:`to_cpu`, what a blob is packed from."""

from __future__ import annotations

import random
from typing import Any, cast

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful


class ModelState(Stateful):
    """The model's state dict as this rank holds it (FSDP: its shards), loaded into any sharding."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model

    def state_dict(self) -> dict[str, Any]:
        return get_model_state_dict(self.model)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        set_model_state_dict(self.model, state)


class OptimizerState(Stateful):
    """The optimizer's state, keyed by parameter name, as this rank holds it."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.model, self.optimizer = model, optimizer

    def state_dict(self) -> dict[str, Any]:
        return get_optimizer_state_dict(self.model, self.optimizer)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        set_optimizer_state_dict(self.model, self.optimizer, state)


class RNGState(Stateful):
    """This process's torch (CPU and CUDA), Python and NumPy RNG states as tensors, ints and
    tuples (what ``weights_only`` loading accepts)."""

    def state_dict(self) -> dict[str, Any]:
        import numpy as np

        name, keys, pos, has_gauss, gauss = cast("tuple[str, np.ndarray, int, int, float]", np.random.get_state())
        state: dict[str, Any] = {
            "torch": torch.get_rng_state(),
            "python": random.getstate(),
            "numpy": (name, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, gauss),
        }
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            state["cuda"] = torch.cuda.get_rng_state_all()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        import numpy as np

        torch.set_rng_state(state["torch"].cpu())
        random.setstate(state["python"])
        name, keys, pos, has_gauss, gauss = state["numpy"]
        np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))
        if "cuda" in state and torch.cuda.is_available():
            torch.cuda.set_rng_state_all([s.cpu() for s in state["cuda"]])


def to_cpu(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_cpu(v) for v in obj)
    return obj
