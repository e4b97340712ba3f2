"""scripts/gpu_bundle.py with a fake pip (no network): which wheels it fetches and how, the
checks on what lands in .whl/ (one wheel per package, installable there, under 64 MiB with the
repository), and the command it prints for the GPU machine."""

from __future__ import annotations

from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement

import gpu_bundle

MIB = 2**20
NAMES = {"hydra_core", "omegaconf", "antlr4_python3_runtime"}


class FakePip:
    """Writes, for each pip command, the wheel that pip would leave (sparse files of ``size``
    bytes), except for the packages in ``skip``; a ``tag`` other than py3-none-any for ``foreign``."""

    def __init__(self, size: int = 100_000, skip: tuple[str, ...] = (), foreign: tuple[str, ...] = ()):
        self.size, self.skip, self.foreign, self.commands = size, skip, foreign, []

    def __call__(self, command):
        self.commands.append(list(command))
        name, version = command[-1].split("==")
        if name in self.skip:
            return
        dest = Path(command[command.index("-d" if "download" in command else "-w") + 1])
        tag = "cp311-cp311-macosx_11_0_arm64" if name in self.foreign else "py3-none-any"
        with open(dest / f"{name.replace('-', '_')}-{version}-{tag}.whl", "wb") as f:
            f.truncate(self.size)


def test_it_fetches_exactly_hydra_omegaconf_and_antlr4_for_cpython_3_12_manylinux(tmp_path):
    pip = FakePip()
    files = gpu_bundle.bundle(tmp_path, pip, other_bytes=0)
    assert {f.name.split("-")[0] for f in files} == NAMES
    by_name = {c[-1].split("==")[0]: c for c in pip.commands}
    assert set(by_name) == {"hydra-core", "omegaconf", "antlr4-python3-runtime"}
    for name in ("hydra-core", "omegaconf"):
        command = " ".join(by_name[name])
        assert " download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp " in command
        assert "--platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64" in command
    # published as source only: built here into a wheel, its dependencies left out as for the others
    assert " wheel --no-deps --no-binary antlr4-python3-runtime " in " ".join(by_name["antlr4-python3-runtime"])


def test_wheels_of_an_earlier_bundle_are_removed_first(tmp_path):
    stale = tmp_path / "hydra_core-1.3.2-py3-none-any.whl"
    stale.write_bytes(b"old")
    gpu_bundle.bundle(tmp_path, FakePip(), other_bytes=0)
    assert not stale.exists()


def test_a_bundle_of_64_mib_or_more_is_refused_in_one_line(tmp_path):
    with pytest.raises(SystemExit, match=r"come to 66\.0 MiB; at most 64 MiB go to the GPU machine$"):
        gpu_bundle.bundle(tmp_path, FakePip(size=22 * MIB), other_bytes=0)


def test_the_repository_counts_against_the_64_mib(tmp_path):
    wheels = 3 * 100_000
    assert gpu_bundle.bundle(tmp_path, FakePip(), other_bytes=64 * MIB - wheels - 1)
    with pytest.raises(SystemExit, match="at most 64 MiB go to the GPU machine"):
        gpu_bundle.bundle(tmp_path, FakePip(), other_bytes=64 * MIB - wheels)


def test_a_missing_wheel_is_refused_naming_what_is_there(tmp_path):
    with pytest.raises(SystemExit, match=r"one wheel each of antlr4_python3_runtime, hydra_core, omegaconf; it has "):
        gpu_bundle.bundle(tmp_path, FakePip(skip=("antlr4-python3-runtime",)), other_bytes=0)


def test_a_wheel_the_gpu_machine_cannot_install_is_refused(tmp_path):
    with pytest.raises(SystemExit, match=r"not installable on CPython 3\.12 x86-64: omegaconf-2\.3\.1-cp311"):
        gpu_bundle.bundle(tmp_path, FakePip(foreign=("omegaconf",)), other_bytes=0)


@pytest.mark.parametrize(
    "filename, ok",
    [
        ("omegaconf-2.3.1-py3-none-any.whl", True),
        ("PyYAML-6.0.2-cp312-cp312-manylinux_2_17_x86_64.manylinux2014_x86_64.whl", True),
        ("PyYAML-6.0.2-cp312-cp312-manylinux_2_17_aarch64.manylinux2014_aarch64.whl", False),
        ("PyYAML-6.0.2-cp311-cp311-manylinux_2_17_x86_64.manylinux2014_x86_64.whl", False),
        ("PyYAML-6.0.2-cp312-cp312-macosx_11_0_arm64.whl", False),
    ],
)
def test_installable_on_the_gpu_machine(filename, ok):
    assert gpu_bundle.installable(filename) is ok


def test_the_pins_meet_readbacks_requirements_and_each_others():
    """hydra-core as pyproject.toml asks; omegaconf and antlr4 as the installed hydra-core and
    omegaconf declare (antlr4 4.9 is the one runtime omegaconf 2.3's grammar accepts)."""
    pins = {w.name: w.version for w in gpu_bundle.WHEELS}
    asked = [Requirement(r) for r in metadata.requires("readback") + metadata.requires("hydra-core")]
    asked += [Requirement(r) for r in metadata.requires("omegaconf")]
    checked = {r.name for r in asked if r.name in pins and r.marker is None}
    assert checked == set(pins)
    for r in asked:
        if r.name in pins and r.marker is None:
            assert r.specifier.contains(pins[r.name]), (r, pins[r.name])


def test_main_prints_the_wheels_and_the_one_command_for_the_gpu_machine(tmp_path, capsys):
    assert gpu_bundle.main(["--dest", str(tmp_path)], run=FakePip()) == 0
    lines = capsys.readouterr().out.splitlines()
    assert sum(".whl" in line and "MiB" in line for line in lines) == 3
    command = lines[-1].strip()
    assert command == (
        "python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && "
        "PYTHONPATH=/tmp/site PYTHON=python3 bash scripts/gpu_check.sh"
    )
