"""The GPU install routes, checked without a GPU: environment.yml, the container recipes
(container/Dockerfile, container/readback.def) and the Slurm launcher that runs jobs in the image.
They must parse, copy files that exist, and name package extras that pyproject.toml defines."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml
from hydra.core.hydra_config import HydraConfig

from toys import REPO, compose

PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
EXTRAS = set(PYPROJECT["project"]["optional-dependencies"])
DOCKER_INSTRUCTIONS = {"FROM", "ARG", "RUN", "COPY", "WORKDIR", "ENV", "LABEL", "CMD", "ENTRYPOINT", "USER"}
FULL_PYTHON = "3.12"  # environment.yml's, which CI runs `make test` on
APPTAINER_SECTIONS = {"files", "post", "environment", "test", "help", "labels", "runscript", "arguments"}


def _named_extras(text: str) -> set[str]:
    """Extras of ``.[a,b]`` installs of readback named in ``text``."""
    return {extra for group in re.findall(r"\.\[([\w,-]+)\]", text) for extra in group.split(",")}


def _torch_pin() -> str:
    return re.search(r"torch==([\d.]+)", (REPO / "Makefile").read_text())[1]


def test_environment_yml_gets_the_tested_torch_from_no_dead_channel():
    env = yaml.safe_load((REPO / "environment.yml").read_text())
    assert env["name"] == "readback" and env["channels"] == ["conda-forge"]  # the pytorch channel stopped at 2.5
    deps = env["dependencies"]
    pip = next(d["pip"] for d in deps if isinstance(d, dict))
    assert f"torch=={_torch_pin()}" in pip  # the torch the CPU route and the tests use
    assert not any(str(d).startswith(("pytorch", "pytorch::")) for d in deps)
    named = _named_extras((REPO / "environment.yml").read_text())
    assert {"dev", "gpu"} <= named and named <= EXTRAS
    assert "--no-build-isolation" in (REPO / "environment.yml").read_text()  # TE's extension compiles
    assert any("transformer-engine" in req for req in PYPROJECT["project"]["optional-dependencies"]["gpu"])


def _dockerfile_instructions() -> list[tuple[str, str]]:
    text = (REPO / "container" / "Dockerfile").read_text().replace("\\\n", " ")
    lines = [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    return [(line.split(None, 1)[0], line.split(None, 1)[1]) for line in lines]


def test_dockerfile_parses_copies_what_exists_and_names_defined_extras():
    instructions = _dockerfile_instructions()
    assert {name for name, _ in instructions} <= DOCKER_INSTRUCTIONS
    assert instructions[0] == ("ARG", "BASE_IMAGE") and instructions[1] == ("FROM", "${BASE_IMAGE}")
    for name, args in instructions:
        if name == "COPY":
            *sources, _ = shlex.split(args)
            assert all((REPO / source).exists() for source in sources), args
    runs = " ".join(args for name, args in instructions if name == "RUN")
    assert _named_extras(runs) == {"dev"} <= EXTRAS and "scripts/versions.py" in runs


def test_apptainer_definition_parses_copies_what_exists_and_names_defined_extras():
    text = (REPO / "container" / "readback.def").read_text()
    body = [line for line in text.splitlines() if line.strip() and not line.startswith("#")]
    header = dict(line.split(":", 1) for line in body[:2])
    assert header["Bootstrap"].strip() == "docker" and header["From"].strip() == "{{ BASE_IMAGE }}"
    sections = re.findall(r"^%(\w+)", text, flags=re.M)
    assert set(sections) <= APPTAINER_SECTIONS and {"files", "post", "test"} <= set(sections)
    files = text.split("%files", 1)[1].split("\n%", 1)[0]
    for line in filter(str.strip, files.splitlines()):
        source, destination = line.split()
        assert (REPO / source).exists() and destination.startswith("/opt/readback/")
    assert _named_extras(text) == {"dev"} <= EXTRAS


def test_versions_line_names_python_torch_cuda_cudnn_triton_te_and_the_gpu():
    out = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "versions.py")], capture_output=True, text=True, timeout=120, check=True
    ).stdout
    assert len(out.splitlines()) == 1
    assert re.fullmatch(
        r"Python 3\.\d+\.\d+, torch \S+, CUDA .+, cuDNN .+, Triton \S+, Transformer Engine .+, GPU .+\n", out
    )


def test_slurm_apptainer_launcher_composes_and_sources_an_existing_script(monkeypatch):
    cfg = compose("hydra/launcher=slurm_apptainer", return_hydra_config=True)
    cfg.hydra.runtime.cwd = str(REPO)  # as at launch
    monkeypatch.delenv("READBACK_IMAGE", raising=False)
    HydraConfig.instance().set_config(cfg)
    try:
        launcher = cfg.hydra.launcher
        assert launcher._target_.endswith("SlurmLauncher") and launcher.gpus_per_node == 8  # slurm.yaml's
        assert list(launcher.setup) == [
            f"export READBACK_IMAGE={REPO}/readback.sif",
            f"export READBACK_SRC={REPO}/src",
            f"source {REPO}/scripts/slurm/apptainer_srun.sh",
        ]
    finally:
        HydraConfig.instance().cfg = None
    assert (REPO / "scripts/slurm/apptainer_srun.sh").is_file()


def _fake(path: Path, body: str) -> None:
    path.write_text("#!/usr/bin/env bash\n" + body)
    path.chmod(0o755)


@pytest.mark.parametrize("image_exists", [True, False])
def test_srun_of_a_job_runs_the_image_python_with_the_checkout(tmp_path, image_exists):
    """submitit's batch line ``srun OPTIONS HOST_PYTHON ARGS`` becomes ``srun OPTIONS apptainer exec
    --nv IMAGE env PYTHONPATH=SRC python ARGS``; fake srun and apptainer run it for real."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    log = tmp_path / "calls"
    _fake(
        bin_dir / "srun",
        f'echo "srun $*" >> {log}\nwhile [ "${{1#-}}" != "$1" ]; do case "$1" in '
        '--output|--error) shift 2;; *) shift;; esac; done\nexec "$@"\n',
    )
    _fake(bin_dir / "apptainer", f'echo "apptainer $*" >> {log}\nshift 3\nexec "$@"\n')  # exec --nv IMAGE
    _fake(bin_dir / "python", f'exec {sys.executable} "$@"\n')  # the image's python
    image = tmp_path / "readback.sif"
    if image_exists:
        image.write_text("")
    script = (
        f"export READBACK_IMAGE={image} READBACK_SRC=/repo/src\n"
        f"source {REPO / 'scripts/slurm/apptainer_srun.sh'}\n"
        f"srun --unbuffered --output /o/%j.out --error /o/%j.err /host/bin/python3 -c "
        f"\"import os; print('ran', os.environ['PYTHONPATH'])\"\n"
    )
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}
    result = subprocess.run(["bash", "-c", script], capture_output=True, text=True, env=env, timeout=60)
    if not image_exists:
        assert result.returncode == 2 and result.stderr.count("\n") == 1 and "READBACK_IMAGE" in result.stderr
        return
    assert result.returncode == 0, result.stderr
    assert result.stdout == "ran /repo/src\n"
    srun_call, apptainer_call = log.read_text().splitlines()
    assert srun_call.startswith("srun --unbuffered --output /o/%j.out --error /o/%j.err apptainer exec --nv ")
    assert apptainer_call.startswith(f"apptainer exec --nv {image} env PYTHONPATH=/repo/src")
    assert "/host/bin/python3" not in srun_call


