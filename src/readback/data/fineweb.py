"""FineWeb-Edu, streamed from the hub or from local shards and tokenised on the fly (cluster runs).

The text is never stored: documents are streamed with ``datasets`` (``streaming=True``) from the
hub, or, offline, from Parquet shards on disk as the hub stores them (``data.path``: a directory
or glob; the same stream, rank split and resumption), tokenised with the Mistral-Nemo tokenizer
(131072 ids; ``data.tokenizer``: a hub name or a ``tokenizer.json`` file), joined with its EOS token and cut into
``seq_len + 1`` windows. Each rank streams only its share of the documents
(``datasets.distributed.split_dataset_by_node``: whole shards when their number divides by the
world size, every ``world_size``-th document otherwise), and tokenises it in ``data.loader_workers``
``DataLoader`` worker processes that read ``data.prefetch`` document batches ahead.

Validation is the first ``val_docs`` documents of the stream, the same on every rank; training
leaves out every document with the text of one of them (a filter, which stays right however the
stream is split, where ``skip`` would spread over the shards).

Resumption is exact with ``shuffle_buffer: 0`` (documents in stream order, the default): the
state is each worker's ``IterableDataset.state_dict`` after the last document batch it handed
out, plus the tokens not yet handed out. Workers answer in rounds, one batch each in worker
order, so a restarted ``DataLoader`` continues where the old one was. With a shuffle buffer,
``datasets`` refills that buffer with new documents on resume, so the run continues on different
(equally distributed) data.
"""

from __future__ import annotations

import glob
import hashlib
import os
from collections.abc import Iterable, Iterator
from itertools import islice
from pathlib import Path
from typing import Any

import numpy as np
import torch

from readback.data.settings import FinewebData
from readback.data.stream import Batch, Layout, val_iter, windows
from readback.errors import ConfigError, require


def _one_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"


def _local_shards(path: str) -> list[str] | None:
    """The Parquet files of a local ``data.path`` (a directory, searched recursively, or a glob),
    sorted by name; ``None`` for a hub dataset's name."""
    here = Path(path).expanduser()
    if here.is_dir():
        found = sorted(str(p) for p in here.rglob("*.parquet"))
    elif any(c in path for c in "*?["):
        found = sorted(glob.glob(str(here), recursive=True))
    else:
        return None
    require(bool(found), "data.path", path, "a directory or glob of Parquet shards (it matches none)")
    return found


def _tokenizer(name: str) -> Any:
    """The tokenizer file at ``name``, or the hub tokenizer of that name."""
    from tokenizers import Tokenizer

    if Path(name).expanduser().is_file():
        try:
            return Tokenizer.from_file(str(Path(name).expanduser()))
        except Exception as e:
            raise ConfigError("data.tokenizer", name, f"a tokenizer.json file [{_one_line(e)}]") from None
    try:
        return Tokenizer.from_pretrained(name, token=os.environ.get("HF_TOKEN"))
    except Exception as e:  # no network, gated repo without a token, wrong name
        raise ConfigError(
            "data.tokenizer",
            name,
            f"a tokenizer file, or a hub tokenizer this machine can download (network; HF_TOKEN for gated repos)"
            f" [{_one_line(e)}]",
        ) from e


def _documents(path: str, subset: str) -> Any:
    """The training documents as a ``datasets`` stream: local Parquet shards (offline), or the hub's."""
    import datasets

    shards = _local_shards(path)
    try:
        if shards is not None:
            return datasets.load_dataset("parquet", data_files=shards, split="train", streaming=True)
        return datasets.load_dataset(path, name=subset, split="train", streaming=True)
    except Exception as e:
        where = path if shards is not None else f"{path}/{subset}"
        raise ConfigError(
            "data.path" if shards is not None else "data.subset",
            where,
            "Parquet shards on this disk, or a dataset and subset this machine can stream from the hub"
            f" [{_one_line(e)}]",
        ) from e


