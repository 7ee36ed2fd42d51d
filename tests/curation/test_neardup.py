"""Near duplicates where the corpus lives: MinHash signatures and LSH bands stored and indexed on each
document, candidate buckets grouped by the database, pairs confirmed on the texts and clustered, every
document of a cluster but the first marked `near_dup_of`; measured against planted near-copies whose
answers are computed independently; killed and split passes ending as a straight one."""

from __future__ import annotations

import json
import random
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from bson import ObjectId
from pymongo import monitoring

from bench.bench_neardup import expected_duplicates, precision_recall
from conftest import db_for, listen, make_config, run_cli, store_config
from corpora import corpus, ingest_files, near_copy, near_marks
from dsgpt2.curation import neardup, passes
from dsgpt2.curation.minhash import (
    Clusters,
    LshParams,
    Signer,
    band_values,
    candidate_probability,
    cluster_texts,
    jaccard,
    optimal_bands,
    permutations,
    shingles,
    signature,
)
from dsgpt2.curation.steps import Split
from dsgpt2.db.client import Connection
from dsgpt2.errors import ConfigError


def test_the_bands_catch_pairs_at_the_threshold_and_few_far_below() -> None:
    for threshold in (0.7, 0.8, 0.9):
        bands, rows = optimal_bands(threshold, 128)
        assert bands * rows <= 128
        assert candidate_probability(threshold, bands, rows) >= 0.98
        assert candidate_probability(threshold - 0.3, bands, rows) < 0.25
    params = LshParams(threshold=0.8)
    assert (params.bands, params.rows) == optimal_bands(0.8, 128)
    assert LshParams(threshold=0.9).key != params.key  # other bands: signed again
    with pytest.raises(ConfigError, match="threshold"):
        LshParams(threshold=1.5)


def test_a_signature_agrees_with_another_as_often_as_their_texts_overlap() -> None:
    rng = random.Random(0)
    words = [f"w{rng.randrange(5000)}" for _ in range(400)]
    other = list(words)
    for i in rng.sample(range(400), 20):
        other[i] = "changed"
    a, b = shingles(" ".join(words), 5), shingles(" ".join(other), 5)
    assert len(a) == 396 and a.dtype == np.uint64 and np.all(a[:-1] < a[1:])
    j = jaccard(a, b)
    perms = permutations(1024, 1)
    agree = float(np.mean(signature(a, perms) == signature(b, perms)))
    assert abs(agree - j) < 0.06, (agree, j)
    assert shingles("Hello, WORLD!", 5).tolist() == shingles("hello world", 5).tolist()  # one shingle
    assert Signer(LshParams()).bands("... !!!") == []  # no words: nobody's near duplicate
    sig = signature(a, permutations(128, 1))
    values = band_values(sig, 16, 8)
    assert len(values) == 16 and all(-(2**63) <= v < 2**63 for v in values)
    same_rows = np.tile(sig[:8], 16)  # every band the same rows: still a value per band
    assert len(set(band_values(same_rows, 16, 8))) == 16


def test_shingles_and_bands_are_the_values_stored_documents_hold() -> None:
    """Documents signed by an earlier run are compared with new ones by these values: pinned as the
    first version computed them."""
    assert shingles("The quick brown fox jumps over the lazy dog", 3).tolist() == [
        1562363923538590999, 2178897808865907333, 4724262545349725023, 7564334832298961374,
        9767422845553696693, 12679927712646654290, 15018675604540029465,
    ]  # fmt: skip
    sig = np.arange(1, 9, dtype=np.uint64) * np.uint64(1000)
    assert band_values(sig, 4, 2) == [
        5417811654777547050,
        1343120467203065633,
        -7839689265277346663,
        1859560494282854703,
    ]


