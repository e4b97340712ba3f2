"""The old command, ``python -m readback.audit_model``, which pages name: it runs
``python -m readback.cli.audit_model`` with the same arguments."""

import runpy

runpy.run_module("readback.cli.audit_model", run_name="__main__", alter_sys=True)
