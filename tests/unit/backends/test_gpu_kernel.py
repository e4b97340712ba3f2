"""The Triton attention core on CUDA against the ops core on the CPU, on the same inputs: the
interpreter tests' comparison (``tests/kernel_comparison.py``) with the kernel compiled for the
GPU, where its exponential and its GEMMs' FP32 sums differ from the interpreter's in their last
bits, within the same bounds. Part ``kernel_tests`` of ``scripts/gpu_check.sh``."""

import os

import pytest
import torch

from kernel_comparison import compare

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
pytest.importorskip("triton", reason="triton is not installed")

CASES = [  # (batch, heads, groups, T, head dim), policy, recipe, rounding: fog_390m's head dim and GQA
    ((1, 8, 4, 256, 128), "reuse_rounded", "delayed", "nearest"),
    ((1, 8, 4, 256, 128), "fresh_reround", "current", "stochastic"),
    ((2, 2, 1, 200, 64), "no_saved_copy", "delayed", "stochastic"),
    ((1, 4, 2, 130, 128), "original", "current", "nearest"),
]


BACKWARDS = [  # the BF16 backward's flavours, and parts set apart, each with fog_390m's head dim and GQA once
    ((1, 8, 4, 256, 128), "reuse_rounded", "delayed", "nearest", dict(bwd_precision="bf16", bwd_reads="te")),
    ((2, 2, 1, 200, 64), "original", "current", "stochastic", dict(bwd_precision="bf16", bwd_reads="forward")),
    ((1, 4, 2, 130, 128), "original", "delayed", "stochastic", dict(bwd_precision="bf16", bwd_reads="te")),
    ((1, 4, 2, 130, 128), "no_saved_copy", "delayed", "nearest", dict(bwd_qkv="original", bwd_probs="rebuilt")),
]


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="the interpreter runs on the CPU")
@pytest.mark.parametrize(("shape", "policy", "recipe", "rounding"), CASES)
def test_the_kernel_on_cuda_rounds_as_the_ops_core(monkeypatch, shape, policy, recipe, rounding):
    compare(shape, policy, recipe, rounding, monkeypatch, "cuda")


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="the interpreter runs on the CPU")
@pytest.mark.parametrize(("shape", "policy", "recipe", "rounding", "backward"), BACKWARDS)
def test_other_backwards_on_cuda_round_as_the_ops_core(monkeypatch, shape, policy, recipe, rounding, backward):
    compare(shape, policy, recipe, rounding, monkeypatch, "cuda", backward)
