"""scripts/gpu_env.py, the environment check of the GPU check, on fakes of the machines it meets:
the GPU machine itself (torch 2.11, no Transformer Engine), no CUDA, a CPU-only torch, a torch
outside readback's range, a wheel missing, a GPU without FP8."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import re
import sys

import pytest
import torch
from packaging.specifiers import SpecifierSet

import gpu_bundle
import gpu_env
from toys import REPO

NON_TE = (
    "emulated_tests",
    "accumulation",
    "policy_runs",
    "audit",
    "kernel_tests",
    "kernel_benchmark",
    "benchmark",
    "kernel_step",
)
TE_PARTS = ("te_tests", "te_benchmark")


@pytest.fixture
def machine(monkeypatch):
    """Fakes torch's version, its CUDA build and device, and which modules import; then returns
    what ``gpu_env.inspect`` finds."""
    real_find_spec = importlib.util.find_spec

    def fake(
        version="2.11.0+cu130",
        cuda="13.0",
        device="NVIDIA H200",
        capability=(9, 0),
        missing=(),
    ):
        monkeypatch.setattr(torch, "__version__", version)
        monkeypatch.setattr(torch.version, "cuda", cuda)
        monkeypatch.setattr(torch.cuda, "is_available", lambda: device is not None)
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=0: device)
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=0: capability)

        def find_spec(name, *args):
            if name in missing:
                return None
            if name == "transformer_engine":  # not installed here: present on the faked machine
                return importlib.machinery.ModuleSpec(name, None)
            return real_find_spec(name, *args)

        monkeypatch.setattr(importlib.util, "find_spec", find_spec)
        return gpu_env.inspect()

    return fake


def _verdicts(machine) -> dict[str, str]:
    lines = gpu_env.plan(machine, gpu_env.supported_torch())
    assert len(lines) == len(gpu_env.PARTS)
    return dict(line.split(": ", 1) for line in lines)


def test_the_gpu_machine_torch_2_11_without_te_runs_every_part_but_the_te_ones(machine):
    verdicts = _verdicts(machine(missing=("transformer_engine",)))
    assert {name: verdicts[name] for name in NON_TE} == dict.fromkeys(NON_TE, "run")
    for name in TE_PARTS:
        assert verdicts[name] == "not run: Transformer Engine (transformer_engine)"


def test_with_transformer_engine_every_part_runs(machine):
    assert set(_verdicts(machine()).values()) == {"run"}


def test_a_cuda_torch_that_sees_no_device_runs_only_the_audit(machine):
    verdicts = _verdicts(machine(device=None, missing=("transformer_engine",)))
    assert verdicts.pop("audit") == "run"
    for name, verdict in verdicts.items():
        assert verdict.startswith("not run: a CUDA device visible to torch 2.11.0+cu130"), name
    assert verdicts["te_tests"].endswith(", Transformer Engine (transformer_engine)")


def test_a_cpu_only_torch_stops_the_check_in_one_line(machine, capsys):
    machine(version="2.13.0+cpu", cuda=None, device=None)
    assert gpu_env.main() == 3
    out = capsys.readouterr().out
    assert out == f"needs a CUDA build of torch; {sys.executable} has torch 2.13.0+cpu, a CPU-only build: nothing run\n"


def test_a_cuda_torch_that_sees_no_device_stops_the_check_in_one_line(machine, capsys):
    machine(version="2.13.0+cu130", cuda="13.0", device=None)
    assert gpu_env.main() == 3
    out = capsys.readouterr().out
    assert out == f"needs a CUDA device; {sys.executable} has torch 2.13.0+cu130, which sees none: nothing run\n"


def test_a_torch_that_does_not_import_stops_the_check_in_one_line(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "torch", None)  # import torch raises ImportError
    found = gpu_env.inspect()
    assert found.torch is None and found.torch_error.startswith("ModuleNotFoundError: import of torch halted")
    assert gpu_env.main() == 3
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 1 and out[0].startswith(f"needs a CUDA build of torch; {sys.executable} cannot import torch")


def test_a_torch_outside_the_supported_range_runs_no_part(machine):
    verdicts = _verdicts(machine(version="2.10.0+cu128"))
    for name, verdict in verdicts.items():
        assert verdict == "not run: a torch that readback supports (torch>=2.11.0a0,<2.14; this is 2.10.0+cu128)", name


def test_a_missing_wheel_stops_the_parts_that_compose_configs_and_says_where_it_comes_from(machine):
    verdicts = _verdicts(machine(missing=("antlr4", "transformer_engine")))
    assert verdicts.pop("audit") == verdicts.pop("kernel_benchmark") == "run"  # they compose no config
    for name, verdict in verdicts.items():
        assert "antlr4-python3-runtime (its wheel: python scripts/gpu_bundle.py)" in verdict, name
        assert "\n" not in verdict


def test_a_missing_test_runner_stops_only_the_test_parts(machine):
    verdicts = _verdicts(machine(missing=("hypothesis",)))
    stopped = {"emulated_tests", "accumulation", "kernel_tests", "te_tests"}
    assert {name for name, v in verdicts.items() if v != "run"} == stopped
    assert verdicts["emulated_tests"] == verdicts["accumulation"] == "not run: hypothesis"


def test_a_gpu_without_fp8_runs_the_policy_runs_and_the_audit(machine):
    verdicts = _verdicts(machine(device="NVIDIA A100-SXM4-80GB", capability=(8, 0), missing=("transformer_engine",)))
    assert verdicts["policy_runs"] == verdicts["audit"] == "run"
    assert verdicts["kernel_tests"] == verdicts["kernel_benchmark"] == "run"  # the kernel multiplies FP32 values
    for name in ("emulated_tests", "accumulation", "benchmark"):
        assert verdicts[name] == "not run: an FP8 GPU (sm89+; NVIDIA A100-SXM4-80GB is sm80)"


@pytest.mark.parametrize(
    "version",
    ["2.10.0", "2.10.2+cu128", "2.11.0a0+gitabc", "2.11.0", "2.11.0+cu130", "2.13.0+cpu", "2.14.0a0+x", "2.14.0"],
)
def test_in_range_agrees_with_packaging_on_readbacks_range(version):
    spec = gpu_env.supported_torch()
    assert gpu_env.in_range(version, spec) == SpecifierSet(spec).contains(version, prereleases=True)


def test_the_supported_range_holds_the_gpu_machines_torch_and_the_makefile_pin():
    spec = gpu_env.supported_torch()
    pin = re.search(r"torch==([\d.]+)", (REPO / "Makefile").read_text())[1]
    assert gpu_env.in_range("2.11.0+cu130", spec) and gpu_env.in_range(pin, spec)


def test_gpu_check_sh_runs_the_parts_of_the_plan_in_its_order():
    script = (REPO / "scripts" / "gpu_check.sh").read_text()
    assert re.findall(r"^part (\w+) ", script, re.M) == [part.name for part in gpu_env.PARTS]


def test_the_wheels_and_the_machine_cover_every_module_the_parts_without_te_need():
    needed = {module for part in gpu_env.PARTS if gpu_env.TE not in part.modules for module in part.modules}
    carried = {wheel.module for wheel in gpu_bundle.WHEELS}
    assert needed == carried | set(gpu_bundle.ON_THE_MACHINE)
    assert not carried & set(gpu_bundle.ON_THE_MACHINE)
