"""The numerics spec is frozen, the read tables are read-only, and the run's rounding state changes
mode only through its own context managers: no module writes the attributes of a ``Numerics``."""

from __future__ import annotations

import ast
import dataclasses
import pickle
from copy import deepcopy
from pathlib import Path

import pytest
import torch

from readback.numerics import CurrentScaling
from readback.numerics.state import Numerics
from readback.ops import OPS, read_rules
from readback.ops.attention import attention
from specs import make_spec

SRC = Path(__file__).resolve().parents[3] / "src" / "readback"
STATE_MODULE = SRC / "ops" / "numerics.py"


def test_the_spec_is_frozen_and_its_reads_read_only():
    spec = make_spec("fp8", CurrentScaling(), "reuse_rounded", site_margin={"attn.core.output": 3})
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.policy = "exact"  # type: ignore[misc]
    with pytest.raises(TypeError):
        spec.reads["attention"]["D"] = "none"  # type: ignore[index]
    with pytest.raises(TypeError):
        spec.reads["attention"] = {}  # type: ignore[index]
    assert spec.read("attention", "D") == "rounded" and spec.site_margin == (("attn.core.output", 3),)
    assert pickle.loads(pickle.dumps(spec)) == spec and deepcopy(spec) is spec


def test_op_read_tables_are_read_only_after_import():
    for op in OPS.values():
        with pytest.raises(TypeError):
            op.READS["exact"] = {}
        with pytest.raises(TypeError):
            op.READS["exact"][next(iter(op.READS["exact"]))] = "rounded"


def test_numerics_settings_and_modes_cannot_be_assigned():
    numerics = Numerics(make_spec("fp8", CurrentScaling(), "reuse_rounded"))
    for name in (
        "spec",
        "policy",
        "recipe",
        "bwd_gemm_precision",
        "rounding",
        "precision",
        "tape",
        "watched",
        "mechanism",
    ):
        with pytest.raises(AttributeError):
            setattr(numerics, name, None)


def test_context_managers_switch_a_mode_for_their_block_only():
    numerics = Numerics(make_spec("fp8", CurrentScaling(), "reuse_rounded"))
    exact = numerics.spec.with_reads("exact", read_rules("exact"))
    with numerics.using(exact):
        assert numerics.read("attention", "D") == "none" and numerics.policy == "exact"
    assert numerics.read("attention", "D") == "rounded" and numerics.policy == "reuse_rounded"
    q, k, v = (torch.randn(1, 2, 8, 16, generator=torch.Generator().manual_seed(i)) for i in range(3))
    with numerics.taping() as tape, numerics.measuring():
        assert numerics.mechanism
        attention(q, k, v, numerics, "attn")
    assert [name for name, _ in tape] == ["attn"] and numerics.tape is None and not numerics.mechanism


def _numerics_attribute_writes(path: Path) -> list[str]:
    """``<...>numerics.<attr> = ...`` and ``setattr(<...>numerics, ...)`` in ``path``'s code."""

    def is_numerics(node: ast.AST) -> bool:
        return (isinstance(node, ast.Name) and node.id == "numerics") or (
            isinstance(node, ast.Attribute) and node.attr == "numerics"
        )

    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        targets = []
        if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        flat = [t for target in targets for t in (target.elts if isinstance(target, ast.Tuple) else [target])]
        found += [f"{path.name}:{node.lineno}" for t in flat if isinstance(t, ast.Attribute) and is_numerics(t.value)]
        call = isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr"
        if call and node.args and is_numerics(node.args[0]):
            found.append(f"{path.name}:{node.lineno} (setattr)")
    return found


def test_no_module_outside_the_numerics_state_writes_its_attributes():
    modules = [p for p in SRC.rglob("*.py") if p != STATE_MODULE]
    assert len(modules) > 50
    assert [w for p in modules for w in _numerics_attribute_writes(p)] == []


def test_the_write_rule_finds_a_write(tmp_path):
    planted = tmp_path / "planted.py"
    planted.write_text("model.numerics.policy = 'x'\nnumerics.tape, y = [], 1\nsetattr(self.numerics, 'a', 1)\n")
    assert _numerics_attribute_writes(planted) == ["planted.py:1", "planted.py:2", "planted.py:3 (setattr)"]
