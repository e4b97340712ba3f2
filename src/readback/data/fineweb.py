"""FineWeb-Edu, streamed from the hub and tokenised on the fly (cluster runs only).

The text is never stored: documents are streamed with ``datasets`` (``streaming=True``),
tokenised with the Mistral-Nemo tokenizer (131072 ids), joined with its EOS token and cut into
the same ``seq_len + 1`` windows, global order and rank split as ``stream.PackedStream``:
every rank reads the whole stream and keeps its own rows, which keeps a 2-process run equal
to a 1-process run of the same global batch at the price of tokenising on every rank.

Validation is the first ``val_docs`` documents of the stream, and training skips them.
Resumption uses ``IterableDataset.state_dict`` plus the tokens not yet handed out. It is
exact with ``shuffle_buffer: 0`` (documents in stream order, the default); with a shuffle
buffer, ``datasets`` refills that buffer with new documents on resume, so the run continues
on different (equally distributed) data.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from itertools import islice
from typing import Any

import numpy as np
import torch

from readback.data.cache import cfg_get
from readback.data.stream import Batch, check_layout, val_iter, windows
from readback.errors import ConfigError, require


def _one_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"


def build_fineweb(
    cfg: Any, *, seq_len: int, micro_batch: int, seed: int, rank: int = 0, world_size: int = 1
) -> TokenStream:
    """The hub tokenizer and streaming dataset the config names, wrapped in a ``TokenStream``."""
    import datasets
    from tokenizers import Tokenizer

    name = cfg_get(cfg, "tokenizer", "mistralai/Mistral-Nemo-Base-2407")
    path = cfg_get(cfg, "path", "HuggingFaceFW/fineweb-edu")
    subset = cfg_get(cfg, "subset", "sample-10BT")
    try:
        tok = Tokenizer.from_pretrained(name, token=os.environ.get("HF_TOKEN"))
    except Exception as e:  # no network, gated repo without a token, wrong name
        raise ConfigError(
            "data.tokenizer",
            name,
            f"a hub tokenizer this machine can download (network; HF_TOKEN for gated repos) [{_one_line(e)}]",
        ) from e
    vocab_size = cfg_get(cfg, "vocab_size", 131072)
    require(
        tok.get_vocab_size() == vocab_size, "data.vocab_size", vocab_size, f"{tok.get_vocab_size()}, the size of {name}"
    )
    eos_token = cfg_get(cfg, "eos_token", "</s>")
    eos = tok.token_to_id(eos_token)
    if eos is None:
        raise ConfigError("data.eos_token", eos_token, f"a token of {name}")
    try:
        ds = datasets.load_dataset(path, name=subset, split="train", streaming=True)
    except Exception as e:
        raise ConfigError(
            "data.subset",
            f"{path}/{subset}",
            f"a dataset and subset this machine can stream from the hub [{_one_line(e)}]",
        ) from e
    ds = ds.select_columns(["text"])
    val_docs = cfg_get(cfg, "val_docs", 2000)
    shuffle_buffer = cfg_get(cfg, "shuffle_buffer", 0)
    train = ds.skip(val_docs)
    if shuffle_buffer > 0:
        train = train.shuffle(seed=seed % (1 << 32), buffer_size=shuffle_buffer)
    return TokenStream(
        train,
        ds.take(val_docs),
        tok,
        eos=eos,
        vocab_size=vocab_size,
        seq_len=seq_len,
        micro_batch=micro_batch,
        seed=seed,
        rank=rank,
        world_size=world_size,
        doc_batch=cfg_get(cfg, "doc_batch", 256),
        fingerprint=f"fineweb:{path}:{subset}:{name}:val{val_docs}:buf{shuffle_buffer}",
    )


class TokenStream:
    """Batches from a (streaming) dataset of ``{"text": ...}`` rows, tokenised as they arrive.

    ``train`` must support ``iter``, ``state_dict``, ``load_state_dict`` and ``set_epoch``
    (a ``datasets.IterableDataset``); ``val`` only iteration.
    """

    def __init__(
        self,
        train: Any,
        val: Any,
        tokenizer: Any,
        *,
        eos: int,
        vocab_size: int,
        seq_len: int,
        micro_batch: int,
        seed: int,
        rank: int = 0,
        world_size: int = 1,
        doc_batch: int = 256,
        fingerprint: str = "",
    ):
        check_layout(seq_len, micro_batch, seed, rank, world_size)
        self.vocab_size, self.seq_len, self.micro_batch = int(vocab_size), int(seq_len), int(micro_batch)
        self.seed, self.rank, self.world_size = int(seed), int(rank), int(world_size)
        self.tokens_per_batch = micro_batch * seq_len
        self.tokenizer, self.fingerprint = tokenizer, fingerprint
        self._train, self._val, self._eos, self._doc_batch = train, val, eos, doc_batch
        self._epoch, self._consumed = 0, 0
        self._buf = np.zeros(0, dtype=np.int64)  # tokens read but not yet handed out (all ranks')
        self._val_tokens: np.ndarray | None = None
        self._train.set_epoch(0)
        self._it = iter(self._train)

    def _encode(self, rows: list[dict]) -> np.ndarray:
        encs = self.tokenizer.encode_batch([r["text"] for r in rows], add_special_tokens=False)
        return np.concatenate([np.append(np.asarray(e.ids, dtype=np.int64), self._eos) for e in encs])

    def _fill(self, need: int) -> None:
        """Read documents until ``need`` tokens are buffered, starting a new epoch at the end."""
        empty_epochs = 0
        while len(self._buf) < need:
            rows = list(islice(self._it, self._doc_batch))
            if rows:
                self._buf, empty_epochs = np.concatenate([self._buf, self._encode(rows)]), 0
                continue
            empty_epochs += 1
            require(empty_epochs < 2, "data", self.fingerprint, "a training stream with documents in it")
            self._epoch += 1
            self._train.set_epoch(self._epoch)
            self._it = iter(self._train)

    def next_batch(self) -> Batch:
        """This rank's rows of the next ``micro_batch * world_size`` windows of the stream."""
        n_global = self.micro_batch * self.world_size
        self._fill(n_global * self.seq_len + 1)
        index = self.rank * self.micro_batch + np.arange(self.micro_batch)
        batch = windows(self._buf, index, self.seq_len)
        self._buf = self._buf[n_global * self.seq_len :]
        self._consumed += n_global
        return batch

    def val_batches(self, n: int) -> Iterator[Batch]:
        """``n`` batches over the held-out documents, in order; the same on every call and rank."""
        require(isinstance(n, int) and n >= 0, "n", n, "an integer >= 0")
        if self._val_tokens is None:
            rows = list(self._val)
            require(bool(rows), "data.val_docs", 0, "an integer >= 1 for validation batches")
            self._val_tokens = self._encode(rows)
        return val_iter(self._val_tokens, n, self.micro_batch, self.seq_len)

    def state_dict(self) -> dict:
        """The dataset's stream position, the epoch and the buffered tokens (at most a few documents)."""
        return {
            "consumed": self._consumed,
            "epoch": self._epoch,
            "fingerprint": self.fingerprint,
            "dataset": self._train.state_dict(),
            "buffer": torch.from_numpy(self._buf.copy()),
        }

    def load_state_dict(self, state: dict) -> None:
        require(
            state.get("fingerprint") == self.fingerprint,
            "data state",
            state.get("fingerprint"),
            f"a state saved by a stream of the same data config ({self.fingerprint})",
        )
        self._consumed, self._epoch = int(state["consumed"]), int(state["epoch"])
        self._train.set_epoch(self._epoch)
        self._train.load_state_dict(state["dataset"])
        self._it = iter(self._train)
        self._buf = torch.as_tensor(state["buffer"]).numpy().astype(np.int64)
