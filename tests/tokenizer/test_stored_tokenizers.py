"""Tokenizers kept in the database (``gridfs:NAME``): stored whole or not at all, fetched by every reader
into a copy of its own checked file by file, refused in one line where there is none or it is taken."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from conftest import run_cli, sample_corpus, store_config
from dsgpt2.db.blobs import BlobStore
from dsgpt2.db.client import Connection
from dsgpt2.db.config import load_config
from dsgpt2.errors import CheckpointError, ConfigError
from dsgpt2.tokenizer.bpe import tokenizer_digest
from dsgpt2.tokenizer.stored import BUCKET, MARKER, StoredTokenizer, fetch_tokenizer, local_tokenizer


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return sample_corpus(tmp_path_factory.mktemp("tok"), documents=300, vocab_size=300)


@pytest.fixture
def conn(corpus: dict[str, Path]) -> Connection:
    c = Connection(load_config(corpus["config"]))
    BlobStore(c, BUCKET).delete("")
    return c


def test_a_pushed_tokenizer_comes_back_whole_and_a_second_fetch_keeps_the_files_it_has(
    corpus: dict[str, Path], conn: Connection, tmp_path: Path
) -> None:
    stored = StoredTokenizer(conn, "tok/v1")
    digest = stored.push(corpus["tok"])
    assert digest == tokenizer_digest(corpus["tok"])
    local = fetch_tokenizer("gridfs:tok/v1", conn, tmp_path)
    assert local == tmp_path / "gridfs-tokenizers" / conn.config.db / "tok" / "v1"
    for f in corpus["tok"].iterdir():
        assert (local / f.name).read_bytes() == f.read_bytes(), f.name
    kept = (local / "vocab.json").stat().st_mtime_ns
    (local / "merges.txt").write_text("edited")  # a damaged copy is fetched again
    fetch_tokenizer("gridfs:tok/v1", conn, tmp_path)
    assert (local / "vocab.json").stat().st_mtime_ns == kept
    assert (local / "merges.txt").read_bytes() == (corpus["tok"] / "merges.txt").read_bytes()
    assert fetch_tokenizer(corpus["tok"], conn, tmp_path) == corpus["tok"]  # a directory is itself


@pytest.mark.timeout(60)
def test_a_tokenizer_that_cannot_be_read_or_holds_a_pipe_is_not_pushed(
    corpus: dict[str, Path], conn: Connection, tmp_path: Path
) -> None:
    """A tokenizer.json cut short was stored (exit 0) for runs to fail on; a named pipe in the directory
    ended the push in a traceback from its copy."""
    import shutil

    tok = tmp_path / "tok"
    shutil.copytree(corpus["tok"], tok)
    whole = (tok / "tokenizer.json").read_bytes()
    (tok / "tokenizer.json").write_bytes(whole[: len(whole) // 2])
    with pytest.raises(ConfigError, match=rf"tokenizer {tok}: tokenizer.json cannot be read \("):
        StoredTokenizer(conn, "cut").push(tok)
    (tok / "tokenizer.json").write_bytes(whole)
    (tok / "tokenizer_config.json").unlink()
    os.mkfifo(tok / "tokenizer_config.json")
    with pytest.raises(ConfigError, match=r"tokenizer_config.json: a named pipe, not a regular file; a tok"):
        StoredTokenizer(conn, "pipe").push(tok)
    assert StoredTokenizer(conn, "cut").marker() is None and StoredTokenizer(conn, "pipe").marker() is None


def test_an_upload_that_died_before_its_marker_stores_no_tokenizer(
    corpus: dict[str, Path], conn: Connection, tmp_path: Path
) -> None:
    store = BlobStore(conn, BUCKET)
    store.put("half/tokenizer.json", corpus["tok"] / "tokenizer.json")  # the files, no marker
    with pytest.raises(ConfigError, match=r"gridfs:half in .*: no tokenizer stored there; store one"):
        fetch_tokenizer("gridfs:half", conn, tmp_path)


def test_a_name_taken_is_refused_unless_overwritten_and_a_replacement_leaves_no_stale_file(
    corpus: dict[str, Path], conn: Connection, tmp_path: Path
) -> None:
    stored = StoredTokenizer(conn, "t")
    other = tmp_path / "other"
    other.mkdir()
    (other / "tokenizer.json").write_text(
        (corpus["tok"] / "tokenizer.json").read_text().replace("<|pad|>", "<|p|>")
    )
    stored.push(corpus["tok"])
    # The same tokenizer again is recognised as there: nothing refused, nothing replaced.
    assert stored.push(corpus["tok"]) == tokenizer_digest(corpus["tok"])
    again = run_cli(
        "vocab", "push", str(corpus["tok"]), "--out", "gridfs:t", "--config", str(corpus["config"])
    )
    assert again.returncode == 0 and "(already there) is in the database as gridfs:t" in again.stdout, (
        again.stderr
    )
    with pytest.raises(ConfigError, match=r"holds a tokenizer .* pass --overwrite"):
        stored.push(other)
    # A typo in the name lists what is stored, the closest named.
    with pytest.raises(
        ConfigError, match=r"no tokenizer stored there; .* the tokenizers stored there: .*gridfs:t\b"
    ):
        fetch_tokenizer("gridfs:tt", conn, tmp_path)
    assert stored.push(other, overwrite=True) == tokenizer_digest(other)
    assert BlobStore(conn, BUCKET).names("t/") == ["t/tokenizer.complete.json", "t/tokenizer.json"]
    assert json.loads(BlobStore(conn, BUCKET).get_text(f"t/{MARKER}", tmp_path / "m") or "")["tokenizer"] == (
        tokenizer_digest(other)
    )


def test_a_damaged_chunk_is_one_error_naming_the_file(
    corpus: dict[str, Path], conn: Connection, tmp_path: Path
) -> None:
    StoredTokenizer(conn, "d").push(corpus["tok"])
    files = conn.db[f"{BUCKET}.files"].find_one({"filename": "d/vocab.json"})
    chunks = conn.db[f"{BUCKET}.chunks"]
    chunk = chunks.find_one({"files_id": files["_id"], "n": 0})
    chunks.update_one({"_id": chunk["_id"]}, {"$set": {"data": b"x" + bytes(chunk["data"])[1:]}})
    with pytest.raises(CheckpointError, match=r"d/vocab\.json is damaged"):
        fetch_tokenizer("gridfs:d", conn, tmp_path)
    assert not (tmp_path / "gridfs-tokenizers" / conn.config.db / "d" / "vocab.json").exists()


def test_a_reader_without_the_config_takes_the_runs_own_copy_or_asks_for_the_config(
    corpus: dict[str, Path], conn: Connection, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    StoredTokenizer(conn, "r").push(corpus["tok"])
    assert local_tokenizer("gridfs:r", None, str(corpus["tok"])) == corpus["tok"]
    with pytest.raises(ConfigError, match=r"--vocab_dir gridfs:r: .* add the command's --config"):
        local_tokenizer("gridfs:r", None, str(tmp_path / "gone"))
    got = local_tokenizer("gridfs:r", str(corpus["config"]))
    assert got.is_relative_to(tmp_path / "cache" / "dsgpt2") and tokenizer_digest(got) == tokenizer_digest(
        corpus["tok"]
    )
    with pytest.raises(ConfigError, match="gridfs:NAME, NAME made of letters"):
        local_tokenizer("gridfs:a b", str(corpus["config"]))


def test_vocab_train_and_push_store_in_the_database_and_refuse_a_taken_name(tmp_path: Path) -> None:
    config, _ = store_config(tmp_path, ["stdlib"])
    assert run_cli("ingest", "--config", str(config), "--sample", "stdlib", "--limit", "200",
                   "--collection", "stdlib", "--no_progress").returncode == 0  # fmt: skip
    train = (
        "vocab",
        "train",
        "--from_mongo",
        "--config",
        str(config),
        "--vocab_size",
        "300",
        "--no_progress",
    )
    made = run_cli(*train, "--out", "gridfs:v")
    assert made.returncode == 0, made.stderr[-2000:]
    assert "tokenizer: it is in the database as gridfs:v (hash " in made.stdout, made.stdout
    again = run_cli(*train, "--out", "gridfs:v")
    assert (
        again.returncode == 2 and "gridfs:v in " in again.stderr and "holds a tokenizer (hash" in again.stderr
    )
    local = run_cli(*train, "--out", str(tmp_path / "tok"))
    assert local.returncode == 0, local.stderr[-2000:]
    push = ("vocab", "push", str(tmp_path / "tok"), "--config", str(config))
    pushed = run_cli(*push, "--out", "gridfs:w")
    digest = tokenizer_digest(tmp_path / "tok")
    assert pushed.returncode == 0 and f"gridfs:w (hash {digest})" in pushed.stdout, pushed.stderr[-2000:]
    not_stored = run_cli(*push, "--out", str(tmp_path / "elsewhere"))
    assert not_stored.returncode == 2 and "give where in the database, gridfs:NAME" in not_stored.stderr
    no_config = run_cli("vocab", "train", "--input", str(tmp_path), "--out", "gridfs:x")
    assert no_config.returncode == 2 and "add --config" in no_config.stderr.strip().splitlines()[-1]
    assert "Traceback" not in no_config.stderr + not_stored.stderr + again.stderr
    assert os.listdir(tmp_path / "tok")  # the local one untouched


def test_a_tokenizer_under_a_longer_name_survives_a_push_and_a_file_not_the_markers_is_refused(
    corpus: dict[str, Path], conn: Connection, tmp_path: Path
) -> None:
    StoredTokenizer(conn, "n/inner").push(corpus["tok"])
    StoredTokenizer(conn, "n").push(corpus["tok"])
    StoredTokenizer(conn, "n").push(corpus["tok"], overwrite=True)
    assert fetch_tokenizer("gridfs:n/inner", conn, tmp_path).is_dir()  # its files kept
    # Replaced while a reader reads it: the file downloaded is not the one the marker it read names.
    store = BlobStore(conn, BUCKET)
    store.put("n/merges.txt", corpus["tok"] / "vocab.json")
    with pytest.raises(CheckpointError, match=r"merges\.txt is not the file its marker names"):
        fetch_tokenizer("gridfs:n", conn, tmp_path / "other")
