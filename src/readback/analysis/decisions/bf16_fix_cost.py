"""The BF16 fix's own cost, and why: the calls of ``docs/results/d_term/preregistration_bf16_fix_cost.md``
from the folder ``sweeps/bf16_fix_cost.sh`` wrote: the registered contrasts of the final validation
loss, paired by seed, and the call, as pre-registered; the same on the final train loss beside it;
then each arm's meter at step 2,000.

    python -m readback.cli.decide bf16_fix_cost SWEEP [--out DIR]

Each contrast pairs two arms by seed over the seeds whose six arms all ended; a diverged run counts
with its last value and the calls are made again without the seeds it is in (where the two differ:
"inconclusive"). The test is not called if its launches (every launch of every run, ``launch.json``'s
history) span CPU kinds or commits, or if R branched from its own step-1,500 checkpoint does not
end where R ends (a branch must continue its base bit for bit). ``--out`` writes ``decision.md``
and ``decision.json`` there.
"""

from __future__ import annotations

import math
from pathlib import Path

import pandas as pd

from readback.analysis.decisions.common import ENDED, diverged_rule, figure, over_seeds, seed_table, side
from readback.analysis.files import load_runs
from readback.analysis.paired import seed_paired
from readback.analysis.render import se_digits
from readback.train.records.launches import read_launches

ARMS = ("R", "T", "B", "Tf", "Bf", "Tp")
TWIN = {"T": "Tf", "B": "Bf"}  # each BF16 backward of TE's reads and its twin that reads the forward's operands
BRANCH_CHECK = "R_branch"
CONTRASTS = (
    ("T", "R"),
    ("B", "R"),
    ("T", "Tf"),
    ("B", "Bf"),
    ("Tf", "R"),
    ("Bf", "R"),
    ("Tp", "T"),
    ("Tp", "R"),
    ("Tp", "Tf"),
    ("B", "T"),
    ("Bf", "Tf"),
)
# each arm's own error against the executed forward's gradient: the meter's variant of its policy
POLICY = {"R": "reuse_rounded", "T": "reuse_rounded", "Tf": "reuse_rounded", "Tp": "reuse_rounded"}
POLICY |= {"B": "original", "Bf": "original"}
METER_STATS = ("grad_bias_debiased_sq", "grad_bias_projection")
METER_STEP = 2000


def contrasts(final: pd.DataFrame) -> dict[str, dict]:
    """Every registered contrast ``a - b`` paired by seed."""
    return {f"{a} - {b}": seed_paired((final[a] - final[b]).to_numpy(float)) for a, b in CONTRASTS}


def cause(c: dict, arm: str) -> str:
    """Where the cost of BF16 backward ``arm`` (T or B) against R sits, by its forward-read twin."""
    twin = TWIN[arm]
    reads, shared = side(c[f"{arm} - {twin}"]) == "behind", side(c[f"{twin} - R"]) == "behind"
    if reads and not shared:
        return "te reads"
    if shared and not reads:
        return "neither"
    return "both" if reads else "not located"


CAUSES = {
    "te reads": "the te reads are the cause: the BF16 backward costs loss, its forward-read twin does not",
    "neither": (
        "neither: the cost is what the BF16 backward shares with its forward-read twin "
        "(BF16 arithmetic, no E5M2 rounding of dO and dS), not the te reads"
    ),
    "both": "both: the te reads add a cost, and so does what the BF16 backward shares with its twin",
    "not located": "not located: the BF16 backward costs loss, and neither component is detected alone",
}


def probs_call(c: dict) -> str:
    """Whether P's rebuild is the te reads' costly part (Tp: T with P read as the forward had it)."""
    back, left = side(c["Tp - T"]), side(c["Tp - R"])
    if back == "ahead" and left != "behind":
        return "P's rebuild is the part: putting P back removes T's cost"
    if back == "ahead":
        return "P's rebuild carries part of it: putting P back lowers T's cost without removing it"
    return "P's rebuild is not shown to be the part (the unrounded Q, K, V that dP, dQ, dK read, or both together)"


def call(c: dict) -> str:
    """The registered call on the contrasts ``c``."""
    costly = [arm for arm in TWIN if side(c[f"{arm} - R"]) == "behind"]
    if not costly:
        return "void: no cost of either BF16 backward detected over the last 500 steps"
    causes = {arm: cause(c, arm) for arm in costly}
    if len(set(causes.values())) > 1:
        return (
            "inconclusive: T and B point at different causes (" + "; ".join(f"{a} {v}" for a, v in causes.items()) + ")"
        )
    found = next(iter(causes.values()))
    verdict = f"{' and '.join(costly)} cost loss; {CAUSES[found]}"
    if found == "te reads" and "T" in costly:
        verdict += f"; {probs_call(c)}"
    return verdict


def finals(runs: pd.DataFrame, column: str, diverged: bool) -> pd.DataFrame:
    """Seed x arm table of ``column`` over the seeds whose six arms all ended (with ``diverged``
    False, over those none of whose runs diverged)."""
    return seed_table(runs, column, ARMS, by="arm", statuses=ENDED if diverged else ("completed",))


