"""An input given to ingest again: a file that changed since is refused rather than called ingested; the
built-in sample under another --limit is refused rather than stored twice; a file read with other options
is warned about; an input none of whose records is usable is refused and leaves nothing behind; a file
whose documents are all duplicates of stored ones (--dedup) is no such input."""

from __future__ import annotations

import os
from pathlib import Path

from conftest import db_for, make_config, run_cli, store_config
from dsgpt2.db.client import Connection
from dsgpt2.db.meta import read_meta


def _ingest(cfg: Path, *args: str) -> object:
    return run_cli("ingest", "--config", str(cfg), "--no_progress", *args)


def _texts(store: Path, name: str) -> list[str]:
    conn = Connection(make_config([name], **db_for(store)))
    return [d["filt_text"] for d in conn.db[name].find({}, sort=[("idx", 1)])]


def test_a_file_that_changed_since_it_was_ingested_is_refused_not_called_ingested(tmp_path: Path) -> None:
    cfg, store = store_config(tmp_path, ["a"])
    f = tmp_path / "d.txt"
    f.write_text("alpha doc\nbeta doc\n")
    assert _ingest(cfg, str(f)).returncode == 0
    f.write_text("gamma, a document of its own\ndelta\n")
    changed = _ingest(cfg, str(f))
    assert changed.returncode == 2 and "Traceback" not in changed.stderr, changed.stderr
    line = changed.stderr.strip().splitlines()[-1]
    assert "d.txt (text: line): the file changed since it was ingested into 'a' (19 bytes then, 35" in line
    assert "dsgpt2 drop --collection a" in line and _texts(store, "a") == ["alpha doc", "beta doc"]
    # The same size, only touched (or rewritten alike): already ingested, said with a warning.
    f.write_text("alpha doc\nbeta doc\n")
    os.utime(f, ns=(1, 1))
    touched = _ingest(cfg, str(f))
    assert touched.returncode == 0 and "already ingested, nothing to do" in touched.stdout, touched.stderr
    assert "modified since it was ingested into a (the same size)" in touched.stderr


def test_the_sample_under_another_limit_is_refused_and_a_file_read_otherwise_is_warned_about(
    tmp_path: Path,
) -> None:
    cfg, store = store_config(tmp_path, ["a"])
    assert _ingest(cfg, "--sample", "stdlib", "--limit", "20").returncode == 0
    more = _ingest(cfg, "--sample", "stdlib", "--limit", "30")
    assert more.returncode == 2, more.stderr
    line = more.stderr.strip().splitlines()[-1]
    assert "(first 30): 'a' already holds sample stdlib" in line and "(first 20)" in line, line
    assert "would store the documents they share twice" in line and len(_texts(store, "a")) == 20
    assert _ingest(cfg, "--sample", "stdlib", "--limit", "20").returncode == 0  # the same: nothing to do
    f = tmp_path / "p.txt"
    f.write_text("one\n\ntwo\n")
    assert _ingest(cfg, str(f)).returncode == 0
    other = _ingest(cfg, "--split", "paragraph", str(f))
    assert other.returncode == 0 and "'a' already holds this file as p.txt (text: line)" in other.stderr


def test_an_input_without_one_usable_record_is_refused_and_leaves_nothing_but_duplicates_are_fine(
    tmp_path: Path,
) -> None:
    cfg, store = store_config(tmp_path, ["u"])
    bad = tmp_path / "b.jsonl"
    bad.write_text("not json at all\nnor this\n")
    refused = _ingest(cfg, "--collection", "u", str(bad))
    assert refused.returncode == 2 and "Traceback" not in refused.stderr, refused.stderr
    line = refused.stderr.strip().splitlines()[-1]
    assert "b.jsonl (jsonl: text): none of its 2 record(s) is usable (bad_json: 2); nothing was" in line
    conn = Connection(make_config(["u"], **db_for(store)))
    assert "u" not in conn.db.list_collection_names() and "u" not in read_meta(conn, ["u"])
    good = tmp_path / "g.jsonl"
    good.write_text('{"text": "a document"}\n{"text": "another one"}\n')
    copy = tmp_path / "copy.jsonl"
    copy.write_text(good.read_text())
    assert _ingest(cfg, "--collection", "u", "--dedup", str(good)).returncode == 0
    duplicates = _ingest(cfg, "--collection", "u", "--dedup", str(copy))
    assert duplicates.returncode == 0 and "2 skipped (duplicate: 2)" in duplicates.stdout, duplicates.stderr
