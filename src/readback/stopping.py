"""Ctrl-C in a long program: one line on stderr and exit 130 (what ``SIGINT`` would give), never
a traceback. What the program finished before stays as it was written: each program writes its
files whole (``readback.train.checkpoint.atomic.atomic_write_text`` and the like), so an interrupted
one leaves the finished files and no torn one.

    @ends_on_ctrl_c("python -m readback.cli.analysis")
    def main(argv=None): ...
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator

EXIT_CODE = 130  # 128 + SIGINT, as a shell reports a process Ctrl-C ended


@contextlib.contextmanager
def ends_on_ctrl_c(program: str, kept: str = "the files it finished are kept") -> Iterator[None]:
    """Turn a ``KeyboardInterrupt`` inside into ``program: stopped by Ctrl-C; <kept>`` and exit 130.
    Also a decorator (``contextlib`` context managers are)."""
    try:
        yield
    except KeyboardInterrupt:
        print(f"{program}: stopped by Ctrl-C; {kept}", file=sys.stderr)
        raise SystemExit(EXIT_CODE) from None
