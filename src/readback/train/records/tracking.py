"""Weights & Biases: curves against tokens, and a run wrapper that never stops training.

Who a run is (name, group, tags, launch context) comes from :mod:`readback.train.records.identity`.
Curves are plotted against ``tokens`` (``define_metric``) and the summary keeps the last and
the minimum of ``loss``.

A requeued job resumes the run id stored in its checkpoint (``resume="allow"``): online it is
one run; offline each start writes another ``wandb/offline-run-<time>-<id>`` folder, and
``python -m readback.cli.sync`` uploads them in start order into that one run.
"""

from __future__ import annotations

import contextlib
import logging
import netrc
import os
import secrets
import string
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal, cast
from urllib.parse import urlparse

from readback.train.records.identity import RunIdentity

log = logging.getLogger(__name__)

#: The x axis of every curve, and the keys plotted against it (globs).
STEP_METRIC = "tokens"
TOKEN_AXIS_KEYS = (
    "loss",
    "val_loss",
    "lr",
    "grad_norm",
    "tokens_per_s",
    "grad_error/*",
    "grad_error_se/*",
    "attn_rowsum/*",
    "kurtosis/*",
    "fp8_saturation/*",
    "fp8_underflow/*",
    "grad_bias/*",
)
#: Keys whose summary keeps both the last and the smallest value (val_loss: the summary.json value).
MIN_LAST_KEYS = ("loss",)


def define_metrics(run: Any) -> None:
    """Curves against ``tokens``; last and min of the losses in the summary."""
    run.define_metric(STEP_METRIC)
    for key in TOKEN_AXIS_KEYS:
        run.define_metric(key, step_metric=STEP_METRIC, summary="min,last" if key in MIN_LAST_KEYS else None)


# ---------------------------------------------------------------------------------------------
# the run, best effort


def _have_wandb_key() -> bool:
    if os.environ.get("WANDB_API_KEY"):
        return True
    host = urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname or ""
    for candidate in (os.environ.get("NETRC"), "~/.netrc", "~/_netrc"):
        if not candidate:
            continue
        path = Path(candidate).expanduser()
        try:
            if path.is_file() and netrc.netrc(str(path)).authenticators(host):
                return True
        except (OSError, netrc.NetrcParseError):
            continue
    return False


def resolve_wandb_mode(mode: str) -> str:
    """``online`` | ``offline`` | ``disabled``: ``WANDB_MODE``/``WANDB_DISABLED`` win, then the config;
    ``auto`` is online when an API key is configured, else offline."""
    if os.environ.get("WANDB_DISABLED", "").lower() in ("1", "true", "yes"):
        return "disabled"
    env = os.environ.get("WANDB_MODE", "").strip().lower()
    chosen = env or mode.lower()
    if chosen == "dryrun":
        chosen = "offline"
    if chosen == "auto":
        chosen = "online" if _have_wandb_key() else "offline"
    if chosen not in ("online", "offline", "disabled"):
        log.warning("unknown wandb mode %r; using offline", chosen)
        chosen = "offline"
    return chosen


def new_wandb_run_id() -> str:
    alphabet = string.ascii_lowercase + string.digits
    return "".join(secrets.choice(alphabet) for _ in range(8))


class WandbLogger:
    """Best-effort wandb run. ``self.mode`` ends up ``online``, ``offline`` or ``noop``: the
    requested mode is tried, then offline into the run directory, then nothing; the first
    failing ``log`` disables it."""

    def __init__(
        self,
        *,
        run_dir: Path,
        identity: RunIdentity,
        project: str,
        entity: str | None,
        mode: str,
        init_timeout: float,
        run_id: str | None = None,
    ):
        self.run_id = run_id or new_wandb_run_id()
        self.mode = "noop"
        self._run = None
        self._warned = False
        wanted = resolve_wandb_mode(mode)
        if wanted == "disabled":
            return
        try:
            import wandb
        except Exception as e:
            log.warning("wandb unavailable (%s); metrics go to metrics.jsonl only", e)
            return
        for attempt in [wanted] + (["offline"] if wanted == "online" else []):
            try:
                self._run = wandb.init(
                    project=project,
                    entity=entity,
                    name=identity.name,
                    group=identity.group,
                    job_type=identity.job_type,
                    tags=list(identity.tags),
                    config=identity.config,
                    dir=str(run_dir),
                    id=self.run_id,
                    resume="allow",
                    mode=cast(Literal["online", "offline", "disabled"], attempt),  # resolve_wandb_mode's
                    settings=wandb.Settings(init_timeout=float(init_timeout), silent=True),
                )
                self.mode = attempt
                break
            except Exception as e:
                log.warning("wandb.init in %s mode failed (%s: %s)", attempt, type(e).__name__, e)
                self._run = None
                # a failed init keeps the run id taken in this process: release it for the next try
                with contextlib.suppress(Exception):
                    wandb.teardown()
        if self._run is None:
            log.warning("wandb disabled for this run; metrics go to metrics.jsonl only")
            return
        try:
            define_metrics(self._run)
        except Exception as e:
            log.warning("wandb define_metric failed (%s: %s)", type(e).__name__, e)

    def log(self, record: Mapping[str, Any], step: int) -> None:
        if self._run is None:
            return
        try:
            self._run.log({k: v for k, v in record.items() if k != "step"}, step=int(step))
        except Exception as e:
            self._fail("log", e)

    def summary(self, values: Mapping[str, Any]) -> None:
        if self._run is None:
            return
        try:
            for k, v in values.items():
                self._run.summary[k] = v
        except Exception as e:
            self._fail("summary", e)

    def mark_preempting(self) -> None:
        """Tell wandb the run stops for a preemption (it is resumed later under the same id)."""
        if self._run is None:
            return
        try:
            self._run.mark_preempting()
        except Exception as e:
            log.debug("wandb mark_preempting failed: %s", e)

    def _fail(self, what: str, e: Exception) -> None:
        if not self._warned:
            log.warning("wandb %s failed (%s: %s); wandb disabled, metrics.jsonl continues", what, type(e).__name__, e)
            self._warned = True
        self.finish(exit_code=1)

    def finish(self, exit_code: int = 0) -> None:
        run, self._run = self._run, None
        if run is None:
            return
        try:
            run.finish(exit_code=exit_code)
        except Exception as e:
            log.warning("wandb finish failed (%s: %s)", type(e).__name__, e)
