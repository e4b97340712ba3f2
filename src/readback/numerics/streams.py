"""The random streams of a run's stochastic roundings, per (site, stream, device): a generator
state, and a counter of keyed draws.

The stream of step ``s`` is seeded from (seed, site, stream, s, salt). So runs are reproducible,
a resume needs no generator state, and streams are independent. Each state is a tensor that a
draw advances in place (``readback.numerics.uniform``) and that is re-seeded in place for every
step: the same tensors throughout, which a compiled step reads as its inputs.

A tensor rounded block by block, whose rounding a backward recomputes (attention's P), draws by
position instead (``readback.numerics.rounding.KeyedDraws``, counter-based as Philox offsets are
on a GPU): its stream's counter is ``[key, offset]`` (int64; the key from the same seed, site,
stream, step and salt), and each rounding claims the rows it covers from the offset on.
"""

from __future__ import annotations

import hashlib

import torch

Key = tuple[str, str, str]  # (site, stream, device)
Snapshot = tuple[dict[Key, torch.Tensor], dict[Key, torch.Tensor]]  # (generator states, counters)


class RandomStreams:
    """The streams of one run, seeded for the step and salt of the last ``reseed`` (0, ``""`` at first)."""

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self.states: dict[Key, torch.Tensor] = {}
        self.counters: dict[Key, torch.Tensor] = {}
        self.step, self.salt = 0, ""

    def state(self, site: str, stream: str, device: torch.device) -> torch.Tensor:
        """The generator state of stream (site, stream) on ``device``, seeded for the current
        step and salt when first asked for."""
        key = (site, stream, str(device))
        if key not in self.states:
            self.states[key] = self._seeded(key, self.step, self.salt)
        return self.states[key]

    def claim(self, site: str, stream: str, device: torch.device, rows: int) -> torch.Tensor:
        """``[key, first row]`` of keyed draws over ``rows`` rows of stream (site, stream): a
        copy, to keep for recomputing the same draws; the counter moves past them in place."""
        key = (site, stream, str(device))
        if key not in self.counters:
            self.counters[key] = self._counter(key, self.step, self.salt)
        counter = self.counters[key]
        start = counter.clone()
        counter[1:].add_(rows)
        return start

    def reseed(self, step: int, salt: str) -> None:
        """Start every stream again, in place, for ``step`` and ``salt``."""
        self.step, self.salt = step, salt
        for key, state in self.states.items():
            state.copy_(self._seeded(key, step, salt))
        for key, counter in self.counters.items():
            counter.copy_(self._counter(key, step, salt))

    def snapshot(self) -> Snapshot:
        """Copies of every generator state and counter."""
        return ({k: t.clone() for k, t in self.states.items()}, {k: t.clone() for k, t in self.counters.items()})

    def restore(self, snapshot: Snapshot) -> None:
        """Each stream of ``snapshot`` continues where it was; streams made since are dropped."""
        for streams, saved in zip((self.states, self.counters), snapshot):
            for key in set(streams) - set(saved):
                del streams[key]
            for key, value in saved.items():
                streams[key].copy_(value)

    def _digest(self, key: Key, step: int, salt: str, kind: str = "") -> int:
        site, stream, _ = key
        text = f"{self.seed}/{site}/{stream}/{step}{salt}{kind}"
        return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little")

    def _seeded(self, key: Key, step: int, salt: str) -> torch.Tensor:
        generator = torch.Generator(device=key[2])
        generator.manual_seed(self._digest(key, step, salt) & (2**63 - 1))
        return generator.get_state()

    def _counter(self, key: Key, step: int, salt: str) -> torch.Tensor:
        draw_key = self._digest(key, step, salt, "/keyed") & 0xFFFF_FFFF
        return torch.tensor([draw_key, 0], dtype=torch.int64, device=key[2])
