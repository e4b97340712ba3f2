"""What each inexact step of the backward contributes to the gradient bias, across checkpoints.

``python -m readback.cli.bias_attribution LABEL=BIAS_JSON [LABEL=BIAS_JSON ...] --out DIR
[--groups total,*.attn.qkv] [--contributions GLOBS] [--reference contrib.exact_read.attention.D]``

Reads the bias meter's ``bias.json`` of several checkpoints (each measured by ``python -m
readback.cli.bias``) and writes ``attribution.md`` (one table: each ``contrib.*`` per gradient group
with its bias, floor, projection and debiased squared bias, ± SE, beside the reference read's;
then each GEMM kind's K), ``attribution.json`` and ``attribution.png``.

``share`` compares sizes as ``sqrt(debiased_sq)``, the bias with its noise floor removed: a
contribution's ``share_upper`` is ``sqrt(debiased_sq + 2 SE) / sqrt(debiased_sq of the
reference)``, the most it can be at two standard errors. Below 0.1 it is less than a tenth of
the reference read's bias (the threshold at which a training comparison would be worth running).
"""

from __future__ import annotations

import fnmatch
import math
from pathlib import Path

D_READ = "contrib.exact_read.attention.D"


def shares(stats: dict, reference: str, group: str) -> dict[str, dict[str, float]]:
    """Each contribution's ``share`` and ``share_upper`` of the reference's bias in ``group``
    (NaN where the reference has no bias above its floor or a statistic is missing)."""
    ref = stats.get(reference, {}).get(group, {}).get("debiased_sq")
    out = {}
    for name, groups in stats.items():
        s = groups.get(group, {})
        sq, se = s.get("debiased_sq"), s.get("debiased_sq_se")
        if ref is None or ref <= 0 or sq is None or se is None:
            out[name] = {"share": math.nan, "share_upper": math.nan}
            continue
        out[name] = {
            "share": math.sqrt(max(sq, 0.0) / ref),
            "share_upper": math.sqrt(max(sq + 2 * se, 0.0) / ref),
        }
    return out


def attribution(
    measured: dict[str, dict], groups: list[str], reference: str = D_READ, contributions: tuple[str, ...] = ("*",)
) -> dict:
    """``{label: {checkpoint, policy, batches, accumulation, stats: {contrib: {group: stats + shares}},
    gemm_k: {kind: sorted K}}}`` from ``{label: bias.json}``; ``groups`` and ``contributions``
    (names without ``contrib.``) are globs."""
    out = {}
    for label, bias in measured.items():
        all_groups = list(next(iter(bias["stats"].values())))
        chosen = [g for g in all_groups if any(fnmatch.fnmatchcase(g, p) for p in groups)]
        contribs = {n: s for n, s in bias["stats"].items() if n.startswith("contrib.")}
        kept = [n for n in contribs if any(fnmatch.fnmatchcase(n.removeprefix("contrib."), c) for c in contributions)]
        stats: dict[str, dict[str, dict]] = {name: {} for name in kept}
        for group in chosen:
            for name, share in shares(contribs, reference, group).items():
                if name in stats:
                    stats[name][group] = {**contribs[name][group], **share}
        kinds = ("fprop", "dgrad", "wgrad")
        out[label] = {
            "checkpoint_step": bias.get("checkpoint_step"),
            "run_dir": bias.get("run_dir"),
            "policy": bias["policy"],
            "batches": bias["batches"],
            "site_margin": bias.get("site_margin", {}),
            "accumulation": bias.get("accumulation"),
            "stats": stats,
            "gemm_k": {k: sorted({ks[k] for ks in bias.get("gemm_k", {}).values()}) for k in kinds},
        }
    return out


def _pm(value: float | None, se: float | None, digits: int = 4) -> str:
    if value is None or math.isnan(value):
        return "n/a"
    text = f"{value:.{digits}g}"
    return text if se is None or math.isnan(se) else f"{text} ± {se:.2g}"


