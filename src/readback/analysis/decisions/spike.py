"""The amax-spike test's decision (``docs/results/d_term/preregistration_spike.md``) from the
folder ``sweeps/amax_spike.sh`` wrote: the four falsifiers, each as pre-registered, and the
figures behind them.

    python -m readback.cli.decide spike SWEEP [--out DIR]

O's amax per step is read from the checkpoints' amax histories (site
``layers.<i>.attn.core.output``; one entry per optimizer step, a ring of 1,024, so the
checkpoints every 500 steps cover every step) and written to ``SWEEP/o_amax_history.csv.gz``;
where that file exists it is read instead, so the decision can be rerun from the committed
records without the checkpoints. ``--out`` writes ``decision.md`` and ``decision.json`` there.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pandas as pd

from readback.analysis.files import load_runs
from readback.analysis.paired import mean_se, t_quantile
from readback.train.checkpoint import list_checkpoints, load_checkpoint

CONTROL, REUSE, FRESH = "no_saved_copy", "reuse_rounded", "fresh_reround"
PRIMARY_K = 12
LAYERS = ("layers.0", "layers.1")
BEFORE, INSIDE = (501, 999), (1001, 2000)  # falsifier 2's windows (step 1,000's spiked entry excluded)
METER_STEPS = (500, 1500, 2500)  # before, inside and after the window
METER_STEP, METER_GROUP, D_READ = 1500, "layers.1.attn.qkv", "contrib.exact_read.attention.D"
FRESH_CONTRIB = "contrib.fresh_reround"  # fresh_reround's own departure, metered on the same checkpoints
SUBNORMAL_BELOW = -6.0  # log2(rms(O) * scale) under E4M3's smallest normal, 2**-6
SLOPE_STEPS = (2250, 2500, 2750, 3000)  # the evaluations in [2,100, 3,200]
ONE_SIDED_T = t_quantile(0.90, len(SLOPE_STEPS) - 1)  # 5 % one-sided, 3 df: 2.353


def spike_k(path: str) -> int:
    """The spike's k in a run folder's name (``precision.amax_spike={...,k:14}``)."""
    found = re.search(r"k:(\d+)", path)
    if found is None:
        raise ValueError(f"no amax spike's k in the run folder {path}")
    return int(found[1])


def o_amax_history(sweep: Path, runs: pd.DataFrame) -> pd.DataFrame:
    """O's amax at every step of every run (experiment, k, seed, layer, step, amax), from the
    checkpoints' histories; cached as ``SWEEP/o_amax_history.csv.gz``."""
    cache = sweep / "o_amax_history.csv.gz"
    if cache.exists():
        return pd.read_csv(cache)
    rows = []
    for run in runs.itertuples():
        per_step: dict[tuple[str, int], float] = {}
        for _, ckpt in list_checkpoints(Path(run.path) / "checkpoints"):
            sites = load_checkpoint(ckpt)["ranks"][0]["numerics"]["sites"]
            for layer in LAYERS:
                state = sites[f"{layer}.attn.core.output"]["state"]
                history, done = state["history"].tolist(), int(state["steps"])
                for step in range(max(1, done - len(history) + 1), done + 1):
                    per_step[(layer, step)] = history[(step - 1) % len(history)]
        rows += [(run.experiment, spike_k(run.path), run.seed, layer, step, a) for (layer, step), a in per_step.items()]
    table = pd.DataFrame(rows, columns=["experiment", "k", "seed", "layer", "step", "amax"])
    if not (runs["status"] == "running").any():  # a running run's history is not its last word
        table.sort_values(["experiment", "k", "seed", "layer", "step"]).to_csv(cache, index=False)
    return table


def ratchet(history: pd.DataFrame) -> dict:
    """Falsifier 2: per reuse_rounded seed and layer, median O amax inside the window over its
    median before; a ratio of 2 or more in at least 3 of the seeds, in either layer, falsifies."""
    h = history[(history["experiment"] == REUSE) & (history["k"] == PRIMARY_K)]
    ratios: dict[str, dict[str, float]] = {}
    for (seed, layer), g in h.groupby(["seed", "layer"]):
        amax = g.set_index("step")["amax"]
        ratios.setdefault(str(seed), {})[layer] = float(amax.loc[INSIDE[0] : INSIDE[1]].median()) / float(
            amax.loc[BEFORE[0] : BEFORE[1]].median()
        )
    per_layer = {layer: sum(r[layer] >= 2 for r in ratios.values()) for layer in LAYERS}
    return {
        "ratio_inside_over_before": ratios,
        "seeds_at_2x_per_layer": per_layer,
        "falsified": max(per_layer.values()) >= 3,
    }


