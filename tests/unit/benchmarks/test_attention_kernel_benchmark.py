"""benchmarks/attention_kernel.py without a GPU: it refuses in one line and measures nothing."""

import pytest
import torch

import attention_kernel


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU it measures")
def test_without_cuda_it_says_so_in_one_line(capsys):
    assert attention_kernel.main(["--seq", "1024"]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err == "attention_kernel: needs a CUDA device; none is visible\n"
