"""The schema (each group's dataclass, kept in the layer it configures; the run's ``Config`` in
``readback.train.settings``) in Hydra's ``ConfigStore``: ``Config`` as ``schema`` and each option schema as
``<group>/schema_<option>``, and every key it declares (for the refusals' "did you mean")."""

from __future__ import annotations

import dataclasses
import typing

from hydra.core.config_store import ConfigStore

from readback.backends.hf import HfModel
from readback.backends.settings import Backend, TeBackend
from readback.data.settings import FinewebData, ShakespeareData, SyntheticData
from readback.numerics.precision_settings import Fp8Settings, PrecisionSettings
from readback.train.settings import Config, Logger, WandbLogger

# Option schemas of the groups whose options differ in keys: conf/<group>/<option>.yaml names
# ``schema_<option>`` first in its defaults list.
OPTION_SCHEMAS: dict[str, dict[str, type]] = {
    "model": {"hf": HfModel},
    "precision": {"fp8": Fp8Settings, "bf16": PrecisionSettings},
    "data": {"shakespeare": ShakespeareData, "synthetic": SyntheticData, "fineweb_edu": FinewebData},
    "backend": {"emulated": Backend, "te": TeBackend},
    "logger": {"none": Logger, "wandb": WandbLogger},
}
SCHEMA_PREFIX = "schema_"


def register() -> None:
    """Put the schema in Hydra's ``ConfigStore`` (idempotent)."""
    store = ConfigStore.instance()
    store.store(name="schema", node=Config)
    for group, options in OPTION_SCHEMAS.items():
        for option, schema in options.items():
            store.store(group=group, name=f"{SCHEMA_PREFIX}{option}", node=schema)


def schema_keys(schema: type = Config, prefix: str = "") -> list[str]:
    """Every dotted key the schema declares, option schemas included (for "did you mean")."""
    keys = []
    hints = typing.get_type_hints(schema)
    for field in dataclasses.fields(schema):
        keys.append(prefix + field.name)
        kind = hints[field.name]
        subtypes = [kind, *OPTION_SCHEMAS.get(prefix + field.name, {}).values()] if not prefix else [kind]
        for sub in subtypes:
            if isinstance(sub, type) and dataclasses.is_dataclass(sub):
                keys += schema_keys(sub, f"{prefix}{field.name}.")
    return list(dict.fromkeys(keys))
