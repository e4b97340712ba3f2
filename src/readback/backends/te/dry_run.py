"""The ``backend=te`` plan a dry run prints: what Transformer Engine would run, on any machine.

A dry run plans a cluster job, often from a machine with no GPU and no Transformer Engine. The
plan (``te_plan``) is a pure function of the config, a TE version and a GPU: where this machine
has them it uses them, and where it has not it assumes ``facts.PLANNING_TE`` and
``facts.PLANNING_GPU`` (the release readback's TE facts were read from, an H100) and says so.
What that TE cannot run on that GPU is refused in one line, as a real run would be.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from readback.backends.settings import ModelSettings
from readback.backends.te.facts import (
    PLANNING_GPU,
    PLANNING_GPU_NAME,
    PLANNING_TE,
    Hardware,
    installed_hardware,
    installed_te_version,
)
from readback.backends.te.plan import te_plan


@dataclass(frozen=True)
class Target:
    """The TE version and GPU a plan is made for, and which of them are assumptions."""

    te_version: str
    hardware: Hardware
    assumed_te: bool
    assumed_gpu: bool

    def describe(self) -> str:
        return f"Transformer Engine {self.te_version} on {self.hardware.describe()}"

    def assumptions(self) -> str:
        """What the plan assumed, and why: the line a dry run prints under the plan's title."""
        assumed = []
        if self.assumed_te:
            why = "none installed here: the release readback's TE facts are read from"
            assumed.append(f"Transformer Engine {self.te_version} ({why})")
        if self.assumed_gpu:
            cudnn = ".".join(map(str, self.hardware.cudnn or ()))
            assumed.append(f"GPU {PLANNING_GPU_NAME} with cuDNN {cudnn} (no CUDA GPU here)")
        return "assumed: " + ("; ".join(assumed) or "nothing (this machine's Transformer Engine and GPU)")


def planning_target() -> Target:
    """This machine's TE and GPU where it has them, the planning assumptions where not."""
    version, hardware = installed_te_version(), installed_hardware()
    assumed_gpu = hardware.capability is None
    return Target(version or PLANNING_TE, PLANNING_GPU if assumed_gpu else hardware, version is None, assumed_gpu)


def dry_run_plan(cfg: ModelSettings) -> tuple[list[str], dict[str, Any]]:
    """The lines a dry run prints for ``cfg``'s ``backend=te`` plan, and the plan as a record for
    its summary. Raises ``ConfigError`` (one line) for what the target cannot run."""
    target = planning_target()
    plan = te_plan(cfg, target.te_version, target.hardware)
    env = ", ".join(f"{k}={v}" for k, v in plan.env.items()) or "none"
    lines = [
        f"backend=te plan for {target.describe()}:",
        f"  {target.assumptions()}",
        f"  TE recipe: {plan.te_recipe.describe() if plan.te_recipe else 'none (FP8 off)'}",
        f"  TE environment: {env}",
        *(f"  {site}: {implementation}" for site, implementation in plan.sites.items()),
    ]
    record = {
        "te_version": target.te_version,
        "gpu": target.hardware.describe(),
        "assumed": [name for name, yes in (("te_version", target.assumed_te), ("gpu", target.assumed_gpu)) if yes],
        "recipe": plan.recipe,
        "recipe_kwargs": dict(plan.recipe_kwargs),
        "env": dict(plan.env),
        "attention_core": plan.attention_core,
        "sites": dict(plan.sites),
    }
    return lines, record
