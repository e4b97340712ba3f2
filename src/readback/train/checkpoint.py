"""Atomic checkpoints: ``run_dir/checkpoints/step_XXXXXXX.pt``, newest-readable resume, pruning.

A file is written to a temporary name in the same directory, flushed, ``fsync``-ed and then
``os.replace``-d onto its final name, so a crash at any moment leaves either the previous
checkpoint set or the new one, never a truncated file under a checkpoint name. The temporary
file of a save that a ``SIGKILL`` interrupted is removed when the run resumes
(:func:`remove_stale_temp_files`).

:func:`resume_plan` decides, from a run directory and a config, where a run starts: the newest
readable checkpoint (``trainer.resume=true``), step 0 (an empty run directory), or a
``ConfigError`` (checkpoints that cannot be resumed, or would be overwritten). ``train.py`` asks it
before Hydra touches the run directory, the trainer again when it starts.

Loading runs no code: a checkpoint holds tensors and plain containers only (the RNG states
included), and is read with ``torch.load(weights_only=True)``. A file that needs more -- a
pickled object, say from a checkpoint someone else crafted -- is refused with one line.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import random
import re
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any, cast

import torch
from omegaconf import OmegaConf

from readback.errors import ConfigError

log = logging.getLogger(__name__)

_UMASK = os.umask(0o022)
os.umask(_UMASK)

CHECKPOINT_FORMAT = 2  # 2: loads with weights_only=True and carries the LR scheduler's state
_NAME = re.compile(r"^step_(\d+)\.pt$")
_TEMP = re.compile(r"^\.(step_\d+\.pt|summary\.json|metrics\.jsonl)\..+\.tmp$")  # atomic_write_bytes' temp files
# Keys a checkpoint can only be resumed under with the value it was trained with.
ARCHITECTURE_KEYS = (
    "model.n_layers",
    "model.d_model",
    "model.n_heads",
    "model.n_kv_groups",
    "model.ffn_dim",
    "model.vocab_size",
    "model.tied",
    "precision.name",
    "precision.amax_history_len",
)


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
        os.fchmod(fd, 0o666 & ~_UMASK)  # mkstemp makes 0600 files: give the final file the usual mode
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
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


def remove_stale_temp_files(directory: Path) -> list[Path]:
    """Delete the temporary files of writes a crash interrupted (``.step_*.pt.*.tmp``, ...)."""
    directory = Path(directory)
    removed = []
    if directory.is_dir():
        for p in directory.iterdir():
            if _TEMP.match(p.name) and p.is_file():
                try:
                    p.unlink()
                    removed.append(p)
                except OSError:  # pragma: no cover - a concurrent delete
                    pass
    return removed


def load_checkpoint(path: Path, map_location: Any = "cpu", mmap: bool = False) -> dict[str, Any]:
    """A checkpoint file's state, read without running code. ``mmap``: map the tensors instead
    of reading them (a quick look at a large checkpoint). A file that would need to unpickle
    anything but tensors and plain containers raises a one-line ``ConfigError``."""
    try:
        state = torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as e:
        refused = next((line.strip() for line in str(e).splitlines() if "GLOBAL" in line), None)
        if refused is None:  # not a pickled callable: an unreadable file, which resume skips
            raise
        raise ConfigError(
            "trainer.resume",
            str(path),
            f"a checkpoint of tensors and plain containers; this file "
            f"was refused unread ({refused}), as loading it could run code",
        ) from e
    if not isinstance(state, dict) or "step" not in state:
        raise ValueError(f"{path} is not a readback checkpoint")
    return state


def load_latest_checkpoint(
    ckpt_dir: Path, map_location: Any = "cpu", mmap: bool = False, quiet: bool = False
) -> tuple[Path, dict[str, Any]] | None:
    """The newest checkpoint that loads; unreadable ones are skipped with a warning."""
    for step, path in reversed(list_checkpoints(ckpt_dir)):
        try:
            return path, load_checkpoint(path, map_location, mmap)
        except ConfigError:  # refused as unsafe: never skipped for an older one
            raise
        except Exception as e:
            if not quiet:
                log.warning("skipping unreadable checkpoint %s (step %d): %s", path, step, e)
    return None


def config_mismatch(saved_config: Mapping[str, Any] | None, cfg: Any) -> tuple[str, Any, Any] | None:
    """The first of :data:`ARCHITECTURE_KEYS` whose value in ``cfg`` differs from the one the
    checkpoint was trained with: ``(key, now, saved)``, or ``None``. Keys unset on either side
    (``model.vocab_size: null`` takes the data's) are not compared."""
    if not isinstance(saved_config, Mapping):
        return None
    saved, cfg = OmegaConf.create(dict(saved_config)), OmegaConf.structured(cfg)
    for key in ARCHITECTURE_KEYS:
        try:
            now, was = OmegaConf.select(cfg, key, default=None), OmegaConf.select(saved, key, default=None)
        except Exception:
            continue
        if now is not None and was is not None and now != was:
            return key, now, was
    return None


def resume_plan(run_dir: Path, cfg: Any, *, mmap: bool = False) -> tuple[Path, dict[str, Any]] | None:
    """Where a run in ``run_dir`` starts: ``(path, state)`` of the checkpoint to resume from, or
    ``None`` for step 0. Raises ``ConfigError`` when

    * the run directory holds checkpoints but ``trainer.resume`` is false (they would be
      overwritten) -- unless this is a requeued Slurm job, which resumes;
    * ``trainer.resume`` is true and none of its checkpoints loads;
    * the newest readable checkpoint has another format than :data:`CHECKPOINT_FORMAT`, or was
      trained with another model (:func:`config_mismatch`).
    """
    from readback.train.preemption import requeued

    ckpt_dir = checkpoint_dir(run_dir)
    found = list_checkpoints(ckpt_dir)
    if not found:
        return None
    resume = cfg.trainer.resume
    if not resume and requeued():
        log.warning(
            "requeued job (SLURM_RESTART_COUNT=%s): resuming from %s", os.environ["SLURM_RESTART_COUNT"], ckpt_dir
        )
        resume = True
    if not resume:
        raise ConfigError(
            "trainer.resume",
            False,
            f"true to continue the run in {run_dir} (it holds {len(found)} "
            f"checkpoint(s), up to step {found[-1][0]}), or a new hydra.run.dir",
        )
    latest = load_latest_checkpoint(ckpt_dir, mmap=mmap, quiet=mmap)
    if latest is None:
        raise ConfigError(
            "trainer.resume",
            True,
            f"a run directory with a readable checkpoint: none of the "
            f"{len(found)} in {ckpt_dir} loads (remove them to start afresh)",
        )
    path, state = latest
    if state.get("format") != CHECKPOINT_FORMAT:
        raise ConfigError(
            "trainer.resume",
            True,
            f"a checkpoint of format {CHECKPOINT_FORMAT}; {path} has format "
            f"{state.get('format')!r} (resume it with the readback that wrote it)",
        )
    mismatch = config_mismatch(state.get("config"), cfg)
    if mismatch is not None:
        key, now, was = mismatch
        raise ConfigError(key, now, f"{was!r}, the value {path} was trained with (or a new hydra.run.dir)")
    return path, state


class RNGState:
    """This process's torch (CPU and CUDA), Python and NumPy RNG states as tensors, ints and
    tuples (what ``weights_only`` loading accepts); a ``Stateful`` for the checkpoint manager."""

    def state_dict(self) -> dict[str, Any]:
        import numpy as np

        name, keys, pos, has_gauss, gauss = cast("tuple[str, np.ndarray, int, int, float]", np.random.get_state())
        state: dict[str, Any] = {
            "torch": torch.get_rng_state(),
            "python": random.getstate(),
            "numpy": (name, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, gauss),
        }
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            state["cuda"] = torch.cuda.get_rng_state_all()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        import numpy as np

        torch.set_rng_state(state["torch"].cpu())
        random.setstate(state["python"])
        name, keys, pos, has_gauss, gauss = state["numpy"]
        np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))
        if "cuda" in state and torch.cuda.is_available():
            torch.cuda.set_rng_state_all([s.cpu() for s in state["cuda"]])
