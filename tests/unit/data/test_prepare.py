"""Preparing a local corpus in bounded memory: streamed documents, the tokenizer from pieces, the
encoded token file (workers, resumption after a kill), JSON lines and Parquet, the same ids as
encoding whole documents."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer

import readback.data.prepare as prep
import readback.data.tokenizer as tokmod
from readback.data import Layout, build_data
from readback.data.corpus import shakespeare_files, val_blocks
from readback.data.documents import clean_lines, iter_blocks
from readback.data.token_file import load_token_file, paths
from readback.errors import ConfigError
from toys import load_data_cfg

TRICKY = [
    "\n\nfirst line\r\nsecond\rthird  \n\n   \n\tindented\n\n\n",
    "no final newline",
    "form\x0cfeed\x0b and a line separator\u2028 end\x85\n\n",
    "  \n lead blanks\n\n\nmiddle\n \n",
]


def whole_document_lines(text: str) -> list[str]:
    """A document's lines as the text route defined them on the whole text."""
    return (text.replace("\r\n", "\n").replace("\r", "\n").strip("\n") + "\n").splitlines(keepends=True)


@pytest.mark.parametrize("text", TRICKY)
def test_a_file_streamed_line_by_line_has_the_lines_of_the_whole_document(tmp_path, text):
    path = tmp_path / "doc.txt"
    path.write_bytes(text.encode())
    with open(path, encoding="utf-8") as f:
        assert list(clean_lines(f)) == whole_document_lines(text)
    lines = whole_document_lines(text)
    expected = [(0, "".join(lines[i : i + 2])) for i in range(0, len(lines), 2)]
    assert list(iter_blocks([path], "text", "text", 2)) == expected


def _texts(tmp_path: Path) -> list[Path]:
    """Lines ending in blanks, indented lines and blank runs: where cutting the text would move the
    pre-tokenizer's words, unless the cuts fall only between letters."""
    words = ["ale", "bread", "cheese", "dough", "eggs", "figs", "grain", "honey"]
    lines = [
        f"{' ' * (i % 5)}{words[i % 8]} and {words[i * 3 % 8]}{' ' * (i % 3)}, line {i}{' ' * (i % 2)}\n"
        + "\n" * (i % 4 == 0)
        for i in range(3000)
    ]
    files = []
    for k in range(2):
        files.append(tmp_path / f"t{k}.txt")
        files[-1].write_text("".join(lines[k::2]))
    return files


def test_the_tokenizer_from_pieces_is_the_one_whole_documents_train(tmp_path, monkeypatch):
    files = _texts(tmp_path)
    docs = ["".join(whole_document_lines(f.read_text())) for f in files]
    whole = tokmod.train_bpe(docs, 400, progress=False)
    monkeypatch.setattr(prep, "PIECE_CHARS", 500)  # many cuts
    pieces = list(prep.bpe_pieces(iter_blocks(files, "text", "text", 7), 1 << 30))
    assert len(pieces) > 10 and "".join(pieces) == "".join(docs)
    assert tokmod.train_bpe(pieces, 400, progress=False).to_str() == whole.to_str()
    cut_anywhere = [d[i : i + 500] for d in docs for i in range(0, len(d), 500)]
    assert tokmod.train_bpe(cut_anywhere, 400, progress=False).to_str() != whole.to_str()  # the cuts matter


@pytest.mark.parametrize("fraction", [0.0, 0.05, 0.1, 1 / 3, 0.37, 0.999])
def test_validation_blocks_keep_the_rule_of_one_block_at_a_time(fraction):
    rule = [int((i + 1) * fraction) > int(i * fraction) for i in range(100_000)]
    assert val_blocks(100_000, fraction).tolist() == rule


def test_the_sample_is_the_corpus_start_in_whole_blocks():
    blocks = [(0, "a" * 10 + "\n"), (0, "b" * 10 + "\n"), (1, "c" * 10 + "\n"), (1, "d\n")]
    assert list(prep.bpe_pieces(blocks, 12)) == ["a" * 10 + "\n" + "b" * 10 + "\n"]
    assert list(prep.bpe_pieces(blocks, 1 << 20)) == ["a" * 10 + "\nbbbbbbbbbb\n", "c" * 10 + "\nd\n"]


def test_embedded_plays_get_the_tokenizer_and_ids_of_whole_documents(tmp_path):
    """The route before this one: BPE on whole cleaned documents, then each block encoded."""
    plays = [f for f in shakespeare_files() if f.name.startswith(("macbeth", "julius"))]
    cfg = load_data_cfg("shakespeare", files=[str(p) for p in plays], vocab_size=400, cache_dir=str(tmp_path))
    docs = ["".join(whole_document_lines(p.read_text())) for p in plays]
    reference = tokmod.train_bpe(docs, 400, progress=False)
    blocks = list(iter_blocks(plays, "text", "text", cfg.block_lines))
    expected = [e.ids for e in reference.encode_batch([text for _, text in blocks])]
    build_data(cfg, Layout(seq_len=16, micro_batch=2, seed=0))
    (directory,) = (tmp_path / "text").iterdir()
    assert Tokenizer.from_file(str(directory / "tokenizer.json")).to_str() == reference.to_str()
    ids, offsets, block_doc = load_token_file(directory, cfg.block_lines, 400)
    assert ids.dtype == np.uint16 and block_doc.tolist() == [d for d, _ in blocks]
    assert [ids[a:b].tolist() for a, b in itertools.pairwise(offsets)] == expected


