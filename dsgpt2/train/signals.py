"""How a run is asked to stop: SIGTERM (a scheduler, ``docker stop``) or Ctrl-C finishes the current
step, saves a checkpoint and exits; a second Ctrl-C stops at once.

Under the ``deepspeed`` launcher a Ctrl-C reaches each rank twice: the terminal's SIGINT and the
SIGTERM the launcher sends its ranks when it gets the SIGINT itself, in either order on a loaded
machine. A SIGINT that follows a SIGTERM within ``PAIRED`` seconds is that pair: the stop is named
SIGINT (a SIGTERM's announcement waits that long for it) and goes on; later, it stops at once.
The ranks decide together (:meth:`StopRequest.agreed`): one that got no signal, or got it a moment
after the others looked, stops at the same step as they do; its own signal, landing after it took the
others' stop, is that same stop (announced, not a second Ctrl-C).

A signal during the last step, or after it (while the final checkpoint is written), changes nothing but
its announcement, worded by when the signal came, not by when the announcement is made; when the run
returns, the handlers it replaced are back, and no announcement is left due.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from typing import Any

from dsgpt2.collective import all_sum

log = logging.getLogger("dsgpt2.train.trainer")

_NAMES = ("SIGINT", "SIGTERM")
PAIRED = 1.0


class StopRequest:
    """Which signal asked the run to stop (``name``: None until one did)."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._pid = os.getpid()
        self._previous: dict[int, Any] = {}
        self._reset()

    def _reset(self) -> None:
        self.name: str | None = None
        self._adopted = False  # the name came from the other ranks, not from a signal to this one
        self._at = 0.0
        self._told = False
        self._timer: threading.Timer | None = None
        self._last = False  # the last step has started: a signal now stops nothing
        self._over = False  # the training loop has ended
        self._late: str | None = None  # "came with"/"after" the last step, where the signal came then
        self.stopped_by: str | None = None  # the stop the ranks agreed on, which ended the training

    def install(self) -> None:
        """Handle SIGTERM and SIGINT in this process until :meth:`restore`, a stop not yet asked."""
        self._reset()
        self._pid = os.getpid()
        for signum in (signal.SIGTERM, signal.SIGINT):
            previous = signal.signal(signum, self._stop)
            # None: a handler not set from Python; the default stands for it.
            self._previous.setdefault(signum, signal.SIG_DFL if previous is None else previous)

    def last_step(self) -> None:
        """The run's last step (by --train_iters) starts: a signal from now on stops nothing."""
        self._last = True

    def over(self) -> None:
        """The training loop has ended on --train_iters or an early stop (the final checkpoint is next):
        a signal of the last step, or one from now on, is said to change nothing."""
        self._over = True
        if self.name is None or self.stopped_by is not None:  # taken, it was said (or the others' was)
            return
        with self._lock:
            told = self._told
        if told and self._late is None:  # announced as a stop: it came with the last step
            log.warning("%s came with the last step: the run ends as it would have", self.name)
        elif not told:
            self._announce()

    def restore(self) -> None:
        """The handlers :meth:`install` replaced, back; no announcement left due."""
        with self._lock:
            self._told = True
        if self._timer is not None:
            self._timer.cancel()
        if os.getpid() == self._pid:
            for signum, handler in self._previous.items():
                signal.signal(signum, handler)
        self._previous.clear()

    def _stop(self, signum: int, frame: Any) -> None:
        if os.getpid() != self._pid:
            # A process forked from the rank (a DataLoader worker before it ignores these signals; the
            # launcher signals a rank's whole tree) inherits this handler: its rank stops it, not the
            # signal, and it must not announce a stop of its own.
            return
        name = signal.Signals(signum).name
        now = time.monotonic()
        if self.name is None or self._adopted:
            self._adopted = False
            self.name, self._at = name, now
            self._late = "after" if self._over else "came with" if self._last else None
            if signum == signal.SIGINT:
                self._announce()
            else:
                self._timer = threading.Timer(PAIRED, self._announce)
                self._timer.daemon = True
                self._timer.start()
        elif signum == signal.SIGINT and self.name == "SIGTERM" and now - self._at < PAIRED:
            # The launcher's SIGTERM came before the terminal's SIGINT of the same Ctrl-C.
            with self._lock:
                if not self._told:
                    self.name = "SIGINT"
            self._announce()
        elif signum == signal.SIGINT:
            raise KeyboardInterrupt
        else:
            # The launcher passing on a signal this rank already got: the stop is under way.
            log.debug("%s after %s: already stopping", name, self.name)

    def _announce(self) -> None:
        with self._lock:
            if self._told:
                return
            self._told = True
        if self._timer is not None:
            self._timer.cancel()
        late = self._late or ("after" if self._over else None)
        if late is not None and self.stopped_by is None:
            log.warning("%s %s the last step: the run ends as it would have, its final checkpoint written",
                        self.name, late)  # fmt: skip
        else:
            log.warning("%s: saving a checkpoint after the current step, then exiting", self.name)

    def agreed(self, device: Any) -> bool:
        """Whether any rank was asked to stop; every rank calls it at the same step (a collective). A rank
        that got no signal takes the others' name for the stop."""
        # Decided by the sum alone: a signal that lands while the sum is taken is counted at the next
        # step, on every rank at once; read here, it would stop this rank a step before the others.
        seen = all_sum([int(self.name == n) for n in _NAMES], device)
        if not any(seen):
            return False
        if self.name is not None and not self._told:
            # A SIGTERM's announcement, due before the save: the rest of its wait for a paired SIGINT.
            time.sleep(max(0.0, self._at + PAIRED - time.monotonic()))
            self._announce()
        if self.name is None:
            self.name = next(n for n, count in zip(_NAMES, seen, strict=True) if count)
            self._adopted = True
            log.info("stopping with the other ranks (%s): saving a checkpoint", self.name)
        self.stopped_by = self.name
        return True
