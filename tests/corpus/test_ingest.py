from __future__ import annotations

import csv
import gzip
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import ROOT, db_for, make_config, run_cli, seed, store_config, write_config
from dsgpt2.corpus import ingest as ingest_mod
from dsgpt2.corpus.builtin import stdlib_documents
from dsgpt2.corpus.cleaning import CLEANER_VERSION, clean_text
from dsgpt2.corpus.formats import file_source
from dsgpt2.corpus.ingest import ingest
from dsgpt2.corpus.readers import builtin_source
from dsgpt2.corpus.records import normalize_conversation
from dsgpt2.db import embedded
from dsgpt2.db.client import Connection
from dsgpt2.db.config import load_config
from dsgpt2.db.meta import read_meta
from dsgpt2.db.validate import validate_collection
from dsgpt2.db.wrapper import MongoWrapper
from dsgpt2.errors import BadDocumentError, ConfigError, CorpusError, IngestError
from pace import deadline, wait_for


def _conn() -> Connection:
    return Connection(make_config(["a"]))


def _texts(conn: Connection, name: str = "a") -> list[str]:
    return [d["filt_text"] for d in conn.db[name].find({}, sort=[("idx", 1)])]


def _assert_contiguous(conn: Connection, name: str = "a") -> None:
    idx = sorted(d["idx"] for d in conn.db[name].find({}, {"idx": 1}))
    assert idx == list(range(len(idx)))
    assert validate_collection(conn, name).ok


def test_text_lines_and_paragraphs(tmp_path: Path) -> None:
    f = tmp_path / "t.txt"
    f.write_text("first line\n\nsecond  line\r\nthird\n\n\nfourth para\nstill fourth\n")
    conn = _conn()
    report = ingest(conn, "a", [file_source(f)])
    assert _texts(conn) == ["first line", "second line", "third", "fourth para", "still fourth"]
    assert report.sources[0].skipped == {"empty": 3}
    ingest(conn, "b", [file_source(f, split="paragraph")])
    assert _texts(conn, "b") == ["first line", "second line\nthird", "fourth para\nstill fourth"]


def test_jsonl_csv_and_gzip(tmp_path: Path) -> None:
    rows = [{"body": "alpha doc", "n": 1}, {"body": "beta doc"}]
    gz = tmp_path / "x.jsonl.gz"
    with gzip.open(gz, "wt") as f:
        f.write("\n".join(json.dumps(r) for r in rows) + "\n")
    c = tmp_path / "x.csv"
    with open(c, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["id", "content"])
        w.writerows([[1, "gamma, with comma"], [2, "delta\nmultiline"]])
    conn = _conn()
    ingest(conn, "a", [file_source(gz, field="body"), file_source(c, column="content")])
    assert _texts(conn) == ["alpha doc", "beta doc", "gamma, with comma", "delta\nmultiline"]
    docs = list(conn.db["a"].find({}, sort=[("idx", 1)]))
    assert docs[0]["form"] == "alpha doc" and docs[0]["idx"] == 0
    _assert_contiguous(conn)


def test_bad_records_are_skipped_and_counted(tmp_path: Path) -> None:
    f = tmp_path / "bad.jsonl"
    f.write_text(
        "\n".join(
            [
                json.dumps({"text": "good"}),
                "{not json",
                json.dumps({"other": "x"}),
                json.dumps({"text": None}),
                json.dumps({"text": 12}),
                json.dumps({"text": "  \t "}),
                json.dumps(["list"]),
                json.dumps({"text": "also good"}),
            ]
        )
        + "\n"
    )
    f.write_bytes(f.read_bytes() + b'{"text": "broken \xff bytes"}\n')
    conn = _conn()
    report = ingest(conn, "a", [file_source(f)])
    assert _texts(conn) == ["good", "also good", "broken \ufffd bytes"]
    assert dict(report.sources[0].skipped) == {
        "bad_json": 2,
        "no_field": 1,
        "null": 1,
        "not_string": 1,
        "empty": 1,
    }
    # The line an editor shows (1-based), not the record's number in the file (1).
    with pytest.raises(BadDocumentError, match=r"bad\.jsonl line 2 is unusable \(bad_json\)"):
        ingest(conn, "b", [file_source(f)], strict=True)


