"""The typed configuration: the schema (``readback.train.settings.Config`` and the groups'
dataclasses, each in the layer it configures, put in Hydra's store by :mod:`.store`), its checks
(the rules between groups: :mod:`.cross_group`) and the entry point's one-line answer to a bad
config (:mod:`.entry`). Importing this package registers the schema with Hydra."""

from readback.config.cross_group import check_site_margin, require_margin
from readback.config.entry import (
    check_run_dir,
    exit_on_bad_config,
    from_saved,
    print_error,
    resume_of,
    typed,
    undo_run_dir,
    validate,
)
from readback.config.refusals import CONF_DIR
from readback.config.store import register
from readback.train.settings import Config

register()

__all__ = [
    "CONF_DIR",
    "Config",
    "check_run_dir",
    "check_site_margin",
    "exit_on_bad_config",
    "from_saved",
    "print_error",
    "require_margin",
    "resume_of",
    "typed",
    "undo_run_dir",
    "validate",
]