def refusal(launches: list[dict], branch: dict) -> str | None:
    """Why the test cannot be called on these runs, or None: launches on several CPU kinds or
    commits, or a branch of R that does not end where R ends."""
    kinds = sorted({f"{e.get('cpu_model')}, {e.get('cpu_capability')}" for e in launches})
    commits = sorted({str(e.get("commit")) for e in launches})
    if len(kinds) > 1:
        return f"not decided: its launches span CPU kinds ({'; '.join(kinds)})"
    if len(commits) > 1 or any(e.get("dirty") for e in launches):
        return f"not decided: its launches span commits or changed files ({', '.join(commits)})"
    if branch.get("same") is False:
        return "not decided: R branched at step 1,500 does not end where R ends"
    return None


def judged(runs: pd.DataFrame, column: str, refused: str | None) -> dict:
    """The contrasts and the call on ``column``, with the diverged-run rule applied."""
    with_diverged, without = finals(runs, column, True), finals(runs, column, False)
    c = contrasts(with_diverged)
    first, second = call(c), call(contrasts(without))
    if refused:
        verdict = refused
    elif len(with_diverged) < 2:
        verdict = "not decided: fewer than 2 seeds have all six arms ended"
    else:
        verdict = diverged_rule(first, second)
    return {"seeds": [int(s) for s in with_diverged.index], "contrasts": c, "call": verdict}


def branch_check(runs: pd.DataFrame) -> dict:
    """R's final validation loss against R branched from its own step-1,500 checkpoint."""
    rows = runs[runs["arm"].isin(["R", BRANCH_CHECK]) & (runs["status"] == "completed")]
    values = rows.pivot_table(index="seed", columns="arm", values="val_loss")
    if BRANCH_CHECK not in values or "R" not in values:
        return {"seeds": [], "same": None}
    values = values[[BRANCH_CHECK, "R"]].dropna()
    same = bool((values[BRANCH_CHECK] == values["R"]).all()) if len(values) else None
    return {"seeds": [int(s) for s in values.index], "same": same}


def meter_figures(runs: pd.DataFrame, wide: pd.DataFrame) -> dict:
    """Each arm's own gradient bias against the executed forward at step 2,000 (the meter's
    ``total`` group), mean and SE over seeds."""
    out = {}
    for arm in ARMS:
        ids = runs[runs["arm"] == arm]["run_id"]
        for key in (f"{stat}/{POLICY[arm]}/total" for stat in METER_STATS):
            values = [wide[key].get((rid, METER_STEP), math.nan) if key in wide else math.nan for rid in ids]
            out[f"{arm} {key}"] = over_seeds(values)
    return out


def decide(sweep: Path) -> dict:
    loaded = load_runs(sweep, keys=["val_loss", "loss", *(f"{stat}/*/total" for stat in METER_STATS)])
    runs = loaded.summary.reset_index().rename(columns={"run": "run_id"})
    runs["arm"] = runs["run_id"].str.split("/").str[0]
    launches = [e for path in runs["path"] for e in read_launches(Path(path))]
    branch = branch_check(runs)
    refused = refusal(launches, branch)
    return {
        "runs": {f"{r.arm} seed {r.seed}": str(r.status) for r in runs.itertuples()},
        "launches": len(launches),
        "cpu": sorted({f"{e.get('cpu_model')}, {e.get('cpu_capability')}" for e in launches}),
        "commits": sorted({str(e.get("commit")) for e in launches}),
        "branch_check": branch,
        "val_loss": judged(runs, "val_loss", refused),
        "train_loss": judged(runs, "final_loss", refused),
        "meter": meter_figures(runs, loaded.wide()),
    }


def _row(name: str, p: dict) -> str:
    (lo, hi), n = p["ci95"], se_digits(p["se"])
    return f"| {name} | {p['n']} | {figure(p['mean'], p['se'])} | {p['t']:+.2f} | [{lo:+.{n}f}, {hi:+.{n}f}] |"


def report(d: dict) -> str:
    """The decision as Markdown."""
    b = d["branch_check"]
    lines = [
        f"Launches: {d['launches']}, on {' and '.join(d['cpu']) or 'no CPU'}, "
        f"at {', '.join(d['commits']) or 'no commit'}.",
        f"R branched at step 1,500 ends where R ends: {b['same']} (seeds {b['seeds']}).",
        "",
    ]
    for loss in ("val_loss", "train_loss"):
        v = d[loss]
        lines += [
            f"**{loss}** (final, paired by seed, seeds {v['seeds']}): {v['call']}.",
            "",
            "| contrast | n | mean ± SE | t | 95 % interval |",
            "|---|---|---|---|---|",
            *(_row(name, p) for name, p in v["contrasts"].items()),
            "",
        ]
    lines += ["| meter at step 2,000 | n | mean ± SE |", "|---|---|---|"]
    lines += [f"| {k} | {m['n']} | {figure(m['mean'], m['se'])} |" for k, m in d["meter"].items()]
    stopped = sorted(k for k, s in d["runs"].items() if s == "diverged")
    lines += ["", f"Runs: {len(d['runs'])}; diverged: {', '.join(stopped) or 'none'}."]
    return "\n".join(lines) + "\n"
