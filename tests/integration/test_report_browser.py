"""The HTML report of a real tiny sweep, opened in a real headless Chromium: every plot decodes
at its own size, the tables hold the sweep's numbers, and the page loads nothing from outside."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess

import pytest

from readback.analysis import final_loss_table, load_runs
from readback.cli.analysis import main as cli_main
from readback.train.records.identity import code_version
from sweeps import EXPERIMENTS

BROWSER = shutil.which("chromium") or shutil.which("chromium-browser")
CHECK = """<script>window.addEventListener("load", () => {
  const images = [...document.images].map(i => ({alt: i.alt, complete: i.complete,
    w: i.naturalWidth, h: i.naturalHeight}));
  const tables = [...document.querySelectorAll("section")].map(s => ({title: s.querySelector("h2").textContent,
    rows: [...s.querySelectorAll("tr")].map(r => [...r.cells].map(c => c.textContent))}));
  const out = document.createElement("pre"); out.id = "browser-check";
  out.textContent = JSON.stringify({images, tables}); document.body.appendChild(out);
});</script>"""


def _png_size(data: bytes) -> tuple[int, int]:
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    return int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")


def _browser():
    if BROWSER:
        return BROWSER
    if os.environ.get("READBACK_REQUIRE_BROWSER") == "1":
        pytest.fail("READBACK_REQUIRE_BROWSER=1 but no chromium on PATH (apt-get install chromium)")
    pytest.skip("no chromium on PATH (Debian package chromium); CI sets READBACK_REQUIRE_BROWSER=1")


@pytest.mark.slow
def test_html_report_renders_its_images_and_tables_in_a_browser(real_sweep, tmp_path):
    browser = _browser()
    sweep = real_sweep.dir
    out = tmp_path / "report"
    assert cli_main([str(sweep), "--out", str(out), "--html", "--metric", "grad_norm"]) == 0
    page = (out / "report.html").read_text(encoding="utf-8")
    assert not re.search(r"""(src|href)=["'](?!data:)""", page), "the page must not load anything"
    pngs = {p.stem.replace("_", " "): _png_size(p.read_bytes()) for p in out.glob("*.png")}
    checked = tmp_path / "checked.html"
    checked.write_text(page.replace("</body>", CHECK + "</body>"), encoding="utf-8")
    proc = subprocess.run(
        [
            browser,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--virtual-time-budget=10000",
            "--dump-dom",
            checked.as_uri(),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    found = re.search(r'<pre id="browser-check">(.*?)</pre>', proc.stdout, re.S)
    assert found, (proc.returncode, proc.stderr[-2000:])
    seen = json.loads(
        found.group(1).replace("&quot;", '"').replace("&amp;", "&").replace("&lt;", "<").replace("&gt;", ">")
    )
    # every plot decoded at its own pixel size
    assert sorted(i["alt"] for i in seen["images"]) == sorted(pngs)
    for img in seen["images"]:
        assert img["complete"] and (img["w"], img["h"]) == pngs[img["alt"]], img
    tables = {t["title"]: t["rows"] for t in seen["tables"]}
    final = tables["Final loss"]
    assert final[0][:3] == ["experiment", "seeds", "final loss"] and "Δ final, paired" in final[0]
    expected = final_loss_table(load_runs(sweep)).set_index("group")
    for row in final[1:]:
        assert row[1] == "2" and row[2].startswith(f"{expected.loc[row[0], 'final_loss_mean']:.3f} ± ")
    assert sorted(r[0] for r in final[1:]) == sorted(EXPERIMENTS)
    assert len(tables["Runs"]) == 1 + 4
    how = {r[0]: r[1] for r in tables["How it was made"][1:]}
    assert how["runs: command"].startswith("python train.py -m +experiment=") and "CPUs" in how["runs: machine"]
    assert how["report: command"].startswith("python -m readback.cli.analysis ")
    commits = {json.loads(f.read_text())["code"]["commit"] for f in sweep.glob("*/*/launch.json")}
    assert len(commits) == 1 and (None in commits) == (code_version()["commit"] is None)  # this checkout's
    commit = commits.pop()
    assert how["runs: code"].startswith(commit[:12]) if commit else how["runs: code"] == "(not recorded)"
    shot = tmp_path / "shot.png"
    subprocess.run(
        [
            browser,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--window-size=1200,1600",
            f"--screenshot={shot}",
            (out / "report.html").as_uri(),
        ],
        capture_output=True,
        timeout=120,
    )
    assert _png_size(shot.read_bytes()) == (1200, 1600)
