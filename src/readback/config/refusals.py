"""OmegaConf's and Hydra's errors, said as the one line a user reads: key, value, valid choices.

Everything here reads the errors' fields (``full_key``, ``key``, ``value``, ``object_type``, the
missing option's name), the schema and the conf directory; nothing parses error text.
"""

from __future__ import annotations

import dataclasses
import difflib
from pathlib import Path
from typing import Any

from hydra.errors import MissingConfigException
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigAttributeError, ConfigKeyError, MissingMandatoryValue, ValidationError

from readback.config.store import OPTION_SCHEMAS, schema_keys
from readback.errors import ConfigError
from readback.fields import valid_text
from readback.overrides import RENAMED_KEYS, override_map

CONF_DIR = Path(__file__).resolve().parents[3] / "conf"


class UnknownKey(ConfigError):
    """A key no schema declares (a typo, a key of another option, or a ``+key`` nothing reads)."""

    def __init__(self, key: str, value: object, hint: str):
        ValueError.__init__(self, f"{key}={value!r} is not {hint}")
        self.key, self.value, self.valid = key, value, hint


def options(group: str) -> list[str]:
    """The options of a config group: its YAML files."""
    return sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml"))


def from_schema_error(error: BaseException) -> ConfigError | None:
    """``ConfigError`` for a value the schema refuses (wrong type, unset), else ``None``."""
    if isinstance(error, MissingMandatoryValue):
        schema, name = error.object_type, str(error.key)
        return ConfigError(str(error.full_key), "???", _words(schema, name) or "a value")
    if isinstance(error, ValidationError):
        return ConfigError(
            str(error.full_key),
            error.value,
            _words(error.object_type, str(error.key)) or "a value of the type its group's schema declares",
        )
    return None


def _words(schema: Any, name: str) -> str | None:
    return valid_text(schema, name) if isinstance(schema, type) and dataclasses.is_dataclass(schema) else None


def from_composition_error(error: Exception, overrides: list[str]) -> ConfigError | None:
    """``ConfigError`` for Hydra's composition errors: an unknown option, key, type."""
    if isinstance(error, MissingConfigException) and error.missing_cfg_file and "/" in error.missing_cfg_file:
        group, option = error.missing_cfg_file.rsplit("/", 1)
        return ConfigError(group, option, options(group))
    cause: BaseException = error
    while cause.__cause__ is not None and not isinstance(
        cause, (ConfigAttributeError, ConfigKeyError, ValidationError)
    ):
        cause = cause.__cause__
    if isinstance(cause, (ConfigAttributeError, ConfigKeyError)) and cause.full_key:
        return unknown_key(cause.full_key, _override_value(cause.full_key, overrides), overrides)
    return from_schema_error(cause)


def _override_value(key: str, overrides: list[str]) -> str | None:
    return next((o.split("=", 1)[1] for o in overrides if o.lstrip("+~").split("=")[0] == key), None)


def unknown_key(key: str, value: object, overrides: list[str]) -> UnknownKey:
    """Where the key lives instead: another option of its group, or the nearest known key."""
    group, _, rest = key.partition(".")
    owners = [
        o for o, schema in OPTION_SCHEMAS.get(group, {}).items() if rest in {f.name for f in dataclasses.fields(schema)}
    ]
    if owners:
        chosen = next(
            (o.split("=", 1)[1] for o in reversed(overrides) if o.lstrip("+~").split("=")[0] == group),
            _default_option(group),
        )
        return UnknownKey(
            key, value, f"a key of {group}={chosen}; it is one of " + ", ".join(f"{group}={o}" for o in owners)
        )
    known = schema_keys()
    hint = difflib.get_close_matches(key, known, n=1, cutoff=0.6) or difflib.get_close_matches(group, known, n=1)
    return UnknownKey(
        key, value, "a config key" + (f"; did you mean {hint[0]}?" if hint else "; see python train.py --cfg job")
    )


def old_spelling(overrides: list[str]) -> ConfigError | None:
    """A key that was renamed (``RENAMED_KEYS``) on the command line, or a group that became a key
    (``policy``) still picked in an experiment file's defaults, refused naming the new key."""
    given = override_map(overrides)
    for old, new in RENAMED_KEYS.items():
        if old in given:
            return UnknownKey(old, given[old], f"a config key any more: it is {new} (e.g. {new}={given[old]})")
    groups_now_keys = {old.removesuffix(".name") for old in RENAMED_KEYS if old.endswith(".name")}
    experiment = CONF_DIR / "experiment" / f"{given.get('experiment')}.yaml"
    overlay = OmegaConf.to_container(OmegaConf.load(experiment)) if experiment.is_file() else {}
    for entry in overlay.get("defaults", []) if isinstance(overlay, dict) else []:
        for choice, option in entry.items() if isinstance(entry, dict) else []:
            group = str(choice).removeprefix("override /")
            if group in groups_now_keys:
                return ConfigError(f"{experiment.stem}: override /{group}", option, f"{group}: {option} (a key now)")
    return None


def _default_option(group: str) -> str:
    for entry in OmegaConf.load(CONF_DIR / "train.yaml").defaults:
        if OmegaConf.is_dict(entry) and group in entry:
            return str(entry[group])
    return "?"


def first_undeclared_key(cfg: DictConfig, prefix: str = "") -> tuple[str, Any] | None:
    """``(dotted key, value)`` of the first key that no schema declares: Hydra adds ``+key``
    overrides even to typed nodes, and ``OmegaConf.to_object`` would drop them silently."""
    schema = OmegaConf.get_type(cfg)
    declared = {f.name for f in dataclasses.fields(schema)} if dataclasses.is_dataclass(schema) else None
    for key, node in cfg.items_ex(resolve=False):
        if not prefix and key == "hydra":
            continue
        if declared is not None and key not in declared:
            value = OmegaConf.to_container(node) if OmegaConf.is_config(node) else node
            return f"{prefix}{key!s}", value
        if OmegaConf.is_dict(node):
            found = first_undeclared_key(node, f"{prefix}{key!s}.")
            if found:
                return found
    return None
