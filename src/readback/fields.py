"""Config fields that carry what they accept, so a key of the schema is one line.

``steps: int = integer(minimum=1)`` gives the type (OmegaConf enforces it while composing), the
range (tested in ``__post_init__``, which ``OmegaConf.to_object`` runs) and the words the user
reads when either is wrong. Defaults live in the YAML files, the user's view; a field here is
``MISSING`` until a YAML file sets it, unless a program other than ``train.py`` needs its default
too (``readback.convert`` takes the ``precision`` group's): then the field holds it (``default``)
and no YAML file repeats it.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable
from typing import Any, ClassVar

from omegaconf import MISSING

from readback.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class Valid:
    """What a field accepts: the words for the error line and the test (``None`` always passes)."""

    text: str
    test: Callable[[Any], bool]


def _field(valid: Valid, default: Any = MISSING) -> Any:
    if isinstance(default, list):
        return dataclasses.field(default_factory=lambda: list(default), metadata={"valid": valid})
    return dataclasses.field(default=default, metadata={"valid": valid})


def integer(minimum: int = 1, default: Any = MISSING) -> Any:
    return _field(Valid(f"an integer >= {minimum}", lambda v: v >= minimum), default)


def number(
    low: float, high: float = math.inf, *, low_open: bool = False, high_open: bool = False, default: Any = MISSING
) -> Any:
    """A finite number in the interval (``inf`` and ``nan`` are refused everywhere)."""
    if high == math.inf:
        text = (
            "a positive number"
            if (low, low_open) == (0, True)
            else f"a finite number {'>' if low_open else '>='} {low:g}"
        )
    else:
        text = f"a number in {'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"

    def test(v: float) -> bool:
        above = v > low if low_open else v >= low
        below = v < high if high_open else v <= high
        return math.isfinite(v) and above and below

    return _field(Valid(text, test), default)


def one_of(choices: Iterable[str | int], default: Any = MISSING, note: str = "") -> Any:
    """One of ``choices``; a ``None`` default makes null a choice too (named first). ``note``
    follows the choices in a refusal, in parentheses: why a value one might expect is absent."""
    choices = tuple(choices)
    words = ", ".join(["null"] * (default is None) + [str(c) for c in choices]) + (f" ({note})" if note else "")
    return _field(Valid(words, lambda v: v in choices), default)


def items(text: str, test: Callable[[list[Any]], bool], default: Any = MISSING) -> Any:
    """A list field with a test over the whole list (its length, its items' ranges)."""
    return matching(text, test, default)


def matching(text: str, test: Callable[[Any], bool], default: Any = MISSING) -> Any:
    """A field whose values pass ``test``, which ``text`` describes (a setting of words and numbers)."""
    return _field(Valid(text, test), default)


def valid_text(schema: type, name: str) -> str | None:
    """The words for field ``name`` of ``schema``: its range, else its type."""
    field = next((f for f in dataclasses.fields(schema) if f.name == name), None)
    if field is None:
        return None
    if "valid" in field.metadata:
        return field.metadata["valid"].text
    kind = str(field.type)
    for word, text in (
        ("bool", "true, false"),
        ("int", "an integer"),
        ("float", "a number"),
        ("list", "a list"),
        ("str", "a string"),
    ):
        if word in kind:
            return text
    return None


class Checked:
    """Base of every config group: each field is tested against its ``Valid``, then ``check``
    runs the group's cross-field rules. ``KEY`` is the group's dotted place in the config."""

    KEY: ClassVar[str] = ""

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):  # type: ignore[arg-type]
            valid = field.metadata.get("valid")
            value = getattr(self, field.name)
            if valid is not None and value is not None and not valid.test(value):
                raise ConfigError(self.key(field.name), value, valid.text)
        self.check()

    def check(self) -> None:
        """Rules between this group's fields (none by default)."""

    @classmethod
    def key(cls, name: str) -> str:
        return f"{cls.KEY}.{name}" if cls.KEY else name
