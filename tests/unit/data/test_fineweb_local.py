"""The FineWeb-Edu route offline: Parquet shards on disk and a tokenizer file give the stream,
rank split and exact resumption that the same shards give streamed as a hub dataset would be."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
import torch

from readback.data import Layout, build_data
from readback.data.fineweb import TokenStream, hold_out
from readback.data.tokenizer import EOS, train_bpe
from readback.errors import ConfigError
from toys import load_data_cfg

SHARDS, PER_SHARD, VAL_DOCS = 4, 15, 10


def _texts() -> list[str]:
    return [
        f"Document {i}. " + " ".join(f"word{(i * 7 + j) % 50}" for j in range(5 + i % 17))
        for i in range(SHARDS * PER_SHARD)
    ]


@pytest.fixture(scope="module")
def offline(tmp_path_factory) -> tuple[Path, Path]:
    """``(shard directory, tokenizer file)``: the hub's layout, Parquet files of ``text`` records."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    root = tmp_path_factory.mktemp("fineweb")
    texts = _texts()
    for k in range(SHARDS):
        rows = texts[k * PER_SHARD : (k + 1) * PER_SHARD]
        pq.write_table(pa.table({"text": rows, "score": [3.0] * len(rows)}), root / f"{k:03d}_00000.parquet")
    tokenizer = root / "tokenizer.json"
    train_bpe(texts, 300, progress=False).save(str(tokenizer))
    return root, tokenizer


def _local(offline, rank=0, world_size=1, workers=0, path=None):
    shards, tokenizer = offline
    cfg = load_data_cfg(
        "fineweb_edu",
        path=str(shards) if path is None else path,
        tokenizer=str(tokenizer),
        vocab_size=300,
        eos_token=EOS,
        val_docs=VAL_DOCS,
        doc_batch=4,
        loader_workers=workers,
    )
    return build_data(cfg, Layout(seq_len=16, micro_batch=2, seed=0, rank=rank, world_size=world_size))


def _as_from_the_hub(offline, rank=0, world_size=1, workers=0):
    """The same documents as a streamed dataset of as many shards, as ``load_dataset(streaming=True)`` gives."""
    from datasets import Dataset
    from tokenizers import Tokenizer

    stream = Dataset.from_dict({"text": _texts()}).to_iterable_dataset(num_shards=SHARDS)
    train, val = hold_out(stream, VAL_DOCS)
    return TokenStream(
        train,
        val,
        Tokenizer.from_file(str(offline[1])),
        eos=0,
        vocab_size=300,
        layout=Layout(seq_len=16, micro_batch=2, seed=0, rank=rank, world_size=world_size),
        doc_batch=4,
        workers=workers,
    )


def _take(stream, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [stream.next_batch() for _ in range(n)]


def _same(a, b) -> bool:
    return len(a) == len(b) and all(torch.equal(xa, xb) and torch.equal(ya, yb) for (xa, ya), (xb, yb) in zip(a, b))


@pytest.mark.parametrize("rank, world_size, workers", [(0, 1, 0), (1, 2, 0), (0, 2, 2)])
def test_local_shards_stream_as_the_hub_route_does_without_the_network(offline, monkeypatch, rank, world_size, workers):
    def refuse(*args, **kwargs):
        raise OSError("network disabled in this test")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "getaddrinfo", refuse)
    local = _local(offline, rank, world_size, workers)
    assert _same(_take(local, 30), _take(_as_from_the_hub(offline, rank, world_size, workers), 30))
    assert _same(list(local.val_batches(2)), list(_as_from_the_hub(offline).val_batches(2)))


@pytest.mark.parametrize("rank, world_size, stop", [(0, 1, 7), (1, 2, 45)])  # 45: in the second epoch
def test_local_shards_resume_exactly(offline, rank, world_size, stop):
    straight = _take(_local(offline, rank, world_size), stop + 5)
    stopped = _local(offline, rank, world_size)
    _take(stopped, stop)
    resumed = _local(offline, rank, world_size)
    resumed.load_state_dict(stopped.state_dict())
    assert _same(_take(resumed, 5), straight[stop:])


def test_a_glob_of_shards_is_a_local_path_and_one_matching_nothing_is_refused(offline, tmp_path):
    assert _same(_take(_local(offline, path=str(offline[0] / "*.parquet")), 3), _take(_local(offline), 3))
    with pytest.raises(ConfigError) as refused:
        _local(offline, path=str(tmp_path / "*.parquet"))
    assert refused.value.key == "data.path" and "matches none" in str(refused.value)


def test_a_tokenizer_file_that_does_not_load_is_refused(offline, tmp_path):
    bad = tmp_path / "tokenizer.json"
    bad.write_text("{not json")
    with pytest.raises(ConfigError) as refused:
        build_data(
            load_data_cfg("fineweb_edu", path=str(offline[0]), tokenizer=str(bad), vocab_size=300, eos_token=EOS),
            Layout(seq_len=16, micro_batch=2, seed=0),
        )
    assert refused.value.key == "data.tokenizer" and "a tokenizer.json file" in str(refused.value)
