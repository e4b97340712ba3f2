"""Validation loss over a fixed set of batches, split over the ranks, leaving no trace in training."""

from __future__ import annotations

import torch

from readback.train.contract import DataStream, TrainableModule
from readback.train.distributed import DistEnv, all_reduce_mean


class Validator:
    """``evaluate(model)``: mean loss over ``batches`` validation batches, the same on every rank.

    Batch ``i`` is evaluated on rank ``i % world_size``; the per-batch losses are summed over
    ranks, so every rank gets the same mean, equal to the single-process one up to round-off.
    ``model.numerics`` (amax histories, random streams) is restored to its state before the
    evaluation forwards.
    """

    def __init__(self, stream: DataStream, batches: int, env: DistEnv, *, lockstep: bool = False) -> None:
        """``lockstep``: every rank runs the same number of forwards (FSDP gathers weights in
        each one); a rank without a batch of its own in the last round reruns one, uncounted."""
        self.stream, self.batches, self.env, self.lockstep = stream, batches, env, lockstep

    @torch.no_grad()
    def evaluate(self, model: TrainableModule) -> float:
        env, dev = self.env, self.env.device
        batches = list(self.stream.val_batches(self.batches))
        rounds = (
            -(-len(batches) // env.world_size) if self.lockstep else len(range(env.rank, len(batches), env.world_size))
        )
        was_training = model.training
        model.eval()
        totals = torch.zeros(2, dtype=torch.float64, device=dev)  # (sum of losses, batches)
        with model.numerics.isolated():
            for k in range(rounds):
                i = env.rank + k * env.world_size
                x, y = batches[min(i, len(batches) - 1)]
                loss = model(x.to(dev), y.to(dev)).double()
                if i < len(batches):
                    totals[0] += loss
                    totals[1] += 1
        model.train(was_training)
        totals = all_reduce_mean(totals, env) * env.world_size
        return float(totals[0] / totals[1].clamp_min(1))
