"""Process-group setup for ``torchrun`` and Slurm (submitit), and the few collectives the loop needs.

* ``torchrun --nproc_per_node=N train.py ...`` sets ``RANK``/``WORLD_SIZE``/``LOCAL_RANK``.
* Under Slurm (``SLURM_JOB_ID`` set, no ``RANK`` yet), on any number of nodes: in a submitit job
  ``submitit.helpers.TorchDistributedEnvironment().export()`` derives and exports them; in a
  task ``srun`` started otherwise they come from ``SLURM_PROCID``/``SLURM_NTASKS``/``SLURM_LOCALID``.
  Either way ``MASTER_ADDR`` is the job's first node and ``MASTER_PORT`` follows the job id, so
  every task of the job agrees on them.
* Without ``WORLD_SIZE`` (or with ``WORLD_SIZE=1``) the run is a single process, no process group.

DDP runs over gloo on CPU and NCCL on CUDA; rank 0 alone writes files and logs. Every collective
waits at most ``trainer.timeouts`` for the other ranks (:func:`set_collective_timeout`); on NCCL
the flight recorder keeps the last collectives and dumps them when its watchdog times one out
(:func:`record_nccl_collectives`).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from readback.errors import ConfigError

log = logging.getLogger(__name__)


@dataclass
class DistEnv:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")
    owns_group: bool = False  # this module created the process group (and destroys it)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def first_host(nodelist: str) -> str:
    """The first host of a Slurm node list: ``gpu[07-08,11],cpu1`` -> ``gpu07``."""
    head = nodelist.split(",")[0] if "[" not in nodelist.split(",")[0] else nodelist.split("]")[0]
    prefix, _, ranges = head.partition("[")
    return prefix + ranges.split(",")[0].split("-")[0]


def slurm_job_id() -> str | None:
    """``<array job>_<task>`` for an array job, else ``SLURM_JOB_ID`` (None outside Slurm)."""
    array, task = os.environ.get("SLURM_ARRAY_JOB_ID"), os.environ.get("SLURM_ARRAY_TASK_ID")
    if array and task:
        return f"{array}_{task}"
    return os.environ.get("SLURM_JOB_ID")


def maybe_export_slurm_env() -> None:
    """Export torch.distributed variables from the Slurm environment when launched by Slurm."""
    if "RANK" in os.environ or "SLURM_JOB_ID" not in os.environ:
        return
    if os.environ.get("SUBMITIT_EXECUTOR") == "slurm":
        import submitit

        submitit.helpers.TorchDistributedEnvironment().export()
        return
    if "SLURM_PROCID" not in os.environ or "SLURM_NTASKS" not in os.environ:
        return  # the batch script itself, not a task
    ntasks, nodes = int(os.environ["SLURM_NTASKS"]), int(os.environ.get("SLURM_JOB_NUM_NODES", "1"))
    os.environ.update(
        {
            "RANK": os.environ["SLURM_PROCID"],
            "WORLD_SIZE": str(ntasks),
            "LOCAL_RANK": os.environ.get("SLURM_LOCALID", "0"),
            "LOCAL_WORLD_SIZE": str(ntasks // nodes),
            "MASTER_ADDR": os.environ.get("MASTER_ADDR")
            or first_host(os.environ.get("SLURM_JOB_NODELIST", "localhost")),
            "MASTER_PORT": os.environ.get("MASTER_PORT") or str(20000 + int(os.environ["SLURM_JOB_ID"]) % 40000),
        }
    )


def world_from_env() -> tuple[int, int, int]:
    """``(rank, world_size, local_rank)`` from the environment; ``(0, 1, 0)`` when unset."""
    maybe_export_slurm_env()
    world = int(os.environ.get("WORLD_SIZE", "1") or 1)
    rank = int(os.environ.get("RANK", "0") or 0)
    local = int(os.environ.get("LOCAL_RANK", str(rank)) or 0)
    return rank, world, local


def resolve_device(name: str, local_rank: int = 0) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError("trainer.device", "cuda", "auto, cpu (no CUDA device is available)")
        return torch.device("cuda", local_rank % max(torch.cuda.device_count(), 1))
    return torch.device("cpu")


def init_distributed(device: str = "auto", timeout_s: float | None = None, trace_dir: Path | None = None) -> DistEnv:
    """Resolve rank/world/device and, for ``world_size > 1``, join (or reuse) the process group,
    whose collectives then wait ``timeout_s`` at most (torch's default without it: 30 minutes on
    gloo, 10 on NCCL). On NCCL the flight recorder dumps into ``trace_dir`` on a timeout."""
    rank, world, local = world_from_env()
    dev = resolve_device(device, local)
    env = DistEnv(rank=rank, world_size=world, local_rank=local, device=dev)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    if world > 1:
        if dist.is_available() and dist.is_initialized():
            env.rank, env.world_size = dist.get_rank(), dist.get_world_size()
        else:
            backend = "nccl" if dev.type == "cuda" else "gloo"
            kwargs: dict[str, Any] = {"backend": backend, "rank": rank, "world_size": world}
            if backend == "nccl":
                kwargs["device_id"] = dev
                if trace_dir is not None:
                    record_nccl_collectives(trace_dir)
            if timeout_s is not None:
                kwargs["timeout"] = timedelta(seconds=timeout_s)
            if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
                kwargs["store"] = attempt_store(kwargs.get("timeout", timedelta(minutes=30)))
            dist.init_process_group(**kwargs)
            env.owns_group = True
        if timeout_s is not None:
            set_collective_timeout(env, timeout_s)  # a group made by the caller too
    return env


def attempt_store(timeout: timedelta) -> dist.Store:
    """The store torchrun's agent keeps for its workers, under a prefix of this attempt: the agent
    keeps one store for every restart of its workers (``--max-restarts``), where the keys torch's
    process group writes would otherwise hand a restarted rank the addresses of the attempt before
    (pytorch/pytorch#135712: ``Connection refused`` while the group forms)."""
    addr, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    store = dist.TCPStore(addr, port, is_master=False, timeout=timeout)
    return dist.PrefixStore(f"readback/attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)


# NCCL's flight recorder (torch >= 2.5 reads these names): a ring of the last collectives with their
# stacks, written per rank when the watchdog times a collective out; torch's
# ``python -m torch.distributed.flight_recorder.fr_trace`` tells from the dumps which rank hung where.
FLIGHT_RECORDER = {"TORCH_FR_BUFFER_SIZE": "2000", "TORCH_NCCL_DUMP_ON_TIMEOUT": "1"}
FLIGHT_RECORDER_FILE = "TORCH_FR_DUMP_TEMP_FILE"  # the dumps' path, the rank appended


def record_nccl_collectives(trace_dir: Path) -> None:
    """Turn NCCL's flight recorder on, dumping into ``trace_dir/nccl_trace_rank_<rank>``, before
    the NCCL group exists (it reads the environment then); what a user set is kept."""
    for name, value in {**FLIGHT_RECORDER, FLIGHT_RECORDER_FILE: str(Path(trace_dir) / "nccl_trace_rank_")}.items():
        os.environ.setdefault(name, value)


def set_collective_timeout(env: DistEnv, seconds: float) -> None:
    """Every later collective of the default group waits ``seconds`` at most for the other ranks:
    gloo then raises in the waiting rank, NCCL's watchdog ends the process."""
    if env.distributed:
        dist.distributed_c10d._set_pg_timeout(timedelta(seconds=seconds))


def cleanup(env: DistEnv) -> None:
    if env.owns_group and dist.is_initialized():
        dist.destroy_process_group()
        env.owns_group = False


def all_reduce_mean(t: torch.Tensor, env: DistEnv) -> torch.Tensor:
    """Mean of ``t`` over ranks (``t`` itself in a single process)."""
    if not env.distributed:
        return t
    t = t.clone()
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t / env.world_size


def broadcast_object(obj: Any, env: DistEnv, src: int = 0) -> Any:
    if not env.distributed:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def barrier(env: DistEnv) -> None:
    if env.distributed:
        dist.barrier()
