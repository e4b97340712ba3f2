"""readback.data: corpus, cached tokenizer, packing, ordering over ranks, resumption, errors."""

from __future__ import annotations

import dataclasses
import io
import json
import math
import re
import shutil
import socket
from pathlib import Path

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

import readback.data.tokenizer as tokmod
import toys
from readback.data import DATASETS, Layout, build_data
from readback.data.cache import cache_root
from readback.data.corpus import shakespeare_files
from readback.data.synthetic import synthetic_split
from readback.data.token_file import write_split
from readback.errors import ConfigError, StateChanged
from toys import CONF, load_data_cfg


def synth(**overrides):
    return load_data_cfg("synthetic", **{"n_tokens": 20_000, **overrides})


def take(stream, n):
    return [stream.next_batch() for _ in range(n)]


def same(batches_a, batches_b) -> bool:
    return len(batches_a) == len(batches_b) and all(
        torch.equal(xa, xb) and torch.equal(ya, yb) for (xa, ya), (xb, yb) in zip(batches_a, batches_b)
    )


@pytest.fixture(scope="module")
def text_cfg(tmp_path_factory):
    """Shakespeare with its own cache, built once here, cold, with every network call refused."""
    cfg = load_data_cfg("shakespeare", cache_dir=str(tmp_path_factory.mktemp("cache")))
    attempts: list[object] = []

    def refuse(*args, **kwargs):
        attempts.append(args)
        raise OSError("network disabled in this test")

    before = dict(tokmod.BUILDS)
    with pytest.MonkeyPatch.context() as mp_:
        mp_.setattr(socket.socket, "connect", refuse)
        mp_.setattr(socket, "create_connection", refuse)
        mp_.setattr(socket, "getaddrinfo", refuse)
        build_data(cfg, Layout(seq_len=128, micro_batch=4, seed=0))
    assert attempts == [], "building the default corpus tried to reach the network"
    assert tokmod.BUILDS["tokenizer"] == before.get("tokenizer", 0) + 1
    return cfg


# --- configs -------------------------------------------------------------------------------


def test_every_dataset_has_a_config_that_composes(monkeypatch, tmp_path):
    from hydra import compose, initialize_config_dir

    from readback.config import CONF_DIR  # registers the schema each data config names

    assert sorted(p.stem for p in (CONF / "data").glob("*.yaml")) == sorted(DATASETS)
    monkeypatch.setenv("READBACK_CACHE", str(tmp_path))
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        for name in DATASETS:
            cfg = compose(overrides=[f"+data={name}"]).data
            assert cfg.name == name
            assert int(cfg.vocab_size) > 0
            OmegaConf.to_container(cfg, resolve=True)


def test_cache_dir_follows_env_var_and_defaults_to_home(monkeypatch, tmp_path):
    monkeypatch.setenv("READBACK_CACHE", str(tmp_path))
    assert cache_root(load_data_cfg("shakespeare").cache_dir) == tmp_path
    assert cache_root(None) == tmp_path
    monkeypatch.delenv("READBACK_CACHE")
    assert cache_root(load_data_cfg("shakespeare").cache_dir) == Path.home() / ".cache" / "readback"
    assert cache_root(None) == Path.home() / ".cache" / "readback"


# --- corpus and tokenizer ------------------------------------------------------------------


def test_tokenizer_round_trips_and_compresses_real_shakespeare(text_cfg):
    stream = build_data(text_cfg, Layout(seq_len=128, micro_batch=4, seed=0))
    hamlet = next(f for f in shakespeare_files() if f.name.startswith("hamlet"))
    text = hamlet.read_text()[20_000:40_000]
    assert "Hamlet" in text or "HAMLET" in text
    ids = stream.tokenizer.encode(text).ids
    assert stream.tokenizer.decode(ids) == text
    assert max(ids) < stream.vocab_size == text_cfg.vocab_size
    assert len(ids) < len(text.encode()) / 2.5  # a trained BPE, not raw bytes


