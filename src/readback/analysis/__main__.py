"""The old command, ``python -m readback.analysis``, which pages and sweeps name: it runs
``python -m readback.cli.analysis`` with the same arguments."""

import runpy

runpy.run_module("readback.cli.analysis", run_name="__main__", alter_sys=True)
