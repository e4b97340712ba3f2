"""Shared test settings and fixtures: a hypothesis profile that keeps property tests fast and
deterministic, the toy models a test builds, a tiny composed config, and the real tiny sweep,
made once per session for every test that reads it."""

import functools
import os
import signal
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from filelock import FileLock
from hypothesis import HealthCheck, settings

# Without a GPU, Triton's kernels run in its interpreter (tests/unit/kernels). Triton reads the
# switch when a function is decorated, its own library's too, at its first import, which can come
# early: a CUDA build of torch imports triton with torch._dynamo. So it is set here, before any
# test module is collected.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import sweeps
import toys
from readback.audit_model.examples import TINY_FOG
from readback.train.settings import Config

settings.register_profile(
    "readback",
    deadline=None,
    max_examples=50,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.load_profile("readback")

INTEGRATION = Path(__file__).parent / "integration"


def pytest_configure(config):
    """A suite started with SIGINT ignored (a background job of a shell script, as CI may start it)
    would pass that on to every program a test starts: Python's own handler is put back, so that
    they take Ctrl-C as they do from a terminal."""
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def pytest_collection_modifyitems(items):
    """Everything under ``tests/integration/`` carries the ``integration`` marker."""
    for item in items:
        if INTEGRATION in item.path.parents:
            item.add_marker(pytest.mark.integration)


@pytest.fixture(scope="module", autouse=True)
def distributed_modules_take_turns(request, tmp_path_factory):
    """A module marked ``distributed`` holds a lock shared by the workers of ``pytest -n`` while it
    runs: two such modules at once, each starting process groups on local ports, have crashed a
    rendezvous (a rank aborted with "terminate called without an active exception")."""
    if request.node.get_closest_marker("distributed") is None:
        yield
        return
    with FileLock(tmp_path_factory.getbasetemp().parent / "distributed.lock"):
        yield


@pytest.fixture
def built(monkeypatch):
    """The toy models ``toys.train`` builds in this test (``toys.BUILT``, emptied first), with the
    launcher's environment (wandb mode, world size, Slurm restarts) unset."""
    for key in ("WANDB_MODE", "WORLD_SIZE", "SLURM_RESTART_COUNT"):
        monkeypatch.delenv(key, raising=False)
    toys.BUILT.clear()
    return toys.BUILT


@pytest.fixture
def tiny_cfg() -> Callable[..., Config]:
    """The typed ``train`` config of the narrowed tiny FOG (``TINY_FOG``, the audit's example's) with
    further overrides: ``tiny_cfg("policy=exact")``; a fresh config per call."""
    return functools.partial(toys.config, *TINY_FOG)


@pytest.fixture(scope="session")
def real_sweep(tmp_path_factory) -> sweeps.Sweep:
    """The real tiny sweep of ``train.py`` (``sweeps.make_sweep``), made once per session; tests
    that change it work on a copy."""
    return sweeps.make_sweep(tmp_path_factory.mktemp("real_sweep"))
