"""The random streams of a run's stochastic roundings: one generator state per (site, stream, device).

The stream of step ``s`` is seeded from (seed, site, stream, s, salt). So runs are reproducible,
a resume needs no generator state, and streams are independent. Each state is a tensor that a
draw advances in place (``readback.numerics.uniform``) and that is re-seeded in place for every
step: the same tensors throughout, which a compiled step reads as its inputs.
"""

from __future__ import annotations

import hashlib

import torch

Key = tuple[str, str, str]  # (site, stream, device)


class RandomStreams:
    """The streams of one run, seeded for the step and salt of the last ``reseed`` (0, ``""`` at first)."""

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self.states: dict[Key, torch.Tensor] = {}
        self.step, self.salt = 0, ""

    def state(self, site: str, stream: str, device: torch.device) -> torch.Tensor:
        """The generator state of stream (site, stream) on ``device``, seeded for the current
        step and salt when first asked for."""
        key = (site, stream, str(device))
        if key not in self.states:
            self.states[key] = self._seeded(key, self.step, self.salt)
        return self.states[key]

    def reseed(self, step: int, salt: str) -> None:
        """Start every stream again, in place, for ``step`` and ``salt``."""
        self.step, self.salt = step, salt
        for key, state in self.states.items():
            state.copy_(self._seeded(key, step, salt))

    def snapshot(self) -> dict[Key, torch.Tensor]:
        return {key: state.clone() for key, state in self.states.items()}

    def restore(self, snapshot: dict[Key, torch.Tensor]) -> None:
        """Each stream of ``snapshot`` continues where it was; streams made since are dropped."""
        for key in set(self.states) - set(snapshot):
            del self.states[key]
        for key, state in snapshot.items():
            self.states[key].copy_(state)

    def _seeded(self, key: Key, step: int, salt: str) -> torch.Tensor:
        site, stream, device = key
        digest = hashlib.blake2b(f"{self.seed}/{site}/{stream}/{step}{salt}".encode(), digest_size=8).digest()
        generator = torch.Generator(device=device)
        generator.manual_seed(int.from_bytes(digest, "little") & (2**63 - 1))
        return generator.get_state()