def test_second_build_loads_the_cache_without_retraining(text_cfg, monkeypatch):
    directory = next((Path(text_cfg.cache_dir) / "text").iterdir())
    files = sorted(p.relative_to(directory) for p in directory.rglob("*") if p.is_file() and p.name[0] != ".")
    assert [str(f) for f in files] == [
        "blocks-b100.bin",
        "split-b100-f0.05/train.bin",
        "split-b100-f0.05/val.bin",
        "tokenizer.json",
        "tokens-b100.bin",
        "tokens-b100.json",
    ]
    mtimes = [(directory / f).stat().st_mtime_ns for f in files]
    builds = dict(tokmod.BUILDS)

    def no_training(*args, **kwargs):
        raise AssertionError("retrained although the cache was there")

    monkeypatch.setattr(tokmod, "train_bpe", no_training)
    monkeypatch.setattr(tokmod, "encode_corpus", no_training)
    stream = build_data(text_cfg, Layout(seq_len=128, micro_batch=4, seed=0))
    assert stream.next_batch()[0].shape == (4, 128)
    assert isinstance(stream.train_tokens, np.memmap) and isinstance(stream.val_tokens, np.memmap)
    assert [(directory / f).stat().st_mtime_ns for f in files] == mtimes
    assert dict(tokmod.BUILDS) == builds


def test_cache_is_keyed_by_corpus_and_vocab(tmp_path):
    plays = [str(f) for f in shakespeare_files() if f.name.startswith(("macbeth", "julius"))]
    cfg = load_data_cfg("shakespeare", files=plays, vocab_size=400, cache_dir=str(tmp_path))
    start = tokmod.BUILDS["tokenizer"]
    build_data(cfg, Layout(seq_len=64, micro_batch=2, seed=0))
    build_data(cfg, Layout(seq_len=64, micro_batch=2, seed=0))
    assert tokmod.BUILDS["tokenizer"] == start + 1
    cfg.vocab_size = 500
    build_data(cfg, Layout(seq_len=64, micro_batch=2, seed=0))
    cfg.files = plays[:1]
    build_data(cfg, Layout(seq_len=64, micro_batch=2, seed=0))
    assert tokmod.BUILDS["tokenizer"] == start + 3
    assert len(list((tmp_path / "text").iterdir())) == 3


# --- packing and split ---------------------------------------------------------------------


@pytest.mark.parametrize("chunk", [1, 2, 1 << 20])  # a run copied in pieces, or at once
def test_split_closes_each_run_with_eos(chunk):
    ids = np.array([1, 2, 3, 4, 5, 6], dtype=np.uint16)
    offsets = np.array([0, 2, 3, 5, 6])  # blocks [1 2] [3] [4 5] [6]
    docs = np.array([0, 0, 1, 1])
    out = {False: io.BytesIO(), True: io.BytesIO()}
    write_split(ids, offsets, docs, np.array([False, True, False, False]), 0, out, chunk=chunk)  # type: ignore[arg-type]
    train, val = (np.frombuffer(out[side].getvalue(), dtype=np.uint16) for side in (False, True))
    assert train.tolist() == [1, 2, 0, 4, 5, 6, 0]
    assert val.tolist() == [3, 0]


def test_batches_are_windows_of_the_train_stream_shifted_by_one():
    cfg = synth()
    train, _, _, _ = synthetic_split(cfg)
    seq_len = 16
    n = (len(train) - 1) // seq_len
    expected = sorted(tuple(train[i * seq_len : i * seq_len + seq_len + 1]) for i in range(n))
    stream = build_data(cfg, Layout(seq_len=seq_len, micro_batch=1, seed=3))
    assert stream.tokens_per_batch == seq_len
    rows = []
    for _ in range(n):  # exactly one epoch
        x, y = stream.next_batch()
        assert x.shape == y.shape == (1, seq_len) and x.dtype == y.dtype == torch.int64
        assert torch.equal(x[0, 1:], y[0, :-1])
        rows.append(tuple(x[0].tolist()) + (int(y[0, -1]),))
    assert sorted(rows) == expected  # every window once, as input + last target


