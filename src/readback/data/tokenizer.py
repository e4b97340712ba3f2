"""Byte-level BPE trained on the local corpus, and the corpus as token ids, both cached on disk.

Byte-level BPE (GPT-2 style) because it round-trips any text exactly and never emits an
unknown token; trained here rather than downloaded so the default corpus needs no network.
The corpus is prepared once (``readback.data.prepare``: at a run's first use, or ahead with
``python -m readback.cli.prepare``) and cached:

    <cache>/text/<corpus digest>-v<vocab>/tokenizer.json         keyed by file contents + vocab
    <cache>/text/<corpus digest>-v<vocab>/tokens-b<lines>.*       + the block size of the split
    <cache>/text/<corpus digest>-v<vocab>/split-b<lines>-f<fraction>/   the packed splits

(the token file's layout: ``readback.data.token_file``). The tokenizer is trained on the whole
corpus up to ``data.tokenizer_sample_mb`` MB (validation included): it is then a function of the
corpus and vocabulary alone, and changing ``val_fraction`` does not retrain it.
"""

from __future__ import annotations

import collections
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from readback.data import corpus, token_file
from readback.data.cache import atomic_write, bad_cache_file, build_lock, cache_root, digest
from readback.data.documents import iter_blocks
from readback.data.prepare import MB, Megabytes, bpe_pieces, encode_corpus
from readback.data.settings import ShakespeareData

EOS = "<|endoftext|>"
FORMAT = "readback-text-v1"  # bump when tokenisation changes (its key: a new version trains anew)
BUILDS: collections.Counter[str] = collections.Counter()  # how often each stage really ran


def train_bpe(texts: Iterable[str], vocab_size: int, *, progress: bool = True) -> Any:
    """A byte-level BPE tokenizer with ``vocab_size`` entries (``EOS`` is id 0) trained on ``texts``,
    read as a stream (the trainer keeps its word counts, not the texts)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    BUILDS["tokenizer"] += 1
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS],
        show_progress=progress and sys.stderr.isatty(),  # no bars in log files
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


@dataclass(frozen=True)
class TokenizedCorpus:
    """The corpus's packed train and validation token streams, mapped from the cache."""

    tokenizer: Any  # tokenizers.Tokenizer
    train: np.ndarray  # read-only maps
    val: np.ndarray
    key: str  # cache key: corpus contents, vocabulary, block size
    eos: int


def corpus_key(cfg: ShakespeareData, files: list[Path]) -> str:
    """The corpus's digest: its files' names and contents; what a document is, for JSON lines and
    Parquet; the BPE's sample size where it leaves text out (the embedded texts' key as before)."""
    parts: list[str | Path] = [FORMAT, *(part for f in files for part in (f.name, f))]
    if cfg.format != "text":
        parts.append(f"format={cfg.format}:{cfg.text_field}")
    if sum(f.stat().st_size for f in files) > cfg.tokenizer_sample_mb * MB:
        parts.append(f"bpe_sample_mb={cfg.tokenizer_sample_mb}")
    return digest(parts)


def tokenized_corpus(cfg: ShakespeareData, *, progress: bool = True) -> TokenizedCorpus:
    """The packed splits of ``cfg``'s corpus, preparing (once, under a lock) what the cache lacks."""
    vocab_size, block_lines = cfg.vocab_size, cfg.block_lines
    files = corpus.corpus_files(cfg.files, cfg.editions, cfg.format)
    directory = cache_root(cfg.cache_dir) / "text" / f"{corpus_key(cfg, files)}-v{vocab_size}"
    tok_path = directory / "tokenizer.json"
    train_path, val_path = token_file.split_files(directory, block_lines, cfg.val_fraction)
    if not all(p.exists() for p in (tok_path, *token_file.paths(directory, block_lines))):
        with build_lock(directory):  # other ranks wait here, then find the files built
            prepare(cfg, files, directory, progress=progress)
    tok = _load_tokenizer(tok_path)
    eos = tok.token_to_id(EOS)
    ids, offsets, block_doc = token_file.load_token_file(directory, block_lines, vocab_size)
    is_val = corpus.val_blocks(len(block_doc), cfg.val_fraction)
    if not val_path.exists():
        with build_lock(directory):
            _split(train_path, val_path, ids, offsets, block_doc, is_val, eos)
    train, val = token_file.load_split(train_path, val_path, ids, block_doc, is_val, vocab_size)
    return TokenizedCorpus(tok, train, val, f"{directory.name}-b{block_lines}", eos)


def prepare(cfg: ShakespeareData, files: list[Path], directory: Path, *, progress: bool = True) -> None:
    """The tokenizer and token file in ``directory``, each unless already there (a token file cut
    short by a kill continues where it stopped)."""
    tok_path = directory / "tokenizer.json"
    if not tok_path.exists():
        blocks = iter_blocks(files, cfg.format, cfg.text_field, cfg.block_lines)
        sample = min(cfg.tokenizer_sample_mb * MB, sum(f.stat().st_size for f in files))
        bar = Megabytes(sample, 0, "tokenizer sample", enabled=progress)
        tok = train_bpe(_read(bpe_pieces(blocks, cfg.tokenizer_sample_mb * MB), bar), cfg.vocab_size, progress=False)
        bar.finish()
        atomic_write(tok_path, tok.save, by_name=True)
    if not all(p.exists() for p in token_file.paths(directory, cfg.block_lines)):
        BUILDS["tokens"] += 1
        encode_corpus(
            iter_blocks(files, cfg.format, cfg.text_field, cfg.block_lines),
            tok_path,
            directory,
            cfg.block_lines,
            cfg.vocab_size,
            workers=cfg.prepare_workers,
            total_bytes=sum(f.stat().st_size for f in files),
            progress=progress,
        )


def _read(pieces: Iterable[str], bar: Megabytes) -> Iterator[str]:
    """``pieces``, counted on ``bar`` as the BPE trainer reads them."""
    for piece in pieces:
        yield piece
        bar.advance(len(piece))


def _split(
    train_path: Path,
    val_path: Path,
    ids: np.ndarray,
    offsets: np.ndarray,
    block_doc: np.ndarray,
    is_val: np.ndarray,
    eos: int,
) -> None:
    """The packed train and validation files, unless there (the validation file, renamed last, marks both)."""
    if val_path.exists():
        return
    train_path.parent.mkdir(parents=True, exist_ok=True)
    partial = {False: train_path.with_name(".train.partial"), True: val_path.with_name(".val.partial")}
    with open(partial[False], "wb") as train, open(partial[True], "wb") as val:
        token_file.write_split(ids, offsets, block_doc, is_val, eos, {False: train, True: val})
    partial[False].replace(train_path)
    partial[True].replace(val_path)


def _load_tokenizer(path: Path) -> Any:
    from tokenizers import Tokenizer

    try:
        tok = Tokenizer.from_file(str(path))
    except Exception as e:  # a cut or garbled tokenizer.json
        raise bad_cache_file(path, f"it does not load ({' '.join(str(e).split())[:120]})") from None
    if tok.token_to_id(EOS) is None:  # not a tokenizer this module trained
        raise bad_cache_file(path, f"it has no {EOS} token, so readback did not train it")
    return tok