def to_markdown(table: dict, reference: str = D_READ) -> str:
    """The attribution table, then each checkpoint's K per GEMM kind."""
    lines = [
        f"Reference: `{reference.removeprefix('contrib.')}`. share = sqrt(debiased² / reference's); "
        "upper: at debiased² + 2 SE.",
        "",
        "| checkpoint | contribution | group | bias | floor | projection | debiased bias² | share | share upper |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for label, entry in table.items():
        for name, groups in entry["stats"].items():
            for group, s in groups.items():
                lines.append(
                    f"| {label} | {name.removeprefix('contrib.')} | {group} | {_pm(s['bias'], s['bias_se'], 3)} | "
                    f"{_pm(s['floor'], None, 3)} | {_pm(s['projection'], s['projection_se'], 3)} | "
                    f"{_pm(s['debiased_sq'], s['debiased_sq_se'], 3)} | {_pm(s['share'], None, 2)} | "
                    f"{_pm(s['share_upper'], None, 2)} |"
                )
    lines += ["", "| checkpoint | policy | batches | site margins | accumulation | K fprop | K dgrad | K wgrad |"]
    lines.append("|---|---|---|---|---|---|---|---|")
    for label, e in table.items():
        margins = ", ".join(f"{p}={k}" for p, k in e["site_margin"].items()) or "none"
        k = e["gemm_k"]
        lines.append(
            f"| {label} | {e['policy']} | {e['batches']} | {margins} | {'/'.join(e['accumulation'] or ['?'])} | "
            f"{_ks(k['fprop'])} | {_ks(k['dgrad'])} | {_ks(k['wgrad'])} |"
        )
    return "\n".join(lines) + "\n"


def _ks(values: list[int]) -> str:
    return ", ".join(str(v) for v in values) or "n/a"


def plot(table: dict, path: str | Path | None = None):
    """Per group (a column), each checkpoint's contributions as bars of sqrt(debiased²) (hollow
    where it is negative: below the floor) with the floor as a tick, on a log axis."""
    from matplotlib.figure import Figure

    groups = list(dict.fromkeys(g for e in table.values() for s in e["stats"].values() for g in s))
    names = list(dict.fromkeys(n for e in table.values() for n in e["stats"]))
    fig = Figure(figsize=(4.5 * len(groups), 1.2 + 0.35 * len(names) * len(table)))
    axes = fig.subplots(1, len(groups), squeeze=False)[0]
    for ax, group in zip(axes, groups):
        labels, y = [], 0
        for c, (label, entry) in enumerate(table.items()):
            for name in names:
                s = entry["stats"].get(name, {}).get(group)
                if s is None:
                    continue
                size = math.sqrt(abs(s["debiased_sq"])) if s["debiased_sq"] is not None else math.nan
                filled = s["debiased_sq"] is not None and s["debiased_sq"] > 0
                ax.barh(y, size, color=f"C{c}" if filled else "none", edgecolor=f"C{c}")
                if s["floor"] is not None:
                    ax.plot([s["floor"]] * 2, [y - 0.4, y + 0.4], "k-", lw=1)
                labels.append(f"{label}: {name.removeprefix('contrib.')}")
                y += 1
        ax.set_yticks(range(len(labels)), labels, fontsize=7)
        ax.invert_yaxis()
        ax.set_xscale("log")
        ax.set_title(group, fontsize=9)
        ax.set_xlabel("sqrt(|debiased bias²|) / |G| (black: floor; hollow: negative)", fontsize=7)
    fig.tight_layout()
    if path is not None:
        fig.savefig(path, dpi=100)
    return fig


if __name__ == "__main__":  # the old command, which sweeps and pages name: python -m readback.cli.bias_attribution
    import runpy

    runpy.run_module("readback.cli.bias_attribution", run_name="__main__", alter_sys=True)
