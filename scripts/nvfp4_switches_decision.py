"""The old command, which sweeps and result pages name: it runs
``python -m readback.cli.decide nvfp4_switches`` with the same arguments."""

import sys

from readback.cli.decide import main

sys.exit(main(["nvfp4_switches", *sys.argv[1:]]))
