"""Near-duplicate detection: precision and recall on a corpus with planted near-copies (edits,
insertions, reordered paragraphs, and heavier edits that must not count) against answers computed
here independently (Python sets of word n-gram tuples), and throughput against ``datasketch``'s
MinHash + MinHashLSH on the same documents, both in memory."""

from __future__ import annotations

import re
import time
from collections import Counter

import numpy as np

from bench.common import Metric

THRESHOLD = 0.8
NGRAM = 5
_WORD = re.compile(r"\w+")


def vocabulary(texts: list[str], size: int = 20_000) -> list[str]:
    """The ``size`` most frequent words of ``texts``, most frequent first."""
    counts = Counter(w for t in texts for w in _WORD.findall(t.lower()))
    return [w for w, _ in counts.most_common(size)]


def planted_corpus(
    vocab: list[str], originals: int = 150, seed: int = 0, paragraphs: int = 5, words: int = 70
) -> tuple[list[str], list[int]]:
    """Documents of random words (Zipf over ``vocab``) with 0-3 planted copies each: a few words
    replaced, a paragraph inserted, the paragraphs reordered, or (not a near copy) many words
    replaced. Returns the documents in a shuffled order and each one's family (its original's number)."""
    rng = np.random.default_rng(seed)
    weights = 1.0 / np.arange(1, len(vocab) + 1)
    weights /= weights.sum()

    def paragraph(n: int) -> list[str]:
        return [vocab[i] for i in rng.choice(len(vocab), size=n, p=weights)]

    def replace(paras: list[list[str]], share: float) -> list[list[str]]:
        out = [list(p) for p in paras]
        for p in out:
            for i in np.flatnonzero(rng.random(len(p)) < share):
                p[i] = vocab[rng.integers(len(vocab))]
        return out

    docs: list[tuple[list[list[str]], int]] = []
    for family in range(originals):
        base = [paragraph(words) for _ in range(paragraphs)]
        docs.append((base, family))
        for _ in range(int(rng.integers(0, 4))):
            kind = rng.integers(4)
            if kind == 0:
                copy = replace(base, float(rng.uniform(0.003, 0.03)))
            elif kind == 1:
                copy = [list(p) for p in base]
                copy.insert(int(rng.integers(len(copy) + 1)), paragraph(int(rng.integers(10, 40))))
            elif kind == 2:
                copy = [base[i] for i in rng.permutation(len(base))]
            else:
                copy = replace(base, float(rng.uniform(0.06, 0.15)))
            docs.append((copy, family))
    order = rng.permutation(len(docs))
    return ["\n\n".join(" ".join(p) for p in docs[i][0]) for i in order], [docs[i][1] for i in order]


def _shingle_set(text: str, n: int) -> set[tuple[str, ...]]:
    w = _WORD.findall(text.lower())
    n = min(n, len(w))
    return {tuple(w[i : i + n]) for i in range(len(w) - n + 1)} if w else set()


def expected_duplicates(texts: list[str], families: list[int], threshold: float = THRESHOLD) -> set[int]:
    """The documents a near-dedup at ``threshold`` must mark: in each family, the connected
    components of the pairs of Jaccard >= threshold, every member but the first of each."""
    sets = [_shingle_set(t, NGRAM) for t in texts]
    members: dict[int, list[int]] = {}
    for i, f in enumerate(families):
        members.setdefault(f, []).append(i)
    parent = list(range(len(texts)))

    def find(x: int) -> int:
        while parent[x] != x:
            x = parent[x]
        return x

    for group in members.values():
        for a_i, a in enumerate(group):
            for b in group[a_i + 1 :]:
                inter = len(sets[a] & sets[b])
                if inter and inter / (len(sets[a]) + len(sets[b]) - inter) >= threshold:
                    ra, rb = find(a), find(b)
                    parent[max(ra, rb)] = min(ra, rb)
    return {i for i in range(len(texts)) if find(i) != i}


def precision_recall(marked: set[int], expected: set[int]) -> tuple[float, float]:
    hit = len(marked & expected)
    return (hit / len(marked) if marked else 1.0), (hit / len(expected) if expected else 1.0)


def _datasketch(texts: list[str]) -> set[int]:
    from datasketch import MinHash, MinHashLSH

    lsh = MinHashLSH(threshold=THRESHOLD, num_perm=128)
    sigs = []
    for i, text in enumerate(texts):
        w = _WORD.findall(text.lower())
        m = MinHash(num_perm=128)
        m.update_batch([" ".join(w[j : j + NGRAM]).encode() for j in range(max(len(w) - NGRAM + 1, 1))])
        lsh.insert(i, m)
        sigs.append(m)
    return {i for i, m in enumerate(sigs) if any(j < i for j in lsh.query(m))}


def neardup(texts: list[str]) -> list[Metric]:
    from dsgpt2.curation.minhash import LshParams, cluster_texts

    docs, families = planted_corpus(vocabulary(texts), originals=600)
    expected = expected_duplicates(docs, families)
    params = LshParams(threshold=THRESHOLD, ngram=NGRAM)
    times: dict[str, list[float]] = {"ours": [], "datasketch": []}
    for _ in range(3):  # alternately, so that machine noise hits both alike
        start = time.perf_counter()
        marked = set(cluster_texts(docs, params))
        times["ours"].append(time.perf_counter() - start)
        start = time.perf_counter()
        theirs_pr = precision_recall(_datasketch(docs), expected)
        times["datasketch"].append(time.perf_counter() - start)
    precision, recall = precision_recall(marked, expected)
    ours, theirs = (len(docs) / float(np.median(times[k])) for k in ("ours", "datasketch"))
    how = (
        "ours: shingles, signatures, bands, buckets and confirmation on the texts; datasketch: MinHash, "
        "LSH insert and query, its precision/recall here {:.3f}/{:.3f}".format(*theirs_pr)
    )
    note = f"{len(docs)} documents, {len(expected)} planted near-copies at Jaccard >= {THRESHOLD}"
    return [
        Metric("neardup precision", precision, 1.0, "share", ">= 0.95", precision >= 0.95, note),
        Metric("neardup recall", recall, 1.0, "share", ">= 0.9", recall >= 0.9, note),
        Metric("neardup docs/s vs datasketch", ours, theirs, "docs/s", ">= 1x", ours >= theirs, how),
    ]
