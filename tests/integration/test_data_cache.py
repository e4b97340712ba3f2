"""Two processes building the same text cache at once: one trains the tokenizer, both read the same
files and batches (the cache's lock), and no temporary file is left."""

from __future__ import annotations

import multiprocessing as mp
from pathlib import Path

from readback.data.corpus import shakespeare_files
from toys import load_data_cfg


def _build_in_child(cfg, barrier, queue) -> None:
    import hashlib

    import readback.data.tokenizer as t
    from readback.data import Layout
    from readback.data import build_data as build

    barrier.wait(timeout=120)  # both look at the empty cache at the same moment
    stream = build(cfg, Layout(seq_len=32, micro_batch=2, seed=0))
    json_path = next(Path(cfg.cache_dir, "text").iterdir()) / "tokenizer.json"
    queue.put(
        (t.BUILDS["tokenizer"], hashlib.sha256(json_path.read_bytes()).hexdigest(), stream.next_batch()[0].tolist())
    )


def test_two_processes_building_at_once_train_once_and_agree(tmp_path):
    plays = [str(f) for f in shakespeare_files() if f.name.startswith("macbeth")]
    cfg = load_data_cfg("shakespeare", files=plays, vocab_size=300, cache_dir=str(tmp_path))
    ctx = mp.get_context("spawn")
    queue, barrier = ctx.Queue(), ctx.Barrier(2)
    procs = [ctx.Process(target=_build_in_child, args=(cfg, barrier, queue)) for _ in range(2)]
    for p in procs:
        p.start()
    results = [queue.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    assert sorted(r[0] for r in results) == [0, 1]  # exactly one process trained
    assert results[0][1:] == results[1][1:]
    assert not list(tmp_path.rglob("*.tmp"))
