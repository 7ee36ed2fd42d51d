"""Settings read from environment variables, checked as flags are: one line naming the variable."""

from __future__ import annotations

import math
import os

from dsgpt2.errors import ConfigError


def env_seconds(name: str, default: float, zero: str) -> float:
    """The number of seconds the variable ``name`` holds, ``default`` where it is unset or empty.
    ``zero``: what 0 means, for the message.

    Raises:
        ConfigError: the variable is not a finite number >= 0, naming it and the fix.
    """
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        seconds = float(raw)
    except ValueError:
        seconds = -1.0
    if not math.isfinite(seconds) or seconds < 0:
        raise ConfigError(
            f"{name}={raw!r}: not a number of seconds; set it to a number >= 0 (0: {zero}) or unset it "
            f"for the default {default:g}"
        )
    return seconds
