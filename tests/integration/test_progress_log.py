"""``python train.py > log 2>&1``, as a Slurm job's ``.out`` is written: the corpus's preparation
and the trainer's progress come as a bounded number of plain lines, never as carriage-return frames."""

from __future__ import annotations

import random
import subprocess
import sys

import pytest

from toys import REPO, TOY_RUN

pytestmark = pytest.mark.integration


def _corpus(path) -> None:
    rng = random.Random(0)
    words = ["to", "be", "or", "not", "that", "is", "the", "question", "whether", "tis", "nobler", "in", "mind"]
    path.write_text("\n".join(" ".join(rng.choices(words, k=8)) for _ in range(2000)) + "\n")


@pytest.mark.parametrize("progress_on", [True, False])
def test_a_run_logged_to_a_file_has_plain_progress_lines(tmp_path, progress_on):
    _corpus(tmp_path / "corpus.txt")
    args = [
        "data=shakespeare",
        f"data.files=[{tmp_path / 'corpus.txt'}]",
        f"data.cache_dir={tmp_path / 'cache'}",  # tokenised afresh: the tokeniser's progress shows
        "data.vocab_size=300",
        "data.block_lines=5",
        "logger=none",
        "model.n_layers=1",
        *TOY_RUN,
        "trainer.steps=60",
        "trainer.log_every=5",
        "trainer.eval_every=60",
        "trainer.eval_batches=1",
        "trainer.ckpt_every=60",
        f"trainer.progress={str(progress_on).lower()}",
        f"hydra.run.dir={tmp_path / 'run'}",
    ]
    with open(tmp_path / "job.out", "w") as out:
        done = subprocess.run(
            [sys.executable, "train.py", *args], cwd=REPO, stdout=out, stderr=subprocess.STDOUT, timeout=300
        )
    text = (tmp_path / "job.out").read_text()
    assert done.returncode == 0, text[-2000:]
    assert "\r" not in text
    lines = text.splitlines()
    steps = [line for line in lines if line.startswith("custom: ") and " steps (" in line]
    preparing = [line for line in lines if line.startswith(("tokenizer sample: ", "preparing: "))]
    if not progress_on:  # no progress at all
        assert steps == preparing == [], lines
        return
    assert 1 <= len(steps) <= 21, steps
    assert steps[-1].startswith("custom: 60/60 steps (100%), loss=") and "ETA 0:00:00" in steps[-1]
    assert [line.split(",")[0] for line in preparing] == [  # a corpus under a megabyte: one line each
        "tokenizer sample: 1/1 megabytes (100%)",
        "preparing: 1/1 megabytes (100%)",
    ], preparing
    assert all("MB_s=" in line and "ETA 0:00:00" in line for line in preparing), preparing
