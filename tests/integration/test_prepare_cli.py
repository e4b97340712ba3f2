"""``python -m readback.cli.prepare``: a corpus prepared ahead is what a run then reads without
building anything; killed mid-way, the next start continues and ends with the same files; a bad
setting is one line on stderr and exit 2."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import readback.data.tokenizer as tokmod
from readback.data import Layout, build_data
from toys import REPO, load_data_cfg

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO / "src")}


def _corpus(path: Path, megabytes: int) -> Path:
    rng = np.random.default_rng(0)
    words = np.array([f"w{i}" for i in range(5000)])
    with open(path, "w") as f:
        while f.tell() < megabytes << 20:
            f.write("".join(" ".join(line) + "\n" for line in words[rng.integers(0, 5000, size=(20_000, 9))]))
    return path


def _prepare(*overrides: str, **kwargs) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "readback.cli.prepare", *overrides],
        cwd=REPO,
        env=ENV,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        **kwargs,
    )


def _settings(corpus: Path, cache: Path) -> list[str]:
    return [f"data.files=[{corpus}]", f"data.cache_dir={cache}", "data.vocab_size=300", "data.prepare_workers=0"]


def test_a_prepared_corpus_is_read_by_the_run_without_building(tmp_path):
    corpus = _corpus(tmp_path / "small.txt", 1)
    proc = _prepare(*_settings(corpus, tmp_path / "cache"))
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    assert out.startswith("prepared ") and "training and" in out
    builds = dict(tokmod.BUILDS)
    cfg = load_data_cfg("shakespeare", files=[str(corpus)], vocab_size=300, cache_dir=str(tmp_path / "cache"))
    assert build_data(cfg, Layout(seq_len=32, micro_batch=2, seed=0)).next_batch()[0].shape == (2, 32)
    assert dict(tokmod.BUILDS) == builds


def test_killed_mid_way_the_next_start_continues_to_the_same_files(tmp_path):
    corpus = _corpus(tmp_path / "big.txt", 16)  # four chunks: the three after the first take seconds to kill in
    straight = _prepare(*_settings(corpus, tmp_path / "straight"))
    assert straight.wait(timeout=600) == 0
    killed = _prepare(*_settings(corpus, tmp_path / "resumed"))
    deadline = time.monotonic() + 600
    record = None
    while time.monotonic() < deadline and killed.poll() is None:
        found = list((tmp_path / "resumed").glob("text/*/tokens-b100.progress.json"))
        if found and json.loads(found[0].read_text())["chunks"] >= 1:
            record = found[0]
            killed.send_signal(signal.SIGKILL)
            break
        time.sleep(0.05)
    killed.wait(timeout=60)
    assert record is not None, "finished before it could be killed"
    resumed = _prepare(*_settings(corpus, tmp_path / "resumed"))
    _, err = resumed.communicate(timeout=600)
    assert resumed.returncode == 0, err
    assert not record.exists()
    for name in ("tokens-b100.bin", "blocks-b100.bin", "tokens-b100.json", "split-b100-f0.05/train.bin"):
        (a,), (b,) = (list(tmp_path.glob(f"{run}/text/*/{name}")) for run in ("straight", "resumed"))
        assert a.read_bytes() == b.read_bytes(), name


@pytest.mark.parametrize(
    "override, says",
    [
        ("data.format=csv", "data.format='csv'"),
        ("data=synthetic", "data='synthetic'"),
        ("data.files=[/nonexistent/corpus.txt]", "/nonexistent/corpus.txt"),
    ],
)
def test_a_bad_setting_is_one_line_and_exit_2(tmp_path, override, says):
    proc = _prepare(override, *([] if override.startswith("data=") else [f"data.cache_dir={tmp_path}"]))
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 2 and says in err and len(err.strip().splitlines()) == 1, err
