"""Python's cyclic garbage collector around a command's start-up.

A trainer imports torch, DeepSpeed and transformers and builds its model and engine: a few million
objects that live as long as the process. Each full pass of the collector walks every one of them again;
a rank of the tiny preset spent 1.3 of its 9 CPU-seconds in those passes (8 of them, 6 while importing).
During :func:`start_up` there is none; after it, one pass frees the start-up's garbage and what survives
is frozen (``gc.freeze``: left out of every later pass), so the collections of the training loop walk
only what the loop itself made.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


@contextlib.contextmanager
def start_up() -> Iterator[None]:
    """No cyclic collection in the block; after it (raised or not), one full pass, the survivors frozen,
    and the collector as it was before the block."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        gc.collect()
        gc.freeze()
        if enabled:
            gc.enable()