def test_train_and_validation_windows_are_disjoint(text_cfg):
    stream = build_data(text_cfg, Layout(seq_len=128, micro_batch=64, seed=0))
    n_val = 1 + len(stream.val_tokens) // (128 * 64)
    val_rows = {tuple(r) for x, _ in stream.val_batches(n_val) for r in x.tolist()}
    train_rows = {tuple(r) for _ in range(math.ceil(stream.n_sequences / 64)) for r in stream.next_batch()[0].tolist()}
    assert len(train_rows) >= stream.n_sequences - 1 and len(val_rows) > 10
    assert not val_rows & train_rows
    share = len(stream.val_tokens) / (len(stream.val_tokens) + len(stream.train_tokens))
    assert 0.5 * text_cfg.val_fraction < share < 1.5 * text_cfg.val_fraction


def test_validation_text_does_not_occur_in_training_text(text_cfg):
    stream = build_data(text_cfg, Layout(seq_len=128, micro_batch=4, seed=0))
    train_text = stream.tokenizer.decode(stream.train_tokens.tolist())
    eos = stream.tokenizer.token_to_id(tokmod.EOS)
    val = stream.val_tokens.tolist()
    pieces, start = [], 0
    for i, t in enumerate(val):
        if t == eos:
            pieces.append(stream.tokenizer.decode(val[start:i]))
            start = i + 1
    long_pieces = [p for p in pieces if len(p) > 1000]  # a document's last block can be short
    assert len(long_pieces) >= 10
    for piece in long_pieces:
        assert piece not in train_text


# --- order, ranks, resumption --------------------------------------------------------------


@pytest.fixture(params=["shakespeare", "synthetic"])
def data_cfg(request, text_cfg):
    return text_cfg if request.param == "shakespeare" else synth()


def test_same_seed_same_batches_other_seed_other_order(data_cfg):
    a = take(build_data(data_cfg, Layout(seq_len=32, micro_batch=4, seed=7)), 5)
    b = take(build_data(data_cfg, Layout(seq_len=32, micro_batch=4, seed=7)), 5)
    c = take(build_data(data_cfg, Layout(seq_len=32, micro_batch=4, seed=8)), 5)
    assert same(a, b)
    assert not any(torch.equal(xa, xc) for (xa, _), (xc, _) in zip(a, c))


def test_epochs_are_reshuffled():
    stream = build_data(synth(n_tokens=2_000), Layout(seq_len=16, micro_batch=1, seed=0))
    n = stream.n_sequences
    first, second = take(stream, n), take(stream, n)
    key = lambda batches: [tuple(x[0].tolist()) for x, _ in batches]  # noqa: E731
    assert sorted(key(first)) == sorted(key(second)) and key(first) != key(second)
    assert stream.state_dict()["epoch"] == 2


@pytest.mark.parametrize("k, m", [(3, 4), (0, 2), (37, 5)])  # 37 crosses an epoch of the small corpus
def test_state_dict_resumes_exactly(data_cfg, k, m):
    if data_cfg.name == "synthetic":
        data_cfg = synth(n_tokens=3_000)
    stream = build_data(data_cfg, Layout(seq_len=32, micro_batch=3, seed=1))
    take(stream, k)
    state = stream.state_dict()
    expected = take(stream, m)
    fresh = build_data(data_cfg, Layout(seq_len=32, micro_batch=3, seed=1))
    fresh.load_state_dict(state)
    assert same(take(fresh, m), expected)
    assert all(isinstance(v, (int, str)) for v in state.values())


def test_state_saved_with_one_rank_resumes_on_two():
    cfg = synth(n_tokens=3_000)
    one = build_data(cfg, Layout(seq_len=16, micro_batch=2, seed=0))
    take(one, 6)
    state = one.state_dict()
    following = take(one, 4)
    ranks = [build_data(cfg, Layout(seq_len=16, micro_batch=2, seed=0, rank=r, world_size=2)) for r in (0, 1)]
    for s in ranks:
        s.load_state_dict(state)
    for k in range(2):
        got = [s.next_batch()[0] for s in ranks]
        assert torch.equal(torch.cat(got), torch.cat([following[2 * k][0], following[2 * k + 1][0]]))


