"""How a run is asked to stop: SIGTERM (a scheduler, ``docker stop``) or Ctrl-C finishes the current
step, saves a checkpoint and exits; a second Ctrl-C stops at once."""

from __future__ import annotations

import logging
import signal
from typing import Any

log = logging.getLogger("dsgpt2.train.trainer")


class StopRequest:
    """Which signal asked the run to stop (``name``: None until one did)."""

    def __init__(self) -> None:
        self.name: str | None = None

    def install(self) -> None:
        """Handle SIGTERM and SIGINT in this process from now on."""
        signal.signal(signal.SIGTERM, self._stop)
        signal.signal(signal.SIGINT, self._stop)

    def _stop(self, signum: int, frame: Any) -> None:
        name = signal.Signals(signum).name
        if self.name and signum == signal.SIGINT:
            raise KeyboardInterrupt
        log.warning("%s: saving a checkpoint after the current step, then exiting", name)
        self.name = name
