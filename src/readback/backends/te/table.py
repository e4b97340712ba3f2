"""The experiment -> Transformer Engine table of docs/te_backend.md, rendered from ``te_plan`` so
that the page and the plan cannot disagree (a test compares them).

    python -m readback.cli.te_table     # prints the table that goes between the markers
"""

from __future__ import annotations

from collections.abc import Callable

from readback.backends.settings import ModelSettings
from readback.backends.te.facts import PLANNING_GPU, PLANNING_GPU_NAME, PLANNING_TE, Hardware
from readback.backends.te.plan import PINNED_BACKEND, te_plan
from readback.errors import ConfigError

START, END = "<!-- te-plan-table:start -->", "<!-- te-plan-table:end -->"
TE_VERSION = PLANNING_TE
GPUS = {PLANNING_GPU_NAME: PLANNING_GPU, "sm100 (B200)": Hardware((10, 0), (9, 14, 0))}
MODEL = ("model=fog_390m",)  # head dim 128, sequence 4096
# (row label, config overrides)
ROWS = [
    ("`reuse_rounded`", ("+experiment=reuse_rounded",)),
    ("`reuse_rounded_bf16_bwd`", ("+experiment=reuse_rounded_bf16_bwd",)),
    (
        "`reuse_rounded_bf16_bwd attention.bwd_reads=forward`",
        ("+experiment=reuse_rounded_bf16_bwd", "attention.bwd_reads=forward"),
    ),
    ("`reuse_rounded backend.fp8_mha=true`", ("+experiment=reuse_rounded", "backend.fp8_mha=true")),
    ("`original_bf16_bwd`", ("+experiment=original_bf16_bwd",)),
    ("`fresh_reround`", ("+experiment=fresh_reround",)),
    ("`no_saved_copy`", ("+experiment=no_saved_copy",)),
    ("`bf16_baseline`", ("+experiment=bf16_baseline",)),
    (
        "`policy=original precision.recipe=current`",
        ("+experiment=reuse_rounded", "policy=original", "precision.recipe=current"),
    ),
    (
        "`policy=original precision.recipe=current attention.bwd_precision=bf16 attention.bwd_reads=te`",
        (
            "+experiment=reuse_rounded",
            "policy=original",
            "precision.recipe=current",
            "attention.bwd_precision=bf16",
            "attention.bwd_reads=te",
        ),
    ),
    ("`reuse_rounded precision.recipe=current`", ("+experiment=reuse_rounded", "precision.recipe=current")),
    (
        "`reuse_rounded precision.recipe=current attention.bwd_precision=bf16`",
        ("+experiment=reuse_rounded", "precision.recipe=current", "attention.bwd_precision=bf16"),
    ),
    ("`policy=original` (delayed scaling)", ("+experiment=reuse_rounded", "policy=original")),
    ("`precision.recipe=mxfp8`", ("+experiment=reuse_rounded", "precision.recipe=mxfp8")),
    ("`precision.recipe=blockwise`", ("+experiment=reuse_rounded", "precision.recipe=blockwise")),
    ("`precision.recipe=nvfp4`", ("+experiment=reuse_rounded", "precision.recipe=nvfp4")),
    (
        "`reuse_rounded precision.recipe=current attention.recipe=delayed`",
        ("+experiment=reuse_rounded", "precision.recipe=current", "attention.recipe=delayed"),
    ),
    (
        "`reuse_rounded precision.recipe=nvfp4 attention.recipe=delayed`",
        ("+experiment=reuse_rounded", "precision.recipe=nvfp4", "attention.recipe=delayed"),
    ),
]


def _switches(plan) -> str:
    shown = {k: v or '""' for k, v in plan.env.items() if k not in PINNED_BACKEND}  # "": pinned empty
    env = [f"`{k}={v}`" for k, v in shown.items()]
    if set(PINNED_BACKEND.items()) <= set(plan.env.items()):
        env.append("fused attention pinned")
    return ", ".join(env) or "none"


def _on(cfg, hardware: Hardware) -> str:
    try:
        te_plan(cfg, TE_VERSION, hardware)
    except ConfigError as error:
        reason = str(error).rsplit(": ", 1)[-1]
        return "refused: " + (reason[:-1] if reason.endswith(")") else reason)
    return "runs"


def render(compose: Callable[[list[str]], ModelSettings]) -> str:
    """The markdown table; ``compose(overrides)`` builds a run's typed config (``backend=te``)."""
    header = [
        "experiment",
        "TE recipe",
        "TE switches",
        "attention core",
        "D reads",
        "dK, dQ, dP read",
        "output projection",
        *GPUS,
    ]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for label, overrides in ROWS:
        cfg = compose([*overrides, "backend=te", *MODEL])
        plan = te_plan(cfg, TE_VERSION, Hardware())
        s = plan.sites
        core = "`te.DotProductAttention`" if plan.te_attention else f"`{s['attention_core']}`"
        qkv = ", ".join(s[f"attention_core.{g}"] for g in ("dK", "dQ", "dP"))  # Q, K, V
        cells = [
            label,
            f"`{plan.te_recipe.describe(only_true=('fp8_dpa', 'fp8_mha'))}`" if plan.te_recipe else "none (FP8 off)",
            _switches(plan),
            core,
            s["attention_core.D"],
            qkv,
            s["attn_proj"],
            *(_on(cfg, hw) for hw in GPUS.values()),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