def test_conversations_turns_and_query_reply(tmp_path: Path) -> None:
    f = tmp_path / "c.jsonl"
    f.write_text(
        "\n".join(
            json.dumps(o)
            for o in [
                {"turns": [{"speaker": "user", "text": "hi  there"}, {"speaker": "bot", "text": "hello"}]},
                {"query": "what is 2+2?", "reply": "4"},
                {"turns": [{"speaker": "user", "text": "alone"}]},
                {"turns": "nope"},
            ]
        )
    )
    conn = _conn()
    report = ingest(conn, "chat", [file_source(f, fmt="conversation")])
    docs = list(conn.db["chat"].find({}, sort=[("idx", 1)]))
    assert docs[0]["turns"] == [{"speaker": "user", "text": "hi there"}, {"speaker": "bot", "text": "hello"}]
    assert docs[1]["turns"][1] == {"speaker": "bot", "text": "4"}
    assert docs[1]["filt_text"] == "user: what is 2+2?\nbot: 4"
    assert dict(report.sources[0].skipped) == {"empty": 1, "bad_conversation": 1}
    assert normalize_conversation([1]).reason == "bad_conversation"


def test_appends_after_existing_documents_and_records_meta(tmp_path: Path) -> None:
    conn = _conn()
    seed(conn, "a", ["old0", "old1"])
    f = tmp_path / "t.txt"
    f.write_text("new0\nnew1\nnew2\n")
    report = ingest(conn, "a", [file_source(f)], batch_size=2)
    assert _texts(conn) == ["old0", "old1", "new0", "new1", "new2"]
    assert report.count == 5 and report.inserted == 3
    meta = read_meta(conn, ["a"])["a"]
    assert meta["count"] == 5 and meta["cleaner_version"] == CLEANER_VERSION
    (state,) = meta["sources"].values()
    assert state["complete"] and state["records"] == 3 and state["inserted"] == 3
    assert len(MongoWrapper(conn.config, connection=conn)) == 5
    # Re-running the same command finds the source complete and adds nothing.
    again = ingest(conn, "a", [file_source(f)])
    assert again.sources[0].already_done and _texts(conn)[-1] == "new2" and again.count == 5


class Crash(Exception):
    pass


def _lines(tmp_path: Path, n: int) -> Path:
    f = tmp_path / "lines.txt"
    f.write_text("".join(f"document number {i}\n" if i % 7 else "\n" for i in range(n)))
    return f


def _expected(n: int) -> list[str]:
    return [f"document number {i}" for i in range(n) if i % 7]


