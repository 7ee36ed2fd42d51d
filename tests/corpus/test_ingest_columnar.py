"""Ingest of the formats pretraining corpora ship in: Parquet (FineWeb's layout), Arrow files and
streams, `datasets` save_to_disk directories; kept columns, bounded batches, exactly-once resume, and
binary files refused instead of stored as text."""

from __future__ import annotations

import csv
import datetime
import decimal
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from conftest import ROOT, db_for, make_config, run_cli, store_config
from dsgpt2.corpus import columnar
from dsgpt2.corpus import ingest as ingest_mod
from dsgpt2.corpus.cleaning import clean_text
from dsgpt2.corpus.formats import detect_format, file_source
from dsgpt2.corpus.ingest import ingest
from dsgpt2.db.client import Connection
from dsgpt2.db.meta import read_meta
from dsgpt2.db.validate import validate_collection
from dsgpt2.errors import BadDocumentError, IngestError
from pace import deadline, wait_for


def fineweb_rows(n: int, start: int = 0) -> dict[str, list]:
    """Rows in FineWeb's layout (its column names and types), texts with spaces and lines to clean."""
    ids = range(start, start + n)
    return {
        "text": [f"Document {i}:  the  quick brown fox.\r\nLine two of {i}.   " for i in ids],
        "id": [f"<urn:uuid:{i:08d}>" for i in ids],
        "dump": ["CC-MAIN-2024-10"] * n,
        "url": [f"https://example.org/{i}" for i in ids],
        "date": [f"2024-02-{1 + i % 28:02d}T00:00:00Z" for i in ids],
        "file_path": [f"s3://commoncrawl/{i}.warc.gz" for i in ids],
        "language": ["en"] * n,
        "language_score": [0.5 + (i % 50) / 100 for i in ids],
        "token_count": [12 + i % 7 for i in ids],
    }


def write_parquet(path: Path, n: int, row_group_size: int = 100) -> Path:
    pq.write_table(pa.table(fineweb_rows(n)), path, row_group_size=row_group_size)
    return path


def _conn() -> Connection:
    return Connection(make_config(["a"]))


def _docs(conn: Connection, name: str = "a") -> list[dict]:
    return list(conn.db[name].find({}, {"_id": 0}, sort=[("idx", 1)]))


def _expected(n: int) -> list[str]:
    return [clean_text(t) for t in fineweb_rows(n)["text"]]


def test_parquet_in_fineweb_layout_with_kept_fields(tmp_path: Path) -> None:
    path = write_parquet(tmp_path / "000_00000.parquet", 250)
    conn = _conn()
    keep = ("id", "url", "dump", "language_score", "token_count")
    report = ingest(conn, "a", [file_source(path, keep_fields=keep)])
    docs = _docs(conn)
    assert [d["filt_text"] for d in docs] == _expected(250) and report.inserted == 250
    rows = fineweb_rows(250)
    assert docs[7]["form"] == rows["text"][7]
    for name in keep:
        assert [d[name] for d in docs] == rows[name]
    assert "file_path" not in docs[0] and "date" not in docs[0]
    assert validate_collection(conn, "a").ok
    # Without --keep_fields only the text is stored.
    conn2 = Connection(make_config(["b"]))
    ingest(conn2, "b", [file_source(path)])
    assert set(conn2.db["b"].find_one({}, {"_id": 0})) == {
        "idx",
        "form",
        "filt_text",
        "text_hash",
        "source",
        "source_pos",
    }


