"""Decontamination: precision and recall on documents of real prose with planted overlaps with an
evaluation set (13 words of an item's context and gold ending, in other case and punctuation) and hard
negatives that must not count (12 shared words, the 13 words reordered, 13 words running into a wrong
ending), and documents/s of ``dsgpt2 decontaminate``'s pass (read from and marked in the embedded
database) against datatrove's ``NGramsDecontFilter`` on the same documents, in memory.

The anchor's ratio is left out, and the note says why, where datatrove does not import (it is no
dependency of dsgpt2: ``make bench`` installs it beside the environment, ``BENCH_ANCHORS`` in the
Makefile; see :func:`_datatrove` for what it needs there)."""

from __future__ import annotations

import json
import re
import tempfile
import time
from pathlib import Path

import numpy as np

from bench.bench_neardup import precision_recall, vocabulary
from bench.common import Metric, database_uri

NGRAM = 13


def planted(
    texts: list[str], vocab: list[str], items: int = 300, seed: int = 0
) -> tuple[list[dict], list[str], set[int]]:
    """HellaSwag-layout items of random words (Zipf over ``vocab``), and the documents: ``texts`` with,
    for each item, one planted overlap and three hard negatives put in the middle of a text. Returns
    the items, the documents and the positions of the contaminated ones."""
    rng = np.random.default_rng(seed)
    vocab = [w for w in vocab if w.isalnum()]  # one word each after normalising ('exist_ok' is two)
    weights = 1.0 / np.arange(1, len(vocab) + 1)
    weights /= weights.sum()

    def words(n: int) -> list[str]:
        return [vocab[i] for i in rng.choice(len(vocab), size=n, p=weights)]

    evals = [{"ctx": " ".join(words(24)), "endings": [" ".join(words(12)) for _ in range(4)],
              "label": int(rng.integers(4))} for _ in range(items)]  # fmt: skip
    docs = [t for t in texts if len(t.split()) >= 40]
    originals = len(docs)  # the planted documents are copies of these, never of each other
    contaminated: set[int] = set()

    def put(span: list[str], avoid: set[tuple[str, ...]] | None = None) -> int:
        """``span`` put into a copy of an original; a hard negative (``avoid``: the item's n-grams) is
        put where the words around it do not happen to complete one (common words often would)."""
        while True:
            w = docs[int(rng.integers(originals))].split()
            cut = int(rng.integers(len(w)))
            text = [*w[:cut], *span, *w[cut:]]
            low = re.findall(r"[^\W_]+", " ".join(text).lower())
            if not avoid or not any(tuple(low[i : i + NGRAM]) in avoid for i in range(len(low) - NGRAM + 1)):
                docs.append(" ".join(text))
                return len(docs) - 1

    for item in evals:
        gold = f"{item['ctx']} {item['endings'][item['label']]}".split()
        start = int(rng.integers(12, 24))  # across the context's end into the ending
        shared = gold[start : start + NGRAM]
        grams = {tuple(gold[i : i + NGRAM]) for i in range(len(gold) - NGRAM + 1)}
        contaminated.add(put([w.upper() + ("," if k % 3 == 0 else "") for k, w in enumerate(shared)]))
        put(gold[start : start + NGRAM - 1], grams)
        put(list(reversed(shared)), grams)
        wrong = item["endings"][(item["label"] + 1) % 4].split()
        put(item["ctx"].split()[-(NGRAM - len(wrong)) :] + wrong, grams)
    return evals, docs, contaminated


def _ours(docs: list[str], items_file: Path) -> tuple[set[int], float]:
    from dsgpt2.curation.decontaminate import CONTAMINATED, Decontamination, load_sets
    from dsgpt2.curation.passes import run_pass
    from dsgpt2.db.client import Connection
    from dsgpt2.db.config import config_from_dict

    where = {"MONGO_CONNECTION_STRING": database_uri(), "MONGO_CONNECTION_DB": "bench_decont"}
    config = config_from_dict({**where, "COLLECTIONS": ["d"]}, env={})
    conn = Connection(config)
    conn.db["d"].drop()
    conn.db["d"].create_index("idx", unique=True)
    conn.db["d"].insert_many([{"idx": i, "filt_text": t} for i, t in enumerate(docs)])
    start = time.perf_counter()
    sets = load_sets([items_file], [None], NGRAM)
    run_pass(conn, ["d"], Decontamination(sets, NGRAM), batch_size=1000)
    seconds = time.perf_counter() - start
    marked = {d["idx"] for d in conn.db["d"].find({CONTAMINATED: {"$exists": True}}, {"idx": 1})}
    conn.close()
    return marked, seconds