def build_fineweb(cfg: FinewebData, layout: Layout) -> TokenStream:
    """The tokenizer and document stream the config names, local or from the hub, in a ``TokenStream``."""
    name = cfg.tokenizer
    path = cfg.path
    subset = cfg.subset
    tok = _tokenizer(name)
    vocab_size = cfg.vocab_size
    require(
        tok.get_vocab_size() == vocab_size, "data.vocab_size", vocab_size, f"{tok.get_vocab_size()}, the size of {name}"
    )
    eos_token = cfg.eos_token
    eos = tok.token_to_id(eos_token)
    if eos is None:
        raise ConfigError("data.eos_token", eos_token, f"a token of {name}")
    ds = _documents(path, subset)
    val_docs = cfg.val_docs
    shuffle_buffer = cfg.shuffle_buffer
    train, val = hold_out(ds.select_columns(["text"]), val_docs)
    if shuffle_buffer > 0:
        train = train.shuffle(seed=layout.seed % (1 << 32), buffer_size=shuffle_buffer)
    return TokenStream(
        train,
        val,
        tok,
        eos=eos,
        vocab_size=vocab_size,
        layout=layout,
        doc_batch=cfg.doc_batch,
        workers=cfg.loader_workers,
        prefetch=cfg.prefetch,
        fingerprint=f"fineweb:{path}:{subset}:{name}:val{val_docs}:buf{shuffle_buffer}",
    )


def _digest(text: str) -> bytes:
    return hashlib.blake2b(text.encode("utf-8"), digest_size=16).digest()


class _NotHeldOut:
    """The training filter: a document whose text is not one of the validation documents'."""

    def __init__(self, held_out: set[bytes]) -> None:
        self.held_out = held_out

    def __call__(self, row: dict) -> bool:
        return _digest(row["text"]) not in self.held_out


def hold_out(ds: Any, val_docs: int) -> tuple[Any, list[dict]]:
    """``(training stream, validation rows)``: the first ``val_docs`` documents, read now, and the
    stream without them."""
    val = list(ds.take(val_docs))
    return ds.filter(_NotHeldOut({_digest(r["text"]) for r in val})), val


def _encode(tokenizer: Any, eos: int, rows: list[dict]) -> np.ndarray:
    encs = tokenizer.encode_batch([r["text"] for r in rows], add_special_tokens=False)
    return np.concatenate([np.append(np.asarray(e.ids, dtype=np.int64), eos) for e in encs])


def _as_is(answer: Any) -> Any:
    return answer


class _Documents(torch.utils.data.IterableDataset):
    """A rank's documents, tokenised where they are read (a ``DataLoader`` worker or this process):
    per ``doc_batch`` documents ``(tokens, worker, state)``, ``state`` the position of this worker's
    share after them. Once its share is read a worker answers ``(None, worker, state)`` for ever,
    so that every round has one answer of every worker, in worker order."""

    def __init__(self, docs: Any, tokenizer: Any, eos: int, doc_batch: int, states: dict[int, dict]) -> None:
        self.docs, self.tokenizer, self.eos, self.doc_batch, self.states = docs, tokenizer, eos, doc_batch, states

    def __iter__(self) -> Iterator[tuple[np.ndarray | None, int, dict]]:
        info = torch.utils.data.get_worker_info()
        worker = info.id if info is not None else 0
        if worker in self.states:
            self.docs.load_state_dict(self.states[worker])
        rows = iter(self.docs)  # in a worker, datasets keeps the worker's shards of the rank's share
        while True:
            batch = list(islice(rows, self.doc_batch))
            yield (_encode(self.tokenizer, self.eos, batch) if batch else None), worker, self.docs.state_dict()