def test_arrow_file_stream_and_a_datasets_directory(tmp_path: Path) -> None:
    import datasets

    table = pa.table(fineweb_rows(120))
    with pa.OSFile(str(tmp_path / "f.arrow"), "wb") as sink, pa.ipc.new_file(sink, table.schema) as w:
        w.write_table(table, max_chunksize=50)
    with pa.OSFile(str(tmp_path / "s.data"), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as w:
        w.write_table(table, max_chunksize=5000)
    ds = datasets.Dataset.from_dict(fineweb_rows(120))
    ds.save_to_disk(str(tmp_path / "saved"), max_shard_size="4KB")  # several Arrow files
    assert len(json.loads((tmp_path / "saved" / "state.json").read_text())["_data_files"]) > 1
    assert detect_format(tmp_path / "f.arrow") == "arrow"
    assert detect_format(tmp_path / "s.data") == "arrow"  # by its first bytes
    assert detect_format(tmp_path / "saved") == "dataset"
    conn = _conn()
    for i, name in enumerate(("f.arrow", "s.data", "saved")):
        ingest(conn, f"c{i}", [file_source(tmp_path / name, keep_fields=("id",))])
        docs = _docs(conn, f"c{i}")
        assert [d["filt_text"] for d in docs] == _expected(120), name
        assert [d["id"] for d in docs] == fineweb_rows(120)["id"]
    datasets.DatasetDict({"train": ds, "test": ds}).save_to_disk(str(tmp_path / "dict"))
    with pytest.raises(IngestError, match=r"DatasetDict with splits train, test: give one split's directory"):
        file_source(tmp_path / "dict")


def test_batches_are_bounded_and_only_the_asked_columns_are_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = write_parquet(tmp_path / "big.parquet", 5000, row_group_size=5000)
    table = columnar.Table(path, "parquet", "text", ("id",))
    sizes, columns = [], set()
    original = columnar.Table._rows

    def spy(self, batch):
        sizes.append(batch.num_rows)
        columns.update(batch.schema.names)
        return original(self, batch)

    monkeypatch.setattr(columnar.Table, "_rows", spy)
    assert sum(1 for _ in table.rows()) == 5000
    assert max(sizes) <= columnar.BATCH_ROWS and columns == {"text", "id"}


def test_a_resume_starts_at_its_row_without_reading_the_groups_before(tmp_path: Path) -> None:
    path = write_parquet(tmp_path / "x.parquet", 1000, row_group_size=100)
    table = columnar.Table(path, "parquet", "text", ())
    rows = [r.text for r in table.rows(0)]
    assert [r.text for r in table.rows(437)] == rows[437:]
    assert [r.text for r in table.rows(1000)] == []
    saved = tmp_path / "saved"
    import datasets

    datasets.Dataset.from_dict(fineweb_rows(300)).save_to_disk(str(saved), max_shard_size="4KB")
    t2 = columnar.Table(saved, "dataset", "text", ())
    every = [r.text for r in t2.rows(0)]
    assert len(every) == 300 and [r.text for r in t2.rows(123)] == every[123:]


class Crash(Exception):
    pass


def test_an_interrupted_parquet_ingest_resumes_exactly_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = write_parquet(tmp_path / "x.parquet", 700, row_group_size=64)
    conn = _conn()
    original = ingest_mod.insert_batch
    calls = {"n": 0}

    def insert(conn_, coll, docs):
        calls["n"] += 1
        if calls["n"] == 4:
            original(conn_, coll, docs[:17])  # part of a batch lands, then the crash
            raise Crash
        return original(conn_, coll, docs)

    monkeypatch.setattr(ingest_mod, "insert_batch", insert)
    with pytest.raises(Crash):
        ingest(conn, "a", [file_source(path, keep_fields=("id",))], batch_size=100)
    monkeypatch.setattr(ingest_mod, "insert_batch", original)
    report = ingest(conn, "a", [file_source(path, keep_fields=("id",))], batch_size=100)
    assert report.sources[0].resumed_at == 317
    docs = _docs(conn)
    assert [d["filt_text"] for d in docs] == _expected(700)
    assert [d["id"] for d in docs] == fineweb_rows(700)["id"]
    assert read_meta(conn, ["a"])["a"]["count"] == 700 and validate_collection(conn, "a").ok
    again = ingest(conn, "a", [file_source(path, keep_fields=("id",))])
    assert again.sources[0].already_done and len(_docs(conn)) == 700


def test_a_killed_parquet_ingest_process_resumes_exactly_once(tmp_path: Path) -> None:
    n = 6000
    path = write_parquet(tmp_path / "x.parquet", n, row_group_size=500)
    cfg, store = store_config(tmp_path)
    args = [sys.executable, "-m", "dsgpt2", "ingest", "--config", str(cfg), "--batch_size", "200",
            "--keep_fields", "id,language_score", str(path)]  # fmt: skip
    proc = subprocess.Popen(args, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    stored = Connection(make_config(["a"], **db_for(store))).db["a"]
    wait_for(lambda: stored.estimated_document_count() >= 400, 120, "400 documents stored", proc, every=0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL, "the ingest finished before it could be killed"
    rerun = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=deadline(300))
    assert rerun.returncode == 0, rerun.stderr
    assert "resumed after record" in rerun.stdout
    conn = Connection(make_config(["a"], **db_for(store)))
    docs = _docs(conn)
    assert [d["filt_text"] for d in docs] == _expected(n)
    assert [d["language_score"] for d in docs] == fineweb_rows(n)["language_score"]
    assert validate_collection(conn, "a").ok


def test_columns_become_what_mongodb_stores(tmp_path: Path) -> None:
    table = pa.table({
        "text": ["a b", "c d"],
        "day": [datetime.date(2024, 1, 2), None],
        "price": pa.array([decimal.Decimal("1.50"), decimal.Decimal("2")], pa.decimal128(5, 2)),
        "big": pa.array([2**64 - 1, 3], pa.uint64()),
        "tags": [["x", "y"], []],
        "meta": [{"k": 1}, {"k": 2}],
    })  # fmt: skip
    pq.write_table(table, tmp_path / "t.parquet")
    cfg, store = store_config(tmp_path)
    result = run_cli("ingest", "--config", str(cfg), "--keep_fields", "day,price,big,tags,meta",
                     str(tmp_path / "t.parquet"))  # fmt: skip
    assert result.returncode == 0, result.stderr
    conn = Connection(make_config(["a"], **db_for(store)))
    first, second = _docs(conn)
    assert first["day"] == datetime.datetime(2024, 1, 2) and second["day"] is None
    assert first["price"] == 1.5 and first["big"] == str(2**64 - 1) and second["big"] == 3
    assert first["tags"] == ["x", "y"] and second["meta"] == {"k": 2}


def test_a_kept_column_is_stored_under_the_name_given(tmp_path: Path) -> None:
    """``--keep_fields source:src,url``: a column named like a document's own field kept under
    another name, in every format that keeps columns."""
    rows = fineweb_rows(30)
    table = pa.table({"text": rows["text"], "source": [f"s{i}" for i in range(30)], "url": rows["url"]})
    pq.write_table(table, tmp_path / "x.parquet")
    lines = [
        {"text": t, "source": f"s{i}", "url": u}
        for i, (t, u) in enumerate(zip(rows["text"], rows["url"], strict=True))
    ]
    (tmp_path / "x.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    with open(tmp_path / "x.csv", "w", newline="") as f:
        w = csv.DictWriter(f, ["text", "source", "url"])
        w.writeheader()
        w.writerows(lines)
    for i, name in enumerate(("x.parquet", "x.jsonl", "x.csv")):
        conn = Connection(make_config([f"k{i}"]))
        ingest(conn, f"k{i}", [file_source(tmp_path / name, keep_fields=("source:src", "url"))])
        docs = _docs(conn, f"k{i}")
        assert [d["src"] for d in docs] == [f"s{j}" for j in range(30)] and docs[4]["url"] == rows["url"][4]
        assert docs[0]["source"] != "s0"  # a document's own field, as ingest writes it


def test_bad_columnar_input_is_one_line(tmp_path: Path) -> None:
    path = write_parquet(tmp_path / "x.parquet", 10)
    cfg, _ = store_config(tmp_path)
    cases = [
        (
            ["--field", "body", str(path)],
            "x.parquet has no column 'body' (--field); its columns are text, id,",
        ),
        (["--field", "body", str(path)], "name the text column with --field, e.g. --field text"),
        (["--keep_fields", "id,nope", str(path)], "no column 'nope' (--keep_fields)"),
        (
            ["--keep_fields", "idx", str(path)],
            "--keep_fields idx: 'idx' is a field of every document (_id, idx,",
        ),
        (
            ["--keep_fields", "id,source", str(path)],
            "keep the column under another name: --keep_fields source:src",
        ),
        (["--keep_fields", "id:", str(path)], "give COLUMN or COLUMN:NAME (e.g. source:src)"),
        (["--keep_fields", "id:a.b", str(path)], "--keep_fields id:a_b_kept"),
        (["--field", "token_count", str(path)], "column 'token_count' holds int64, not text"),
    ]
    truncated = tmp_path / "cut.parquet"
    truncated.write_bytes(path.read_bytes()[:200])
    cases.append(([str(truncated)], "cut.parquet: not a readable parquet input"))
    (tmp_path / "notes").mkdir()
    cases.append(([str(tmp_path / "notes")], "not a `datasets` save_to_disk directory"))
    cases.append((["--format", "dataset", str(path)], "x.parquet is a file, and --format dataset"))
    for extra, message in cases:
        result = run_cli("ingest", "--config", str(cfg), *extra)
        assert result.returncode == 2, (extra, result.stderr)
        assert message in result.stderr and result.stderr.count("\n") == 1, (extra, result.stderr)


def test_damage_inside_a_parquet_file_keeps_what_precedes_it(tmp_path: Path) -> None:
    path = write_parquet(tmp_path / "x.parquet", 2000, row_group_size=500)
    meta = pq.ParquetFile(path).metadata
    start = meta.row_group(2).column(0).data_page_offset
    data = bytearray(path.read_bytes())
    data[start : start + 300] = os.urandom(300)  # garble the third row group's first text page
    path.write_bytes(bytes(data))
    conn = _conn()
    with pytest.raises(IngestError, match="the file is damaged after record"):
        ingest(conn, "a", [file_source(path)])
    docs = _docs(conn)
    assert 0 < len(docs) < 2000 and [d["filt_text"] for d in docs] == _expected(2000)[: len(docs)]


@pytest.mark.parametrize(
    "name, data, what",
    [
        ("data.txt", None, "a Parquet file"),
        ("report.txt", b"%PDF-1.7\n%\xe2\xe3\xcf\xd3\n1 0 obj\n", "a PDF"),
        ("corpus.jsonl", b"PK\x03\x04\x14\x00\x00\x00\x08\x00", "a zip archive"),
        ("corpus.txt", b"\x28\xb5\x2f\xfd\x04\x58\x00\x00", "zstd-compressed"),
        ("blob.csv", b"text\nabc\x00\x01\x02def\n", "binary"),
    ],
)
def test_a_binary_file_is_read_by_its_reader_or_refused_never_stored_as_text(
    tmp_path: Path, name: str, data: bytes | None, what: str
) -> None:
    cfg, store = store_config(tmp_path)
    path = tmp_path / name
    if data is None:  # a Parquet file under a text name: known by its first bytes, read as Parquet
        write_parquet(path, 30)
        result = run_cli("ingest", "--config", str(cfg), str(path))
        assert result.returncode == 0, result.stderr
        conn = Connection(make_config(["a"], **db_for(store)))
        assert [d["filt_text"] for d in _docs(conn)] == _expected(30)
        forced = run_cli("ingest", "--config", str(cfg), "--format", "text", str(path))
        assert forced.returncode == 2 and "is a Parquet file, not text; nothing was stored" in forced.stderr
        return
    path.write_bytes(data + b"\n" * 10)
    result = run_cli("ingest", "--config", str(cfg), str(path))
    assert result.returncode == 2 and f"{name} is {what}" in result.stderr, result.stderr
    assert result.stderr.count("\n") == 1 and "nothing was stored" in result.stderr


def test_a_skipped_row_is_located_by_row_group_and_row(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    rows = fineweb_rows(300)
    bad = {5: "null", 70: "null", 130: "empty", 199: "null", 250: "null"}
    for i, why in bad.items():
        rows["text"][i] = None if why == "null" else "   "
    path = tmp_path / "x.parquet"
    pq.write_table(pa.table(rows), path, row_group_size=64)
    monkeypatch.setattr(columnar, "BATCH_ROWS", 16)  # several batches in a row group
    report = tmp_path / "skipped.jsonl"
    conn = _conn()
    ingest(conn, "a", [file_source(path)], report_file=report)
    got = [json.loads(x) for x in report.read_text().splitlines()]
    assert got == [
        {"file": str(path), "row_group": i // 64, "row": i % 64, "reason": why} for i, why in bad.items()
    ]
    groups = pq.ParquetFile(path)
    assert [groups.read_row_group(g["row_group"]).column("text")[g["row"]].as_py() for g in got] == [
        rows["text"][i] for i in bad
    ]
    # A resumed read starts in a row group: its rows are located in that group all the same.
    table = columnar.Table(path, "parquet", "text", ())
    rest = table.rows(100)
    next(rest)
    assert table.where() == {"file": str(path), "row_group": 1, "row": 36}
    with pytest.raises(BadDocumentError, match=r"x\.parquet row group 0, row 5 is unusable \(null\)"):
        ingest(conn, "b", [file_source(path)], strict=True)
    # An Arrow file: the record batch and the row in it.
    arrow = tmp_path / "x.arrow"
    with pa.OSFile(str(arrow), "wb") as sink, pa.ipc.new_file(sink, pa.table(rows).schema) as w:
        w.write_table(pa.table(rows), max_chunksize=50)
    ingest(conn, "c", [file_source(arrow)], report_file=report)
    located = [(x["row_group"], x["row"]) for x in map(json.loads, report.read_text().splitlines())]
    assert located == [(i // 50, i % 50) for i in bad]
