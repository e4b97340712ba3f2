"""Progress of a long loop: a live tqdm bar on a terminal, plain lines in a log file.

Written to a file (a Slurm job's ``.out``, ``make train > log 2>&1``), a tqdm bar is a stream of
carriage-return frames, megabytes of them in a long run. :func:`progress` gives the bar only when
its stream is a terminal; otherwise it writes one plain line each time another ``fraction`` of
the loop is done (5 % by default) or ``min_interval_s`` seconds have passed since the last line,
and at the end: ``<desc>: 250/1000 steps (25%), loss=4.5210, tok_s=12345, elapsed 0:01:02, ETA 0:03:06``.
"""

from __future__ import annotations

import contextlib
import math
import sys
import time
from collections.abc import Iterator
from typing import IO, Any, Protocol

_SHOWN = [True]  # the innermost ``shown(...)``


class Progress(Protocol):
    def update(self, n: int = 1) -> None: ...
    def set_postfix(self, **values: Any) -> None: ...
    def close(self) -> None: ...


class Off:
    """No progress at all."""

    def update(self, n: int = 1) -> None:
        pass

    def set_postfix(self, **values: Any) -> None:
        pass

    def close(self) -> None:
        pass


def _clock(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "?"
    s = round(seconds)
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


class Lines:
    """Plain progress lines, one every ``fraction`` of ``total`` or ``min_interval_s`` seconds."""

    def __init__(
        self,
        total: int,
        initial: int,
        desc: str,
        unit: str,
        stream: IO[str],
        fraction: float,
        min_interval_s: float,
    ) -> None:
        self.total, self.n, self.start_n, self.desc, self.unit = total, initial, initial, desc, unit
        self.stream, self.min_interval_s = stream, min_interval_s
        self.every = max(1, math.ceil(max(total - initial, 1) * fraction))
        self.postfix: dict[str, Any] = {}
        self.t0 = self.last_t = time.monotonic()
        self.last_n = initial
        self.closed = False

    def update(self, n: int = 1) -> None:
        self.n += n
        now = time.monotonic()
        if self.n - self.last_n >= self.every or now - self.last_t >= self.min_interval_s or self.n >= self.total:
            self._write(now)

    def set_postfix(self, **values: Any) -> None:
        self.postfix = values

    def close(self) -> None:
        if not self.closed and self.n != self.last_n:
            self._write(time.monotonic())
        self.closed = True

    def line(self, now: float) -> str:
        elapsed = now - self.t0
        done = self.n - self.start_n
        rate = done / elapsed if elapsed > 0 else math.nan
        eta = (self.total - self.n) / rate if done and rate > 0 else math.nan
        share = f" ({100 * self.n / self.total:.0f}%)" if self.total else ""
        plural = self.unit + ("es" if self.unit.endswith(("ch", "sh", "s", "x")) else "s")  # batches, steps
        parts = [f"{self.desc}: {self.n}/{self.total} {plural}{share}"]
        parts += [f"{k}={v}" for k, v in self.postfix.items()]
        parts += [f"elapsed {_clock(elapsed)}", f"ETA {_clock(eta)}"]
        return ", ".join(parts)

    def _write(self, now: float) -> None:
        self.stream.write(self.line(now) + "\n")
        self.stream.flush()
        self.last_n, self.last_t = self.n, now


class Bar:
    """tqdm's live bar; ``set_postfix`` shows at the bar's next refresh."""

    def __init__(self, total: int, initial: int, desc: str, unit: str, stream: IO[str]) -> None:
        from tqdm import tqdm  # imported here: a run without progress needs no tqdm

        self.bar = tqdm(total=total, initial=initial, desc=desc, unit=unit, file=stream, dynamic_ncols=True)

    def update(self, n: int = 1) -> None:
        self.bar.update(n)

    def set_postfix(self, **values: Any) -> None:
        self.bar.set_postfix(values, refresh=False)

    def close(self) -> None:
        self.bar.close()


@contextlib.contextmanager
def shown(on: bool) -> Iterator[None]:
    """Within it, :func:`progress` shows nothing unless ``on`` (``trainer.progress=false`` hides
    the progress of the data a run builds, too)."""
    _SHOWN.append(on)
    try:
        yield
    finally:
        _SHOWN.pop()


def progress(
    total: int,
    initial: int = 0,
    desc: str = "",
    *,
    unit: str = "step",
    enabled: bool = True,
    stream: IO[str] | None = None,
    fraction: float = 0.05,
    min_interval_s: float = 300.0,
) -> Progress:
    """Progress of a loop of ``total`` units, ``initial`` of them done: nothing unless
    ``enabled`` (and :func:`shown`); a live bar when ``stream`` (default ``sys.stderr``) is a terminal; else plain
    lines (:class:`Lines`)."""
    if not (enabled and _SHOWN[-1]):
        return Off()
    stream = sys.stderr if stream is None else stream
    isatty = getattr(stream, "isatty", None)
    if callable(isatty) and isatty():
        return Bar(total, initial, desc, unit, stream)
    return Lines(total, initial, desc, unit, stream, fraction, min_interval_s)


__all__ = ["Progress", "progress", "shown"]
