"""``python -m readback.cli.prepare [overrides]``: prepare a local corpus ahead of training.

Takes the overrides a run takes (``data.files=[...]``, ``data.format=jsonl``, ``data.vocab_size``,
``data.cache_dir`` ...) and does what a run's first use does (``readback.data.tokenizer``): trains
the tokenizer, encodes the corpus into the token file and writes the validation split, with a
progress bar. Run again after a kill, it continues where it stopped. Prints where the files are.
Exit 2 with one line on stderr for a bad config or input.
"""

from __future__ import annotations

import sys

from readback.config import exit_on_bad_config, print_error
from readback.errors import ConfigError


def main(argv: list[str] | None = None) -> int:
    from hydra import compose, initialize_config_dir

    from readback.config import CONF_DIR, validate
    from readback.data.settings import ShakespeareData
    from readback.data.tokenizer import tokenized_corpus

    overrides = sys.argv[1:] if argv is None else argv
    exit_on_bad_config(overrides)
    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        data = validate(compose("train", overrides=overrides)).data
    if not isinstance(data, ShakespeareData):
        print_error(ConfigError("data", data.name, "a local corpus (data=shakespeare, with data.files)"))
        return 2
    try:
        corpus = tokenized_corpus(data)
    except ConfigError as error:
        print_error(error)
        return 2
    print(f"prepared {corpus.key}: {len(corpus.train)} training and {len(corpus.val)} validation tokens")
    return 0


if __name__ == "__main__":
    sys.exit(main())
