"""The old command, which sweeps and result pages name: it runs
``python -m readback.cli.decide spike`` with the same arguments."""

import sys

from readback.cli.decide import main

sys.exit(main(["spike", *sys.argv[1:]]))
