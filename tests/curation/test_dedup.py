"""Exact duplicates where the corpus lives: `text_hash` stored at ingest and by `dsgpt2 dedup --exact`
for documents without one, copies marked `dup_of` the first copy (COLLECTIONS order, then idx) by
the database's grouping, a killed pass ending as a straight one, `ingest --dedup` skipping and
counting texts the corpus holds."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from bson import ObjectId

from conftest import db_for, make_config, run_cli, store_config
from corpora import ingest_files, marks, planted, reference
from dsgpt2.curation import dedup, passes
from dsgpt2.curation.passes import run_pass
from dsgpt2.db.client import Connection
from dsgpt2.documents import hash_text


def _open(store: Path, names: list[str], **extra: object) -> Connection:
    return Connection(make_config(names, **db_for(store), **extra))


def test_dedup_exact_marks_every_copy_but_the_first_across_collections(tmp_path: Path) -> None:
    collections = {"news": planted(1, 300, 120), "web": planted(2, 200, 120)}
    cfg, store = ingest_files(tmp_path, collections)
    conn = _open(store, list(collections))
    hashed = conn.db["news"].find_one({"idx": 0})
    assert hashed["text_hash"] == hash_text(collections["news"][0])  # stored at ingest
    conn.close()

    result = run_cli("dedup", "--config", str(cfg), "--exact", "--batch_size", "64", "--no_progress")
    assert result.returncode == 0, result.stderr
    expected = reference(collections)
    conn = _open(store, list(collections))
    assert marks(conn, list(collections)) == expected
    news = sum(1 for n, _ in expected if n == "news")
    assert f"news: 300 documents, 0 hashed by this run; {news} exact duplicate(s)" in result.stdout
    groups = sum(1 for t in set(collections["news"] + collections["web"])
                 if (collections["news"] + collections["web"]).count(t) > 1)  # fmt: skip
    assert f"{groups} text(s) held more than once" in result.stdout
    assert "text_hash_1" in conn.db["web"].index_information()
    conn.close()

    again = run_cli("dedup", "--config", str(cfg), "--exact", "--no_progress")
    assert again.returncode == 0 and "(0 by this run)" in again.stdout, again.stdout

    # Another order of COLLECTIONS keeps other copies: the marks follow, the kept ones unmarked.
    data = json.loads(cfg.read_text())
    cfg.write_text(json.dumps({**data, "COLLECTIONS": ["web", "news"]}))
    flipped = run_cli("dedup", "--config", str(cfg), "--exact", "--no_progress")
    assert flipped.returncode == 0, flipped.stderr
    conn = _open(store, ["web", "news"])
    assert marks(conn, ["web", "news"]) == reference({"web": collections["web"], "news": collections["news"]})
    assert "unmarked" in flipped.stdout


class Crash(Exception):
    pass


@pytest.mark.parametrize("where", ["hashing", "marking"])
def test_a_killed_pass_ends_as_a_straight_one(monkeypatch: pytest.MonkeyPatch, where: str) -> None:
    """Documents another application wrote (no hash), numbered in place; the pass killed half-way
    through its hashing or its marking, then run again."""
    texts = planted(3, 400, 150)
    conn = Connection(make_config(["articles"], TEXT_FIELD="body"))
    conn.db["articles"].insert_many([{"_id": ObjectId(), "idx": i, "body": t} for i, t in enumerate(texts)])
    calls = {"n": 0}
    owner, attr = (passes, "write_ops") if where == "hashing" else (dedup._Marker, "_write")
    original = getattr(owner, attr)

    def crash(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 3:
            raise Crash
        return original(*args, **kwargs)

    monkeypatch.setattr(owner, attr, crash)
    monkeypatch.setattr(dedup, "_BULK", 20)
    with pytest.raises(Crash):
        run_pass(conn, ["articles"], dedup.Hashing(), batch_size=50)
    monkeypatch.setattr(owner, attr, original)
    report = run_pass(conn, ["articles"], dedup.Hashing(), batch_size=50)
    expected = reference({"articles": texts})
    assert marks(conn, ["articles"]) == expected
    (part,) = report.collections
    assert part.documents == 400 and part.duplicates == len(expected)
    if where == "hashing":
        assert part.hashed == 400 - 100  # two batches of 50 were hashed before the crash
    assert conn.db["articles"].count_documents({"text_hash": {"$type": "string"}}) == 400


def test_a_part_run_reports_what_it_hashed_and_signed_not_marks_it_has_not_counted() -> None:
    """`dedup --exact --near --part 1/2` hashes and signs its share; the marking (and the counting of
    duplicates) waits for the run without --part, so its report says no "0 duplicate(s)" it never
    counted, nor the FILTER that would keep them out."""
    from dsgpt2.curation import neardup
    from dsgpt2.curation.minhash import LshParams
    from dsgpt2.curation.steps import Split

    conn = Connection(make_config(["articles"], TEXT_FIELD="body"))
    texts = planted(7, 100, 30)
    conn.db["articles"].insert_many([{"_id": ObjectId(), "idx": i, "body": t} for i, t in enumerate(texts)])
    part = Split(part=0, parts=2)
    exact = run_pass(conn, ["articles"], dedup.Hashing(), split=part)
    near = run_pass(conn, ["articles"], neardup.Signing(LshParams(threshold=0.8)), split=part)
    assert exact.lines() == ["articles: 50 hashed by this run"]
    assert near.lines()[1:] == ["articles: 50 signed by this run"]
    assert marks(conn, ["articles"]) == {}
    whole = run_pass(conn, ["articles"], dedup.Hashing())
    assert whole.lines()[0].startswith(
        f"articles: 100 documents, 50 hashed by this run; {len(reference({'a': texts}))} "
    )
    assert any('"FILTER"' in line for line in whole.lines())


def test_ingest_dedup_skips_and_counts_texts_the_corpus_holds(tmp_path: Path) -> None:
    news = planted(4, 100, 60)
    cfg, store = ingest_files(tmp_path, {"news": news})
    data = json.loads(cfg.read_text())
    cfg.write_text(json.dumps({**data, "COLLECTIONS": ["news", "web"]}))
    web = planted(5, 150, 90)
    (tmp_path / "web.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in web))
    result = run_cli("ingest", "--config", str(cfg), "--collection", "web", str(tmp_path / "web.jsonl"),
                     "--dedup", "--batch_size", "16", "--no_progress")  # fmt: skip
    assert result.returncode == 0, result.stderr
    fresh, seen = [], set(news)
    for t in web:
        if t not in seen:
            fresh.append(t)
            seen.add(t)
    assert (
        f"150 records read, {len(fresh)} inserted, {150 - len(fresh)} skipped (duplicate: {150 - len(fresh)})"
        in (result.stdout)
    )
    conn = _open(store, ["news", "web"])
    assert [d["filt_text"] for d in conn.db["web"].find().sort("idx")] == fresh
    assert [d["idx"] for d in conn.db["web"].find().sort("idx")] == list(range(len(fresh)))


def test_dedup_refusals_are_one_line(tmp_path: Path) -> None:
    cfg, _ = store_config(tmp_path, ["news"])
    plain = run_cli("dedup", "--config", str(cfg))
    assert plain.returncode == 2 and "say which duplicates: --exact" in plain.stderr.strip().splitlines()[-1]
    missing = run_cli("dedup", "--config", str(cfg), "--exact", "--collection", "nowhere")
    assert missing.returncode != 0 and "'nowhere'" in missing.stderr and "Traceback" not in missing.stderr
    assert len(missing.stderr.strip().splitlines()) == 1