def test_every_place_names_the_same_pythons_and_ci_runs_each():
    """requires-python, the classifiers, environment.yml, the README and .ci/run agree, and pip
    refuses the versions just outside them."""
    classified = sorted(
        (c.rsplit(" ", 1)[1] for c in PYPROJECT["project"]["classifiers"] if re.fullmatch(r".*:: 3\.\d+", c)),
        key=lambda v: tuple(map(int, v.split("."))),
    )
    low, high = classified[0], classified[-1]
    assert len(classified) == int(high.split(".")[1]) - int(low.split(".")[1]) + 1  # no version skipped
    upper = f"3.{int(high.split('.')[1]) + 1}"
    assert PYPROJECT["project"]["requires-python"] == f">={low},<{upper}"
    env = yaml.safe_load((REPO / "environment.yml").read_text())
    assert next(d for d in env["dependencies"] if str(d).startswith("python=")) == f"python={FULL_PYTHON}"
    assert f"(Python {low} to {high})" in (REPO / "README.md").read_text()
    ci = (REPO / ".ci" / "run").read_text()
    assert re.search(rf"^FULL_PYTHON={re.escape(FULL_PYTHON)}$", ci, re.M)
    smoke = re.search(r'^SMOKE_PYTHONS="([\d. ]+)"$', ci, re.M)[1].split()
    assert sorted([FULL_PYTHON, *smoke]) == sorted(classified)
    assert 'make test PYTHON="$python"' in ci
    assert 'read -r -a versions <<< "$SMOKE_PYTHONS"' in ci and 'make smoke PYTHON="$(interpreter "$version")"' in ci