def test_state_of_other_data_is_refused_and_another_seed_keeps_the_place():
    """Other data (another corpus, or windows of another length) cannot take the position; a new
    seed (a resume under ``trainer.resume_changed_config``) goes on from it, in its own order."""
    stream = build_data(synth(), Layout(seq_len=16, micro_batch=2, seed=0))
    stream.next_batch()
    for other in (synth(data_seed=1), synth(n_tokens=3000)):
        with pytest.raises(StateChanged, match=r"^data='synthetic:.*set it back, or trainer.resume_changed_config"):
            build_data(other, Layout(seq_len=16, micro_batch=2, seed=0)).load_state_dict(stream.state_dict())
    with pytest.raises(StateChanged):
        build_data(synth(), Layout(seq_len=8, micro_batch=2, seed=0)).load_state_dict(stream.state_dict())
    reseeded = build_data(synth(), Layout(seq_len=16, micro_batch=2, seed=1))
    reseeded.load_state_dict(stream.state_dict())
    assert reseeded.state_dict()["consumed"] == stream.state_dict()["consumed"] == 2


@pytest.mark.parametrize("world_size", [2, 3])
def test_ranks_together_see_what_one_rank_sees_in_consecutive_calls(data_cfg, world_size):
    if data_cfg.name == "synthetic":
        data_cfg = synth(n_tokens=2_000)  # 120 windows: the calls below cross epochs
    m, calls = 3, 30
    single = take(build_data(data_cfg, Layout(seq_len=16, micro_batch=m, seed=5)), calls * world_size)
    ranks = [
        build_data(data_cfg, Layout(seq_len=16, micro_batch=m, seed=5, rank=r, world_size=world_size))
        for r in range(world_size)
    ]
    for k in range(calls):
        per_rank = [s.next_batch() for s in ranks]
        for i in (0, 1):
            together = torch.cat([b[i] for b in per_rank])
            assert together.shape == (m * world_size, 16)
            assert torch.equal(together, torch.cat([single[world_size * k + j][i] for j in range(world_size)]))


def test_val_batches_are_fixed(data_cfg):
    stream = build_data(data_cfg, Layout(seq_len=32, micro_batch=4, seed=0))
    first = list(stream.val_batches(3))
    take(stream, 2)
    assert len(first) == 3 and same(list(stream.val_batches(3)), first)
    other = build_data(data_cfg, Layout(seq_len=32, micro_batch=4, seed=9, rank=1, world_size=2))
    assert same(list(other.val_batches(3)), first)
    assert not torch.equal(first[0][0], first[1][0])
    for x, y in first:
        assert torch.equal(x[:, 1:], y[:, :-1])


def test_val_batches_do_not_move_training():
    a, b = (build_data(synth(), Layout(seq_len=16, micro_batch=2, seed=0)) for _ in range(2))
    list(a.val_batches(4))
    assert same(take(a, 3), take(b, 3))


# --- synthetic -----------------------------------------------------------------------------


def test_synthetic_is_deterministic_from_its_seed():
    a, b, c = synthetic_split(synth()), synthetic_split(synth()), synthetic_split(synth(data_seed=1))
    assert np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1])
    assert not np.array_equal(a[0], c[0])
    assert a[2] == 256 and int(a[0].max()) < 256 and len(a[1]) == int(20_000 * 0.05)
    stream = build_data(synth(vocab_size=64, n_tokens=5_000), Layout(seq_len=8, micro_batch=2, seed=0))
    assert stream.vocab_size == 64 and int(stream.next_batch()[0].max()) < 64