def _datatrove(docs: list[str], evals: list[dict]) -> tuple[set[int], float]:
    """datatrove's n-gram hashes of the items (query: the context, text: the gold ending, as its
    lighteval reader gives them, with the query's and the overlapping n-grams) and its filter on the
    documents, timed from the index to the last document.

    Three shims, none in what is measured: its indexer is called without being built (building it
    requires lighteval, only to read lighteval's tasks); its English word tokenizer is NLTK's
    ``word_tokenize`` without the punkt sentence model (a separate download; its normaliser has taken
    the punctuation out before, so the sentences change nothing); its xxhash64 is given UTF-8 bytes
    (xxhash 4 takes no str)."""
    import types

    import xxhash
    from datatrove.data import Document
    from datatrove.pipeline.decont import NGramsDecontConfig, NGramsDecontFilter, NGramsDecontIndexer
    from datatrove.utils.word_tokenizers import WordTokenizer
    from nltk.tokenize import NLTKWordTokenizer

    class Words(WordTokenizer):
        def __init__(self) -> None:
            super().__init__("english")
            self.words = NLTKWordTokenizer()

        def word_tokenize(self, text: str) -> list[str]:
            return [w.strip() for w in self.words.tokenize(text) if w.strip()]

        def sent_tokenize(self, text: str) -> list[str]:
            return [text]

        def span_tokenize(self, text: str) -> list[tuple[int, int]]:
            return [(0, len(text))]

    def hash64(text: str) -> int:
        return xxhash.xxh64_intdigest(text.encode("utf-8"))

    config = NGramsDecontConfig(n_grams=NGRAM, find_query_ngrams=True, find_overlap_ngrams=True)
    words = Words()
    with tempfile.TemporaryDirectory() as folder:
        start = time.perf_counter()
        indexer = types.SimpleNamespace(config=config, tokenizer=words, hash_func=hash64)
        hashes: set[int] = set()
        for item in evals:
            hashes.update(
                NGramsDecontIndexer.compute_hashes(indexer, item["endings"][item["label"]], item["ctx"])
            )
        np.array(sorted(hashes), dtype="<u8").tofile(Path(folder) / "items.index.hashes")
        filt = NGramsDecontFilter(folder, config=config, language=words)
        filt.hash_func = hash64
        marked = set()
        for i, text in enumerate(docs):
            if filt.filter(Document(text=text, id=str(i))) is not True:
                marked.add(i)
        return marked, time.perf_counter() - start


def decont(texts: list[str]) -> list[Metric]:
    evals, docs, expected = planted(texts, vocabulary(texts))
    with tempfile.TemporaryDirectory() as folder:
        items_file = Path(folder) / "items.jsonl"
        items_file.write_text("".join(json.dumps(e) + "\n" for e in evals))
        # Alternately, so that machine noise hits both alike; the median time of each.
        runs = []
        for _ in range(3):
            ours_run = _ours(docs, items_file)
            try:
                theirs_run: tuple[set[int], float] | Exception = _datatrove(docs, evals)
            except Exception as exc:  # any failure of the anchor leaves its ratio out, and says why
                theirs_run = exc
            runs.append((ours_run, theirs_run))
    marked = runs[0][0][0]
    precision, recall = precision_recall(marked, expected)
    ours = len(docs) / float(np.median([r[0][1] for r in runs]))
    note = (f"{len(docs)} documents, {len(expected)} planted overlaps of {NGRAM} words, "
            f"{3 * len(evals)} hard negatives")  # fmt: skip
    metrics = [
        Metric("decont precision", precision, 1.0, "share", ">= 0.95", precision >= 0.95, note),
        Metric("decont recall", recall, 1.0, "share", ">= 0.95", recall >= 0.95, note),
    ]
    failed = next((t for _, t in runs if isinstance(t, Exception)), None)
    if failed is not None:
        text = str(failed).strip()
        why = f"{type(failed).__name__}: {text.splitlines()[0] if text else ''}"[:160]
        note = f"datatrove's n-gram filter did not run here ({why}); ours through the database"
        metrics.append(
            Metric("decont docs/s (datatrove not run)", ours, 0.0, "docs/s", "ratio skipped", True, note)
        )
        return metrics
    theirs_marked = runs[0][1][0]  # type: ignore[index]
    theirs = len(docs) / float(np.median([r[1][1] for r in runs]))  # type: ignore[index]
    tp, tr = precision_recall(theirs_marked, expected)
    how = f"ours through the database (read, look up, mark); datatrove in memory, its P/R {tp:.3f}/{tr:.3f}"
    metrics.append(Metric("decont docs/s vs datatrove", ours, theirs, "docs/s", ">= 1x", ours >= theirs, how))
    return metrics
