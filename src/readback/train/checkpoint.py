"""Atomic checkpoints: ``run_dir/checkpoints/step_XXXXXXX.pt``, newest-readable resume, pruning.

A file is written to a temporary name in the same directory, flushed, ``fsync``-ed and then
``os.replace``-d onto its final name, so a crash at any moment leaves either the previous
checkpoint set or the new one, never a truncated file under a checkpoint name.
"""

from __future__ import annotations

import logging
import os
import random
import re
import tempfile
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)

_NAME = re.compile(r"^step_(\d+)\.pt$")


def checkpoint_dir(run_dir: Path) -> Path:
    return Path(run_dir) / "checkpoints"


def checkpoint_path(ckpt_dir: Path, step: int) -> Path:
    return Path(ckpt_dir) / f"step_{int(step):07d}.pt"


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_write_bytes(path: Path, write: Any) -> None:
    """Call ``write(fileobj)`` on a temp file next to ``path``, fsync it, then rename onto ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    _fsync_dir(path.parent)


def atomic_write_text(path: Path, text: str) -> None:
    atomic_write_bytes(path, lambda f: f.write(text.encode("utf-8")))


def atomic_torch_save(obj: Any, path: Path) -> None:
    atomic_write_bytes(path, lambda f: torch.save(obj, f))


def list_checkpoints(ckpt_dir: Path) -> list[tuple[int, Path]]:
    """``(step, path)`` of every checkpoint file in ``ckpt_dir``, oldest first."""
    ckpt_dir = Path(ckpt_dir)
    if not ckpt_dir.is_dir():
        return []
    found = []
    for p in ckpt_dir.iterdir():
        m = _NAME.match(p.name)
        if m and p.is_file():
            found.append((int(m.group(1)), p))
    return sorted(found)


def prune_checkpoints(ckpt_dir: Path, keep_last: int | None) -> list[Path]:
    """Delete all but the newest ``keep_last`` checkpoints (``None`` or ``<= 0`` keeps all)."""
    if keep_last is None or keep_last <= 0:
        return []
    removed = []
    for _, p in list_checkpoints(ckpt_dir)[: -int(keep_last)]:
        try:
            p.unlink()
            removed.append(p)
        except OSError as e:  # pragma: no cover - a concurrent delete
            log.warning("could not remove old checkpoint %s: %s", p, e)
    return removed


def save_checkpoint(state: dict[str, Any], ckpt_dir: Path, step: int, keep_last: int | None = None) -> Path:
    """Atomically write ``state`` as the checkpoint of ``step``, then prune to ``keep_last``."""
    path = checkpoint_path(ckpt_dir, step)
    atomic_torch_save(state, path)
    prune_checkpoints(ckpt_dir, keep_last)
    return path


def load_checkpoint(path: Path, map_location: Any = "cpu") -> dict[str, Any]:
    # The trainer wrote these files itself (RNG tuples, data-stream states), hence full unpickling.
    state = torch.load(path, map_location=map_location, weights_only=False)
    if not isinstance(state, dict) or "step" not in state:
        raise ValueError(f"{path} is not a readback checkpoint")
    return state


def load_latest_checkpoint(ckpt_dir: Path, map_location: Any = "cpu") -> tuple[Path, dict[str, Any]] | None:
    """The newest checkpoint that loads; unreadable ones are skipped with a warning."""
    for step, path in reversed(list_checkpoints(ckpt_dir)):
        try:
            return path, load_checkpoint(path, map_location)
        except Exception as e:  # noqa: BLE001 - any unreadable file is skipped
            log.warning("skipping unreadable checkpoint %s (step %d): %s", path, step, e)
    return None


def rng_state() -> dict[str, Any]:
    """This process's torch (CPU and CUDA), Python and NumPy RNG states."""
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    try:
        import numpy as np

        state["numpy"] = np.random.get_state()
    except ImportError:  # pragma: no cover
        pass
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"].cpu() if hasattr(state["torch"], "cpu") else state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([s.cpu() for s in state["cuda"]])
    if "numpy" in state:
        try:
            import numpy as np

            np.random.set_state(state["numpy"])
        except ImportError:  # pragma: no cover
            pass
