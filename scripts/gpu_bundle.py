"""The wheels a bare GPU machine needs for scripts/gpu_check.sh, downloaded here into ``.whl/``.

The GPU machine this is written for has Python 3.12 and torch 2.11 (CUDA 13.0), triton,
transformers, numpy, pytest and hypothesis, and no network. What the check imports beyond that
is Hydra and its two dependencies: their wheels (for CPython 3.12 on manylinux x86-64) are
fetched here with pip, checked against the 64 MiB that one run there takes along with the
repository, and installed there offline:

    python scripts/gpu_bundle.py            # here: fills .whl/ and prints the command to run there

``antlr4-python3-runtime`` 4.9.3, the one version omegaconf 2.3 accepts, is published as source
only; pip builds it here into a pure-Python wheel, which installs on any Python 3.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEST = ROOT / ".whl"
LIMIT_BYTES = 64 * 2**20  # what one run on the GPU machine may take along: the wheels and the repository
SITE = "/tmp/site"  # where the wheels are installed on the GPU machine


@dataclass(frozen=True)
class Wheel:
    name: str  # the distribution
    version: str
    module: str  # what readback imports
    source_only: bool = False  # no wheel is published: pip builds one here


WHEELS = (
    Wheel("hydra-core", "1.3.8", "hydra"),
    Wheel("omegaconf", "2.3.1", "omegaconf"),
    Wheel("antlr4-python3-runtime", "4.9.3", "antlr4", source_only=True),
)
# The other modules the check imports, and why the GPU machine has them without a wheel from here.
ON_THE_MACHINE = {
    "numpy": "installed there",
    "pytest": "installed there",
    "hypothesis": "installed there",
    "yaml": "PyYAML, a requirement of transformers",
    "packaging": "a requirement of pytest and of transformers",
    "filelock": "a requirement of torch",
    "triton": "a requirement of torch's CUDA build",
}
TARGET = ("--python-version", "3.12", "--implementation", "cp", "--platform", "manylinux2014_x86_64")
TARGET += ("--platform", "manylinux_2_17_x86_64")


def pip_commands(dest: Path, python: str = sys.executable) -> list[list[str]]:
    """One pip command per wheel: ``pip download`` of the published wheel, ``pip wheel`` (a
    build from the source distribution) for a source-only release."""
    commands = []
    for wheel in WHEELS:
        pinned = f"{wheel.name}=={wheel.version}"
        common = [python, "-m", "pip", "-q", "--disable-pip-version-check"]
        if wheel.source_only:
            commands.append([*common, "wheel", "--no-deps", "--no-binary", wheel.name, "-w", str(dest), pinned])
        else:
            command = [*common, "download", "--no-deps", "--only-binary=:all:", *TARGET, "-d", str(dest), pinned]
            commands.append(command)
    return commands


def _normalized(name: str) -> str:
    return name.lower().replace("-", "_")


def installable(filename: str) -> bool:
    """Whether the GPU machine's pip takes this wheel: pure Python, or CPython 3.12 on manylinux x86-64."""
    pure = filename.endswith("-py3-none-any.whl")
    return pure or ("-cp312-cp312-manylinux" in filename and filename.endswith("_x86_64.whl"))


def check_bundle(dest: Path, other_bytes: int) -> list[Path]:
    """The wheels in ``dest``: exactly one per entry of ``WHEELS``, each installable on the GPU
    machine, and with ``other_bytes`` (the repository) within ``LIMIT_BYTES``. Else one line, raised."""
    files = sorted(dest.glob("*.whl"))
    found = {_normalized(f.name.split("-")[0]): f for f in files}
    expected = {_normalized(w.name) for w in WHEELS}
    if len(found) != len(files) or set(found) != expected:
        names = ", ".join(f.name for f in files) or "none"
        wanted = ", ".join(sorted(expected))
        raise SystemExit(f"gpu_bundle: {dest} must hold one wheel each of {wanted}; it has {names}")
    foreign = [f.name for f in files if not installable(f.name)]
    if foreign:
        raise SystemExit(f"gpu_bundle: not installable on CPython 3.12 x86-64: {', '.join(foreign)}")
    total = sum(f.stat().st_size for f in files) + other_bytes
    if total >= LIMIT_BYTES:
        raise SystemExit(
            f"gpu_bundle: the wheels and the repository come to {total / 2**20:.1f} MiB; "
            f"at most {LIMIT_BYTES / 2**20:.0f} MiB go to the GPU machine"
        )
    return files


def repository_bytes(root: Path = ROOT) -> int:
    """Size of the files git tracks: they go to the GPU machine with the wheels."""
    listed = subprocess.run(["git", "ls-files", "-z"], cwd=root, capture_output=True, check=True).stdout
    paths = [root / name for name in listed.decode().split("\0") if name]
    return sum(p.stat().st_size for p in paths if p.is_file())


def install_command(python: str = "python3") -> str:
    """What to run on the GPU machine, at the repository root: the offline install, then the check."""
    return (
        f"{python} -m pip install -q --no-index --no-deps --target {SITE} .whl/*.whl && "
        f"PYTHONPATH={SITE} PYTHON={python} bash scripts/gpu_check.sh"
    )


def bundle(dest: Path, run: Callable[[Sequence[str]], object], other_bytes: int) -> list[Path]:
    """Empties ``dest`` of wheels, runs the pip commands (``run``), and checks what they left."""
    dest.mkdir(parents=True, exist_ok=True)
    for old in dest.glob("*.whl"):
        old.unlink()
    for command in pip_commands(dest):
        run(command)
    return check_bundle(dest, other_bytes)


def _pip(command: Sequence[str]) -> None:
    subprocess.run(command, check=True)


def main(argv: Sequence[str] | None = None, run: Callable[[Sequence[str]], object] = _pip) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dest", type=Path, default=DEST, help="where the wheels go (default: .whl/)")
    args = parser.parse_args(argv)
    repository = repository_bytes()
    files = bundle(args.dest, run, repository)
    for f in files:
        print(f"{f.stat().st_size / 2**20:7.2f} MiB  {f.name}")
    wheels = sum(f.stat().st_size for f in files)
    print(f"{wheels / 2**20:7.2f} MiB  in {args.dest} (with the repository: {(wheels + repository) / 2**20:.1f} MiB)")
    print("on the GPU machine, at the repository root:")
    print(f"  {install_command()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