def _prepared(directory: Path, block_lines: int) -> list[bytes]:
    return [p.read_bytes() for p in paths(directory, block_lines)]


def _encode(files: list[Path], directory: Path, workers: int, blocks=None) -> None:
    tok_path = directory / "tokenizer.json"
    if not tok_path.exists():
        blocks_for_bpe = iter_blocks(files, "text", "text", 7)
        tokmod.train_bpe(prep.bpe_pieces(blocks_for_bpe, 1 << 30), 300, progress=False).save(str(tok_path))
    prep.encode_corpus(
        iter_blocks(files, "text", "text", 7) if blocks is None else blocks,
        tok_path,
        directory,
        7,
        300,
        workers=workers,
        total_bytes=sum(f.stat().st_size for f in files),
        progress=False,
    )


def test_a_kill_loses_at_most_the_chunks_in_flight_and_the_next_start_continues(tmp_path, monkeypatch):
    files = _texts(tmp_path)
    monkeypatch.setattr(prep, "CHUNK_CHARS", 2000)
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    for d in (straight, resumed):
        d.mkdir()
    _encode(files, straight, workers=0)
    n_chunks = sum(1 for _ in prep.chunks(iter_blocks(files, "text", "text", 7)))
    assert n_chunks > 20

    def killed_after(n):
        for i, chunk in enumerate(prep.chunks(iter_blocks(files, "text", "text", 7))):
            if i == n:
                raise KeyboardInterrupt  # the kill, with chunk n read and not yet encoded
            yield from zip(chunk[1], chunk[0])

    with pytest.raises(KeyboardInterrupt):
        _encode(files, resumed, workers=0, blocks=killed_after(13))
    record = json.loads((resumed / "tokens-b7.progress.json").read_text())
    assert record["chunks"] == 12  # one chunk was in flight (two tasks at most with one worker)
    encoded = []
    monkeypatch.setattr(prep, "encode_chunk", lambda texts: encoded.append(texts) or ENCODE(texts))
    _encode(files, resumed, workers=0)
    assert len(encoded) == n_chunks - 12  # only what was not written before
    assert _prepared(resumed, 7) == _prepared(straight, 7)
    assert not (resumed / "tokens-b7.progress.json").exists()


ENCODE = prep.encode_chunk


def test_worker_processes_write_the_same_file(tmp_path, monkeypatch):
    files = _texts(tmp_path)
    one, two = tmp_path / "one", tmp_path / "two"
    for d in (one, two):
        d.mkdir()
    _encode(files, one, workers=0)
    (two / "tokenizer.json").write_bytes((one / "tokenizer.json").read_bytes())
    monkeypatch.setattr(prep, "CHUNK_CHARS", 20_000)  # the parent's chunks; a spawned worker only encodes
    _encode(files, two, workers=2)
    assert _prepared(two, 7) == _prepared(one, 7)


def _records(n: int) -> list[dict]:
    return [{"id": i, "body": f"Record {i} says hello.\nIts second line {i}.\n" if i % 5 else ""} for i in range(n)]


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_json_lines_and_parquet_are_a_document_per_record(tmp_path, fmt):
    rows = _records(200)
    path = tmp_path / f"docs.{fmt}"
    if fmt == "jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    else:
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.table({"id": [r["id"] for r in rows], "body": [r["body"] for r in rows]}), path)
    blocks = list(iter_blocks([path], fmt, "body", 1))
    kept = [r["body"] for r in rows if r["body"]]  # the empty ones are skipped
    assert [d for d, _ in blocks] == [d for d in range(len(kept)) for _ in range(2)]
    assert "".join(t for _, t in blocks) == "".join(kept)
    cfg = load_data_cfg(
        "shakespeare",
        files=[str(path)],
        format=fmt,
        text_field="body",
        vocab_size=300,
        prepare_workers=0,
        cache_dir=str(tmp_path),
    )
    stream = build_data(cfg, Layout(seq_len=16, micro_batch=2, seed=0))
    assert "Record" in stream.tokenizer.decode(stream.next_batch()[0][0].tolist())


@pytest.mark.parametrize(
    "fmt, content, key, says",
    [
        ("jsonl", '{"body": "fine"}\nnot json\n', "data.files", "docs.jsonl:2"),
        ("jsonl", '{"body": 3}\n', "data.text_field", "a string field of every record"),
        ("jsonl", '{"text": "x"}\n', "data.files", "JSON objects with a string 'body'"),
        ("parquet", "not parquet at all", "data.files", "Parquet files"),
    ],
)
def test_bad_records_are_refused_in_one_line_naming_the_file(tmp_path, fmt, content, key, says):
    path = tmp_path / f"docs.{fmt}"
    path.write_text(content)
    cfg = load_data_cfg(
        "shakespeare", files=[str(path)], format=fmt, text_field="body", vocab_size=300, cache_dir=str(tmp_path)
    )
    with pytest.raises(ConfigError) as refused:
        build_data(cfg, Layout(seq_len=16, micro_batch=2, seed=0))
    assert refused.value.key == key and says in str(refused.value) and "\n" not in str(refused.value)


def test_a_parquet_file_without_the_column_is_refused(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "docs.parquet"
    pq.write_table(pa.table({"text": ["a b c\n"] * 3}), path)
    with pytest.raises(ConfigError) as refused:
        list(iter_blocks([path], "parquet", "body", 1))
    assert refused.value.key == "data.text_field" and "text" in str(refused.value)
