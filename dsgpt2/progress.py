"""Progress that reads well wherever stderr goes: a tqdm bar on a terminal, a log line every
``DSGPT2_PROGRESS_SECONDS`` seconds (default 30) when stderr is a file or a pipe (a scheduler, ``nohup``,
CI, ``docker compose``), nothing with ``--no_progress``.

A bar redrawn with carriage returns is unreadable in a file and tqdm hides it there altogether, so
without this a long ingest or evaluation writes nothing until it ends.
"""

from __future__ import annotations

import logging
import sys
import time
from typing import Any, Protocol

from dsgpt2.settings.environment import env_seconds

ENV_SECONDS = "DSGPT2_PROGRESS_SECONDS"
DEFAULT_SECONDS = 30.0

log = logging.getLogger("dsgpt2.progress")


class Progress(Protocol):
    """What every caller uses of a bar: tqdm's own names."""

    def update(self, n: int = 1) -> Any: ...

    def set_postfix(self, ordered_dict: dict[str, Any] | None = None, refresh: bool = True,
                    **kwargs: Any) -> None: ...  # fmt: skip

    def close(self) -> None: ...


def on_terminal(stream: Any = None) -> bool:
    """Whether ``stream`` (stderr by default) is a terminal; False for a stream without ``isatty``."""
    stream = sys.stderr if stream is None else stream
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # no such method, or closed
        return False


def interval_seconds() -> float:
    """Seconds between two progress lines: ``DSGPT2_PROGRESS_SECONDS``, else 30.

    Raises:
        ConfigError: the variable is not a number of seconds >= 0.
    """
    return env_seconds(ENV_SECONDS, DEFAULT_SECONDS, "a line at every update")


def progress(
    desc: str, unit: str = "it", total: int | None = None, initial: int = 0, enabled: bool = True
) -> Progress:
    """A progress display for ``desc``: a tqdm bar on a terminal, :class:`LogLines` otherwise, a
    silent tqdm when not ``enabled``.

    Args:
        desc: what is progressing, the start of each line.
        unit: what is counted (``doc``, ``batch``).
        total: the count at the end, when known (percent and time left).
        initial: the count already done (a resumed pass); the rate counts only what follows.
        enabled: False for ``--no_progress``: nothing at all.

    Raises:
        ConfigError: a bad ``DSGPT2_PROGRESS_SECONDS`` (checked on a terminal too, so that a command
            that works there works the same in a log).
    """
    from tqdm import tqdm

    if not enabled:
        return tqdm(disable=True)
    every = interval_seconds()
    if on_terminal():
        return tqdm(desc=desc, unit=unit, total=total, initial=initial)
    return LogLines(desc, unit, total=total, initial=initial, every=every)


class LogLines:
    """A log line (INFO, logger ``dsgpt2.progress``) at the first update ``every`` seconds after the last
    line: the count, the total and percent when known, the rate, the time left, the postfix; a last
    line at :meth:`close` when lines were written and the count moved since."""

    def __init__(
        self,
        desc: str,
        unit: str,
        *,
        total: int | None,
        initial: int,
        every: float,
        clock: Any = time.monotonic,
    ) -> None:
        self.desc, self.unit, self.total, self.every = desc, unit, total, every
        self.n = self.initial = initial
        self.postfix: dict[str, Any] = {}
        self._clock = clock
        self.started = self._last = clock()
        self._shown: int | None = None  # the count of the last line (None: no line yet)
        self.closed = False

    def update(self, n: int = 1) -> None:
        if self.closed:
            return
        self.n += n
        if self._clock() - self._last >= self.every:
            self._line()

    def set_postfix(self, ordered_dict: dict[str, Any] | None = None, refresh: bool = True,
                    **kwargs: Any) -> None:  # fmt: skip
        self.postfix = {**(ordered_dict or {}), **kwargs}

    def close(self) -> None:
        if not self.closed and self._shown is not None and self._shown != self.n:
            self._line()
        self.closed = True

    def __enter__(self) -> LogLines:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _line(self) -> None:
        now = self._clock()
        rate = (self.n - self.initial) / max(now - self.started, 1e-9)
        parts = [f"{self.n:,} {self.unit}"]
        if self.total:
            parts = [f"{self.n:,}/{self.total:,} {self.unit} ({100 * self.n / self.total:.1f}%)"]
        parts.append(f"{rate:,.1f} {self.unit}/s" if rate < 100 else f"{rate:,.0f} {self.unit}/s")
        if self.total and rate > 0 and self.n < self.total:
            parts.append(f"{_duration((self.total - self.n) / rate)} left")
        parts += [f"{k}={v}" for k, v in self.postfix.items()]
        log.info("%s: %s", self.desc, ", ".join(parts))
        self._last, self._shown = now, self.n


def _duration(seconds: float) -> str:
    """``42s``, ``3m05s``, ``2h07m``."""
    s = round(seconds)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"
