"""The kernels run in Triton's interpreter on the CPU (``TRITON_INTERPRET=1``, set by the root
``tests/conftest.py`` before triton's first import); without triton installed these tests are skipped."""

import pytest

pytest.importorskip("triton", reason="triton is not installed (pip install triton)")
