"""Which parts of scripts/gpu_check.sh this machine can run: one line per part, ``NAME: run`` or
``NAME: not run: <what is missing>``, decided from what imports, so that a machine without
Transformer Engine (or Hydra, or a GPU) still runs every part it can.

Without a CUDA build of torch the check has nothing to run: then this prints one line saying so
and exits 3. It imports torch and nothing else (the other modules are only looked up), and it
reads readback's supported torch range from pyproject.toml.

    python scripts/gpu_env.py
"""

from __future__ import annotations

import importlib.util
import re
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path

from gpu_bundle import WHEELS

ROOT = Path(__file__).resolve().parents[1]
FP8_CAPABILITY = (8, 9)  # FP8 tensor cores: Ada (sm89), Hopper (sm90) and newer

# module -> what provides it
MODULES = {
    "numpy": "numpy",
    "filelock": "filelock",
    "yaml": "PyYAML",
    "packaging": "packaging",
    "hydra": "hydra-core",
    "omegaconf": "omegaconf",
    "antlr4": "antlr4-python3-runtime",
    "pytest": "pytest",
    "hypothesis": "hypothesis",
    "triton": "triton",
    "transformer_engine": "Transformer Engine (transformer_engine)",
}
READBACK = ("numpy", "filelock")  # what readback's modules on the parts' paths import
CONFIG = (*READBACK, "yaml", "packaging", "hydra", "omegaconf", "antlr4")  # and composing conf/ with Hydra
TESTS = (*CONFIG, "pytest", "hypothesis")  # and pytest with tests/conftest.py
TE = "transformer_engine"


@dataclass(frozen=True)
class Part:
    name: str
    gpu: str  # "none" (runs on the CPU), "cuda" (any CUDA device), "fp8" (sm89+)
    modules: tuple[str, ...]


# In the order gpu_check.sh runs them: a few training steps first (an import-time error stops the
# check there, before the long parts), the TE parts last.
PARTS = (
    Part("first_steps", "cuda", CONFIG),
    Part("emulated_tests", "fp8", TESTS),
    Part("accumulation", "fp8", TESTS),
    Part("policy_runs", "cuda", CONFIG),
    Part("audit", "none", READBACK),
    Part("kernel_tests", "cuda", (*TESTS, "triton")),
    Part("kernel_benchmark", "cuda", (*READBACK, "triton")),
    Part("benchmark", "fp8", CONFIG),
    Part("kernel_step", "fp8", (*CONFIG, "triton")),
    Part("te_tests", "fp8", (*TESTS, TE)),
    Part("te_benchmark", "fp8", (*CONFIG, TE)),
)


@dataclass(frozen=True)
class Machine:
    """What the parts depend on, as found by ``inspect``."""

    torch: str | None  # torch.__version__; None: torch does not import
    torch_error: str | None
    cuda: str | None  # torch.version.cuda; None: a CPU-only build
    device: str | None  # the name of CUDA device 0; None: no device visible
    capability: tuple[int, int] | None
    modules: frozenset[str]  # the modules of MODULES that can be imported


def inspect() -> Machine:
    modules = frozenset(m for m in MODULES if importlib.util.find_spec(m) is not None)
    try:
        import torch
    except Exception as error:
        return Machine(None, f"{type(error).__name__}: {error}", None, None, None, modules)
    visible = torch.cuda.is_available()
    device = torch.cuda.get_device_name(0) if visible else None
    capability = tuple(torch.cuda.get_device_capability(0)) if visible else None
    return Machine(torch.__version__, None, torch.version.cuda, device, capability, modules)  # type: ignore[arg-type]


def supported_torch(pyproject: Path = ROOT / "pyproject.toml") -> str:
    """readback's torch requirement in pyproject.toml, e.g. ``>=2.11,<2.14``."""
    dependencies = tomllib.loads(pyproject.read_text())["project"]["dependencies"]
    return next(d.removeprefix("torch").strip() for d in dependencies if re.match(r"torch\s*[<>=!~]", d))


def _release(version: str) -> tuple[int, ...]:
    """``2.11.0+cu130`` -> ``(2, 11, 0)``."""
    return tuple(int(n) for n in re.findall(r"\d+", version.split("+")[0])[:3])


def in_range(version: str, spec: str) -> bool:
    """Whether ``version`` meets every clause of ``spec`` (``>=``, ``>``, ``<=``, ``<``, ``==``)."""
    compare = {
        ">=": tuple.__ge__,
        ">": tuple.__gt__,
        "<=": tuple.__le__,
        "<": tuple.__lt__,
        "==": tuple.__eq__,
    }
    have = _release(version)
    for clause in spec.split(","):
        op, bound = re.match(r"\s*(>=|<=|==|>|<)\s*([\d.]+)", clause).groups()  # type: ignore[union-attr]
        want = _release(bound)
        if not compare[op](have[: len(want)], want):
            return False
    return True


def needs_cuda_torch(machine: Machine, python: str = sys.executable) -> str | None:
    """The one line that stops the check before any part (no CUDA build of torch, or one that sees
    no device: a CPU machine with PyPI's torch), or None."""
    if machine.torch is None:
        return f"needs a CUDA build of torch; {python} cannot import torch ({machine.torch_error}): nothing run"
    if machine.cuda is None:
        return f"needs a CUDA build of torch; {python} has torch {machine.torch}, a CPU-only build: nothing run"
    if machine.device is None:
        return f"needs a CUDA device; {python} has torch {machine.torch}, which sees none: nothing run"
    return None


def _missing_module(module: str) -> str:
    carried = {w.module for w in WHEELS}
    hint = " (its wheel: python scripts/gpu_bundle.py)" if module in carried else ""
    return MODULES[module] + hint


def why_not(part: Part, machine: Machine, spec: str) -> str | None:
    """What ``part`` lacks on ``machine``, in one line; None: it runs."""
    missing = []
    if machine.torch is None or not in_range(machine.torch, spec):
        missing.append(f"a torch that readback supports (torch{spec}; this is {machine.torch})")
    if part.gpu != "none" and machine.device is None:
        missing.append(f"a CUDA device visible to torch {machine.torch}")
    elif part.gpu == "fp8" and machine.capability is not None and machine.capability < FP8_CAPABILITY:
        sm = "".join(map(str, machine.capability))
        missing.append(f"an FP8 GPU (sm89+; {machine.device} is sm{sm})")
    missing += [_missing_module(m) for m in part.modules if m not in machine.modules]
    return ", ".join(missing) or None


def plan(machine: Machine, spec: str) -> list[str]:
    """One line per part: ``NAME: run`` or ``NAME: not run: REASON``."""
    lines = []
    for part in PARTS:
        reason = why_not(part, machine, spec)
        lines.append(f"{part.name}: run" if reason is None else f"{part.name}: not run: {reason}")
    return lines


def main() -> int:
    machine = inspect()
    stop = needs_cuda_torch(machine)
    if stop:
        print(stop)
        return 3
    print("\n".join(plan(machine, supported_torch())))
    return 0


if __name__ == "__main__":
    sys.exit(main())
