"""The old command, which sweeps and result pages name: it runs
``python -m readback.cli.decide te_reads_meter`` with the same arguments."""

import sys

from readback.cli.decide import main

sys.exit(main(["te_reads_meter", *sys.argv[1:]]))