def test_a_tiny_model_learns_synthetic_data():
    torch.manual_seed(0)
    stream = build_data(synth(n_tokens=50_000), Layout(seq_len=32, micro_batch=16, seed=0))
    v = stream.vocab_size
    model = torch.nn.Sequential(torch.nn.Embedding(v, 64), torch.nn.Linear(64, v))

    def val_loss() -> float:
        with torch.no_grad():
            return float(
                np.mean(
                    [
                        torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten()).item()
                        for x, y in stream.val_batches(4)
                    ]
                )
            )

    before = val_loss()
    for _ in range(150):
        x, y = stream.next_batch()
        loss = torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
        model.zero_grad()
        loss.backward()
        with torch.no_grad():  # plain SGD: torch.optim's first use costs seconds of imports
            for p in model.parameters():
                p -= 2.0 * p.grad
    assert before > 0.9 * math.log(v)
    assert val_loss() < 0.4 * before


# --- fineweb_edu (no network: the stream logic on an in-memory dataset) ----------------------


def _docs_stream(n_docs: int, shards: int):
    from datasets import Dataset

    texts = [f"Document {i}. " + " ".join(f"word{(i * 7 + j) % 50}" for j in range(5 + i % 17)) for i in range(n_docs)]
    return Dataset.from_dict({"text": texts}).to_iterable_dataset(num_shards=shards)


def _token_stream(text_cfg, rank=0, world_size=1, workers=0):
    """Rank ``rank``'s stream of 60 documents in 4 shards, the first 10 held out for validation."""
    from readback.data.fineweb import TokenStream, hold_out

    tok = build_data(text_cfg, Layout(seq_len=16, micro_batch=2, seed=0)).tokenizer
    train, val = hold_out(_docs_stream(60, shards=4), 10)
    return TokenStream(
        train,
        val,
        tok,
        eos=0,
        vocab_size=text_cfg.vocab_size,
        layout=Layout(seq_len=16, micro_batch=2, seed=0, rank=rank, world_size=world_size),
        doc_batch=4,
        workers=workers,
        fingerprint="t",
    )


def _documents(stream, batches) -> list[int]:
    """The numbers of the documents that ``batches`` (consecutive, from one stream) begin."""
    text = stream.tokenizer.decode(torch.cat([x.flatten() for x, _ in batches]).tolist())
    return [int(n) for n in re.findall(r"Document (\d+)\.", text)]


def test_streaming_ranks_read_disjoint_shares_and_validation_is_held_out(text_cfg):
    single = _token_stream(text_cfg)
    batches = take(single, 100)  # more than one pass over the 50 training documents
    assert single.state_dict()["epoch"] == 1
    for x, y in batches:
        assert x.shape == (2, 16) and torch.equal(x[:, 1:], y[:, :-1])
    assert set(_documents(single, batches)) == set(range(10, 60))
    r0, r1 = _token_stream(text_cfg, 0, 2), _token_stream(text_cfg, 1, 2)
    share0, share1 = set(_documents(r0, take(r0, 12))), set(_documents(r1, take(r1, 12)))
    assert share0 and share1 and not share0 & share1 and share0 | share1 <= set(range(10, 60))
    val = list(single.val_batches(3))
    assert same(list(r1.val_batches(3)), val) and same(list(single.val_batches(3)), val)
    val_text = single.tokenizer.decode(val[0][0][0].tolist())
    assert "Document" in val_text and not any(f"Document {i}." in val_text for i in range(10, 60))
    with pytest.raises(ConfigError, match="rank1/2"):
        r1.load_state_dict(r0.state_dict())  # another rank's share


@pytest.mark.parametrize("rank, world_size, workers, stop", [(0, 1, 0, 5), (1, 2, 0, 45), (0, 2, 2, 45)])
def test_streaming_resume_continues_with_the_same_batches(text_cfg, rank, world_size, workers, stop):
    straight = take(_token_stream(text_cfg, rank, world_size, workers), stop + 5)
    stopped = _token_stream(text_cfg, rank, world_size, workers)
    take(stopped, stop)  # 45: past the end of the rank's share (about 40 batches), in its second epoch
    state = stopped.state_dict()
    assert len(state["workers"]) == max(workers, 1)
    resumed = _token_stream(text_cfg, rank, world_size, workers)
    resumed.load_state_dict(state)
    assert same(take(resumed, 5), straight[stop:])


