"""benchmarks/gpu_step.py without a GPU: it refuses in one line, pairs sequence lengths with
micro-batches, runs its worker on the CPU, and turns a timeout, a crash or running out of memory
into a result."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import torch

import gpu_step

TINY = ["--model", "tiny", "--vocab", "256", "--device", "cpu", "--steps", "2", "--warmup", "1"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU machine it measures")
def test_without_cuda_it_refuses_in_one_line(capsys):
    assert gpu_step.main([]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == f"gpu_step: needs a CUDA device; torch {torch.__version__} sees none: nothing measured\n"


def test_sequence_lengths_pair_with_one_micro_batch_each_or_share_one():
    assert gpu_step.shapes(gpu_step._parse(["--seq", "1024", "4096", "--micro-batch", "8", "2"])) == [
        (1024, 8),
        (4096, 2),
    ]
    assert gpu_step.shapes(gpu_step._parse(["--seq", "1024", "4096"])) == [(1024, 8), (4096, 8)]
    with pytest.raises(SystemExit):
        gpu_step._parse(["--seq", "1024", "2048", "4096", "--micro-batch", "8", "2"])


def test_the_worker_command_runs_one_case_at_one_shape():
    args = gpu_step._parse([*TINY, "--seq", "32", "64", "--micro-batch", "4", "2", "--max-seconds", "5"])
    command = gpu_step.worker_command(args, "emulated_bf16", 64, 2)
    assert command[:2] == [sys.executable, str(Path(gpu_step.__file__).resolve())]
    worker = gpu_step._parse(command[2:])
    assert (worker.worker, worker.seq, worker.micro_batch, worker.model, worker.vocab) == (
        "emulated_bf16",
        [64],
        [2],
        "tiny",
        256,
    )
    assert (worker.steps, worker.warmup, worker.max_seconds, worker.device) == (2, 1, 5.0, "cpu")


@pytest.mark.parametrize("case", ["emulated_bf16", "emulated_reuse_rounded"])
def test_the_worker_measures_a_tiny_fog_on_the_cpu(case):
    args = gpu_step._parse([*TINY, "--seq", "32"])
    result = gpu_step.run_case(case, 32, 2, args)
    assert (result["case"], result["seq"], result["micro_batch"], result["steps"]) == (case, 32, 2, 2)
    assert result["tokens_per_s"] > 0 and result["loss_finite"] and "error" not in result
    assert result["mfu"] is None  # no known peak for a CPU
    assert result["sites"]["linear"] == "readback.ops.linear"


def test_running_out_of_memory_is_a_result_with_the_peak_not_a_failure(monkeypatch):
    def out_of_memory(*args):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 8.00 GiB\nmore detail")

    monkeypatch.setattr(gpu_step, "_timed_steps", out_of_memory)
    result = gpu_step.run_case("emulated_bf16", 32, 2, gpu_step._parse([*TINY, "--seq", "32"]))
    assert result["oom"] and result["error"] == "out of memory: CUDA out of memory. Tried to allocate 8.00 GiB"
    assert math.isnan(result["peak_mem_gib"])  # the CPU has no CUDA peak
    timed_out = {"case": "emulated_bf16", "seq": 64, "micro_batch": 2, "error": "timed out after 50 s"}
    assert gpu_step.failures([result, timed_out]) == [timed_out]
    table = gpu_step._table([result, timed_out])
    assert "out of memory: CUDA out of memory" in table and "timed out after 50 s" in table


def test_a_worker_that_hangs_crashes_or_reports_becomes_one_result():
    def run(code: str, timeout: float = 60) -> dict:
        return gpu_step.run_worker([sys.executable, "-c", code], "emulated_bf16", 1024, 8, timeout)

    assert run("import time; time.sleep(30)", timeout=1)["error"] == "timed out after 1 s"
    crashed = run("import sys; print('first'); sys.exit('CUDA error: an illegal memory access')")
    assert crashed["error"] == "exit 1: CUDA error: an illegal memory access"
    reported = run(f"print('noise'); print('RESULT ' + {json.dumps(json.dumps({'case': 'x', 'steps': 3}))})")
    assert reported == {"case": "x", "steps": 3}


def test_fp8_cases_are_compared_with_the_bf16_case_of_their_backend_at_the_same_length():
    def result(case, seq, tokens_per_s, peak):
        return {"case": case, "seq": seq, "tokens_per_s": tokens_per_s, "peak_mem_gib": peak}

    results = [
        result("emulated_bf16", 1024, 1000.0, 10.0),
        result("emulated_reuse_rounded", 1024, 500.0, 12.5),
        result("emulated_reuse_rounded", 4096, 400.0, 40.0),  # its baseline ran out of memory
        {"case": "emulated_bf16", "seq": 4096, "error": "out of memory", "oom": True},
        result("te_bf16", 1024, 2000.0, 8.0),
        result("te_fp8", 1024, 3000.0, 6.0),
    ]
    assert gpu_step.fp8_against_bf16(results) == [
        "emulated_reuse_rounded / emulated_bf16 at seq 1024: tokens/s x0.50, peak memory x1.25",
        "te_fp8 / te_bf16 at seq 1024: tokens/s x1.50, peak memory x0.75",
    ]
