"""The bias command's options as data: site margins, replaced config keys, accumulation, and the
default output directory's suffix each adds (``readback.cli.bias``)."""

from __future__ import annotations

import re

from readback.errors import require


def parse_margin(text: str) -> tuple[str, list[int]]:
    """``PATTERN=K`` or ``PATTERN=K1,K2,...`` -> ``(PATTERN, [K, ...])``, every K a site margin
    (>= 0), refused before any checkpoint is read."""
    from readback.config import require_margin

    pattern, _, values = text.rpartition("=")
    try:
        margins = [int(v) for v in values.split(",")]
    except ValueError:
        margins = []
    require(bool(pattern) and bool(margins), "--site-margin", text, "PATTERN=K, e.g. attn.core.output=12")
    require_margin(f"--site-margin {pattern}", min(margins))
    return pattern, margins


def label(text: str) -> str:
    """``text`` (site patterns and margins: ``attn.core.output=12``) as part of a directory name."""
    return re.sub(r"[^\w.=,-]", "_", text) or "none"


def accumulation_keys(name: str | None, gemms: list[str]) -> dict | None:
    """The ``precision`` keys that ``--accumulation`` and ``--accumulation-gemm`` replace (None: neither given)."""
    if name is None and not gemms:
        return None
    pairs = [g.partition("=") for g in gemms]
    for text, (gemm, sep, mode) in zip(gemms, pairs):
        require(bool(gemm and sep and mode), "--accumulation-gemm", text, "GEMM=MODE, e.g. dgrad=ieee")
    keys: dict = {"accumulation_gemms": {gemm: mode for gemm, _, mode in pairs} or None}
    return keys | ({"accumulation": name} if name is not None else {})


def group_keys(group: str, pairs: list[str]) -> dict:
    """``--<group> KEY=VALUE`` as ``{KEY: VALUE}``, VALUE read as YAML (``true``, ``1``, ``[a, b]``)."""
    import yaml

    keys = {}
    for text in pairs:
        key, sep, value = text.partition("=")
        require(bool(key and sep), f"--{group}", text, "KEY=VALUE, e.g. recipe=nvfp4")
        keys[key] = yaml.safe_load(value)
    return keys


def group_label(group: str, pairs: list[str]) -> str:
    """The default directory's suffix for a group's replaced keys (``-precision-recipe=nvfp4``)."""
    return f"-{group}-" + label(",".join(pairs)) if pairs else ""


def accumulation_label(keys: dict | None) -> str:
    """The default directory's suffix for replaced accumulation keys (``-acc-hopper``)."""
    if keys is None:
        return ""
    gemms = ",".join(f"{g}={m}" for g, m in (keys["accumulation_gemms"] or {}).items())
    return "-acc-" + label("".join(filter(None, [keys.get("accumulation"), gemms and f"({gemms})"])))


def single_margin(parsed: tuple[str, list[int]]) -> tuple[str, int]:
    pattern, margins = parsed
    require(len(margins) == 1, "--site-margin", f"{pattern}={margins}", "one K per pattern (a sweep: --sweep-margin)")
    return pattern, margins[0]


def part_variants_of(parts: str | None) -> list | None:
    """``--parts``' variants (None: not given; ``""``: every backward), a name that is no backward refused."""
    if parts is None:
        return None
    from readback.bias.backward_parts import FORWARD_READS, backwards, part_variants

    names = parts.split(",") if parts else None
    valid = [*backwards(), FORWARD_READS]
    unknown = ",".join(n for n in names or [] if n not in valid)
    require(not unknown, "--parts", unknown, f"a comma-separated list of {valid}")
    return part_variants(names)
