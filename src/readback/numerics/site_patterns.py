"""Site patterns: the globs over site names that options take (``precision.site_margin``, an amax
spike's site, the bias meter's ``--site-margin``), matched and refused one way everywhere."""

from __future__ import annotations

import fnmatch
import re

from readback.errors import require


def site_matches(name: str, pattern: str) -> bool:
    """A site pattern is a glob over the site name, matching whole trailing components too:
    ``attn.core.output`` matches ``layers.3.attn.core.output``."""
    return fnmatch.fnmatchcase(name, pattern) or fnmatch.fnmatchcase(name, f"*.{pattern}")


def site_kinds(sites: list[str]) -> list[str]:
    """The kinds of ``sites``, each once: names without their layer (``layers.3.attn.core.output``
    -> ``attn.core.output``), the words a refused site pattern is answered with."""
    return list(dict.fromkeys(re.sub(r"^layers\.\d+\.", "", s) for s in sites))


def require_site_pattern(
    key: str, pattern: str, sites: list[str], valid: str = "site patterns (globs) matching"
) -> None:
    """``ConfigError`` naming ``key`` unless ``pattern`` matches one of ``sites``; the refusal
    lists the kinds of those sites after ``valid`` (every option taking a site pattern answers so)."""
    require(any(site_matches(s, pattern) for s in sites), key, pattern, f"{valid} " + ", ".join(site_kinds(sites)))