def test_clusters_are_the_confirmed_components_whatever_the_bucket_order() -> None:
    rng = random.Random(1)
    similar_pairs = {(1, 2), (2, 3), (5, 6), (7, 9)}

    def similar(a: int, b: int) -> bool:
        return (a, b) in similar_pairs

    bucket_list = [[1, 2, 3], [3, 4], [1, 3, 5], [5, 6, 7], [7, 8, 9], list(range(1, 10))]
    results = set()
    for _ in range(10):
        rng.shuffle(bucket_list)
        clusters = Clusters(similar)
        for keys in bucket_list:
            clusters.add_bucket(sorted(keys))
        results.add(tuple(sorted(clusters.duplicates().items())))
    assert results == {((2, 1), (3, 1), (6, 5), (9, 7))}


def test_precision_and_recall_on_planted_near_copies_in_memory() -> None:
    docs, families = corpus()
    expected = expected_duplicates(docs, families)
    assert len(expected) > 40
    marked = set(cluster_texts(docs, LshParams(threshold=0.8)))
    precision, recall = precision_recall(marked, expected)
    assert precision >= 0.95 and recall >= 0.9, (precision, recall)


def _expected_marks(collections: dict[str, list[str]], families: dict[str, list[int]]) -> set[str]:
    labels = [f"{n}:{i}" for n, texts in collections.items() for i in range(len(texts))]
    docs = [t for texts in collections.values() for t in texts]
    fams = [f for n in collections for f in families[n]]
    return {labels[i] for i in expected_duplicates(docs, fams)}


def test_dedup_near_from_the_cli_marks_planted_copies_across_collections(tmp_path: Path) -> None:
    docs, families = corpus()
    half = len(docs) // 2
    collections = {"news": docs[:half], "web": docs[half:]}
    cfg, store = ingest_files(tmp_path, collections)
    done = run_cli("dedup", "--config", str(cfg), "--near", "--threshold", "0.8", "--no_progress")
    assert done.returncode == 0, done.stderr
    expected = _expected_marks(collections, {"news": families[:half], "web": families[half:]})
    conn = Connection(make_config(["news", "web"], **db_for(store)))  # fmt: skip
    got = near_marks(conn, ["news", "web"])
    precision, recall = precision_recall(set(got), expected)
    assert precision >= 0.95 and recall >= 0.9, (precision, recall)
    for copy, kept in got.items():  # the first of a cluster: earlier collection, then smaller idx
        (cn, ci), (kn, ki) = copy.split(":"), kept.split(":")
        assert ["news", "web"].index(kn) < ["news", "web"].index(cn) or (kn == cn and int(ki) < int(ci))
    counts = re.findall(r"(\d+) near duplicate\(s\)", done.stdout)
    assert sum(map(int, counts)) == len(got) and len(counts) == 2
    assert "confirmed" in done.stdout and "e.g. " in done.stdout
    indexes = {i["name"] for i in conn.db["news"].list_indexes()}
    assert "lsh_1" in indexes
    again = run_cli("dedup", "--config", str(cfg), "--near", "--no_progress")
    assert (
        again.returncode == 0 and "0 signed by this run" in again.stdout and "(0 by this run)" in again.stdout
    )
    stricter = run_cli("dedup", "--config", str(cfg), "--near", "--threshold", "0.95", "--no_progress")
    assert stricter.returncode == 0, stricter.stderr
    assert f"news: {half} documents, {half} signed by this run" in stricter.stdout  # other bands
    conn = Connection(conn.config)
    fewer = near_marks(conn, ["news", "web"])
    assert set(fewer) < set(got) and "unmarked" in stricter.stdout


class Crash(Exception):
    pass


