"""Which documents train and which validate, and how the corpus is cut into chunks. Pure functions.

A document belongs to the training split when its split draw (seed, collection, idx) is below
``tr_ratio``; the rest validate, and never train. The draw depends on the document's own idx, not
on the size of any collection: documents that arrive later split the same way whenever they are
read. Chunks of ``chunk_docs`` consecutive documents are the unit every reader fetches (see
:mod:`dsgpt2.data.table`).
"""

from __future__ import annotations

import hashlib

import numpy as np

from dsgpt2.corpus.draws import uniform

# The defaults of a run's split and order: training's flags and evaluation of a model without a
# run record both start from them.
DEFAULT_SEED = 1234
DEFAULT_TR_RATIO = 0.99
DEFAULT_CHUNK_DOCS = 1000


def split_mask(indices: np.ndarray, tr_ratio: float, seed: int, collection: str = "") -> np.ndarray:
    """True for the idx (of ``collection``) in the training split; the others validate."""
    if tr_ratio >= 1.0:
        return np.ones(len(indices), dtype=bool)
    return uniform(indices, seed + _name_key(collection), salt="split") < tr_ratio


def _name_key(name: str) -> int:
    # Each collection draws its own split: idx 5 of one says nothing about idx 5 of another.
    return int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest(), "little") if name else 0
