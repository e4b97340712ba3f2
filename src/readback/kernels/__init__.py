"""Triton kernels of readback's ops (``ops`` calls them): the FP8 attention core's forward and
backward, with the very roundings, draws and counts of the emulated op. They run on CUDA, and
on the CPU under Triton's interpreter (``TRITON_INTERPRET=1``), where the tests prove them
against ``ops.attention``. Nothing here imports the rest of readback but ``errors``."""