def d_read_bias(runs: pd.DataFrame, step: int, contribution: str = D_READ) -> dict[str, float]:
    """The meter's debiased squared bias of ``contribution`` (default the D read) on layer 1's
    QKV gradient at ``step``, per reuse_rounded seed (k 12) that has it."""
    values = {}
    for run in runs[runs["experiment"] == REUSE].itertuples():
        bias = Path(run.path) / "bias" / f"step{step}" / "bias.json"
        if spike_k(run.path) == PRIMARY_K and bias.exists():
            values[str(run.seed)] = json.loads(bias.read_text())["stats"][contribution][METER_GROUP]["debiased_sq"]
    return values


def meter(runs: pd.DataFrame, wide: pd.DataFrame) -> dict:
    """Falsifier 3: the D read's debiased squared bias on layer 1's QKV gradient at step 1,500,
    pooled over the reuse_rounded seeds (between-seed SE); void unless O is in subnormals. The
    same figure before and after the window is reported beside it (``by_step``)."""
    values, grid = d_read_bias(runs, METER_STEP), {}
    for run in runs[runs["experiment"] == REUSE].itertuples():
        if str(run.seed) in values and spike_k(run.path) == PRIMARY_K:
            at = wide.loc[(run.run_id, METER_STEP)]
            grid[str(run.seed)] = {
                layer: float(at[f"attn_out_log2_rms_scaled/mean/{layer}.attn.core"]) for layer in LAYERS
            }
    by_step = {}
    for step in METER_STEPS:
        for label, contribution in (("D read", D_READ), ("fresh_reround", FRESH_CONTRIB)):
            found = np.array(list(d_read_bias(runs, step, contribution).values()))
            step_mean, step_se = mean_se(found)
            by_step[f"{step} {label}"] = {"n": len(found), "mean": step_mean, "se": step_se}
    mean, se = mean_se(np.array(list(values.values())))
    in_subnormals = bool(grid) and all(g["layers.1"] < SUBNORMAL_BELOW for g in grid.values())
    return {
        "debiased_sq_per_seed": values,
        "mean": mean,
        "se": se,
        "by_step": by_step,
        "z": mean / se if se > 0 else float("nan"),
        "log2_rms_scaled_at_step": grid,
        "o_in_subnormals": in_subnormals,
        "void": not in_subnormals,
        "falsified": in_subnormals and not mean > 2 * se,
    }


def slope(curve: pd.DataFrame, runs: pd.DataFrame) -> dict:
    """Falsifier 4: the least-squares slope of each seed's paired gap (reuse_rounded minus the
    control, val_loss) over the evaluations 2,250-3,000; the mean slope's one-sided t above 2.353
    falsifies. Slopes in nats per 1,000 steps."""
    k12 = runs[runs["path"].map(spike_k) == PRIMARY_K]
    val = curve[curve["run"].isin(k12["run_id"]) & curve["step"].isin(SLOPE_STEPS)]
    table = val.pivot_table(index=["seed", "step"], columns="experiment", values="value")
    slopes = {}
    for seed, g in table.groupby(level="seed"):
        gap = (g[REUSE] - g[CONTROL]).droplevel("seed")
        if len(gap) == len(SLOPE_STEPS):
            slopes[str(seed)] = float(np.polyfit(gap.index.to_numpy(float) / 1000, gap.to_numpy(float), 1)[0])
    mean, se = mean_se(np.array(list(slopes.values())))
    t = mean / se if se > 0 else float("nan")
    return {
        "slope_per_seed": slopes,
        "mean": mean,
        "se": se,
        "t": t,
        "critical_t": ONE_SIDED_T,
        "falsified": bool(t > ONE_SIDED_T),
    }


def final_gaps(runs: pd.DataFrame) -> dict:
    """Reported beside the falsifiers: final val_loss of reuse_rounded and fresh_reround minus the
    control's, per k, paired by seed."""
    out = {}
    runs = runs.assign(k=runs["path"].map(spike_k))
    for k, g in runs.groupby("k"):
        final = g.pivot_table(index="seed", columns="experiment", values="val_loss")
        for arm in (REUSE, FRESH):
            if arm in final and CONTROL in final:
                d = (final[arm] - final[CONTROL]).dropna().to_numpy(float)
                mean, se = mean_se(d)
                out[f"k{k}/{arm}"] = {"n_pairs": len(d), "mean": mean, "se": se}
    return out


