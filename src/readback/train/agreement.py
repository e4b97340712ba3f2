"""Before step 1 every rank says what it is about to run, and a run whose ranks differ is refused.

A YAML edited or a checkout pulled between a job's submission and one node's start, or a node
with another image, would otherwise train on: DDP averages whatever gradients the ranks send.
Compared, key by key: the resolved config (every key but a node's own cache folder), the code
(its git commit and whether the tree is dirty, and a hash of the package's sources, which sees an
installed copy and two dirty trees alike), the versions of torch, Transformer Engine and Triton,
and the data's fingerprint (which names the token cache it was read from). A difference is
refused on every rank, before the model is built, anything trained or a file of the run written,
in one line naming each differing key with its values and the ranks that hold them.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import re
import socket
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from readback.errors import ConfigError
from readback.train.distributed import DistEnv
from readback.train.records.identity import PACKAGE, code_version
from readback.train.settings import Config, config_leaves

_SHOWN = 6  # differing keys a refusal lists
NODE_KEYS = ("data.cache_dir",)  # may name a node-local folder; what it holds is the data's fingerprint
OTHER_PACKAGES = ("transformer_engine", "triton")  # besides torch: the kernels a GPU run may take


def what_runs(cfg: Config, data_fingerprint: str) -> dict[str, Any]:
    """What this rank is about to run, as ``{key: value}``: the config's dotted keys (but
    :data:`NODE_KEYS`), then ``code.*``, ``version.*`` and ``data.fingerprint``."""
    described: dict[str, Any] = {k: v for k, v in config_leaves(cfg) if k not in NODE_KEYS}
    described |= {f"code.{k}": v for k, v in code_version().items()}
    described["code.sources"] = sources_digest()
    described["version.torch"] = torch.__version__
    described |= {f"version.{name}": installed_version(name) for name in OTHER_PACKAGES}
    described["data.fingerprint"] = re.sub(r":rank\d+/\d+", "", data_fingerprint)  # less the rank's share
    return described


@functools.cache
def sources_digest(package: Path = PACKAGE) -> str:
    """SHA-256 of the package's Python sources, by relative path and content (12 hex digits)."""
    digest = hashlib.sha256()
    for path in sorted(package.rglob("*.py")):
        digest.update(str(path.relative_to(package)).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:12]


def installed_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def disagreements(described: Sequence[dict[str, Any]]) -> list[tuple[str, list[tuple[Any, list[int]]]]]:
    """``(key, [(value, ranks holding it), ...])`` for each key whose value is not the same on
    every rank, in rank 0's key order; within a key, values in the order of their first rank."""
    keys = list(dict.fromkeys(k for d in described for k in d))
    found = []
    for key in keys:
        holders: list[tuple[Any, list[int]]] = []
        for rank, d in enumerate(described):
            value = d.get(key, "(absent)")
            same = next((ranks for v, ranks in holders if v == value), None)
            if same is None:
                holders.append((value, [rank]))
            else:
                same.append(rank)
        if len(holders) > 1:
            found.append((key, holders))
    return found


def ranks_text(ranks: list[int]) -> str:
    """``rank 3``, ``ranks 0, 2`` or ``ranks 0-7`` (a run of consecutive ranks)."""
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    if ranks == list(range(ranks[0], ranks[-1] + 1)) and len(ranks) > 2:
        return f"ranks {ranks[0]}-{ranks[-1]}"
    return "ranks " + ", ".join(map(str, ranks))


class RanksDisagree(ConfigError):
    """The ranks of one run would run different things: one line, exit 2, nothing trained."""

    def __init__(self, found: list[tuple[str, list[tuple[Any, list[int]]]]]):
        self.key, self.value = found[0][0], found[0][1][0][0]
        self.valid = "the same value on every rank"
        listed = "; ".join(
            f"{key} " + ", ".join(f"{value} on {ranks_text(ranks)}" for value, ranks in holders)
            for key, holders in found[:_SHOWN]
        )
        more = f"; ... ({len(found)} keys in all)" if len(found) > _SHOWN else ""
        ValueError.__init__(
            self, f"ranks disagree: {listed}{more}; launch every node with the same command, code and software"
        )


def agree(cfg: Config, data_fingerprint: str, env: DistEnv) -> list[str]:
    """Each rank's host name, once every rank has compared what it runs with the others';
    :class:`RanksDisagree` on every rank otherwise. One process: its own host, nothing compared."""
    mine: dict[str, Any] = {"host": socket.gethostname(), "runs": what_runs(cfg, data_fingerprint)}
    if not env.distributed:
        return [mine["host"]]
    gathered: list[Any] = [None] * env.world_size
    dist.all_gather_object(gathered, mine)
    found = disagreements([g["runs"] for g in gathered])
    if found:
        raise RanksDisagree(found)
    return [g["host"] for g in gathered]
