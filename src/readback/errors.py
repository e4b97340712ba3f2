"""The error users see for a bad configuration or input: one line, key, value and the fix."""

from __future__ import annotations

import re
from collections.abc import Iterable


class ConfigError(ValueError):
    """A configuration or input the run cannot start with.

    Entry points print ``str(error)`` as one line on stderr and exit with code 2 before any
    work is done or any file is written.
    """

    def __init__(self, key: str, value: object, valid: Iterable[object] | str):
        self.key, self.value = key, value
        self.valid = valid if isinstance(valid, str) else ", ".join(str(v) for v in valid)
        super().__init__(f"{key}={value!r} is not valid; valid: {self.valid}")


class StateChanged(ConfigError):
    """A checkpointed state of another config than the run's (other data): a resume refuses it,
    unless it goes on under a changed config (``trainer.resume_changed_config``); then the
    component starts afresh instead, as ``afresh`` says."""

    def __init__(self, key: str, value: object, valid: str, afresh: str):
        super().__init__(key, value, valid)
        self.afresh = afresh


class NumericsError(RuntimeError):
    """A run's numerics reached a value they cannot go on with, which no config check could see
    (a site's scale that is no usable FP32 number): the run ends ``failed``, naming the site,
    never ``diverged``, since the model did not blow up: its rounding did."""


def require(condition: bool, key: str, value: object, valid: Iterable[object] | str) -> None:
    """Raise ``ConfigError(key, value, valid)`` unless ``condition`` holds."""
    if not condition:
        raise ConfigError(key, value, valid)


def some_of(names: Iterable[str], most: int = 12) -> str:
    """``names`` as a refusal lists what exists: layer indices folded into a glob
    (``layers.*.mlp.up``), each name once, the first ``most`` and how many there are."""
    kinds = list(dict.fromkeys(re.sub(r"(^|\.)layers\.\d+\.", r"\1layers.*.", n) for n in names))
    return ", ".join(kinds[:most]) + (f", ... ({len(kinds)} in all)" if len(kinds) > most else "")


def choose(key: str, value: str, valid: Iterable[str]) -> str:
    """``value`` if it is one of ``valid``, else a ``ConfigError`` listing them."""
    valid = list(valid)
    require(value in valid, key, value, valid)
    return value
