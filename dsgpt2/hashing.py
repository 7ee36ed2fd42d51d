"""SplitMix64's finaliser on numpy arrays: the one 64-bit mixer every seeded draw and hash is made from.

A document's split and sample (:mod:`dsgpt2.corpus.draws`), the epoch's permutation of documents
(:mod:`dsgpt2.data.order`) and MinHash shingles and bands (:mod:`dsgpt2.curation.minhash`) all pass
their keys through it. Stored marks and resumed runs depend on its exact bits: the constants are
SplitMix64's (Steele, Lea and Flood, 2014), and they never change.
"""

from __future__ import annotations

import numpy as np

# Weyl increment of SplitMix64's state: 2**64 / the golden ratio, odd. Also a multiplier that spreads
# consecutive integers over the 64 bits (draws.uniform, minhash's polynomial over word hashes).
GOLDEN_GAMMA = np.uint64(0x9E3779B97F4A7C15)
# The finaliser's two multipliers (Stafford's "Mix13" variant, which SplitMix64 uses).
MIX_MULTIPLIER_1 = np.uint64(0xBF58476D1CE4E5B9)
MIX_MULTIPLIER_2 = np.uint64(0x94D049BB133111EB)


def splitmix64(x: np.ndarray) -> np.ndarray:
    """SplitMix64's finaliser of each uint64 of ``x``: a bijection in which every output bit depends on
    every input bit. Products wrap at 2**64, as the finaliser means them to."""
    with np.errstate(over="ignore"):  # numpy warns of a wrapping product of scalars, not of arrays
        x = (x ^ (x >> np.uint64(30))) * MIX_MULTIPLIER_1
        x = (x ^ (x >> np.uint64(27))) * MIX_MULTIPLIER_2
        return x ^ (x >> np.uint64(31))
