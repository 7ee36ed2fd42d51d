"""MinHash signatures and LSH bands of a text, and the clustering of candidate near duplicates:
pure functions, no database.

A text's shingles are its word n-grams (lower-cased ``\\w+`` words; a text shorter than n words is
one shingle), each hashed to 64 bits. The Jaccard similarity of two texts is that of their shingle
sets. A signature is, for each of ``num_perm`` hash functions h(x) = (a·x + b) >> 32 (multiply-shift,
strongly universal over 32-bit keys, a and b 64-bit), the minimum over the text's shingles: two texts
agree on one entry with probability equal to their Jaccard similarity. The signature is cut into
``bands`` bands of ``rows`` entries, each band hashed to one signed 64-bit value: texts sharing a band
value are candidates, which happens with probability 1 - (1 - J**rows)**bands.
"""

from __future__ import annotations

import re
import zlib
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from dsgpt2.errors import ConfigError
from dsgpt2.hashing import GOLDEN_GAMMA, splitmix64
from dsgpt2.settings.options import POSITIVE_INT, RATIO, Checked, Range, option

VERSION = 1
_WORD = re.compile(r"\w+")
_MASK32 = np.uint64(0xFFFFFFFF)
_CHUNK = 4096  # shingles per matrix product: bounds memory on very long texts
_ALL_PAIRS = 256

# The permutations a signature may have: at least 2, as it always had.
# More than a few hundred buys no accuracy (the standard error falls as 1/sqrt(num_perm)) and costs
# memory and time per document.
NUM_PERM = Range(int, 2, 8192)


@dataclass(frozen=True)
class LshParams(Checked):
    """How texts are shingled, signed and banded; the ``key`` stored beside a document's bands."""

    threshold: float = option(0.8, "the Jaccard similarity from which two texts are near", check=RATIO)
    ngram: int = option(5, "words per shingle", check=POSITIVE_INT)
    num_perm: int = option(128, "MinHash permutations", check=NUM_PERM)
    bands: int = 0
    rows: int = 0
    seed: int = 1

    def check(self) -> None:
        if not self.bands:
            bands, rows = optimal_bands(self.threshold, self.num_perm)
            object.__setattr__(self, "bands", bands)
            object.__setattr__(self, "rows", rows)
        if self.bands * self.rows > self.num_perm:
            raise ConfigError(
                f"--num_perm {self.num_perm}: fewer than bands x rows ({self.bands} x {self.rows}); give more"
            )

    @property
    def key(self) -> str:
        """The signature's identity: the bands of texts signed under another key are not comparable.
        The threshold is not part of it; the bands it chose are."""
        return f"v{VERSION}:w{self.ngram}:p{self.num_perm}:b{self.bands}r{self.rows}:s{self.seed}"


def candidate_probability(j: float | np.ndarray, bands: int, rows: int) -> float | np.ndarray:
    """Probability that two texts of Jaccard similarity ``j`` share at least one band."""
    return 1.0 - (1.0 - np.power(j, rows)) ** bands


def optimal_bands(threshold: float, num_perm: int, recall: float = 0.98) -> tuple[int, int]:
    """``(bands, rows)`` with bands x rows <= num_perm that make a pair at ``threshold`` a candidate
    with probability >= ``recall`` and, among those, admit the fewest false candidates below it (the
    smallest area under the candidate curve there). Candidates are confirmed on their texts: a false
    candidate costs a comparison, a missed pair costs recall."""
    below = np.linspace(0.0, threshold, 201)
    options = []
    for rows in range(1, num_perm + 1):
        bands = num_perm // rows
        at = float(candidate_probability(threshold, bands, rows))
        false = _area(candidate_probability(below, bands, rows), below)
        options.append((at < recall, false if at >= recall else -at, bands, rows))
    _, _, bands, rows = min(options)
    return bands, rows


def _area(y: np.ndarray, x: np.ndarray) -> float:
    return float(((y[1:] + y[:-1]) * np.diff(x)).sum() / 2)


