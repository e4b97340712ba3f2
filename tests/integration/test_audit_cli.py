"""``python -m readback.cli.audit`` as a process: its JSON rows, and a bad argument (one line, exit 2)."""

import json
import subprocess
import sys

from readback.policy import POLICIES


def test_cli_json(tmp_path):
    path = tmp_path / "audit.json"
    done = subprocess.run(
        [sys.executable, "-m", "readback.cli.audit", "--json", str(path), "--seed", "1"],
        capture_output=True,
        text=True,
        timeout=600,  # about 12 s alone; a shared machine's CI ran it past 120 s
    )
    assert done.returncode == 0, done.stderr  # rows that differ do not fail the audit
    assert "rule wants" in done.stdout and "DIFFERS" in done.stdout
    rows = json.loads(path.read_text())
    for row in rows:
        assert {"op", "gradient", "reads", "expected", "ok", "rel_err"} <= row.keys()
        assert row["ok"] in (True, False, None)
    policies = {row["policy"] for row in rows if row["op"].startswith("readback.")}
    assert policies == set(POLICIES)
    assert all("policy" not in row for row in rows if not row["op"].startswith("readback."))
    reuse = [
        r for r in rows if r["op"] == "readback.attention" and r["gradient"] == "D" and r["policy"] == "reuse_rounded"
    ]
    assert reuse[0]["ok"] is False and reuse[0]["reads"] == "rounded"


def test_bad_argument_exit_2_as_a_process():
    done = subprocess.run(
        [sys.executable, "-m", "readback.cli.audit", "--seed", "x"], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 2
    assert len(done.stderr.strip().splitlines()) == 1
    assert done.stdout == ""
