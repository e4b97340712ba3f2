"""The dose-response of one checkpoint as a Markdown table, from ``python -m readback.cli.bias
--sweep-margin``'s ``dose.json``: per margin K, the D read's and fresh_reround's contribution to
one group's gradient bias (bias with its floor, projection and debiased squared norm with their
SEs) and O's underflow fraction and relative rounding error per attention layer (and, where the
meter recorded it, where O's rms lands on O8's grid, ``log2(rms(O) * scale)``).

    python scripts/dose_table.py docs/results/d_term/dose_stress14/dose.json [--group layers.1.attn.qkv]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from readback.stopping import ends_on_ctrl_c

READS = {"D read": "contrib.exact_read.attention.D", "fresh_reround": "contrib.fresh_reround"}


def dose_table(dose: dict, group: str) -> str:
    layers = sorted(dose["points"][0]["o_rounding"])
    head = ["K"]
    for label in READS:
        head += [f"{label}: bias (floor)", f"{label}: projection", f"{label}: debiased bias²"]
    head += [f"O underflow ({', '.join(layers)})", f"O rel. rounding error ({', '.join(layers)})"]
    on_grid = all("log2_rms_scaled" in o for o in dose["points"][0]["o_rounding"].values())  # newer meters
    if on_grid:
        head += [f"log2(rms(O) * scale) ({', '.join(layers)})"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for point in dose["points"]:
        row = [str(point["margin"])]
        for key in READS.values():
            s = point["stats"][key][group]
            row += [
                f"{s['bias']:.4f} ({s['bias_se']:.4f})",
                f"{s['projection']:+.4f} ± {s['projection_se']:.4f}",
                f"{s['debiased_sq']:+.5f} ± {s['debiased_sq_se']:.5f}",
            ]
        o = point["o_rounding"]
        row += [" / ".join(f"{o[layer]['underflow']:.3f}" for layer in layers)]
        row += [" / ".join(f"{o[layer]['rel_err']:.3f}" for layer in layers)]
        if on_grid:
            row += [" / ".join(f"{o[layer]['log2_rms_scaled']:+.2f}" for layer in layers)]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


@ends_on_ctrl_c("scripts/dose_table.py")
def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("dose", type=Path)
    parser.add_argument("--group", default="layers.1.attn.qkv")
    args = parser.parse_args(argv)
    dose = json.loads(args.dose.read_text())
    print(f"checkpoint step {dose['checkpoint_step']}, {dose['batches']} batches, group {args.group}\n")
    print(dose_table(dose, args.group))


if __name__ == "__main__":
    main()
