"""The bias meter's z on errors of known mean (``docs/results/meter_calibration/preregistration.md``).

Measures, then decides:

    python scripts/meter_null_calibration.py measure CKPT [CKPT ...] --out DIR   # real nulls
    python scripts/meter_null_calibration.py synthetic --out DIR                 # synthetic errors
    python scripts/meter_null_calibration.py decide DIR                          # tables, plot, calls

``measure``: per checkpoint, 80 training batches from ``80 x`` its index among the checkpoints
of its seed; per batch the executed forward, its FP64 reference gradient and the fresh_reround
backward under two random-stream salts; ``e_b = g_A - g_B`` (mean exactly zero). Cut into
disjoint sets of N = 8, 16, 32 batches; per set and group, the estimators on ``e`` (the null)
and on ``e - alpha G`` (a known mean: projection ``alpha``, debiased squared bias ``alpha^2``,
``alpha = 3 x floor``). One JSON line per (checkpoint, N, set, group) in ``DIR/real.jsonl``.
``synthetic``: the same statistics on Gaussian and multivariate-t errors, ``DIR/synthetic.jsonl``.
``decide``: ``DIR/calibration.md``, ``calibration.json`` and ``z_real_n16.png`` from those files
(or from their ``.jsonl.gz``, as committed).
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
from pathlib import Path

import numpy as np
import torch

from readback.bias.estimators import group_stats
from readback.bias.meter import group_of, variant_errors
from readback.bias.variants import variants
from readback.cli.bias import load_run
from readback.jsonl import read_jsonl
from readback.probe import reference_gradients, taped_backward
from readback.progress import progress
from readback.stopping import ends_on_ctrl_c

BATCHES, SIZES = 80, (8, 16, 32)
GROUPS = ("total", "layers.0.attn.qkv", "layers.1.attn.qkv")
ALPHA_FLOORS = 3.0  # the known mean's size, in floors
# statistic -> (estimate, SE); the debiased SE without its guard (``group_stats(guard=False)``) is
# in the records measured since the guard exists (preregistration_nonzero.md)
Z_STATS = {
    "projection": ("projection", "projection_se"),
    "debiased_sq": ("debiased_sq", "debiased_sq_se"),
    "debiased_sq_unguarded": ("debiased_sq", "debiased_sq_se_unguarded"),
}
CALLED_N, MEAN_LIMIT, SD_BAND, SHARE_LIMIT = 16, 0.25, (0.8, 1.2), 0.05
SYNTHETIC_D, SYNTHETIC_REPS = 2048, 2000


def measure(checkpoints: list[Path], out: Path) -> None:
    """``real.jsonl``: the estimators on two fresh draws' difference, per set and group."""
    path_out = out / "real.jsonl"
    done = {(x["arm"], x["seed"], x["step"]) for x in read_jsonl(path_out)} if path_out.exists() else set()
    seen: dict[int, int] = {}
    with path_out.open("a") as records:
        for path in checkpoints:
            model, stream, step, run_dir = load_run(path)
            seed = stream.seed
            index = seen[seed] = seen.get(seed, -1) + 1
            if (run_dir.parent.name, seed, step) in done:  # measured before this command was stopped
                continue
            for _ in range(BATCHES * index):  # no two sets of one seed share a batch
                stream.next_batch()
            e, r = _fresh_differences(model, [stream.next_batch() for _ in range(BATCHES)], f"{run_dir.name}/{step}")
            for n in SIZES:
                for s in range(BATCHES // n):
                    for group, names in _groups(e[0]).items():
                        es, rs = (torch.stack([_flat(d, names) for d in x[s * n : (s + 1) * n]]) for x in (e, r))
                        line = {"arm": run_dir.parent.name, "seed": seed, "step": step, "n": n, "set": s}
                        records.write(json.dumps({**line, "group": group, **_null_and_known(es, rs)}) + "\n")
            records.flush()


def _fresh_differences(model, batches: list, label: str) -> tuple[list[dict], list[dict]]:
    """Per batch ``{parameter: g_fresh,A - g_fresh,B}`` and the reference gradient."""
    numerics = model.numerics
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    fresh = [v for v in variants(numerics) if v.name == "fresh_reround"]
    errors, references = [], []
    bar = progress(len(batches), desc=label, unit="batch", min_interval_s=60)
    for b, (x, y) in enumerate(batches):
        salt = f"/null{b}"
        with numerics.isolated(salt):
            for p in params.values():
                p.grad = None
            loss, tape = taped_backward(model, x, y)
            reference = reference_gradients(model, params, tape, x, y, torch.float64)
        a, c = (variant_errors(model, params, (x, y), loss, reference, fresh, salt + d)["fresh_reround"] for d in "ab")
        errors.append({n: a[n] - c[n] for n in a})
        references.append(reference)
        bar.update()
    bar.close()
    return errors, references


def _groups(example: dict) -> dict[str, list[str]]:
    return {g: [n for n in example if g == "total" or group_of(n) == g] for g in GROUPS}


def _flat(grads: dict, names: list[str]) -> torch.Tensor:
    return torch.cat([grads[n].flatten() for n in names])


def _null_and_known(e: torch.Tensor, r: torch.Tensor) -> dict:
    """The estimators on ``e`` (truth 0) and on ``e - alpha G`` (truth alpha, alpha^2)."""
    null = _statistics(e, r)
    alpha = ALPHA_FLOORS * null["floor"]
    return {"null": null, "known": _statistics(e - alpha * r.mean(0), r), "alpha": alpha}


def _statistics(e: torch.Tensor, r: torch.Tensor) -> dict:
    """``group_stats``, and the debiased SE without its guard beside it."""
    return group_stats(e, r) | {"debiased_sq_se_unguarded": group_stats(e, r, guard=False)["debiased_sq_se"]}


def synthetic(out: Path, seed: int = 0) -> None:
    """``synthetic.jsonl``: Gaussian and multivariate-t (3 df) errors with covariance eigenvalues
    falling as 1/i, mean 0 and ``-alpha G``, ``r_b = G``, at each N."""
    gen = torch.Generator().manual_seed(seed)
    d = SYNTHETIC_D
    sd = (1.0 / torch.arange(1, d + 1, dtype=torch.float64)).sqrt()
    g = torch.randn(d, generator=gen, dtype=torch.float64)
    g = g / g.norm()
    with (out / "synthetic.jsonl").open("w") as records:
        for noise in ("gaussian", "t3"):
            for n in SIZES:
                scale = 0.1 * math.sqrt(n / float((sd**2).sum()))  # the floor at 0.1 (Gaussian)
                alpha = ALPHA_FLOORS * 0.1
                for rep in range(SYNTHETIC_REPS):
                    e = torch.randn(n, d, generator=gen, dtype=torch.float64) * sd * scale
                    if noise == "t3":
                        chi2 = torch.randn(n, 3, generator=gen, dtype=torch.float64).pow(2).sum(1)
                        e = e / (chi2 / 3).sqrt()[:, None] / math.sqrt(3)  # unit covariance scale
                    r = g.expand(n, d)
                    null, known = _statistics(e, r), _statistics(e - alpha * g, r)
                    line = {"noise": noise, "n": n, "rep": rep, "alpha": alpha, "null": null, "known": known}
                    records.write(json.dumps(line) + "\n")


def z_scores(line: dict, stat: str, kind: str) -> float:
    """``(estimate - truth) / SE`` of ``stat`` in ``line``'s ``kind`` (``null`` or ``known``)."""
    value, se = Z_STATS[stat]
    alpha = line["alpha"] if kind == "known" else 0.0
    truth = {"projection": alpha, "debiased_sq": alpha**2}[value]
    return (line[kind][value] - truth) / line[kind][se]


def summary(z: np.ndarray) -> dict:
    """Count, mean z and its 95 % interval, sd and its 95 % interval (chi-square by
    Wilson-Hilferty), share with |z| > 2 and its 95 % Wilson interval."""
    n, q = len(z), 1.959964
    mean, sd = float(z.mean()), float(z.std(ddof=1))
    half = q * sd / math.sqrt(n)
    df = n - 1

    def chi2(p_z: float) -> float:  # the chi-square quantile at the normal quantile p_z
        return df * (1 - 2 / (9 * df) + p_z * math.sqrt(2 / (9 * df))) ** 3

    share = float((np.abs(z) > 2).mean())
    centre, spread = (share + q**2 / (2 * n)) / (1 + q**2 / n), q / (1 + q**2 / n)
    wilson = spread * math.sqrt(share * (1 - share) / n + q**2 / (4 * n**2))
    return {
        "count": n,
        "mean": mean,
        "mean_ci": [mean - half, mean + half],
        "sd": sd,
        "sd_ci": [sd * math.sqrt(df / chi2(q)), sd * math.sqrt(df / chi2(-q))],
        "share_gt2": share,
        "share_ci": [centre - wilson, centre + wilson],
    }


def call(s: dict) -> str:
    """The pre-registered words for one summary."""
    if s["sd_ci"][0] > SD_BAND[1] or s["share_ci"][0] > SHARE_LIMIT:
        return "anti-conservative"
    if abs(s["mean"]) > MEAN_LIMIT and not s["mean_ci"][0] <= 0 <= s["mean_ci"][1]:
        return "biased"
    if s["sd_ci"][1] < SD_BAND[0]:
        return "conservative"
    return "calibrated"


def records(folder: Path, name: str) -> list[dict]:
    """``name.jsonl``'s records, or those of ``name.jsonl.gz`` where only that exists."""
    packed = folder / f"{name}.jsonl.gz"
    if (folder / f"{name}.jsonl").exists() or not packed.exists():
        return read_jsonl(folder / f"{name}.jsonl")
    return [json.loads(line) for line in gzip.decompress(packed.read_bytes()).decode().splitlines() if line]


def decide(folder: Path) -> None:
    rows = []
    real = records(folder, "real")
    for kind in ("null", "known"):
        for n in SIZES:
            for group in GROUPS:
                for stat in _measured(real):
                    z = np.array([z_scores(x, stat, kind) for x in real if x["n"] == n and x["group"] == group])
                    rows.append({"source": f"real {kind}", "n": n, "group": group, "stat": stat, **summary(z)})
    made = any((folder / f"synthetic{suffix}").exists() for suffix in (".jsonl", ".jsonl.gz"))
    fake = records(folder, "synthetic") if made else []  # a folder of real cells alone has none
    for noise in ("gaussian", "t3") if fake else ():
        for kind in ("null", "known"):
            for n in SIZES:
                for stat in _measured(fake):
                    z = np.array([z_scores(x, stat, kind) for x in fake if x["n"] == n and x["noise"] == noise])
                    rows.append({"source": f"{noise} {kind}", "n": n, "group": "-", "stat": stat, **summary(z)})
    for row in rows:
        row["call"] = call(row)
    (folder / "calibration.json").write_text(json.dumps(rows, indent=1) + "\n")
    (folder / "calibration.md").write_text(_markdown(rows) + "\n")
    _plot(real, folder / "z_real_n16.png")
    print(_markdown(rows))


def _measured(lines: list[dict]) -> list[str]:
    """The statistics of Z_STATS whose SE the records hold (records made before the debiased SE's
    guard have no unguarded SE)."""
    return [stat for stat, (_, se) in Z_STATS.items() if se in lines[0]["null"]]


def _markdown(rows: list[dict]) -> str:
    def interval(pair: list[float]) -> str:
        return f"[{pair[0]:+.2f}, {pair[1]:+.2f}]"

    called = [r for r in rows if r["source"] == "real null" and r["n"] == CALLED_N]
    lines = [
        "# The meter's z on nulls: the calls",
        "",
        f"Pre-registered calls (real null, N = {CALLED_N}): "
        + "; ".join(f"{r['stat']} on {r['group']}: **{r['call']}**" for r in called)
        + ".",
        "",
        "| source | N | group | statistic | count | mean z [95 %] | sd z [95 %] | share abs(z) > 2 [95 %] | call |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['source']} | {r['n']} | {r['group']} | {r['stat']} | {r['count']} "
            f"| {r['mean']:+.2f} {interval(r['mean_ci'])} | {r['sd']:.2f} [{r['sd_ci'][0]:.2f}, {r['sd_ci'][1]:.2f}] "
            f"| {r['share_gt2']:.3f} [{r['share_ci'][0]:.3f}, {r['share_ci'][1]:.3f}] | {r['call']} |"
        )
    return "\n".join(lines)


def _plot(real: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6), sharey=True)
    grid = np.linspace(-4, 4, 200)
    for ax, stat in zip(axes, Z_STATS):
        for group in GROUPS:
            z = [z_scores(x, stat, "null") for x in real if x["n"] == CALLED_N and x["group"] == group]
            ax.hist(z, bins=np.linspace(-4, 4, 17), density=True, histtype="step", label=f"{group} ({len(z)})")
        ax.plot(grid, np.exp(-(grid**2) / 2) / math.sqrt(2 * math.pi), "k--", label="N(0, 1)")
        ax.set(title=f"{stat}: z on two fresh draws' difference, N = {CALLED_N}", xlabel="z")
    axes[0].set_ylabel("density")
    axes[1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


@ends_on_ctrl_c("scripts/meter_null_calibration.py")
def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("action", choices=("measure", "synthetic", "decide"))
    parser.add_argument("paths", nargs="*", type=Path, help="checkpoints (measure) or the folder (decide)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.action == "decide":
        decide(args.paths[0])
        return
    args.out.mkdir(parents=True, exist_ok=True)
    measure(args.paths, args.out) if args.action == "measure" else synthetic(args.out)


if __name__ == "__main__":
    main()
