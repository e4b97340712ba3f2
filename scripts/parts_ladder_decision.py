"""The old command, which sweeps and result pages name: it runs
``python -m readback.cli.decide parts_ladder`` with the same arguments."""

import sys

from readback.cli.decide import main

sys.exit(main(["parts_ladder", *sys.argv[1:]]))
