"""The kernels run in Triton's interpreter on the CPU (set before triton is first imported, as
triton reads it when a kernel is defined); without triton installed these tests are skipped."""

import os

import pytest

os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton", reason="triton is not installed (pip install triton)")
