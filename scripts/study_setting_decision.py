"""The old command, which sweeps and result pages name: it runs
``python -m readback.cli.decide study_setting`` with the same arguments."""

import sys

from readback.cli.decide import main

sys.exit(main(["study_setting", *sys.argv[1:]]))
