"""The bias meter inside a real ``train.py`` run, and ``python -m readback.cli.bias`` from its checkpoint."""

import json
import subprocess
import sys

import pytest

from readback.cli.bias import main as bias_main
from toys import REPO, TWO_STEP_RUN


@pytest.mark.slow
def test_bias_in_training_and_from_a_checkpoint(tmp_path):
    run = tmp_path / "run"
    tiny = [
        *TWO_STEP_RUN,
        "trainer.ckpt_every=2",
        "+experiment=reuse_rounded",
        "precision.site_margin={attn.core.output:12}",
        "probe.bias_every=2",
        "probe.bias_batches=1",
    ]
    subprocess.run(
        [sys.executable, "train.py", *tiny, f"hydra.run.dir={run}"],
        cwd=REPO,
        check=True,
        capture_output=True,
        timeout=300,
    )
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert "grad_bias/reuse_rounded/layers.0.attn.qkv" in records[-1]
    assert "grad_bias/contrib.exact_read.attention.D/total" in records[-1]
    assert "fp8_underflow/layers.0.attn.core.output" in records[-1]
    assert bias_main([str(run), "--batches", "2", "--out", str(tmp_path / "bias")]) == 0
    written = json.loads((tmp_path / "bias" / "bias.json").read_text())
    assert written["checkpoint_step"] == 2 and written["batches"] == 2
    assert (tmp_path / "bias" / "bias.png").stat().st_size > 0
    assert "| contrib.exact_read.attention.D | total |" in (tmp_path / "bias" / "bias.md").read_text()
    with pytest.raises(SystemExit) as exit_:
        bias_main([str(tmp_path / "nothing_here")])
    assert exit_.value.code == 2
