"""Every program is ``python -m readback.cli.NAME``: no library module parses a command line, the
old commands that sweeps, scripts and result pages name still run (each forwards to its program
with the same arguments), and README.md's table lists every program."""

from __future__ import annotations

import ast
import re
import runpy
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
SRC = REPO / "src" / "readback"
CLI = SRC / "cli"

# the old command -> the program it runs (its usage line's prog)
OLD_COMMANDS = {
    ("-m", "readback.analysis"): "python -m readback.cli.analysis",
    ("-m", "readback.audit"): "python -m readback.cli.audit",
    ("-m", "readback.audit_model"): "python -m readback.cli.audit_model",
    ("-m", "readback.sync"): "python -m readback.cli.sync",
    ("-m", "readback.bias.attribution"): "python -m readback.cli.bias_attribution",
    ("-m", "readback.bias.onset"): "python -m readback.cli.bias_onset",
    ("-m", "readback.bias.shapes"): "python -m readback.cli.bias_shapes",
    **{
        (f"scripts/{name}_decision.py",): f"python -m readback.cli.decide {name}"
        for name in ("bf16_bwd", "bf16_fix_cost", "nvfp4_switches", "parts_ladder", "spike", "study_setting")
    },
    ("scripts/te_reads_meter_decision.py",): "python -m readback.cli.decide te_reads_meter",
}


def argparse_importers(root: Path) -> list[str]:
    """The modules under ``root`` outside ``cli/`` that import argparse (at any depth of the file)."""
    found = []
    for path in sorted(root.rglob("*.py")):
        if CLI in path.parents:
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            names += [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            if any(name.split(".")[0] == "argparse" for name in names):
                found.append(str(path.relative_to(root)))
                break
    return found


def test_no_module_outside_cli_imports_argparse():
    assert argparse_importers(SRC) == []


def test_the_check_finds_an_argparse_import(tmp_path):
    (tmp_path / "cli").mkdir()
    (tmp_path / "lib.py").write_text("def main():\n    from argparse import ArgumentParser\n")
    (tmp_path / "plain.py").write_text("import json\n")
    assert argparse_importers(tmp_path) == ["lib.py"]


def _programs() -> list[str]:
    """The modules of cli/ that run as programs (a ``main`` run under ``__main__``)."""
    return sorted(p.stem for p in CLI.glob("*.py") if 'if __name__ == "__main__":' in p.read_text())


# in one process the library module an old command names is imported already (python -m starts afresh)
@pytest.mark.filterwarnings("ignore:.*found in sys.modules after import of package:RuntimeWarning")
@pytest.mark.parametrize("old", list(OLD_COMMANDS), ids=" ".join)
def test_each_old_command_runs_its_program(old, monkeypatch, capsys):
    """As ``python -m`` and ``python FILE`` run them (runpy), in this process to keep it fast."""
    monkeypatch.chdir(REPO)
    monkeypatch.setattr(sys, "argv", [old[-1], "--help"])
    with pytest.raises(SystemExit) as done:
        if old[0] == "-m":
            runpy.run_module(old[1], run_name="__main__", alter_sys=True)
        else:
            runpy.run_path(old[0], run_name="__main__")
    assert done.value.code == 0
    assert capsys.readouterr().out.startswith(f"usage: {OLD_COMMANDS[old]} ")


def test_readme_lists_every_program():
    listed = set(re.findall(r"^\| `python -m readback\.cli\.(\w+)", (REPO / "README.md").read_text(), re.M))
    assert "decide" in _programs() and listed == set(_programs())
