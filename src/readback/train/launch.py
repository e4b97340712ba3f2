"""``run(cfg, run_dir)``: process group, determinism and preemption handling around one
:class:`~readback.train.trainer.Trainer` (or the dry run)."""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import Any

import torch

from readback.errors import ConfigError
from readback.train.checkpoint import sole_writer
from readback.train.contract import Builders
from readback.train.distributed import (
    cleanup,
    init_distributed,
    resolve_device,
    world_from_env,
)
from readback.train.dry_run import dry_run
from readback.train.preemption import PreemptionGuard
from readback.train.settings import Config
from readback.train.threads import apply_threads
from readback.train.trainer import Trainer


def run(cfg: Config, run_dir: Path, builders: Builders | None = None) -> dict[str, Any]:
    """Train (or, with ``trainer.dry_run``, size) the configured model; return the summary.

    ``builders`` make the model and the data (:class:`~readback.train.contract.Builders`: the FOG
    and ``build_data`` by default). Rank 0 first claims ``run_dir``
    (:mod:`~readback.train.checkpoint.writer_lock`: one writer per run directory), then writes
    ``run_dir/metrics.jsonl``, ``run_dir/checkpoints/`` and ``run_dir/summary.json``. Raises
    :class:`~readback.errors.ConfigError` for trainer-level runtime misconfiguration (before
    anything is written, except for an error the data raises mid-run, which also writes
    ``status: "failed"``); any other exception writes ``status: "failed"`` and re-raises. A
    preemption signal raises :class:`~readback.train.preemption.Preempted` after a checkpoint.
    """
    builders = builders or Builders()
    run_dir = Path(run_dir)
    experiment = cfg.experiment
    rank, world, local = world_from_env()
    accum = accumulation_steps(cfg, world)
    if cfg.trainer.dry_run:
        return dry_run(cfg, run_dir, experiment, builders, rank=rank, world_size=world)
    resolve_device(cfg.trainer.device, local)  # a bad device is a config error, raised early
    env = init_distributed(cfg.trainer.device, cfg.trainer.timeouts.startup_s, trace_dir=run_dir)
    det_before = torch.are_deterministic_algorithms_enabled()
    warn_before = torch.is_deterministic_algorithms_warn_only_enabled()
    threads_before = torch.get_num_threads()
    apply_threads(cfg.trainer.threads, cfg.model.name)
    if env.device.type == "cpu":
        torch.use_deterministic_algorithms(True, warn_only=True)
        keep_freed_memory()
    try:
        with (
            PreemptionGuard(cfg.trainer.preempt_signals) as guard,
            sole_writer(run_dir, env, cfg.trainer.lock_lease_s) as writer,
        ):
            return Trainer(cfg, run_dir, env, accum, experiment, builders, guard, writer).train()
    finally:
        torch.use_deterministic_algorithms(det_before, warn_only=warn_before)
        torch.set_num_threads(threads_before)
        cleanup(env)


def keep_freed_memory() -> bool:
    """Have glibc's malloc keep what a step frees for the next step, which allocates the same
    tensors again: handed back to the system, their pages are faulted in again every step, 5-10 %
    of a tiny FOG's step on the CPU (``docs/performance.md``). Blocks up to 32 MiB then come from
    the heap, which is not trimmed, so the resident memory stays at the steps' peak. Process-wide
    and for good; nothing where the C library is not glibc. Returns whether malloc took both."""
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3  # malloc.h
    mapped = mallopt(m_mmap_threshold, 32 << 20)  # glibc's largest (HEAP_MAX_SIZE / 2 on 64-bit)
    return bool(mapped) & bool(mallopt(m_trim_threshold, 2**31 - 1))


def accumulation_steps(cfg: Config, world_size: int) -> int:
    """``global_batch / (micro_batch * world_size)``; a ``ConfigError`` unless it divides."""
    gb, mb = cfg.model.global_batch, cfg.trainer.micro_batch
    per_step = mb * world_size
    if gb % per_step:
        raise ConfigError(
            "model.global_batch",
            gb,
            f"a positive multiple of trainer.micro_batch x world size = {mb} x {world_size} = {per_step}",
        )
    return gb // per_step
