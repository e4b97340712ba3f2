"""benchmarks/data.py's parts: the corpus it writes (its size, files, a lexicon that grows with
it) and its measurement of a command's peak memory and CPU time."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

_SPEC = importlib.util.spec_from_file_location(
    "benchmark_data", Path(__file__).parents[3] / "benchmarks" / "data.py"
)  # by path: a module named ``data`` is too easily shadowed
assert _SPEC is not None and _SPEC.loader is not None
bench = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(bench)


def test_the_corpus_has_its_size_in_files_of_at_most_the_file_size(tmp_path, monkeypatch):
    monkeypatch.setattr(bench, "FILE_MB", 1)
    files = bench.write_corpus(tmp_path / "c", 3)
    sizes = [f.stat().st_size for f in files]
    assert len(files) == 3 and all(s < (1 << 20) + (100 << 10) for s in sizes), sizes
    assert 3 << 20 <= sum(sizes) < (3 << 20) + (100 << 10), sizes
    words = set(files[0].read_text().split())
    assert len(words) > 1000 and all(w.isalpha() for w in words)  # a Zipf law over a large lexicon


def test_a_command_is_measured_by_its_peak_memory_and_cpu_time():
    command = [sys.executable, "-c", "x = bytearray(200 << 20); sum(range(3_000_000))"]
    seconds, cpu_s, largest, tree = bench.measured(command, dict(os.environ))
    assert seconds > 0 and cpu_s > 0
    assert 200 < largest < 400 and tree < 400, (largest, tree)
