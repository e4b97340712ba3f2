"""``train.py`` with ``model=hf``: a converted transformers model trains and is probed, and an
unknown architecture is refused in one line (exit 2); a converted GPT-2 (Conv1D linears) trains."""

import os
import subprocess
import sys

import pytest

from toys import REPO


@pytest.mark.slow
def test_train_py_trains_a_converted_transformers_model(tmp_path):
    pytest.importorskip("transformers", reason="transformers not installed (extra hf)")
    run_dir = tmp_path / "run"
    cmd = [
        sys.executable,
        "train.py",
        "model=hf",
        "+experiment=no_saved_copy",
        "logger=none",
        "data=synthetic",
        "data.n_tokens=32768",
        "model.seq_len=32",
        "model.global_batch=4",
        "trainer.micro_batch=4",
        "trainer.steps=3",
        "trainer.log_every=1",
        "probe.every=2",
        f"hydra.run.dir={run_dir}",
    ]
    env = {**os.environ, "WANDB_MODE": "disabled", "PYTHONPATH": str(REPO / "src")}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    summary = (run_dir / "summary.json").read_text()
    assert '"status": "completed"' in summary and "readback.ops.attention (routed SDPA)" in summary
    metrics = (run_dir / "metrics.jsonl").read_text()
    assert "grad_error/rel_err/total" in metrics and "attn_rowsum/mean/model.layers.0.self_attn.core" in metrics


def test_model_hf_with_an_unknown_architecture_is_one_line_exit_2(tmp_path):
    pytest.importorskip("transformers", reason="transformers not installed (extra hf)")
    proc = subprocess.run(
        [sys.executable, "train.py", "model=hf", "model.architecture=gpt9", f"hydra.run.dir={tmp_path / 'run'}"],
        cwd=REPO,
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO / "src")},
        timeout=120,
    )
    assert proc.returncode == 2 and not (tmp_path / "run").exists()
    assert proc.stderr.strip().splitlines()[-1] == "error: model.architecture='gpt9' is not valid; valid: llama"


def test_a_converted_gpt2_trains_its_conv1d_linears_in_fp8():
    """GPT-2's linears are transformers' Conv1D: converted, a few steps of AdamW on one batch lower
    the loss, and every Conv1D weight moves (its gradient reached the Parameter)."""
    transformers = pytest.importorskip("transformers", reason="transformers not installed (extra hf)")
    import torch

    import readback

    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_layer=2, n_embd=64, n_head=4, vocab_size=128, n_positions=32, attn_implementation="sdpa", use_cache=False
    )
    model = transformers.GPT2LMHeadModel(config)
    report = readback.convert(model, precision={"recipe": "delayed", "amax_history_len": 16}, policy="reuse_rounded")
    conv1d = [n for n, what in report.swapped.items() if what.startswith("Conv1D -> readback.ops.linear")]
    assert len(conv1d) == 8
    before = {n: model.get_submodule(n).weight.detach().clone() for n in conv1d}
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(0, 128, (4, 32), generator=torch.Generator().manual_seed(1))
    losses = []
    for _ in range(12):
        loss = model(input_ids=ids, labels=ids).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        model.numerics.end_step()
        losses.append(loss.item())
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < 0.9 * losses[0], losses
    assert all(not torch.equal(model.get_submodule(n).weight, before[n]) for n in conv1d)
