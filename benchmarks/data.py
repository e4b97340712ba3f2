"""Preparing a local corpus and starting to train on it: peak memory and speed by corpus size.

    python benchmarks/data.py --sizes 10,100,1000 --workers 2 --dir /tmp/readback-bench

For each size it writes a corpus of that many MB (text files of at most 64 MB, a document per
file: English-like lines of words drawn from a Zipf law over a lexicon that grows with the
corpus, so the tokenizer's word counts grow as a real corpus's do), then runs, each in a fresh
process with a cold cache:

* ``python -m readback.cli.prepare``: its wall time and CPU time (all its processes), MB per
  second of each, the peak resident memory of its largest process (``ru_maxrss``: the program
  or one encoding worker) and of the whole process tree (sampled every 0.1 s);
* ``train.py`` for one step of the tiny model on the prepared corpus: its peak resident memory.

Prints one Markdown row per size (docs/performance.md keeps them).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
FILE_MB = 64
LEXICON_PER_MB = 2000  # distinct words the corpus can use, per MB of it


def write_corpus(directory: Path, size_mb: int, seed: int = 0) -> list[Path]:
    """``size_mb`` MB of text in files of at most ``FILE_MB`` MB (see the module doc)."""
    rng = np.random.default_rng(seed)
    letters = np.array(list("etaoinshrdlucmfwypvbgkjqxz"))
    n_words = LEXICON_PER_MB * size_mb
    lengths = rng.integers(2, 10, size=n_words)
    lexicon = np.array(["".join(rng.choice(letters, size=n, p=None)) for n in lengths], dtype=object)
    directory.mkdir(parents=True, exist_ok=True)
    files, left, index = [], size_mb << 20, 0
    while left > 0:
        path, written = directory / f"part{index:04d}.txt", 0
        with open(path, "w", encoding="utf-8") as f:
            while written < min(left, FILE_MB << 20):
                words = lexicon[np.minimum(rng.zipf(1.2, size=10_000), n_words) - 1]  # about 60 kB
                lines = [" ".join(words[i : i + 10]) + "\n" for i in range(0, len(words), 10)]
                text = "".join(lines)
                f.write(text)
                written += len(text)
        files.append(path)
        left -= written
        index += 1
    return files


def _tree_rss_mb(pid: int) -> float:
    """Resident MB of ``pid`` and its descendants, from /proc."""
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        try:
            with open(f"/proc/{p}/statm") as f:
                total += int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
            with open(f"/proc/{p}/task/{p}/children") as f:
                todo.extend(int(c) for c in f.read().split())
        except OSError:
            continue
    return total / (1 << 20)


# Runs the command and prints the peak resident KB of its largest process and the CPU seconds of
# all (it and its descendants, once waited for), a fresh count for each command.
_PEAK = (
    "import resource, subprocess, sys; code = subprocess.call(sys.argv[1:]); "
    "r = resource.getrusage(resource.RUSAGE_CHILDREN); "
    "print('peak_kb', r.ru_maxrss, 'cpu_s', r.ru_utime + r.ru_stime); sys.exit(code)"
)


def measured(command: list[str], env: dict[str, str]) -> tuple[float, float, float, float]:
    """``(seconds, CPU seconds, largest process's peak MB, process tree's sampled peak MB)`` of
    ``command``."""
    start = time.perf_counter()
    proc = subprocess.Popen(
        [sys.executable, "-c", _PEAK, *command],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    tree_peak = 0.0
    while proc.poll() is None:
        tree_peak = max(tree_peak, _tree_rss_mb(proc.pid))
        time.sleep(0.1)
    seconds = time.perf_counter() - start
    output = proc.stdout.read() if proc.stdout else ""
    if proc.returncode != 0:
        sys.exit(f"{' '.join(command[:4])} ... failed ({proc.returncode}):\n{output[-2000:]}")
    peak_kb, _, cpu_s = output.rsplit("peak_kb", 1)[1].split()[:3]
    return seconds, float(cpu_s), int(peak_kb) / 1024, tree_peak


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="10,100", help="corpus sizes in MB, comma-separated")
    parser.add_argument("--workers", type=int, default=2, help="data.prepare_workers")
    parser.add_argument("--dir", type=Path, default=Path("/tmp/readback-bench-data"), help="corpora and caches")
    args = parser.parse_args(argv)
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), "WANDB_MODE": "disabled"}
    print(f"{os.cpu_count()} CPUs, data.prepare_workers={args.workers}")
    print(
        "| corpus | prepare: wall | CPU | MB/s | MB per CPU s | peak RSS, largest process | all processes"
        " | training: peak RSS |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for size in (int(s) for s in args.sizes.split(",")):
        corpus_dir, cache = args.dir / f"corpus-{size}mb", args.dir / f"cache-{size}mb"
        files = sorted(corpus_dir.glob("*.txt")) or write_corpus(corpus_dir, size)
        subprocess.run(["rm", "-rf", str(cache)], check=True)
        data = [f"data.files=[{','.join(str(f) for f in files)}]", f"data.cache_dir={cache}"]
        mb = sum(f.stat().st_size for f in files) / (1 << 20)
        prep = [sys.executable, "-m", "readback.cli.prepare", *data, f"data.prepare_workers={args.workers}"]
        seconds, cpu_s, largest, tree = measured(prep, env)
        train = [
            sys.executable,
            "train.py",
            "+experiment=reuse_rounded",
            *data,
            "trainer.steps=1",
            "trainer.eval_every=1",
            "trainer.eval_batches=1",
            "trainer.progress=false",
            f"hydra.run.dir={args.dir / f'run-{size}mb-{time.time_ns()}'}",
        ]
        _, _, train_peak, _ = measured(train, env)  # the program's own peak: one process
        cells = [f"{mb:.0f} MB", f"{seconds:.0f} s", f"{cpu_s:.0f} s", f"{mb / seconds:.2f}", f"{mb / cpu_s:.2f}"]
        cells += [f"{largest:.0f} MB", f"{tree:.0f} MB"]
        print(f"| {' | '.join(cells)} | {train_peak:.0f} MB |", flush=True)


if __name__ == "__main__":
    main()
