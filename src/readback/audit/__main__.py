"""The old command, ``python -m readback.audit``, which pages and scripts name: it runs
``python -m readback.cli.audit`` with the same arguments."""

import runpy

runpy.run_module("readback.cli.audit", run_name="__main__", alter_sys=True)
