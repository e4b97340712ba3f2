"""ARCHITECTURE.md's "A setting's road" is what the code does: composing a run's config, building
its model and running one step, the modules that read each numerics setting outside the ops are
the ones the page lists for it, at most four of them before the ops (five files in all with the
op), so a longer road fails here. What reads a setting is traced at run time: every read of its
attribute on the objects that carry it down (the config, the settings, the spec, the run's
``Numerics``), by the module that reads it."""

from __future__ import annotations

import re
import sys
from collections import defaultdict
from pathlib import Path

import pytest
import torch

from readback.backends import build_model
from readback.numerics.attention_settings import AttentionSettings
from readback.numerics.precision_settings import Fp8Settings
from readback.numerics.settings import NumericsSettings
from readback.numerics.spec import NumericsSpec
from readback.numerics.state import Numerics
from readback.train.settings import Config
from toys import config

REPO = Path(__file__).resolve().parents[2]
SRC = REPO / "src" / "readback"
PAGE = (REPO / "ARCHITECTURE.md").read_text()
MAX_FILES = 5  # from the YAML to the op that uses it, the op included
# setting -> {class that carries it down: the attributes it is read by there}
CARRIERS = {
    "policy": {Config: ("policy",), NumericsSettings: ("policy",), NumericsSpec: ("policy",), Numerics: ("policy",)},
    "attention.bwd_precision": {
        AttentionSettings: ("bwd_precision",),
        NumericsSpec: ("bwd_gemm_precision",),
        Numerics: ("bwd_gemm_precision",),
    },
    "precision.rounding": {Fp8Settings: ("rounding",), NumericsSpec: ("rounding",), Numerics: ("rounding",)},
    "attention.recipe": {AttentionSettings: ("recipe",), NumericsSpec: ("attention_recipe", "recipe_for")},
}
# runs that read every one of them: stochastic rounding, a recipe of the core's own, TE's backward
TINY = ("model.n_layers=1", "model.vocab_size=2048")
RUNS = [
    ("+experiment=reuse_rounded", "precision.rounding=stochastic", "attention.recipe=current", *TINY),
    ("+experiment=reuse_rounded", "attention.bwd_precision=bf16", "attention.bwd_reads=te", *TINY),
]


def _traced_readers(monkeypatch) -> dict[str, set[str]]:
    """``{setting: {module path under readback/}}`` of the reads while each run's config is made
    and checked, its model built, and one step run."""
    readers: dict[str, set[str]] = defaultdict(set)
    by_class: dict[type, dict[str, str]] = defaultdict(dict)
    for setting, carriers in CARRIERS.items():
        for cls, attributes in carriers.items():
            by_class[cls] |= dict.fromkeys(attributes, setting)
    for cls, watched in by_class.items():
        original = cls.__getattribute__

        def read(self, name, original=original, watched=watched):
            if name in watched:
                module = sys._getframe(1).f_globals.get("__name__", "")
                if module == "readback.fields":  # a group checking its fields' ranges: the group's module
                    module = type(self).__module__
                if module.startswith("readback."):
                    readers[watched[name]].add(module)
            return original(self, name)

        monkeypatch.setattr(cls, "__getattribute__", read)
    for run in RUNS:
        cfg = config(*run)
        model = build_model(cfg)
        idx = torch.randint(0, cfg.model.vocab_size, (2, cfg.model.seq_len))
        model(idx, idx).backward()
        model.numerics.end_step()
    return {s: {_path(m) for m in modules} for s, modules in readers.items()}


def _path(module: str) -> str:
    """``ops/__init__.py`` for ``readback.ops``: the module's file under readback/."""
    return Path(sys.modules[module].__file__).relative_to(SRC).as_posix()


def _page_road(setting: str) -> list[str]:
    """The files the page lists on ``setting``'s road, in order, the YAML and the ops left out."""
    bullet = re.search(rf"^\* \*\*{re.escape(setting)}\*\*: (.+?)(?=\n\* |\n\n)", PAGE, re.MULTILINE | re.DOTALL)
    assert bullet, f"ARCHITECTURE.md gives no road for {setting}"
    stops = [s.split()[0].strip("`") for s in bullet.group(1).split("->")]
    return [s for s in stops if s.endswith(".py") and not s.startswith("ops/")]


@pytest.fixture(scope="module")
def readers():
    with pytest.MonkeyPatch.context() as monkeypatch:
        return _traced_readers(monkeypatch)


@pytest.mark.parametrize("setting", list(CARRIERS))
def test_each_setting_is_read_on_its_road_only(readers, setting):
    found = readers[setting]
    outside_ops = sorted(m for m in found if not m.startswith("ops/"))
    assert any(m.startswith("ops/") for m in found) or setting == "attention.recipe", (setting, found)
    assert sorted(_page_road(setting)) == outside_ops, f"{setting} is read by {outside_ops}"
    assert len(outside_ops) + 1 <= MAX_FILES, f"{setting}'s road: {outside_ops} and the op"
