"""The ``data`` group's schema: one dataclass per dataset (``conf/data/<name>.yaml``)."""

from __future__ import annotations

from dataclasses import dataclass

from omegaconf import MISSING

from readback.data.corpus import EDITIONS
from readback.data.documents import FORMATS
from readback.errors import require
from readback.fields import Checked, integer, number, one_of

DATASETS: tuple[str, ...] = ("shakespeare", "synthetic", "fineweb_edu")


@dataclass
class Data(Checked):
    KEY = "data"
    name: str = one_of(DATASETS)
    vocab_size: int = integer(minimum=2)


@dataclass
class ShakespeareData(Data):
    val_fraction: float = number(0, 1, high_open=True)
    block_lines: int = integer()
    editions: str = one_of(EDITIONS)
    files: list[str] | None = None  # readable text files, checked by readback.config.entry
    format: str = one_of(FORMATS)
    text_field: str = MISSING
    tokenizer_sample_mb: int = integer()
    prepare_workers: int = integer(minimum=0)
    cache_dir: str | None = None

    def check(self) -> None:
        require(self.vocab_size >= 257, "data.vocab_size", self.vocab_size, "an integer >= 257 (256 bytes + EOS)")
        require(  # an empty list would fall back to the embedded texts unasked
            self.files is None or len(self.files) > 0,
            "data.files",
            self.files,
            "null (the embedded texts) or a non-empty list of text files / globs",
        )


@dataclass
class SyntheticData(Data):
    n_tokens: int = integer(minimum=4)
    val_fraction: float = number(0, 1, high_open=True)
    data_seed: int = integer(minimum=0)
    branching: int = integer()
    noise: float = number(0, 1)

    def check(self) -> None:
        require(self.branching <= self.vocab_size, "data.branching", self.branching, f"1..{self.vocab_size}")


@dataclass
class FinewebData(Data):
    path: str = MISSING
    subset: str = MISSING
    tokenizer: str = MISSING
    eos_token: str = MISSING
    val_docs: int = integer()
    shuffle_buffer: int = integer(minimum=0)
    doc_batch: int = integer()
    loader_workers: int = integer(minimum=0)
    prefetch: int = integer()