def test_fineweb_without_network_fails_with_a_config_error(monkeypatch):
    import tokenizers

    def offline(*args, **kwargs):
        raise OSError("no network")

    monkeypatch.setattr(tokenizers.Tokenizer, "from_pretrained", offline)
    with pytest.raises(ConfigError) as info:
        build_data(load_data_cfg("fineweb_edu"), Layout(seq_len=16, micro_batch=2, seed=0))
    assert info.value.key == "data.tokenizer" and "\n" not in str(info.value)


# --- errors --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name, settings, key",
    [
        ("synthetic", {"val_fraction": 1.0}, "data.val_fraction"),
        ("synthetic", {"branching": 300}, "data.branching"),
        ("shakespeare", {"editions": "quarto"}, "data.editions"),
        ("shakespeare", {"vocab_size": 256}, "data.vocab_size"),
        ("shakespeare", {"files": []}, "data.files"),  # not the embedded texts, unasked
    ],
)
def test_bad_config_raises_config_error(name, settings, key):
    with pytest.raises(ConfigError) as info:
        load_data_cfg(name, **settings)
    assert info.value.key == key
    assert "\n" not in str(info.value) and key in str(info.value)


def test_an_unknown_dataset_is_refused_in_one_line():
    with pytest.raises(ConfigError) as info:
        toys.config("data.name=tiny_stories")
    assert info.value.key == "data.name" and "synthetic" in str(info.value)


def test_an_untyped_data_group_is_refused():
    with pytest.raises(TypeError, match="typed config"):
        build_data(OmegaConf.create({"name": "synthetic", "vocab_size": 64}), Layout(seq_len=8, micro_batch=2, seed=0))


def test_missing_or_empty_files_raise_config_error(tmp_path):
    empty, blank = tmp_path / "empty.txt", tmp_path / "blank.txt"
    empty.write_text("")
    blank.write_text("\n\n  \n")
    for files in ([str(tmp_path / "missing.txt")], [str(empty)], [str(blank)], [str(tmp_path / "*.md")]):
        with pytest.raises(ConfigError) as info:
            cfg = load_data_cfg("shakespeare", files=files, cache_dir=str(tmp_path / "cache"))
            build_data(cfg, Layout(seq_len=16, micro_batch=2, seed=0))
        assert info.value.key == "data.files" and files[0].split("/")[-1] in str(info.value)


def test_a_cache_that_cannot_be_written_is_one_line(tmp_path):
    """A ``data.cache_dir`` under a file (or read-only, or on a full disk): one line naming it."""
    (tmp_path / "file").write_text("")
    cfg = dataclasses.replace(_small_text_cfg(tmp_path), cache_dir=str(tmp_path / "file" / "cache"))
    with pytest.raises(ConfigError) as refused:
        build_data(cfg, Layout(seq_len=16, micro_batch=2, seed=0))
    line = str(refused.value)
    assert refused.value.key == "data.cache_dir" and "\n" not in line
    assert "valid: a cache directory this run can write (" in line and "Not a directory); set another" in line


def _small_text_cfg(tmp_path):
    text = tmp_path / "small.txt"
    words = ["ale", "bread", "cheese", "dough", "eggs", "figs", "grain", "honey"]
    text.write_text("".join(f"{words[i % 8]} and {words[(i * 3) % 8]}, line {i}\n" for i in range(400)))
    return load_data_cfg("shakespeare", files=[str(text)], vocab_size=300, block_lines=20, cache_dir=str(tmp_path))


def _cut(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:-100])


def _out_of_vocab(path: Path) -> None:
    ids = np.fromfile(path, dtype=np.uint16)
    ids[17] = 300
    ids.tofile(path)


def _record_says(dtype: str):
    """The token file's record saying its ids are ``dtype``: another version's, or edited."""

    def spoil(tokens: Path) -> None:
        record = tokens.with_name("tokens-b20.json")
        record.write_text(json.dumps({**json.loads(record.read_text()), "dtype": dtype}))

    return spoil