def decide(sweep: Path) -> dict:
    loaded = load_runs(sweep, keys=["val_loss", "attn_out_log2_rms_scaled/*"])
    runs = loaded.summary.reset_index().rename(columns={"run": "run_id"})
    wide = loaded.wide()
    statuses = {f"{r.experiment} k{spike_k(r.path)} seed {r.seed}": str(r.status) for r in runs.itertuples()}
    decision: dict = {
        "runs": statuses,
        "diverged": {"falsified": any(s == "diverged" for s in statuses.values())},
        "ratchet": ratchet(o_amax_history(sweep, runs)),
        "meter": meter(runs, wide),
        "slope": slope(loaded.curve("val_loss"), runs),
        "final_gaps": final_gaps(runs),
    }
    decision["account_falsified"] = any(decision[f]["falsified"] for f in ("diverged", "ratchet", "meter", "slope"))
    return decision


def report(d: dict) -> str:
    """The decision as Markdown."""
    r, m, s = d["ratchet"], d["meter"], d["slope"]
    lines = [
        "| falsifier | measured | falsifies? |",
        "|---|---|---|",
        f"| 1. a run diverges | statuses: {', '.join(sorted(set(d['runs'].values())))} ({len(d['runs'])} runs) "
        f"| {'yes' if d['diverged']['falsified'] else 'no'} |",
        f"| 2. ratchet: median O amax, steps 1,001-2,000 over 501-999, >= 2 in >= 3 of 4 seeds | seeds at 2x per "
        f"layer: {r['seeds_at_2x_per_layer']} | {'yes' if r['falsified'] else 'no'} |",
        f"| 3. no D-read bias at step 1,500 while O is in subnormals | debiased bias² {m['mean']:+.2e} ± {m['se']:.1e} "
        f"(z {m['z']:.1f}); O in subnormals: {m['o_in_subnormals']} | "
        f"{'void' if m['void'] else ('yes' if m['falsified'] else 'no')} |",
        f"| 4. the paired gap grows over 2,250-3,000 | slope {s['mean']:+.4f} ± {s['se']:.4f} nats per 1,000 steps, "
        f"t {s['t']:.2f} against {s['critical_t']:.3f} | {'yes' if s['falsified'] else 'no'} |",
        "",
        f"**The account is {'falsified' if d['account_falsified'] else 'not falsified'}** by these runs.",
        "",
        "Per seed: O amax ratio inside/before (layer 0, layer 1); the meter's debiased bias²; "
        "log2(rms(O) x scale) at step 1,500 (layer 0, layer 1); the gap's slope.",
        "",
        "| seed | amax ratio | D-read debiased bias² | log2 rms scaled | slope |",
        "|---|---|---|---|---|",
    ]
    for seed in sorted(r["ratio_inside_over_before"]):
        ratio = r["ratio_inside_over_before"][seed]
        grid = m["log2_rms_scaled_at_step"].get(seed, dict.fromkeys(LAYERS, float("nan")))
        lines.append(
            f"| {seed} | {' / '.join(f'{ratio[layer]:.2f}' for layer in LAYERS)} "
            f"| {m['debiased_sq_per_seed'].get(seed, float('nan')):+.2e} "
            f"| {' / '.join(f'{grid[layer]:+.2f}' for layer in LAYERS)} "
            f"| {s['slope_per_seed'].get(seed, float('nan')):+.4f} |"
        )
    lines += ["", "Debiased bias² on layer 1's QKV gradient (reuse_rounded checkpoints), mean ± SE over seeds:", ""]
    lines += ["| step, contribution | seeds | mean ± SE |", "|---|---|---|"]
    lines += [f"| {key} | {b['n']} | {b['mean']:+.2e} ± {b['se']:.1e} |" for key, b in m["by_step"].items()]
    lines += [
        "",
        "Final val_loss gaps to the control (paired by seed):",
        "",
        "| k / arm | pairs | mean ± SE |",
        "|---|---|---|",
    ]
    lines += [f"| {key} | {g['n_pairs']} | {g['mean']:+.4f} ± {g['se']:.4f} |" for key, g in d["final_gaps"].items()]
    return "\n".join(lines)
