"""ARCHITECTURE.md names the code as it is: every file, package and ``readback.`` module it names
exists, and every package and top-level module of readback has its place in the layer map."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SRC = REPO / "src" / "readback"
PAGE = (REPO / "ARCHITECTURE.md").read_text()
LAYER_MAP = PAGE.split("```")[1]  # the diagram: one row per layer, its packages and modules first


def _named_paths() -> list[str]:
    """``ops/attention.py``, ``train/checkpoint/``, ``conf/train.yaml``, and backticked
    ``checkpoint/dirs``: the page's file and package names (a path, or a name ending in .py)."""
    bare = re.findall(r"(?<![\w./<])((?:\w+/)+|(?:\w+/)*\w+\.(?:py|yaml|md))(?![\w/<])", PAGE)
    quoted = [t for t in re.findall(r"`([\w./]+)`", PAGE) if "/" in t and not t.startswith(".")]
    # `train/settings.Config`: the module's path, without the object it names in it
    quoted = [re.sub(r"(/\w+)\.(?!py$|yaml$|md$)\w+$", r"\1", t) for t in quoted]
    return sorted(set(bare + quoted))


def _exists(name: str) -> bool:
    """Under the repository, readback's source, or (a module's short path) any package of it."""
    stem = name.rstrip("/")
    candidates = [stem, f"{stem}.py"]
    if any((root / c).exists() for root in (REPO, SRC) for c in candidates):
        return True
    return any(p.exists() for c in candidates for p in SRC.rglob(c) if "__pycache__" not in p.parts)


@pytest.mark.parametrize("name", _named_paths())
def test_every_file_and_package_it_names_exists(name):
    assert _exists(name), f"ARCHITECTURE.md names {name}, which is gone"


@pytest.mark.parametrize("dotted", sorted(set(re.findall(r"`(readback(?:\.\w+)+)", PAGE))))
def test_every_readback_module_or_object_it_names_imports(dotted):
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):  # the longest importable prefix, then attributes
        try:
            found = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        for attribute in parts[cut:]:
            assert hasattr(found, attribute), f"ARCHITECTURE.md names {dotted}: no {attribute}"
            found = getattr(found, attribute)
        return
    pytest.fail(f"ARCHITECTURE.md names {dotted}, which does not import")


def test_every_package_and_top_level_module_has_its_place_in_the_layer_map():
    own = {p.name + "/" for p in SRC.iterdir() if (p / "__init__.py").exists()}
    own |= {p.name for p in SRC.glob("*.py") if p.name != "__init__.py"}
    missing = sorted(name for name in own if not re.search(rf"(?<![\w/.]){re.escape(name)}", LAYER_MAP))
    assert not missing, f"packages and modules the layer map of ARCHITECTURE.md leaves out: {missing}"


def test_the_check_finds_a_name_that_is_gone():
    assert not _exists("train/checkpoint_dirs.py") and not _exists("ops/no_such_op.py")
    assert _exists("train/checkpoint/") and _exists("checkpoint/dirs") and _exists("conf/train.yaml")
