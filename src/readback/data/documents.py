"""A local corpus read as a stream of line blocks, never a whole file or corpus at once.

``data.format`` says what a document is: ``text``, a whole file; ``jsonl``, a line's JSON object
(its ``data.text_field``); ``parquet``, a record (that column), read a row group's batch at a
time. A document's text is cleaned (line endings made ``\\n``, blank lines at its start and end
dropped, a final ``\\n``) and cut into blocks of ``block_lines`` lines (``str.splitlines``'s
lines), the unit of the train/validation split; the last block of a document may be shorter.
A text file is cleaned line by line as it is read, so a file of any size is streamed; a record
is held whole, as its format stores it. Records with no text are skipped.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from pathlib import Path

from readback.errors import ConfigError

FORMATS: tuple[str, ...] = ("text", "jsonl", "parquet")
Block = tuple[int, str]  # (document number, the text of block_lines lines of it)


def clean_lines(raw_lines: Iterable[str]) -> Iterator[str]:
    """The lines of a cleaned document from its ``\\n``-terminated lines (universal newlines):
    the same as ``text.strip("\\n") + "\\n"`` cut by ``splitlines(keepends=True)``, lazily."""
    blank_run: list[str] = []  # "\n" lines held until a line with text follows (dropped at the end)
    started = False
    for raw in raw_lines:
        if raw == "\n":
            if started:
                blank_run.append(raw)
            continue
        started = True
        yield from blank_run
        blank_run.clear()
        yield from (raw if raw.endswith("\n") else raw + "\n").splitlines(keepends=True)


def _blocks_of(doc: int, lines: Iterable[str], block_lines: int) -> Iterator[Block]:
    block: list[str] = []
    for line in lines:
        block.append(line)
        if len(block) == block_lines:
            yield doc, "".join(block)
            block.clear()
    if block:
        yield doc, "".join(block)


def _text_lines(text: str) -> Iterator[str]:
    return clean_lines(text.replace("\r\n", "\n").replace("\r", "\n").splitlines(keepends=True))


def _jsonl_texts(path: Path, field: str) -> Iterator[str]:
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
                text = record[field]
            except (json.JSONDecodeError, TypeError, KeyError) as e:
                raise ConfigError(
                    "data.files", f"{path}:{number}", f"JSON objects with a string {field!r} ({type(e).__name__})"
                ) from None
            if not isinstance(text, str):
                raise ConfigError("data.text_field", field, f"a string field of every record ({path}:{number})")
            yield text


def _parquet_texts(path: Path, field: str, batch_rows: int = 1024) -> Iterator[str]:
    import pyarrow.parquet as pq

    try:
        table = pq.ParquetFile(path)
    except Exception as e:  # pyarrow's errors for a file that is not Parquet
        raise ConfigError("data.files", str(path), f"Parquet files ({type(e).__name__})") from None
    if field not in table.schema_arrow.names:
        raise ConfigError("data.text_field", field, f"a column of {path} ({', '.join(table.schema_arrow.names)})")
    for batch in table.iter_batches(batch_size=batch_rows, columns=[field]):
        yield from (t for t in batch.column(0).to_pylist() if t is not None)


def iter_blocks(files: list[Path], fmt: str, text_field: str, block_lines: int) -> Iterator[Block]:
    """Every block of the corpus in order, numbered by document (see the module doc)."""
    doc = 0
    for path in files:
        if fmt == "text":
            with open(path, encoding="utf-8") as f:  # universal newlines, as the text is cleaned
                yield from _blocks_of(doc, clean_lines(f), block_lines)
            doc += 1
            continue
        texts = _jsonl_texts(path, text_field) if fmt == "jsonl" else _parquet_texts(path, text_field)
        for text in texts:
            lines = list(_text_lines(text))
            if lines:
                yield from _blocks_of(doc, lines, block_lines)
                doc += 1