def permutations(num_perm: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """The multiply-shift functions' ``a`` (odd) and ``b``: ``(num_perm, 1)`` uint64 arrays."""
    rng = np.random.default_rng(seed)
    a = rng.integers(0, 2**64, size=(num_perm, 1), dtype=np.uint64) | np.uint64(1)
    b = rng.integers(0, 2**64, size=(num_perm, 1), dtype=np.uint64)
    return a, b


def shingles(text: str, ngram: int) -> np.ndarray:
    """The sorted distinct 64-bit hashes of ``text``'s word n-grams (empty for a text without words)."""
    words = _WORD.findall(text.lower())
    if not words:
        return np.empty(0, dtype=np.uint64)
    w = np.fromiter(
        (zlib.crc32(x.encode("utf-8", "surrogatepass")) for x in words), dtype=np.uint64, count=len(words)
    )
    n = min(ngram, len(w))
    m = len(w) - n + 1
    h = np.zeros(m, dtype=np.uint64)
    for k in range(n):  # a polynomial over the n word hashes, wrapping at 2**64
        h = h * GOLDEN_GAMMA + w[k : k + m]
    return np.unique(splitmix64(h))


def signature(sh: np.ndarray, perms: tuple[np.ndarray, np.ndarray]) -> np.ndarray:
    """The MinHash signature (uint64 values below 2**32) of a shingle set; all 2**32 - 1 when empty."""
    a, b = perms
    out = np.full(a.shape[0], _MASK32, dtype=np.uint64)
    keys = (sh ^ (sh >> np.uint64(32))) & _MASK32  # 32-bit keys, as multiply-shift takes
    for start in range(0, len(keys), _CHUNK):
        t = np.multiply(a, keys[start : start + _CHUNK])  # (num_perm, shingles), wrapping at 2**64
        t += b
        np.minimum(out, t.min(axis=1) >> np.uint64(32), out=out)  # the shift is monotone: taken once
    return out


def band_values(sig: np.ndarray, bands: int, rows: int) -> list[int]:
    """One signed 64-bit value per band (each band's index mixed in: equal rows in two different bands
    are different values), as BSON stores them."""
    table = sig[: bands * rows].reshape(bands, rows)
    h = splitmix64(np.arange(1, bands + 1, dtype=np.uint64))
    for k in range(rows):
        h = splitmix64(h ^ table[:, k])
    return h.view(np.int64).tolist()


class Signer:
    """Bands of texts under one :class:`LshParams`."""

    def __init__(self, params: LshParams) -> None:
        self.params = params
        self.perms = permutations(params.num_perm, params.seed)

    def bands(self, text: str) -> list[int]:
        """The text's band values; none for a text without words (it is nobody's near duplicate)."""
        sh = shingles(text, self.params.ngram)
        if not len(sh):
            return []
        return band_values(signature(sh, self.perms), self.params.bands, self.params.rows)


def jaccard(a: np.ndarray, b: np.ndarray) -> float:
    """Jaccard similarity of two sorted distinct shingle arrays (two empty texts: 0)."""
    if not len(a) or not len(b):
        return 0.0
    common = len(np.intersect1d(a, b, assume_unique=True))
    return common / (len(a) + len(b) - common)


def buckets(bands_of: Iterable[tuple[int, Sequence[int]]]) -> list[list[int]]:
    """The LSH buckets, in memory: for each band value held by more than one key, the sorted keys."""
    held: dict[int, list[int]] = {}
    for key, values in bands_of:
        for v in values:
            held.setdefault(v, []).append(key)
    return [sorted(keys) for keys in held.values() if len(keys) > 1]


class Clusters:
    """Union-find over document keys, fed bucket by bucket, joining only confirmed pairs.

    In a bucket of up to 256 keys, every pair not in one cluster already is compared, so the clusters
    are the connected components of the confirmed candidate pairs, whatever the order of the buckets;
    a bucket of n copies of one text costs n - 1 comparisons. In a larger bucket (a band value that
    boilerplate shares), each key is compared with one representative of each of the bucket's
    clusters so far. A pair found dissimilar is not compared again in another bucket.
    """

    def __init__(self, similar: Callable[[int, int], bool]) -> None:
        self.similar = similar
        self.parent: dict[int, int] = {}
        self.rejected: set[tuple[int, int]] = set()
        self.compared = 0
        self.confirmed = 0

    def find(self, x: int) -> int:
        root = x
        while self.parent.get(root, root) != root:
            root = self.parent[root]
        while x != root:  # path compression
            self.parent[x], x = root, self.parent.get(x, x)
        return root

    def union(self, x: int, y: int) -> None:
        rx, ry = self.find(x), self.find(y)
        if rx != ry:  # the smaller key stays root: a cluster's root is its first document
            self.parent[max(rx, ry)] = min(rx, ry)

    def add_bucket(self, keys: Sequence[int]) -> None:
        if len(keys) <= _ALL_PAIRS:
            for i, key in enumerate(keys):
                for other in keys[:i]:
                    self._join(other, key)
            return
        reps: list[int] = []
        for key in keys:
            joined = False
            for rep in reps:
                joined = self._join(rep, key) or joined
            if not joined:
                reps.append(key)

    def _join(self, x: int, y: int) -> bool:
        """Whether ``x`` and ``y`` are in one cluster, after comparing them if they were not."""
        if self.find(x) == self.find(y):
            return True
        pair = (x, y) if x < y else (y, x)
        if pair in self.rejected:
            return False
        self.compared += 1
        if self.similar(*pair):
            self.confirmed += 1
            self.union(x, y)
            return True
        self.rejected.add(pair)
        return False

    def duplicates(self) -> dict[int, int]:
        """Every clustered key but each cluster's first, mapped to that first key."""
        out = {}
        for key in self.parent:
            root = self.find(key)
            if root != key:
                out[key] = root
        return out


def cluster_texts(texts: Sequence[str], params: LshParams) -> dict[int, int]:
    """Near duplicates among ``texts``, in memory: every clustered index but each cluster's first,
    mapped to that first index (what ``dedup --near`` marks, without a database)."""
    signer = Signer(params)
    sets = [shingles(t, params.ngram) for t in texts]
    bands = [
        (i, band_values(signature(s, signer.perms), params.bands, params.rows) if len(s) else [])
        for i, s in enumerate(sets)
    ]
    clusters = Clusters(lambda a, b: jaccard(sets[a], sets[b]) >= params.threshold)
    for keys in buckets(bands):
        clusters.add_bucket(keys)
    return clusters.duplicates()