@pytest.mark.parametrize("where", ["signing", "marking"])
def test_a_killed_near_pass_ends_as_a_straight_one(monkeypatch: pytest.MonkeyPatch, where: str) -> None:
    docs, _ = corpus()
    conn = Connection(make_config(["articles"], TEXT_FIELD="body"))
    conn.db["articles"].insert_many([{"_id": ObjectId(), "idx": i, "body": t} for i, t in enumerate(docs)])
    params = LshParams(threshold=0.8)
    straight = set(cluster_texts(docs, params))
    calls = {"n": 0}
    original = passes.write_ops

    def crash(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 3:
            raise Crash
        return original(*args, **kwargs)

    if where == "signing":
        monkeypatch.setattr(passes, "write_ops", crash)
    else:  # killed after the first bulk write of marks
        monkeypatch.setattr(neardup, "_BULK", 10)
        real_write = neardup.write_ops

        def write(conn, name, ops, what):
            if what.startswith("dedup --near: marking"):
                calls["n"] += 1
                if calls["n"] == 2:
                    raise Crash
            return real_write(conn, name, ops, what)

        monkeypatch.setattr(neardup, "write_ops", write)
    with pytest.raises(Crash):
        passes.run_pass(conn, ["articles"], neardup.Signing(params), batch_size=40)
    monkeypatch.undo()
    conn = Connection(conn.config)
    if where == "marking":  # some marks written, not all
        assert 0 < len(near_marks(conn, ["articles"])) < len(straight)
    report = passes.run_pass(conn, ["articles"], neardup.Signing(params), batch_size=40)
    assert {int(k.split(":")[1]) for k in near_marks(conn, ["articles"])} == straight
    (part,) = report.collections
    assert part.duplicates == len(straight)
    if where == "signing":
        assert part.signed == len(docs) - 80  # two batches of 40 were signed before the crash


class Commands(monitoring.CommandListener):
    def __init__(self) -> None:
        self.names: list[str] = []

    def started(self, event: monitoring.CommandStartedEvent) -> None:
        if event.command_name == "createIndexes":
            self.names.append(f"createIndexes {event.command['indexes'][0]['name']}")
        elif event.command_name == "dropIndexes":
            self.names.append(f"dropIndexes {event.command['index']}")
        elif event.command_name == "update" and any("lsh" in json.dumps(u["u"], default=str)
                                                     for u in event.command.get("updates", [])):  # fmt: skip
            self.names.append("sign")

    def succeeded(self, event: Any) -> None:
        pass

    def failed(self, event: Any) -> None:
        pass


def test_the_bands_index_is_built_once_the_bands_are_written(monkeypatch: pytest.MonkeyPatch) -> None:
    """A bulk load: the server sorts the keys of one build instead of placing each document's random keys
    as it is signed; signing again under other settings drops the old bands' index first."""
    docs, _ = corpus()
    seen = Commands()
    listen(monkeypatch, seen)
    conn = Connection(make_config(["articles"], TEXT_FIELD="body"))
    conn.db["articles"].insert_many([{"idx": i, "body": t} for i, t in enumerate(docs)])
    for threshold, signs, drops in [(0.8, True, False), (0.8, False, False), (0.9, True, True)]:
        seen.names.clear()
        passes.run_pass(conn, ["articles"], neardup.Signing(LshParams(threshold=threshold)), batch_size=40)
        assert seen.names.count("createIndexes lsh_1") == 1, seen.names
        built = seen.names.index("createIndexes lsh_1")
        assert ("sign" in seen.names[:built]) == signs and "sign" not in seen.names[built:]
        assert ("dropIndexes lsh_1" in seen.names) == drops
        assert not drops or seen.names.index("dropIndexes lsh_1") < seen.names.index("sign")
    assert "lsh_1" in {i["name"] for i in conn.db["articles"].list_indexes()}


@pytest.mark.slow
def test_split_passes_by_workers_and_parts_end_as_a_straight_one(tmp_path: Path) -> None:
    assert Split(workers=3).ranges((0, 9)) == [(0, 3), (3, 6), (6, 10)]
    assert Split(workers=4).ranges((5, 6)) == [(5, 6), (6, 7)]  # fewer idx values than workers
    assert Split(part=3, parts=4).ranges((5, 6)) == []  # more machines than idx values: nothing here
    assert Split(workers=2, part=1, parts=2).ranges((0, 99)) == [(50, 75), (75, 100)]
    docs, _ = corpus()
    cfg, store = ingest_files(tmp_path, {"news": docs})
    straight = set(cluster_texts(docs, LshParams(threshold=0.8)))
    for part in ("1/2", "2/2"):
        done = run_cli("dedup", "--config", str(cfg), "--near", "--exact", "--workers", "2", "--part", part,
                       "--batch_size", "16", "--no_progress")  # fmt: skip
        assert done.returncode == 0, done.stderr
        assert f"part {part} done" in done.stdout
    conn = Connection(make_config(["news"], **db_for(store)))
    assert conn.db["news"].count_documents({"lsh_key": {"$exists": False}}) == 0
    assert near_marks(conn, ["news"]) == {}  # parts sign; marking waits for the run without --part
    done = run_cli("dedup", "--config", str(cfg), "--near", "--no_progress")
    assert done.returncode == 0 and f"news: {len(docs)} documents, 0 signed by this run" in done.stdout
    conn = Connection(conn.config)
    assert {int(k.split(":")[1]) for k in near_marks(conn, ["news"])} == straight
    curated = run_cli("curate", "--config", str(cfg), "--rules", "gopher", "--workers", "2", "--no_progress")
    assert curated.returncode == 0 and f"{len(docs)} judged by this run" in curated.stdout


def test_dedup_near_refusals_are_one_line(tmp_path: Path) -> None:
    cfg, _ = store_config(tmp_path, ["news"])
    for args, says in [
        (["--near", "--threshold", "1.5"], "must be in (0, 1]"),
        (["--near", "--part", "3/2"], "expected R/M"),
        (["--near", "--workers", "0"], "positive integer"),
        ([], "--exact, --near, or both"),
    ]:
        done = run_cli("dedup", "--config", str(cfg), *args)
        assert done.returncode == 2 and says in done.stderr, (args, done.stderr)
        assert len(done.stderr.strip().splitlines()) == 1 and "Traceback" not in done.stderr


def _words(rng: random.Random, n: int) -> list[str]:
    return [f"w{rng.randrange(20000)}" for _ in range(n)]


def test_ingest_dedup_after_a_near_pass_signs_and_marks_what_arrives(tmp_path: Path) -> None:
    """A growing corpus: documents ingested after `dedup --near` are signed at ingest and checked
    against the lsh index (and against each other); a near copy is kept but marked, an exact copy is
    skipped, and a reader with a FILTER (a --follow run's) leaves the copies out."""
    rng = random.Random(5)
    old = [_words(rng, 300) for _ in range(20)]
    cfg, store = ingest_files(tmp_path, {"news": [" ".join(w) for w in old]})
    assert run_cli("dedup", "--config", str(cfg), "--exact", "--near", "--no_progress").returncode == 0
    fresh = _words(rng, 300)
    arriving = [
        near_copy(rng, old[3]),
        " ".join(old[5]),
        " ".join(fresh),
        near_copy(rng, fresh),
        " ".join(_words(rng, 300)),
    ]
    path = tmp_path / "more.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in arriving))
    data = json.loads(cfg.read_text())
    cfg.write_text(json.dumps({**data, "COLLECTIONS": ["news", "web"]}))
    done = run_cli("ingest", "--config", str(cfg), "--collection", "web", str(path), "--dedup",
                   "--batch_size", "2", "--no_progress")  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "4 inserted (2 marked near_dup_of), 1 skipped (duplicate: 1)" in done.stdout
    conn = Connection(make_config(["news", "web"], **db_for(store)))
    assert near_marks(conn, ["web"]) == {
        "web:0": "news:3",
        "web:2": "web:1",
    }  # the batch boundary between them
    assert conn.db["web"].count_documents({"lsh_key": LshParams().key}) == 4
    again = run_cli("dedup", "--config", str(cfg), "--near", "--no_progress")
    assert again.returncode == 0 and "web: 4 documents, 0 signed by this run" in again.stdout
    conn = Connection(conn.config)
    assert near_marks(conn, ["web"]) == {"web:0": "news:3", "web:2": "web:1"}
    from dsgpt2.db.wrapper import MongoWrapper

    keep = {"near_dup_of": {"$exists": False}}
    follow = MongoWrapper(make_config(["news", "web"], **db_for(store),
                                      FILTER=keep))  # fmt: skip
    assert [d.index for d in follow.get_range(20, 24)] == [21, 23] and follow.skipped["filtered"] == 2
