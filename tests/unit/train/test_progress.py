"""Progress in a log file is plain lines, a bounded number of them; on a terminal it is tqdm's
live bar; ``trainer.progress=false`` shows none. The helper alone, then the trainer through it."""

from __future__ import annotations

import io
import re
import sys

import pytest

from readback.progress import Bar, Lines, Off, progress
from toys import make_cfg, train


class FakeTTY(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_in_a_file_a_line_every_5_percent_and_at_the_end(tmp_path):
    with open(tmp_path / "log", "w") as log:
        bar = progress(1000, desc="run", stream=log)
        assert isinstance(bar, Lines)
        for step in range(1, 1001):
            bar.set_postfix(loss=f"{4 - step / 1000:.4f}", tok_s="1234")
            bar.update()
        bar.close()
    text = (tmp_path / "log").read_text()
    assert "\r" not in text
    lines = text.splitlines()
    assert len(lines) == 20
    assert lines[0].startswith("run: 50/1000 steps (5%), ")
    assert re.fullmatch(r"run: 1000/1000 steps \(100%\), loss=3\.0000, tok_s=1234, elapsed \S+, ETA 0:00:00", lines[-1])


def test_a_resumed_loop_counts_from_where_it_was_and_closes_with_its_last_step():
    log = io.StringIO()
    bar = progress(100, initial=90, desc="run", stream=log)
    for _ in range(3):
        bar.update()
    bar.close()
    bar.close()
    lines = log.getvalue().splitlines()
    assert [line.split(",")[0] for line in lines] == [f"run: {n}/100 steps ({n}%)" for n in (91, 92, 93)]


def test_a_slow_loop_writes_a_line_when_min_interval_s_has_passed(monkeypatch):
    now = [0.0]
    monkeypatch.setattr("readback.progress.time.monotonic", lambda: now[0])
    log = io.StringIO()
    bar = progress(10_000, desc="run", stream=log, min_interval_s=60)
    for _ in range(3):
        now[0] += 61
        bar.update()
    assert len(log.getvalue().splitlines()) == 3


def test_on_a_terminal_the_live_bar_and_disabled_nothing():
    tty = FakeTTY()
    bar = progress(50, desc="run", stream=tty)
    assert isinstance(bar, Bar)
    for _ in range(50):
        bar.update()
    bar.close()
    assert "\r" in tty.getvalue() and "50/50" in tty.getvalue()
    assert isinstance(progress(50, stream=tty, enabled=False), Off)


# --------------------------------------------------------------------------- through the trainer


def _train_with_stderr(monkeypatch, tmp_path, stream, **trainer) -> None:
    monkeypatch.setattr(sys, "stderr", stream)
    train(make_cfg(**{"trainer.steps": 40, "trainer.ckpt_every": 40, **trainer}), tmp_path / "run")


def test_training_into_a_log_file_writes_plain_progress_lines(monkeypatch, tmp_path):
    with open(tmp_path / "stderr.log", "w") as log:
        _train_with_stderr(monkeypatch, tmp_path, log, **{"trainer.progress": True})
    text = (tmp_path / "stderr.log").read_text()
    assert "\r" not in text
    lines = [line for line in text.splitlines() if line.startswith("custom: ")]
    assert 1 <= len(lines) <= 21, lines
    assert re.match(r"custom: 40/40 steps \(100%\), loss=\d+\.\d{4}, tok_s=\d+, elapsed ", lines[-1])


@pytest.mark.parametrize("progress_on", [True, False])
def test_training_on_a_terminal_shows_the_live_bar_unless_progress_is_off(monkeypatch, tmp_path, progress_on):
    tty = FakeTTY()
    _train_with_stderr(monkeypatch, tmp_path, tty, **{"trainer.progress": progress_on})
    if progress_on:
        assert "\r" in tty.getvalue() and "40/40" in tty.getvalue()
    else:
        assert "custom" not in tty.getvalue() and "\r" not in tty.getvalue()