def _negative(tokens: Path) -> None:
    """The token file holding signed ids, one negative (with its record saying so)."""
    ids = np.fromfile(tokens, dtype=np.uint16).astype(np.int16)
    ids[17] = -3
    ids.tofile(tokens)
    _record_says("int16")(tokens)


def _offsets_decrease(index: Path) -> None:
    blocks = np.fromfile(index, dtype=np.int64).reshape(-1, 2)
    blocks[[0, 1], 0] = blocks[[1, 0], 0]
    blocks.tofile(index)


@pytest.mark.parametrize(
    ("damaged", "damage", "says"),
    [
        ("tokens-b20.bin", _cut, "it is truncated: it holds"),
        ("blocks-b20.bin", _cut, "it is truncated: it holds"),
        ("tokens-b20.json", _cut, "it is not a token file's record (JSONDecodeError)"),
        ("split-b20-f0.05/train.bin", _cut, "it is truncated: its splits hold"),
        ("split-b20-f0.05/val.bin", _out_of_vocab, "token 17 is id 300, outside the vocabulary of 300 ids"),
        ("tokens-b20.bin", _negative, "token 17 is id -3, negative"),
        ("tokens-b20.bin", _record_says("float16"), "its ids are float16, not integers"),
        ("blocks-b20.bin", _offsets_decrease, "offsets do not index its"),
    ],
)
def test_a_bad_token_file_is_refused_naming_it(tmp_path, damaged, damage, says):
    """The prepared corpus (token file, its index and record, the splits training maps): cut short
    by a copy or a full disk, or holding what no run can train on (ids outside the vocabulary,
    negative or not integers at all, an index out of order), is refused before training, naming
    the file (the splits by their folder when their sum is short)."""
    cfg = _small_text_cfg(tmp_path)
    build_data(cfg, Layout(seq_len=16, micro_batch=2, seed=0))
    (path,) = tmp_path.glob(f"text/*/{damaged}")
    damage(path)
    with pytest.raises(ConfigError) as refused:
        build_data(cfg, Layout(seq_len=16, micro_batch=2, seed=0))
    line = str(refused.value)
    named = path.parent if "splits hold" in says else path
    assert line.startswith(f"data.cache_dir='{named}' is not valid;") and says in line, line
    assert line.endswith("delete it to rebuild it") and "\n" not in line
    shutil.rmtree(named) if named.is_dir() else named.unlink()
    build_data(cfg, Layout(seq_len=16, micro_batch=2, seed=0))  # rebuilt


@pytest.mark.parametrize(
    "n_tokens, seq_len, fits",
    [
        (100, 32, "at most 4: a sequence takes seq_len + 1 tokens, and the data holds 95 training and 5 validation"),
        (1000, 49, None),
        (1000, 50, "at most 49"),
        (20, 8, "none can: the data holds 19 training and 1 validation"),
    ],
)
def test_a_sequence_longer_than_either_split_is_refused_when_the_stream_is_built(n_tokens, seq_len, fits):
    """Validation too: not at the first evaluation, after the run has trained."""
    layout = Layout(seq_len=seq_len, micro_batch=2, seed=0)
    if fits is None:
        assert len(list(build_data(synth(n_tokens=n_tokens), layout).val_batches(1)))
        return
    with pytest.raises(ConfigError) as info:
        build_data(synth(n_tokens=n_tokens), layout)
    assert (info.value.key, info.value.value) == ("model.seq_len", seq_len) and fits in str(info.value)


def test_impossible_layout_raises_config_error(tmp_path):
    with pytest.raises(ConfigError):
        build_data(synth(n_tokens=100), Layout(seq_len=200, micro_batch=2, seed=0))
    with pytest.raises(ConfigError):
        Layout(seq_len=16, micro_batch=2, seed=0, rank=2, world_size=2)
    with pytest.raises(ConfigError):
        Layout(seq_len=0, micro_batch=2, seed=0)
    with pytest.raises(ConfigError):
        list(build_data(synth(val_fraction=0.0), Layout(seq_len=16, micro_batch=2, seed=0)).val_batches(1))
