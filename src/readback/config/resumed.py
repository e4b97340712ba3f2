"""A resume continues the run as it was configured, whatever the defaults are today.

The config saved in the run's newest checkpoint is the base of a resume. Today's ``conf/`` is
composed under the run's own options (its ``model``, ``precision``, ``data``, ``backend``,
``logger`` and experiment, unless the command line picks others), and every key the resume's
command line does not give takes the run's saved value. So ``python train.py hydra.run.dir=RUN
trainer.resume=true`` alone continues a run, and a default that changed since the run started
(in a newer readback) changes nothing in it: one line names each such key, ``default changed
since this run started: X was A, is B; this run keeps A``.

Given by the command line, and checked against the checkpoint as before
(:func:`readback.train.checkpoint.resume_plan`: refused unless ``trainer.resume_changed_config``):
each ``key=value``, and every key that an option picked there (``model=small``) sets otherwise
than the run's own option. How this launch runs (:data:`LAUNCH_KEYS`) is always today's. A key
added since the run started takes today's default, as the run had no other.

After the resume, the run directory's ``.hydra/config.yaml`` holds the config the run goes on
with and ``.hydra/overrides.yaml`` the run's command line with this one's keys laid over it, so
the next resume (and the analysis) reads the run, not the last command.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, cast

from omegaconf import DictConfig, ListConfig, OmegaConf

from readback.config.refusals import from_composition_error
from readback.config.store import OPTION_SCHEMAS
from readback.overrides import override_map, with_current_keys
from readback.train.settings import RESOLVED_KEYS

log = logging.getLogger(__name__)

# How this launch runs, never taken from the run: whether it resumes, and under what.
LAUNCH_KEYS = ("trainer.resume", "trainer.resume_changed_config", "trainer.log_gap", "trainer.dry_run")
OVERRIDES_FILE = Path(".hydra") / "overrides.yaml"
CONFIG_FILE = Path(".hydra") / "config.yaml"


def saved_options(saved: Mapping[str, Any], conf_dir: Path) -> dict[str, str]:
    """The options a saved config was composed from (``group -> option``, ``experiment`` among
    them), those that ``conf_dir`` still has."""
    found = {
        group: str(saved[group]["name"])
        for group in OPTION_SCHEMAS
        if isinstance(saved.get(group), Mapping) and (conf_dir / group / f"{saved[group].get('name')}.yaml").is_file()
    }
    if (conf_dir / "experiment" / f"{saved.get('experiment')}.yaml").is_file():
        found["experiment"] = str(saved["experiment"])
    return found


def option_overrides(options: Mapping[str, str]) -> list[str]:
    """``options`` as Hydra overrides: ``group=option``, ``+experiment=name`` (an optional overlay)."""
    return [f"+{g}={o}" if g == "experiment" else f"{g}={o}" for g, o in options.items()]


def saved_config(run_dir: Path) -> Mapping[str, Any] | None:
    """The config saved in the newest checkpoint of ``run_dir`` (sizes checked, nothing moved),
    or ``None``: no checkpoint, or none readable now (the resume itself then says why)."""
    from readback.train.checkpoint import checkpoint_dir, load_latest_checkpoint

    try:
        found = load_latest_checkpoint(checkpoint_dir(run_dir), quiet=True)
    except OSError:
        return None
    config = found[1].get("config") if found else None
    return config if isinstance(config, Mapping) else None


def resumed_config(
    saved: Mapping[str, Any],
    overrides: list[str],
    conf_dir: Path,
    *,
    previous: list[str] | None = None,
    report: bool = False,
) -> DictConfig:
    """The config a resume goes on with: ``saved`` (the run's), with what ``overrides`` (this
    command line's, ``hydra.*`` left out) give laid over it, composed from ``conf_dir``.
    ``previous``, the run's own command line: keys it gave are the run's settings, not defaults,
    and are kept without a word. ``report``: log each changed default in one line."""
    saved = with_current_keys(saved)
    overrides = [o for o in overrides if not o.lstrip("+~").startswith("hydra")]
    choices = _options_picked(overrides)
    values = [o for o in overrides if o.lstrip("+~").partition("=")[0] not in choices]
    own = saved_options(saved, conf_dir)
    options = {**own, **choices}
    now = _compose(conf_dir, option_overrides(options) + values)
    given_keys = list(override_map(values))
    if options != own:  # an option picked otherwise than the run's: the keys it sets are given too
        picked, runs = _compose(conf_dir, option_overrides(options)), _compose(conf_dir, option_overrides(own))
        given_keys += [k for k, a, b in _leaves(_plain(picked), _plain(runs)) if a != b]
    previous_keys = list(override_map(previous).keys() - _options_picked(previous or []).keys())
    resumed = now.copy()
    for key, was, today in _leaves(_plain(now), saved):
        if _under(key, (*given_keys, *LAUNCH_KEYS)) or was == today or (today is None and key in RESOLVED_KEYS):
            continue
        OmegaConf.update(resumed, key, was, merge=False)
        if report and not _under(key, previous_keys):
            log.warning(
                "default changed since this run started: %s was %r, is %r; this run keeps %r", key, was, today, was
            )
    return resumed


def record(run_dir: Path, resumed: DictConfig, overrides: list[str], previous: list[str]) -> None:
    """Write the run's ``.hydra`` files as a resume leaves them (see the module docstring)."""
    given = override_map(overrides)
    kept = [o for o in previous if o.lstrip("+~").partition("=")[0] not in given]
    (run_dir / OVERRIDES_FILE).write_text(OmegaConf.to_yaml(OmegaConf.create(kept + list(overrides))))
    (run_dir / CONFIG_FILE).write_text(OmegaConf.to_yaml(resumed))


def previous_overrides(hydra_files: Mapping[str, bytes]) -> list[str]:
    """The run's command line, from the ``.hydra/overrides.yaml`` it held before this launch."""
    text = hydra_files.get(OVERRIDES_FILE.name)
    loaded = OmegaConf.create(text.decode()) if text else None
    return [str(o) for o in loaded] if isinstance(loaded, ListConfig) else []


def _options_picked(overrides: list[str]) -> dict[str, str]:
    """The options a command line picks (``group -> option``, ``experiment`` among them)."""
    return {k: v for k, v in override_map(overrides).items() if k in OPTION_SCHEMAS or k == "experiment"}


def _compose(conf_dir: Path, overrides: list[str]) -> DictConfig:
    """``conf_dir``'s ``train`` under ``overrides``; inside a Hydra job too (whose own Hydra is
    set aside meanwhile and put back), with the job's config search path (a sweep's own presets)."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.hydra_config import HydraConfig

    searchpath = list(HydraConfig.get().searchpath) if HydraConfig.initialized() else []
    if searchpath:
        overrides = [*overrides, f"hydra.searchpath=[{','.join(searchpath)}]"]
    jobs = GlobalHydra.instance().hydra
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(str(conf_dir), version_base="1.3"):
            return compose("train", overrides=overrides)
    except Exception as e:  # an option the run chose that today's conf/ lacks: one line, as at launch
        refusal = from_composition_error(e, overrides)
        if refusal is None:
            raise
        raise refusal from e
    finally:
        if jobs is not None:
            GlobalHydra.instance().initialize(jobs)


def _plain(cfg: DictConfig) -> dict[str, Any]:
    return cast(dict[str, Any], OmegaConf.to_container(cfg, resolve=True))


def _leaves(now: Mapping[str, Any], saved: Mapping[str, Any], prefix: str = "") -> Iterator[tuple[str, Any, Any]]:
    """``(dotted key, saved value, value now)`` of each key both hold, down to where either stops
    being a mapping (a group saved as null is one value)."""
    for key, value in now.items():
        if key not in saved:
            continue
        was, dotted = saved[key], f"{prefix}{key}"
        if isinstance(value, Mapping) and isinstance(was, Mapping):
            yield from _leaves(value, was, f"{dotted}.")
        else:
            yield dotted, _listed(was), _listed(value)


def _listed(value: Any) -> Any:
    """Tuples as lists, for comparing a saved value with a composed one."""
    return [_listed(v) for v in value] if isinstance(value, (list, tuple)) else value


def _under(key: str, prefixes: tuple[str, ...] | list[str]) -> bool:
    return any(key == p or key.startswith(f"{p}.") for p in prefixes)
