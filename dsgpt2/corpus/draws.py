"""Deterministic per-document selection: which documents a sample or a split holds.

Each document's fate is a pure function of (seed, salt, global index): a
SplitMix64 hash mapped to [0, 1). Deciding one document never needs a list
of all indices, any process computes the same answer for any index, and
ranges are decided with vectorised numpy, so 100M documents cost nothing
up front.
"""

from __future__ import annotations

import numpy as np

from dsgpt2.hashing import GOLDEN_GAMMA, splitmix64

_SALTS = {"sample": 0x5A17, "split": 0x5B11, "shuffle": 0x5F0F, "blocks": 0xB10C}


def uniform(indices: np.ndarray, seed: int, salt: str = "sample") -> np.ndarray:
    """A float in [0, 1) for every index: the same for the same (index, seed, salt)."""
    x = np.asarray(indices, dtype=np.uint64)
    key = np.uint64((seed * 0x100000001B3 + _SALTS[salt]) & 0xFFFFFFFFFFFFFFFF)
    with np.errstate(over="ignore"):
        z = splitmix64(x * GOLDEN_GAMMA + key)
    # The top 53 bits make an exactly representable double in [0, 1).
    return (z >> np.uint64(11)).astype(np.float64) / float(1 << 53)


def select(start: int, stop: int, fraction: float, seed: int, salt: str = "sample") -> np.ndarray:
    """The indices in ``[start, stop)`` that a ``fraction`` sample with ``seed`` holds (sorted)."""
    idx = np.arange(start, stop, dtype=np.int64)
    if fraction >= 1.0:
        return idx
    return idx[uniform(idx, seed, salt) < fraction]
