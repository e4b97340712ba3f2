"""The offline wandb runs under sweep (or run) directories, found and read without a server;
``python -m readback.cli.sync`` uploads them (every ``<run dir>/wandb/offline-run-<time>-<id>``
folder, the folders of one run id in start order).

:func:`read_offline_run` reads what wandb wrote into a folder (its ``.wandb`` record log), so a
run's name, group, tags, config, summary and history can be checked without a server.
"""

from __future__ import annotations

import json
import re
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

#: ``offline-run-YYYYMMDD_HHMMSS-<id>``: wandb's folder name for one start of an offline run.
OFFLINE_FOLDER = re.compile(r"offline-run-(\d{8}_\d{6})-([a-z0-9]+)$")
_BLOCK, _HEADER = 32768, 7  # the record log: a 7-byte file header, then 32 KiB blocks of chunks
_FULL, _LAST = 1, 4


def offline_folders(*roots: str | Path) -> list[Path]:
    """Every offline run folder below ``roots``, in start order (time stamp, then id)."""
    found = {
        p for root in roots for p in Path(root).rglob("offline-run-*") if p.is_dir() and OFFLINE_FOLDER.match(p.name)
    }
    return sorted(found, key=lambda p: (OFFLINE_FOLDER.match(p.name).group(1), p.name, str(p)))  # type: ignore[union-attr]


def _records(path: Path) -> Iterator[Any]:
    """The protobuf records of a ``.wandb`` file (wandb's LevelDB-style log of chunks)."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    if data[:4] != b":W&B":
        raise ValueError(f"{path} is not a wandb record log")
    pos, buf = _HEADER, b""
    while pos + 7 <= len(data):
        left = _BLOCK - pos % _BLOCK
        if left < 7:  # a block's tail too short for a chunk header is padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if kind == 0 and length == 0:
            pos += left
            continue
        buf += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (_FULL, _LAST):
            record = wandb_internal_pb2.Record()  # type: ignore[attr-defined]  # protobuf makes it at import
            record.ParseFromString(buf)
            buf = b""
            yield record


def read_offline_run(folder: str | Path) -> dict[str, Any]:
    """What one offline folder holds: ``id``, ``name``, ``group``, ``job_type``, ``tags``,
    ``config`` and ``summary`` (plain values), ``history`` (one dict per logged step) and
    ``metrics`` (``define_metric``: key -> ``{"step_metric", "summary"}``)."""
    folder = Path(folder)
    files = sorted(folder.glob("run-*.wandb"))
    if not files:
        raise FileNotFoundError(f"no run-*.wandb file in {folder}")
    out: dict[str, Any] = {"config": {}, "summary": {}, "history": [], "metrics": {}}
    for rec in _records(files[0]):
        kind = rec.WhichOneof("record_type")
        if kind == "run":
            r = rec.run
            out.update(
                id=r.run_id,
                name=r.display_name,
                group=r.run_group,
                job_type=r.job_type,
                tags=list(r.tags),
                project=r.project,
                entity=r.entity,
            )
            out["config"].update({u.key: json.loads(u.value_json) for u in r.config.update if u.key != "_wandb"})
        elif kind == "config":
            out["config"].update({u.key: json.loads(u.value_json) for u in rec.config.update if u.key != "_wandb"})
        elif kind == "history":
            out["history"].append({_key(i): json.loads(i.value_json) for i in rec.history.item})
        elif kind == "summary":
            for u in rec.summary.update:
                key = _key(u)
                if not key.startswith("_"):
                    out["summary"][key] = json.loads(u.value_json)
        elif kind == "metric" and (rec.metric.name or rec.metric.glob_name):
            m = rec.metric
            kept = [s for s in ("min", "max", "mean", "last", "best") if getattr(m.summary, s)]
            out["metrics"][m.name or m.glob_name] = {"step_metric": m.step_metric or None, "summary": kept}
    return out


def _key(item: Any) -> str:
    return item.key or "/".join(item.nested_key)


if __name__ == "__main__":  # the old command, which pages name: python -m readback.cli.sync
    import runpy

    runpy.run_module("readback.cli.sync", run_name="__main__", alter_sys=True)
