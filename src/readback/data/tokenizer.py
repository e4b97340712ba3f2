"""Byte-level BPE trained on the local corpus, and the corpus as token ids, both cached on disk.

Byte-level BPE (GPT-2 style) because it round-trips any text exactly and never emits an
unknown token; trained here rather than downloaded so the default corpus needs no network.
Training a 2048-token vocabulary on Shakespeare takes about a second and tokenising it a few
more, so both are done once and cached:

    <cache>/text/<corpus digest>-v<vocab>/tokenizer.json        keyed by file contents + vocab
    <cache>/text/<corpus digest>-v<vocab>/tokens-b<lines>.npz     + the block size of the split

The tokenizer is trained on the whole corpus (validation included): it is then a function of
the corpus and vocabulary alone, and changing ``val_fraction`` does not retrain it.
"""

from __future__ import annotations

import collections
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from readback.data import corpus
from readback.data.cache import atomic_write, bad_cache_file, build_lock, cache_root, check_token_arrays, digest
from readback.data.settings import ShakespeareData
from readback.progress import progress as progress_of

EOS = "<|endoftext|>"
FORMAT = "readback-text-v1"  # bump when tokenisation or the cache layout changes
BUILDS: collections.Counter[str] = collections.Counter()  # how often each stage really ran


def train_bpe(docs: list[str], vocab_size: int, *, progress: bool = True) -> Any:
    """A byte-level BPE tokenizer with ``vocab_size`` entries (``EOS`` is id 0) trained on ``docs``."""
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
    tok.train_from_iterator(docs, trainer=trainer, length=len(docs))
    return tok


def encode_blocks(
    tok: Any, texts: list[str], *, progress: bool = True, chunk: int = 256
) -> tuple[np.ndarray, np.ndarray]:
    """All ``texts`` encoded back to back, and ``offsets`` so text i is ``ids[offsets[i]:offsets[i+1]]``."""
    BUILDS["tokens"] += 1
    pieces: list[np.ndarray] = []
    bar = progress_of(len(texts), desc="tokenising", unit="block", enabled=progress)  # plain lines in a log file
    for i in range(0, len(texts), chunk):
        pieces.extend(np.asarray(e.ids, dtype=np.int64) for e in tok.encode_batch(texts[i : i + chunk]))
        bar.update(min(chunk, len(texts) - i))
    bar.close()
    lengths = np.fromiter((len(p) for p in pieces), dtype=np.int64, count=len(pieces))
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    ids = np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.int64)
    return ids.astype(np.uint16 if tok.get_vocab_size() <= 1 << 16 else np.uint32), offsets


@dataclass(frozen=True)
class TokenizedCorpus:
    """The corpus as token ids, cut into the line blocks that the train/val split assigns."""

    tokenizer: Any  # tokenizers.Tokenizer
    ids: np.ndarray  # all blocks back to back
    offsets: np.ndarray  # block i is ids[offsets[i]:offsets[i + 1]]
    block_doc: np.ndarray  # the document each block comes from
    key: str  # cache key: corpus contents, vocabulary, block size
    eos: int


def tokenized_corpus(cfg: ShakespeareData, *, progress: bool = True) -> TokenizedCorpus:
    """Load the tokenizer and token ids from the cache, building (once, under a lock) what is missing."""
    vocab_size, block_lines = cfg.vocab_size, cfg.block_lines
    files = corpus.corpus_files(cfg.files, cfg.editions)
    corpus_key = digest([FORMAT, *(part for f in files for part in (f.name, f.read_bytes()))])
    directory = cache_root(cfg.cache_dir) / "text" / f"{corpus_key}-v{vocab_size}"
    tok_path, ids_path = directory / "tokenizer.json", directory / f"tokens-b{block_lines}.npz"

    if not (tok_path.exists() and ids_path.exists()):
        with build_lock(directory):  # other ranks wait here, then find the files built
            _build(cfg, files, tok_path, ids_path, vocab_size, block_lines, progress)
    return _load(tok_path, ids_path, f"{directory.name}-b{block_lines}", vocab_size)


def _build(
    cfg: ShakespeareData,
    files: list[Path],
    tok_path: Path,
    ids_path: Path,
    vocab_size: int,
    block_lines: int,
    progress: bool,
) -> None:
    from tokenizers import Tokenizer

    if tok_path.exists() and ids_path.exists():
        return
    docs = corpus.load_documents(files, cache_root(cfg.cache_dir) / "hf-datasets")
    if tok_path.exists():
        tok = Tokenizer.from_file(str(tok_path))
    else:
        tok = train_bpe(docs, vocab_size, progress=progress)
        atomic_write(tok_path, tok.save, by_name=True)
    blocks = corpus.blocks(docs, block_lines)
    ids, offsets = encode_blocks(tok, [b.text for b in blocks], progress=progress)
    block_doc = np.asarray([b.doc for b in blocks], dtype=np.int32)
    atomic_write(ids_path, lambda f: np.savez(f, ids=ids, offsets=offsets, block_doc=block_doc))


def _load(tok_path: Path, ids_path: Path, key: str, vocab_size: int) -> TokenizedCorpus:
    from tokenizers import Tokenizer

    try:
        tok = Tokenizer.from_file(str(tok_path))
    except Exception as e:  # a cut or garbled tokenizer.json
        raise bad_cache_file(tok_path, f"it does not load ({' '.join(str(e).split())[:120]})") from None
    ids, offsets, block_doc = read_token_shard(ids_path, vocab_size)
    eos = tok.token_to_id(EOS)
    if eos is None:  # not a tokenizer this module trained
        raise bad_cache_file(tok_path, f"it has no {EOS} token, so readback did not train it")
    return TokenizedCorpus(tok, ids, offsets, block_doc, key, eos)


def read_token_shard(path: Path, vocab_size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(ids, offsets, block_doc)`` of a cached token file, or a ``ConfigError`` naming it and
    what is wrong: not a whole archive of those arrays, or arrays a run cannot train on
    (:func:`~readback.data.cache.check_token_arrays`)."""
    try:
        with np.load(path) as z:
            ids, offsets, block_doc = z["ids"], z["offsets"], z["block_doc"]
    except (OSError, ValueError, EOFError, KeyError, zipfile.BadZipFile) as e:
        raise bad_cache_file(
            path, f"it is truncated or not a token file ({type(e).__name__}: {' '.join(str(e).split())})"
        ) from None
    check_token_arrays(path, vocab_size, ids, offsets, block_doc)
    return ids, offsets, block_doc
