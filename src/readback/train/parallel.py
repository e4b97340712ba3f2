"""Data parallelism: ``trainer.parallel=ddp`` (replicated weights, all-reduced gradients) or
``fsdp`` (FSDP2, ``torch.distributed.fsdp.fully_shard``: each FOG block and the root sharded
over the ranks, gathered for their forward and backward, gradients reduce-scattered).

FSDP's ``MixedPrecisionPolicy`` gathers the parameters in their own dtype (FP32) and reduces
gradients in FP32: the FP8 sites compute their amaxes and scales from the master weights, as
under DDP, and the lower-precision copies are the numerics' business, not the sharding's. It
casts no forward inputs either (a cast would rebuild the per-block statistics dict a block fills). With either,
the FP8 scaling states stay the same on every rank (``Numerics.end_step`` reduces amaxes, max).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

import torch
from torch import nn

from readback.train.contract import TrainableModule
from readback.train.distributed import DistEnv


def apply_parallelism(model: TrainableModule, env: DistEnv, parallel: str) -> nn.Module:
    """What the training micro-steps call: ``model`` itself (one process, or sharded in place by
    FSDP2), or its DDP wrapper."""
    if not env.distributed:
        return model
    if parallel == "fsdp":
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        policy = MixedPrecisionPolicy(param_dtype=None, reduce_dtype=torch.float32, cast_forward_inputs=False)
        for block in model.layers:
            fully_shard(block, mp_policy=policy, reshard_after_forward=True)
        fully_shard(model, mp_policy=policy, reshard_after_forward=False)  # its backward starts at once
        return model
    from torch.nn.parallel import DistributedDataParallel as DDP

    return DDP(model, device_ids=[env.device] if env.device.type == "cuda" else None)


@contextmanager
def _fsdp_no_sync(module: Any) -> Iterator[None]:
    module.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        module.set_requires_gradient_sync(True)


@contextmanager
def whole_parameters(forward: nn.Module) -> Iterator[None]:
    """Inside, an FSDP model's parameters are whole, local tensors, and a backward leaves local,
    unreduced gradients on them, as on an unwrapped model (the gradient probe compares those
    with its reference); on exit they are sharded again. Every rank must enter it."""
    from torch.distributed.fsdp import FSDPModule

    sharded = [m for m in forward.modules() if isinstance(m, FSDPModule)]
    for m in sharded:
        m.set_requires_gradient_sync(False, recurse=False)
        m.set_reshard_after_forward(False, recurse=False)
        m.set_reshard_after_backward(False, recurse=False)
        m.unshard()
    try:
        yield
    finally:
        for m in sharded:
            m.reshard()
            m.set_requires_gradient_sync(True, recurse=False)
            m.set_reshard_after_forward(m is not forward, recurse=False)
            m.set_reshard_after_backward(True, recurse=False)


def no_gradient_sync(forward: nn.Module, env: DistEnv) -> Any:
    """A context in which backward accumulates local gradients without communicating."""
    from torch.distributed.fsdp import FSDPModule
    from torch.nn.parallel import DistributedDataParallel as DDP

    if isinstance(forward, DDP):
        return forward.no_sync()
    if isinstance(forward, FSDPModule):
        return _fsdp_no_sync(forward)
    return nullcontext()
