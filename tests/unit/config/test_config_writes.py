"""No module writes into a run's config once it is checked: a derived value (the tokenizer's
vocabulary) makes a new config (``train.contract.with_vocabulary``) or is passed on."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[3] / "src" / "readback"


def _config_writes(path: Path, root: Path = SRC) -> list[str]:
    """``cfg.<...> = ...`` and ``cfg[...] = ...`` (also on ``self.cfg``) in ``path``'s code."""

    def rooted_at_cfg(node: ast.AST) -> bool:
        while isinstance(node, (ast.Attribute, ast.Subscript)):
            if isinstance(node, ast.Attribute) and node.attr == "cfg" and isinstance(node.value, ast.Name):
                return True  # self.cfg.<...>
            node = node.value
        return isinstance(node, ast.Name) and node.id == "cfg"

    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.Assign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for t in targets:
                if isinstance(t, (ast.Attribute, ast.Subscript)) and rooted_at_cfg(t.value):
                    found.append(f"{path.relative_to(root)}:{node.lineno}")
    return found


def test_no_module_writes_into_a_config():
    modules = sorted(SRC.rglob("*.py"))
    assert len(modules) > 50
    assert [w for p in modules for w in _config_writes(p)] == []


def test_the_rule_finds_a_write(tmp_path):
    planted = tmp_path / "planted.py"
    planted.write_text("cfg.model.vocab_size = 3\nself.cfg.trainer['steps'] = 1\ncfg = other\nself.cfg = cfg\n")
    assert _config_writes(planted, tmp_path) == ["planted.py:1", "planted.py:2"]
