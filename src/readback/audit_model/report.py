"""The audit's table: saved tensor -> error if stored in FP8 -> gradients it hurts -> bytes saved."""

from __future__ import annotations

import json
import math
from pathlib import Path

from readback.audit_model.core import STORAGES, AuditRow


def to_markdown(rows: list[AuditRow], title: str = "") -> str:
    """One line per saved tensor: relative error of the total gradient for each storage ("free":
    no gradient moves), the groups it hurts most, and the bytes an FP8 copy would save."""
    storages = [s for s in STORAGES if s in rows[0].errors] if rows else list(STORAGES)
    lines = [f"{title}", ""] if title else []
    lines += [
        "| saved tensor (module/op.attribute) | shape | " + " | ".join(storages) + " | hurts | bytes saved in FP8 |",
        "|---" * (len(storages) + 4) + "|",
    ]
    for row in rows:
        lines.append(
            f"| {row.name} | {'x'.join(map(str, row.shape))} {row.dtype} | "
            + " | ".join(row.verdicts[s] for s in storages)
            + f" | {', '.join(row.hurts()) or '-'} | {row.fp8_bytes_saved} |"
        )
    free = [r for r in rows if r.verdicts.get("e4m3") == "free"]
    lines += [
        "",
        f"{len(rows)} saved tensors, {sum(r.nbytes for r in rows)} bytes; {len(free)} can be stored as "
        f"E4M3 with no gradient change, saving {sum(r.fp8_bytes_saved for r in free)} bytes.",
    ]
    return "\n".join(lines) + "\n"


def plot(rows: list[AuditRow], path: str | Path | None = None, title: str = ""):
    """Relative gradient error of each saved tensor under each storage (log scale; free = bottom)."""
    import numpy as np
    from matplotlib.figure import Figure

    storages = [s for s in STORAGES if s != "original" and rows and s in rows[0].errors]
    fig = Figure(figsize=(10, 2 + 0.22 * len(rows)))
    ax = fig.subplots()
    y = np.arange(len(rows))
    for i, storage in enumerate(storages):
        values = [max(r.errors[storage]["total"], 1e-9) for r in rows]
        ax.barh(y + (i - 1) * 0.27, values, height=0.27, label=storage)
    ax.set_xscale("log")
    ax.set_yticks(y, [r.name for r in rows], fontsize=6)
    ax.invert_yaxis()
    ax.set_xlabel("relative error of the total gradient (1e-9 = free)")
    ax.legend(fontsize=7)
    ax.set_title(title or "saved tensors stored in FP8", fontsize=9)
    fig.tight_layout()
    if path is not None:
        fig.savefig(path, dpi=110)
    return fig


def write(rows: list[AuditRow], out: str | Path, title: str = "") -> dict[str, Path]:
    """``audit.json``, ``audit.md`` and ``audit.png`` in ``out``."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / "audit.json", "markdown": out / "audit.md", "plot": out / "audit.png"}

    def finite(v: float) -> float | None:
        return v if not (isinstance(v, float) and math.isinf(v)) else None

    data = [
        {**r.to_json(), "errors": {s: {g: finite(e) for g, e in errs.items()} for s, errs in r.errors.items()}}
        for r in rows
    ]
    paths["json"].write_text(json.dumps({"title": title, "rows": data}, indent=1) + "\n")
    paths["markdown"].write_text(to_markdown(rows, title))
    plot(rows, paths["plot"], title)
    return paths
