"""``python -m readback.audit``: see ``readback.audit``."""

import sys

from readback.audit import main

sys.exit(main())
