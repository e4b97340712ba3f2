"""The old command, which sweeps and result pages name: it runs
``python -m readback.cli.decide bf16_bwd`` with the same arguments."""

import sys

from readback.cli.decide import main

sys.exit(main(["bf16_bwd", *sys.argv[1:]]))