class TokenStream:
    """Batches from a (streaming) dataset of ``{"text": ...}`` rows, tokenised as they arrive.

    ``train`` (all ranks' documents) must support ``iter``, ``state_dict``, ``load_state_dict`` and
    ``set_epoch`` (a ``datasets.IterableDataset``); this rank streams its share of it. ``val``
    only iteration. ``workers``: ``DataLoader`` worker processes that tokenise (0: this process),
    each ``prefetch`` document batches ahead.
    """

    def __init__(
        self,
        train: Any,
        val: Iterable[dict],
        tokenizer: Any,
        *,
        eos: int,
        vocab_size: int,
        layout: Layout,
        doc_batch: int = 256,
        workers: int = 0,
        prefetch: int = 2,
        fingerprint: str = "",
    ):
        from datasets.distributed import split_dataset_by_node

        self.vocab_size, self.layout = int(vocab_size), layout
        self.tokens_per_batch = layout.tokens_per_batch
        rank, world_size = layout.rank, layout.world_size
        self.tokenizer, self.workers, self.prefetch = tokenizer, int(workers), int(prefetch)
        self.fingerprint = f"{fingerprint}:rank{rank}/{world_size}:workers{workers}"  # whose share, split how
        self._train = split_dataset_by_node(train, rank=rank, world_size=world_size) if world_size > 1 else train
        self._val, self._eos, self._doc_batch = val, eos, doc_batch
        self._epoch, self._consumed = 0, 0
        self._states: dict[int, dict] = {}  # each worker's position after the last batch it handed out
        self._buf = np.zeros(0, dtype=np.int64)  # this rank's tokens read but not yet handed out
        self._val_tokens: np.ndarray | None = None
        self._train.set_epoch(0)
        self._answers: Iterator[tuple[np.ndarray | None, int, dict]] | None = None  # started on first use

    def _start(self) -> Iterator[tuple[np.ndarray | None, int, dict]]:
        docs = _Documents(self._train, self.tokenizer, self._eos, self._doc_batch, dict(self._states))
        if not self.workers:
            return iter(docs)
        loader = torch.utils.data.DataLoader(
            docs, batch_size=None, num_workers=self.workers, prefetch_factor=self.prefetch, collate_fn=_as_is
        )
        return iter(loader)

    def _fill(self, need: int) -> None:
        """Read document batches, a round at a time, until ``need`` tokens are buffered, starting a
        new epoch when every worker has read its share."""
        empty_epochs = 0
        while len(self._buf) < need:
            if self._answers is None:
                self._answers = self._start()
            answers = [next(self._answers) for _ in range(max(self.workers, 1))]
            self._states.update({worker: state for _, worker, state in answers})
            tokens = [t for t, _, _ in answers if t is not None]
            if tokens:
                self._buf, empty_epochs = np.concatenate([self._buf, *tokens]), 0
                continue
            empty_epochs += 1
            require(empty_epochs < 2, "data", self.fingerprint, "a training stream with documents in it")
            self._epoch += 1
            self._train.set_epoch(self._epoch)
            self._states, self._answers = {}, None

    def next_batch(self) -> Batch:
        """The next ``micro_batch`` windows of this rank's share of the stream."""
        layout = self.layout
        self._fill(layout.tokens_per_batch + 1)
        batch = windows(self._buf, np.arange(layout.micro_batch), layout.seq_len)
        self._buf = self._buf[layout.tokens_per_batch :]
        self._consumed += layout.micro_batch * layout.world_size
        return batch

    def val_batches(self, n: int) -> Iterator[Batch]:
        """``n`` batches over the held-out documents, in order; the same on every call and rank."""
        require(isinstance(n, int) and n >= 0, "n", n, "an integer >= 0")
        if self._val_tokens is None:
            rows = list(self._val)
            require(bool(rows), "data.val_docs", 0, "an integer >= 1 for validation batches")
            self._val_tokens = _encode(self.tokenizer, self._eos, rows)
        return val_iter(self._val_tokens, n, self.layout)

    def state_dict(self) -> dict:
        """The epoch, each worker's stream position and the buffered tokens (at most a few documents)."""
        return {
            "consumed": self._consumed,
            "epoch": self._epoch,
            "fingerprint": self.fingerprint,
            "workers": {int(w): state for w, state in self._states.items()},
            "buffer": torch.from_numpy(self._buf.copy()),
        }

    def load_state_dict(self, state: dict) -> None:
        require(
            state.get("fingerprint") == self.fingerprint,
            "data state",
            state.get("fingerprint"),
            f"a state saved by a stream of the same data config, rank and world size ({self.fingerprint})",
        )
        self._consumed, self._epoch = int(state["consumed"]), int(state["epoch"])
        self._train.set_epoch(self._epoch)
        self._states, self._answers = {int(w): s for w, s in state["workers"].items()}, None
        self._buf = torch.as_tensor(state["buffer"]).numpy().astype(np.int64)