@pytest.mark.parametrize("where", ["after_insert_before_meta", "half_of_a_batch", "before_insert"])
def test_interrupted_ingest_resumes_exactly_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    f = _lines(tmp_path, 100)
    conn = _conn()
    original_insert = ingest_mod.insert_batch
    original_record = ingest_mod._record
    calls = {"insert": 0, "record": 0}

    def insert(conn_, coll, docs):
        calls["insert"] += 1
        if calls["insert"] == 3:
            if where == "half_of_a_batch":
                original_insert(conn_, coll, docs[: len(docs) // 2])
                raise Crash
            if where == "before_insert":
                raise Crash
        return original_insert(conn_, coll, docs)

    def record(*args, **kwargs):
        calls["record"] += 1
        # Records: 1 = source start, 2..: one per batch. Crash after the 3rd batch's insert.
        if where == "after_insert_before_meta" and calls["record"] == 4:
            raise Crash
        original_record(*args, **kwargs)

    monkeypatch.setattr(ingest_mod, "insert_batch", insert)
    monkeypatch.setattr(ingest_mod, "_record", record)
    with pytest.raises(Crash):
        ingest(conn, "a", [file_source(f)], batch_size=10)
    partial = _texts(conn)
    assert 0 < len(partial) < len(_expected(100))
    monkeypatch.setattr(ingest_mod, "insert_batch", original_insert)
    monkeypatch.setattr(ingest_mod, "_record", original_record)
    report = ingest(conn, "a", [file_source(f)], batch_size=10)
    assert report.sources[0].resumed_at > 0
    assert _texts(conn) == _expected(100)
    _assert_contiguous(conn)
    assert read_meta(conn, ["a"])["a"]["count"] == len(_expected(100))


def test_killed_ingest_process_resumes_exactly_once(tmp_path: Path) -> None:
    n = 5000
    f = _lines(tmp_path, n)
    cfg, store = store_config(tmp_path)
    args = [sys.executable, "-m", "dsgpt2", "ingest", "--config", str(cfg), "--batch_size", "200", str(f)]
    proc = subprocess.Popen(args, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    # Wait until some batches have been committed, then kill without warning.
    stored = Connection(make_config(["a"], **db_for(store))).db["a"]
    wait_for(lambda: stored.estimated_document_count() >= 400, 120, "400 documents stored", proc, every=0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL, "the ingest finished before it could be killed"
    conn = Connection(make_config(["a"], **db_for(store)))
    partial = conn.db["a"].count_documents({})
    assert 0 < partial < len(_expected(n))

    rerun = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=deadline(300))
    assert rerun.returncode == 0, rerun.stderr
    assert "resumed after record" in rerun.stdout
    conn = Connection(conn.config)
    assert _texts(conn) == _expected(n)
    _assert_contiguous(conn)


def test_input_errors_are_clear(tmp_path: Path) -> None:
    with pytest.raises(IngestError, match="not found"):
        file_source(tmp_path / "missing.txt")
    c = tmp_path / "x.csv"
    c.write_text("id,body\n1,hello\n")
    with pytest.raises(IngestError, match=r"no column 'text'.*\['id', 'body'\].*--column"):
        file_source(c)
    with pytest.raises(ConfigError, match="--batch_size must be a positive integer, got 0"):
        ingest(_conn(), "a", [], batch_size=0)
    with pytest.raises(IngestError, match="unknown sample"):
        builtin_source("nope")


def test_sample_corpus_is_real_deterministic_text(sample_texts: list[str]) -> None:
    assert len(sample_texts) > 5000
    size = sum(len(t.encode()) for t in sample_texts)
    assert size > 2_000_000
    assert list(stdlib_documents(50)) == sample_texts[:50]
    words = " ".join(sample_texts[:200]).split()
    common = {"the", "of", "a", "to", "is", "and"}
    assert sum(w in common for w in words) > 0.08 * len(words)  # English prose, not code


def test_the_docstring_walk_keeps_ast_walks_order_over_the_stdlib() -> None:
    """The sample's docstrings come from a walk over statements only: the same nodes, in the same order,
    as ``ast.walk`` finds, in every tenth file of the standard library (nested in classes, functions,
    if, try, except, with, match)."""
    import ast
    import itertools

    from dsgpt2.corpus.builtin import _source_files, _statement_walk, stdlib_root

    kinds = ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef
    files = 0
    for path in itertools.islice(_source_files(stdlib_root()), 0, None, 10):
        try:
            tree = ast.parse(path.read_bytes())
        except (SyntaxError, ValueError):
            continue
        expected = [n for n in ast.walk(tree) if isinstance(n, kinds)]
        assert [n for n in _statement_walk(tree) if isinstance(n, kinds)] == expected, path
        files += 1
    assert files > 50


def test_sample_ingest(sample_texts: list[str]) -> None:
    conn = _conn()
    report = ingest(conn, "a", [builtin_source("stdlib", limit=300)], batch_size=100)
    assert report.inserted == 300
    assert _texts(conn)[:3] == [clean_text(t) for t in sample_texts[:3]]


def test_hostile_jsonl_bom_csv_and_bad_bytes_are_skipped_or_read(tmp_path: Path) -> None:
    deep = '{"text": "x", "y": ' + "[" * 100_000 + "]" * 100_000 + "}"
    j = tmp_path / "deep.jsonl"
    j.write_text("\n".join(['{"text": "before"}', deep, '{"text": "after"}']) + "\n")
    c = tmp_path / "excel.csv"
    c.write_bytes("\ufefftext,id\nfirst row,1\nsecond row,2\n".encode())  # a spreadsheet's BOM
    t = tmp_path / "latin1.txt"
    t.write_bytes("caf\xe9 au lait\nplain line\n".encode("latin-1"))
    conn = _conn()
    report = ingest(conn, "a", [file_source(j), file_source(c), file_source(t)])
    assert dict(report.sources[0].skipped) == {"bad_json": 1}
    assert _texts(conn) == ["before", "after", "first row", "second row", "caf\ufffd au lait", "plain line"]
    _assert_contiguous(conn)
    # The replaced bytes are counted and the way out named, not silently swallowed.
    assert report.sources[2].decoding.replaced == 1
    (said,) = [line for line in report.lines() if "U+FFFD" in line]
    assert "1 byte sequence(s) not valid utf-8" in said and "--encoding" in said
    assert not [line for line in report.lines()[:2] if "U+FFFD" in line]


def test_encoding_reads_latin1_and_an_unknown_one_is_refused(tmp_path: Path) -> None:
    t = tmp_path / "latin1.txt.gz"
    t.write_bytes(gzip.compress("caf\xe9 au lait\nna\xefve\n".encode("latin-1")))
    conn = _conn()
    report = ingest(conn, "a", [file_source(t, encoding="latin-1")])
    assert _texts(conn) == ["caf\xe9 au lait", "na\xefve"]
    assert report.sources[0].decoding.replaced == 0
    with pytest.raises(IngestError, match="unknown --encoding 'klingon'"):
        file_source(t, encoding="klingon")


def _gzip_lines(path: Path, n: int) -> bytes:
    # Incompressible-ish lines, so that the damage lands well inside the stream.
    import random

    rng = random.Random(0)
    data = "".join(f"line {i} {rng.getrandbits(128):032x}\n" for i in range(n)).encode()
    path.write_bytes(gzip.compress(data))
    return path.read_bytes()


@pytest.mark.parametrize("damage", ["crc", "flipped"])
def test_a_gzip_damaged_inside_is_refused_before_any_of_its_text_is_stored(
    tmp_path: Path, damage: str
) -> None:
    """gzip finds damage only at a member's end (its CRC): text read before that may be garbled anywhere
    (a byte flipped mid-file stored documents of scrambled text). Refused whole, in one line, exit 2."""
    f = tmp_path / "lines.txt.gz"
    good = _gzip_lines(f, 5000)
    if damage == "crc":
        f.write_bytes(good[:-8] + bytes(b ^ 0xFF for b in good[-8:-4]) + good[-4:])  # the CRC32 trailer
    else:
        middle = len(good) // 2
        f.write_bytes(good[:middle] + bytes(b ^ 0x5A for b in good[middle : middle + 4]) + good[middle + 4 :])
    clean = tmp_path / "clean.txt"
    clean.write_text("a clean document\n")
    cfg, store = store_config(tmp_path)
    from conftest import run_cli

    args = ["ingest", "--config", str(cfg), "--no_progress", str(clean), str(f)]
    for _ in range(2):  # the same line again, nothing stored twice
        done = run_cli(*args)
        assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
        line = done.stderr.strip().splitlines()[-1]
        assert "lines.txt.gz: the gzip file is damaged" in line and "nothing of it is ingested" in line, line
        assert _texts(Connection(make_config(["a"], **db_for(store)))) == ["a clean document"]


def test_a_truncated_gzip_keeps_what_precedes_and_stops_with_one_line(tmp_path: Path) -> None:
    n = 5000
    f = tmp_path / "lines.txt.gz"
    good = _gzip_lines(f, n)
    f.write_bytes(good[: len(good) // 2])
    cfg, store = store_config(tmp_path)
    args = ["ingest", "--config", str(cfg), "--batch_size", "300", "--no_progress", str(f)]
    from conftest import run_cli

    first = run_cli(*args)
    assert first.returncode == 2, first.stderr
    assert "Traceback" not in first.stderr
    line = first.stderr.strip().splitlines()[-1]
    assert "lines.txt.gz" in line and "damaged after record" in line and "re-run" in line
    read = int(line.split("damaged after record ")[1].split(" ")[0])
    conn = Connection(make_config(["a"], **db_for(store)))
    expected = [f"line {i} " for i in range(read)]
    texts = _texts(conn)
    assert [t[: len(e)] for t, e in zip(texts, expected, strict=True)] == expected
    assert read == len(texts) and 0 < len(texts) < n
    # Re-run on the same damaged file: the same line, nothing inserted twice.
    again = run_cli(*args)
    assert again.returncode == 2 and again.stderr.strip().splitlines()[-1] == line
    assert _texts(Connection(conn.config)) == texts
    _assert_contiguous(Connection(conn.config))
    assert not list(tmp_path.glob(".*snapshot-*"))


def test_a_field_no_record_has_exits_2_naming_the_fields_the_records_have(tmp_path: Path) -> None:
    f = tmp_path / "news.jsonl"
    f.write_text(
        "".join(json.dumps({"id": i, "title": f"t{i}", "text": f"story {i}"}) + "\n" for i in range(50))
    )
    cfg, store = store_config(tmp_path, ["news"])
    done = run_cli("ingest", "--config", str(cfg), "--field", "body", "--no_progress", str(f))
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr and "WARNING" not in done.stderr
    line = done.stderr.strip().splitlines()[-1]
    assert "none of its 50 record(s) has the field named by --field body; nothing was stored" in line
    assert "the fields id, title, text" in line and "e.g. --field text" in line
    conn = Connection(make_config(["news"], **db_for(store)))
    assert conn.db["news"].count_documents({}) == 0
    # No unfinished ingest left behind, nor the collection this run made for it.
    assert "news" not in read_meta(conn, ["news"]) and "news" not in conn.db.list_collection_names()
    # The field it names works, from a clean start.
    again = run_cli("ingest", "--config", str(cfg), "--field", "text", "--no_progress", str(f))
    assert again.returncode == 0, again.stderr
    assert _texts(conn, "news") == [f"story {i}" for i in range(50)]
    assert run_cli("validate", "--config", str(cfg)).returncode == 0


def test_an_empty_file_exits_2_and_a_collection_training_ignores_is_named(tmp_path: Path) -> None:
    cfg, store = store_config(tmp_path, ["news"])
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    done = run_cli("ingest", "--config", str(cfg), "--no_progress", str(empty))
    assert done.returncode == 2, done.stderr
    line = done.stderr.strip().splitlines()[-1]
    assert "empty.jsonl (jsonl: text): no record in it; nothing was read" in line
    assert "Traceback" not in done.stderr
    # Refused, it leaves nothing behind: no collection made for it, no ingest record calling it complete.
    conn = Connection(make_config(["news"], **db_for(store)))
    assert "news" not in conn.db.list_collection_names() and read_meta(conn, ["news"]) == {}
    assert "COLLECTIONS" not in done.stdout
    # Into a collection the config does not train on: stored, and a line says how to train on it.
    f = tmp_path / "k.jsonl"
    f.write_text("".join(json.dumps({"text": f"story {i}"}) + "\n" for i in range(5)))
    done = run_cli("ingest", "--config", str(cfg), "--collection", "k", "--no_progress", str(f))
    assert done.returncode == 0, done.stderr
    assert f"note: 'k' is not in the COLLECTIONS of {cfg}; add it there to train on it" in done.stdout
    assert "COLLECTIONS" not in run_cli("ingest", "--config", str(cfg), "--no_progress", str(f)).stdout
    assert _texts(Connection(make_config(["k"], **db_for(store))), "k") == [f"story {i}" for i in range(5)]


def test_a_file_read_again_in_another_encoding_is_refused_and_a_dropped_collection_takes_it(
    tmp_path: Path,
) -> None:
    """The encoding hint followed into the same collection: reading the file again would store every
    document twice, so it is refused in one line naming the way out; `dsgpt2 drop` is that way."""
    cfg, store = store_config(tmp_path, ["news"])
    f = tmp_path / "latin.txt"
    f.write_bytes("caf\xe9 au lait\n\nna\xefve\n".encode("latin-1"))
    first = run_cli("ingest", "--config", str(cfg), "--no_progress", "--split", "paragraph", str(f))
    assert first.returncode == 0 and "--encoding" in first.stdout, first.stdout
    again = run_cli("ingest", "--config", str(cfg), "--no_progress", "--split", "paragraph", "--encoding",
                    "latin-1", str(f))  # fmt: skip
    assert again.returncode == 2 and "Traceback" not in again.stderr, again.stderr
    (line,) = again.stderr.strip().splitlines()[-1:]
    assert "already ingested into 'news', read as utf-8; reading it again as latin-1 would store" in line
    assert "dsgpt2 drop --collection news" in line
    conn = Connection(make_config(["news"], **db_for(store)))
    assert _texts(conn, "news") == ["caf\ufffd au lait", "na\ufffdve"]  # nothing added
    # drop names what it would drop and drops nothing without --yes; with it, the collection and its records.
    asked = run_cli("drop", "--config", str(cfg), "--collection", "news")
    assert asked.returncode == 2 and "news (2 documents) in" in asked.stderr and "--yes" in asked.stderr
    assert _texts(conn, "news") == ["caf\ufffd au lait", "na\ufffdve"]
    assert run_cli("drop", "--config", str(cfg), "--collection", "meta_info", "--yes").returncode == 2
    dropped = run_cli("drop", "--config", str(cfg), "--collection", "news", "--yes")
    assert dropped.returncode == 0 and "dropped news (2 documents)" in dropped.stdout, dropped.stderr
    assert "news" not in conn.db.list_collection_names() and read_meta(conn, ["news"]) == {}
    right = run_cli("ingest", "--config", str(cfg), "--no_progress", "--split", "paragraph", "--encoding",
                    "latin-1", str(f))  # fmt: skip
    assert right.returncode == 0, right.stderr
    assert _texts(conn, "news") == ["café au lait", "naïve"]


def test_each_skipped_record_is_located_in_the_report_and_the_first_in_the_log(tmp_path: Path) -> None:
    j = tmp_path / "m.jsonl"
    lines = [json.dumps({"text": f"good {i}"}) for i in range(30)]
    lines[3] = "{not json"  # line 4
    lines[7] = json.dumps({"text": None})  # line 8
    lines[12] = ""  # a blank line: a line, not a record
    lines[20] = json.dumps({"body": "x"})  # line 21
    lines[25] = json.dumps({"text": "   "})  # line 26
    lines[27] = json.dumps({"text": 7})  # line 28
    lines[29] = json.dumps({"text": "good 1"})  # line 30: line 2's text again
    j.write_text("\n".join(lines) + "\n")
    c = tmp_path / "c.csv"
    # header; a row; a blank line; a quoted text over two lines; an empty text; a short row; a row.
    c.write_text('id,text\n1,first\n\n2,"two\nlines"\n3,\n4\n5,last\n')
    cfg, store = store_config(tmp_path)
    report = tmp_path / "skipped.jsonl"
    args = ["--dedup", "--report", str(report), "--no_progress", str(j), str(c)]
    done = run_cli("ingest", "--config", str(cfg), *args)
    assert done.returncode == 0, done.stderr
    expected = [(j, 4, "bad_json"), (j, 8, "null"), (j, 21, "no_field"), (j, 26, "empty"),
                (j, 28, "not_string"), (j, 30, "duplicate"), (c, 6, "empty"), (c, 7, "no_field")]  # fmt: skip
    assert [json.loads(x) for x in report.read_text().splitlines()] == [
        {"file": str(f), "line": n, "reason": why} for f, n, why in expected
    ]
    assert (
        "m.jsonl line 4 (bad_json), m.jsonl line 8 (null), m.jsonl line 21 (no_field), m.jsonl line 26 "
        f"(empty), m.jsonl line 28 (not_string) and 1 more (--report {report} lists each)" in done.stderr
    )
    assert "c.csv line 6 (empty), c.csv line 7 (no_field)" in done.stderr
    conn = Connection(make_config(["a"], **db_for(store)))
    assert _texts(conn)[-3:] == ["first", "two\nlines", "last"]
    # --strict names the line an editor shows: the 21st, after a blank 20th (the 20th record).
    strict = tmp_path / "s.jsonl"
    strict.write_text(
        "".join(json.dumps({"text": f"t{i}"}) + "\n" for i in range(19)) + "\n" + '{"body": 1}\n'
    )
    stopped = run_cli(
        "ingest", "--config", str(cfg), "--collection", "b", "--strict", "--no_progress", str(strict)
    )
    assert stopped.returncode == 2 and "Traceback" not in stopped.stderr
    assert "s.jsonl line 21 is unusable (no_field)" in stopped.stderr.strip().splitlines()[-1]


def test_a_paragraph_is_located_by_its_first_line(tmp_path: Path) -> None:
    t = tmp_path / "p.txt"
    t.write_text("\n\none\ntwo\n\n\nthree\n\nfour\nfive\nsix\n")
    source = file_source(t, split="paragraph")
    located = [(record.text.split()[0], source.locate(i)["line"]) for i, record in enumerate(source.read())]
    assert located == [("one", 3), ("three", 7), ("four", 9)]


def test_text_hash_is_indexed_at_ingest_and_by_dsgpt2_index(tmp_path: Path) -> None:
    f = tmp_path / "t.txt"
    f.write_text("one\ntwo\n")
    cfg, store = store_config(tmp_path)
    assert run_cli("ingest", "--config", str(cfg), "--no_progress", str(f)).returncode == 0
    conn = Connection(make_config(["a"], **db_for(store)))
    assert {"text_hash": 1} in [dict(i["key"]) for i in conn.db["a"].list_indexes()]
    # A collection another application wrote, numbered in place.
    conn.db["app"].insert_many([{"body": f"article {i}"} for i in range(5)])
    done = run_cli("index", "--config", str(cfg), "--collection", "app", "--field", "body", "--no_progress")
    assert done.returncode == 0, done.stderr
    assert {"text_hash": 1} in [dict(i["key"]) for i in conn.db["app"].list_indexes()]


def _start_ingest(cfg: Path, collection: str, path: Path) -> subprocess.Popen:
    args = ["ingest", "--config", str(cfg), "--collection", collection, "--batch_size", "50", "--no_progress"]
    return subprocess.Popen([sys.executable, "-m", "dsgpt2", *args, str(path)], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip


def _numbered(n: int, tag: str, path: Path) -> list[str]:
    texts = [f"{tag} document {i}" for i in range(n)]
    path.write_text("".join(t + "\n" for t in texts))
    return texts


@pytest.mark.slow
def test_two_ingests_at_once_into_one_local_store_lose_nothing(tmp_path: Path) -> None:
    """Two `dsgpt2 ingest` processes at the same moment into one local:// store (whose server the first
    to come starts): into two collections, into one; the same source twice is refused while its
    writer lives, never stored twice."""
    directory = tmp_path / "db"
    cfg = write_config(tmp_path / "c.json", MONGO_CONNECTION_STRING=f"local://{directory}",
                       MONGO_CONNECTION_DB="corpus", COLLECTIONS=["x", "y"])  # fmt: skip
    n = 2000
    a, b = _numbered(n, "a", tmp_path / "a.txt"), _numbered(n, "b", tmp_path / "b.txt")
    try:
        procs = [_start_ingest(cfg, "x", tmp_path / "a.txt"), _start_ingest(cfg, "y", tmp_path / "b.txt")]
        for proc in procs:
            _, err = proc.communicate(timeout=deadline(300))
            assert proc.returncode == 0, err[-3000:]
        conn = Connection(load_config(cfg))
        assert _texts(conn, "x") == a and _texts(conn, "y") == b
        _assert_contiguous(conn, "x")
        _assert_contiguous(conn, "y")
        assert {k: v["count"] for k, v in read_meta(conn, ["x", "y"]).items()} == {"x": n, "y": n}

        procs = [_start_ingest(cfg, "z", tmp_path / "a.txt"), _start_ingest(cfg, "z", tmp_path / "b.txt")]
        for proc in procs:
            _, err = proc.communicate(timeout=deadline(300))
            assert proc.returncode == 0, err[-3000:]
        _assert_contiguous(conn, "z")
        docs = list(conn.db["z"].find({}, {"_id": 0, "filt_text": 1}, sort=[("idx", 1)]))
        assert len(docs) == 2 * n
        assert [d["filt_text"] for d in docs if d["filt_text"][0] == "a"] == a
        assert [d["filt_text"] for d in docs if d["filt_text"][0] == "b"] == b
        meta = read_meta(conn, ["z"])["z"]
        assert meta["count"] == 2 * n
        assert sorted(s["inserted"] for s in meta["sources"].values()) == [n, n]

        big = _numbered(5 * n, "w", tmp_path / "w.txt")
        first = _start_ingest(cfg, "w", tmp_path / "w.txt")
        some = lambda: conn.db["w"].estimated_document_count() >= 100  # noqa: E731
        wait_for(some, 120, "the first ingest's first documents", first, every=0.02)
        first.send_signal(signal.SIGSTOP)  # alive, holding the source, writing nothing for now
        try:
            second = run_cli("ingest", "--config", str(cfg), "--collection", "w", "--no_progress",
                             str(tmp_path / "w.txt"))  # fmt: skip
        finally:
            first.send_signal(signal.SIGCONT)
        assert second.returncode == 2 and "Traceback" not in second.stderr
        assert "another dsgpt2 ingest" in second.stderr.strip().splitlines()[-1]
        _, err = first.communicate(timeout=deadline(300))
        assert first.returncode == 0, err[-3000:]
        assert _texts(conn, "w") == big
        _assert_contiguous(conn, "w")
        again = run_cli(
            "ingest", "--config", str(cfg), "--collection", "w", "--no_progress", str(tmp_path / "w.txt")
        )
        assert again.returncode == 0 and "already ingested" in again.stdout
        assert read_meta(conn, ["w"])["w"]["count"] == len(big) == conn.db["w"].count_documents({})
    finally:
        embedded.stop(directory)


def test_a_source_another_machine_holds_is_refused_until_its_heartbeat_is_stale(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    f = _lines(tmp_path, 100)
    conn = _conn()
    meta = conn.db[conn.config.meta_collection]
    held = f"sources.{file_source(f).key}"
    now = time.time()
    meta.update_one({"collection": "a"}, {"$set": {f"{held}.owner": "elsewhere:4242:beef",
                                                   f"{held}.heartbeat": now}}, upsert=True)  # fmt: skip
    with pytest.raises(
        CorpusError, match=r"another dsgpt2 ingest \(elsewhere:4242:beef\) is writing it into 'a'"
    ):
        ingest(conn, "a", [file_source(f)])
    assert conn.db["a"].count_documents({}) == 0
    # No sign of life for longer than the lease: that ingest is gone, this one takes the source over.
    meta.update_one({"collection": "a"}, {"$set": {f"{held}.heartbeat": now - 2 * ingest_mod.LEASE_SECONDS}})
    ingest(conn, "a", [file_source(f)], batch_size=10)
    assert _texts(conn) == _expected(100)

    # A run whose source another ingest took over stops at its next record of progress, unfinished.
    g = tmp_path / "g.txt"
    g.write_text("".join(f"line {i}\n" for i in range(100)))
    original = ingest_mod.insert_batch
    calls = {"n": 0}

    def insert(conn_, coll, docs):
        calls["n"] += 1
        if calls["n"] == 2:
            meta.update_one(
                {"collection": "b"}, {"$set": {f"sources.{file_source(g).key}.owner": "elsewhere:1:f"}}
            )
        return original(conn_, coll, docs)

    monkeypatch.setattr(ingest_mod, "insert_batch", insert)
    with pytest.raises(CorpusError, match="another dsgpt2 ingest took over writing it into 'b'"):
        ingest(conn, "b", [file_source(g)], batch_size=10)
    assert not read_meta(conn, ["b"])["b"]["sources"][file_source(g).key]["complete"]


def _without_root_overrides() -> list[str] | None:
    """A command prefix under which chmod 000 denies this user (root's overrides dropped), or None."""
    import os
    import shutil

    if os.geteuid() != 0:
        return []
    setpriv = shutil.which("setpriv")
    caps = "-dac_override,-dac_read_search,-fowner"
    return [setpriv, f"--bounding-set={caps}", f"--inh-caps={caps}", "--"] if setpriv else None


def test_an_input_whose_name_is_not_utf8_is_refused_before_reading(tmp_path: Path) -> None:
    """The ingest record keeps the input's path: a name of undecodable bytes is refused, not a traceback."""
    from dsgpt2.corpus.formats import file_source

    named = tmp_path / "caf\udce9.jsonl"  # latin-1 bytes, as os.fsdecode gives them
    named.write_text('{"text": "a b c"}\n')
    with pytest.raises(IngestError, match=r"its path is not UTF-8 text .*rename it; nothing was stored"):
        file_source(named, "auto")


def test_an_input_this_user_may_not_read_is_one_line_and_stores_nothing(tmp_path: Path) -> None:
    """It was told as a file damaged after record 0, and left an empty collection behind."""
    prefix = _without_root_overrides()
    if prefix is None:
        pytest.skip("running as root without setpriv: no file is unreadable")
    unreadable = tmp_path / "unread.jsonl"
    unreadable.write_text('{"text": "a b c"}\n')
    unreadable.chmod(0)
    tmp_path.chmod(0o777)
    cfg = write_config(tmp_path / "c.json", MONGO_CONNECTION_STRING=f"local://{tmp_path / 'db'}",
                       MONGO_CONNECTION_DB="d", COLLECTIONS=["b"])  # fmt: skip
    argv = [*prefix, sys.executable, "-m", "dsgpt2", "ingest", "--config", str(cfg), str(unreadable)]
    result = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip() == (
        f"dsgpt2: error: input file '{unreadable}' cannot be read (Permission denied); nothing was stored"
    )
    assert not (tmp_path / "db").exists()
