"""Fixed-length training sequences from a token array: order, sharding over ranks, resumption.

Packing: the split's tokens are laid end to end (an EOS token wherever the text is not
continuous) and cut into windows of ``seq_len + 1`` tokens with stride ``seq_len``; a window
gives ``x = w[:-1]`` and ``y = w[1:]``, so every token is a target exactly once per epoch.

Order: all ranks walk one global sequence stream, epoch ``e`` being a permutation of the
windows drawn from ``(seed, e)``. A step consumes ``micro_batch * world_size`` consecutive
entries; rank ``r`` takes entries ``[r * micro_batch, (r + 1) * micro_batch)`` of them. Hence
two ranks at call ``k`` see exactly what one rank sees at calls ``2k`` and ``2k + 1`` (the
trainer compares a 2-process run with a 1-process run accumulating two micro-batches), and
the position is a single count of global entries that any world size can resume from.
"""

from __future__ import annotations

import numbers
from collections.abc import Iterator
from dataclasses import dataclass, fields
from typing import Any

import numpy as np
import torch

from readback.errors import ConfigError, StateChanged, require

Batch = tuple[torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class Layout:
    """How a rank takes its batches of the one global stream (see module doc): sequences of
    ``seq_len`` tokens, ``micro_batch`` of them per call, the order drawn from ``seed``, and this
    rank's share among ``world_size``. Checked when made (``ConfigError``), so no stream is built on a
    layout it cannot serve."""

    seq_len: int
    micro_batch: int
    seed: int
    rank: int = 0
    world_size: int = 1

    def __post_init__(self) -> None:
        def whole(x: object) -> bool:
            return isinstance(x, numbers.Integral) and not isinstance(x, bool)

        seq_len, micro_batch, seed, rank, world_size = (getattr(self, f.name) for f in fields(self))
        require(whole(seq_len) and seq_len >= 1, "seq_len", seq_len, "an integer >= 1")
        require(whole(micro_batch) and micro_batch >= 1, "micro_batch", micro_batch, "an integer >= 1")
        require(whole(seed), "seed", seed, "an integer")
        require(whole(world_size) and world_size >= 1, "world_size", world_size, "an integer >= 1")
        require(whole(rank) and 0 <= rank < world_size, "rank", rank, f"0..{world_size - 1}")
        for f in fields(self):  # numpy's integers too, as Python's
            object.__setattr__(self, f.name, int(getattr(self, f.name)))

    @property
    def tokens_per_batch(self) -> int:
        return self.micro_batch * self.seq_len


def windows(tokens: np.ndarray, index: np.ndarray, seq_len: int) -> Batch:
    """``(x, y)`` int64 tensors of shape ``(len(index), seq_len)`` for the windows ``index``."""
    rows = tokens[index[:, None] * seq_len + np.arange(seq_len + 1)].astype(np.int64)
    rows_t = torch.from_numpy(rows)
    return rows_t[:, :-1].contiguous(), rows_t[:, 1:].contiguous()


def n_windows(tokens: np.ndarray, seq_len: int) -> int:
    """How many ``seq_len + 1`` windows with stride ``seq_len`` fit in ``tokens``."""
    return max(0, (len(tokens) - 1) // seq_len)


def check_seq_len(seq_len: int, train: np.ndarray, val: np.ndarray) -> None:
    """``ConfigError`` unless both splits hold one window of ``seq_len + 1`` tokens: refused when
    the stream is built, before any step, not at the first evaluation."""
    fits = min(len(train), len(val)) - 1
    held = f"the data holds {len(train)} training and {len(val)} validation tokens"
    require(
        seq_len <= fits,
        "model.seq_len",
        seq_len,
        f"at most {fits}: a sequence takes seq_len + 1 tokens, and {held}"
        if fits >= 1
        else f"a length both splits can supply, and none can: {held} (more text, or another data.val_fraction)",
    )


def val_iter(tokens: np.ndarray, n: int, layout: Layout) -> Iterator[Batch]:
    """``n`` batches of the validation windows in order, cycling if ``n`` batches need more."""
    micro_batch, seq_len = layout.micro_batch, layout.seq_len
    total = n_windows(tokens, seq_len)
    if total == 0:
        raise ConfigError(
            "data.val_fraction",
            "too little validation text",
            f"enough validation text for one window of seq_len + 1 = {seq_len + 1} tokens",
        )
    for b in range(n):
        index = (b * micro_batch + np.arange(micro_batch)) % total
        yield windows(tokens, index, seq_len)


class PackedStream:
    """Batches of packed windows over train/validation token arrays, in memory or mapped (see module doc)."""

    def __init__(
        self,
        train: np.ndarray,
        val: np.ndarray,
        *,
        vocab_size: int,
        layout: Layout,
        fingerprint: str = "",
        tokenizer: Any = None,
    ):
        self.vocab_size, self.layout = int(vocab_size), layout
        self.tokens_per_batch = layout.tokens_per_batch
        self.tokenizer = tokenizer  # tokenizers.Tokenizer for text data, None for synthetic
        self.fingerprint = fingerprint
        self.train_tokens, self.val_tokens = train, val
        check_seq_len(layout.seq_len, train, val)
        self.n_sequences = n_windows(train, layout.seq_len)
        self._consumed = 0  # global entries of the sequence stream taken so far, by all ranks
        self._perms: dict[int, np.ndarray] = {}

    def _order(self, epoch: int) -> np.ndarray:
        if epoch not in self._perms:
            rng = np.random.default_rng([self.layout.seed % (1 << 64), epoch])
            self._perms = {epoch: rng.permutation(self.n_sequences)}
        return self._perms[epoch]

    def _window_ids(self, start: int, count: int) -> np.ndarray:
        """The windows at global stream positions ``start .. start + count - 1``."""
        pos = start + np.arange(count)
        epochs, within = np.divmod(pos, self.n_sequences)
        out = np.empty(count, dtype=np.int64)
        for e in np.unique(epochs):
            sel = epochs == e
            out[sel] = self._order(int(e))[within[sel]]
        return out

    def next_batch(self) -> Batch:
        """This rank's ``(x, y)`` of the next global batch; int64, shape ``(micro_batch, seq_len)``."""
        layout = self.layout
        start = self._consumed + layout.rank * layout.micro_batch
        index = self._window_ids(start, layout.micro_batch)
        self._consumed += layout.micro_batch * layout.world_size
        return windows(self.train_tokens, index, layout.seq_len)

    def val_batches(self, n: int) -> Iterator[Batch]:
        """``n`` validation batches in a fixed order: the same on every call and on every rank.

        Not sharded: a trainer that wants to split the work keeps batch ``i`` on rank
        ``i % world_size`` and averages the per-batch losses over all ranks.
        """
        require(isinstance(n, int) and n >= 0, "n", n, "an integer >= 0")
        return val_iter(self.val_tokens, n, self.layout)

    def state_dict(self) -> dict:
        """Where the stream is; loading it into a stream of the same data continues identically."""
        epoch, cursor = divmod(self._consumed, self.n_sequences)
        return {
            "consumed": self._consumed,
            "epoch": epoch,
            "cursor": cursor,
            "seed": self.layout.seed,
            "n_sequences": self.n_sequences,
            "fingerprint": self.fingerprint,
        }

    def load_state_dict(self, state: dict) -> None:
        """Resume at ``state``. The world size and micro-batch may differ, and so may the seed: the
        stream goes on at the same place (epoch and position in it), in the new seed's order. A
        state of other data (other text, tokenizer or ``model.seq_len``: other windows) raises
        :class:`~readback.errors.StateChanged`: its position counts windows of that data."""
        if (state.get("fingerprint"), state.get("n_sequences")) != (self.fingerprint, self.n_sequences):
            raise StateChanged(
                "data",
                self.fingerprint,
                f"the data this run's checkpoint was trained on, {state.get('fingerprint')!r} in "
                f"{state.get('n_sequences')} windows ({self.n_sequences} now): the text of data.files, the "
                "tokenizer or model.seq_len changed since; set it back, or trainer.resume_changed_config=true "
                "to start the new data from its beginning",
                afresh="the new data starts from its beginning",
            )
        self._consumed = int(state["consumed"])
