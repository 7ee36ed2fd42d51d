"""The token cache's integrity: each file's size and SHA-256 recorded in cache.json when it is written,
checked when it is reused. A damaged cache is built again by its builder (one warning naming the file),
refused in one line by a reader; a cache.json of an earlier dsgpt2 (no record) is checked against its
own offsets and given its record; a killed append's leftovers are no damage."""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from conftest import make_config, seed, write_config
from dsgpt2.data.cache import CachedChunks, build_cache
from dsgpt2.data.sources import DataSpec, StreamingChunks, fingerprint
from dsgpt2.db.client import Connection
from dsgpt2.errors import ConfigError
from dsgpt2.tokenizer.bpe import VocabSettings, train_vocab

SPEC = DataSpec(context=32, chunk_docs=40, tr_ratio=0.8, seed=3, eot=0, pad=1)


def texts(n: int) -> list[str]:
    words = ("a", "cache", "keeps", "the", "tokens", "of", "every", "document", "once", "and", "checks")
    return [f"document {i}: " + " ".join(words[(i * k) % len(words)] for k in range(1, 30)) for i in range(n)]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("cache-damage") / "tok"
    train_vocab(iter(texts(120)), out, VocabSettings(vocab_size=300), "test", progress=False)
    return out


@pytest.fixture
def corpus() -> Connection:
    conn = Connection(make_config(["a"]))
    seed(conn, "a", texts(120))
    return conn


def build(conn: Connection, tokenizer: Path, cache: Path, counts: tuple[int, ...] = (120,)) -> dict[str, int]:
    source = StreamingChunks(conn.config, list(counts), tokenizer, SPEC, "all")
    return build_cache(source, cache, fingerprint(conn.config, tokenizer, SPEC), 300, workers=0)


def blocks(cache: Path, conn: Connection, tokenizer: Path) -> list[np.ndarray]:
    table = StreamingChunks(conn.config, [120], tokenizer, SPEC, "train").table
    cached = CachedChunks(cache, "train", table)
    return [cached[(1, c)].blocks for c in range(len(cached))]


def same(a: list[np.ndarray], b: list[np.ndarray]) -> bool:
    return len(a) == len(b) and all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))


@pytest.fixture
def caught(caplog: pytest.LogCaptureFixture):
    """The cache's log records, whatever a command did to logging before."""
    logger = logging.getLogger("dsgpt2.data.cache")
    level, propagate = logger.level, logger.propagate
    logger.addHandler(caplog.handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False  # each record once, through the handler added here
    yield caplog
    logger.removeHandler(caplog.handler)
    logger.setLevel(level)
    logger.propagate = propagate


def test_the_cache_records_each_files_size_and_sha256_and_goes_on_hashing_over_an_append(
    corpus: Connection, tokenizer: Path, tmp_path: Path
) -> None:
    build(corpus, tokenizer, tmp_path, (80,))
    build(corpus, tokenizer, tmp_path)  # the corpus grown: chunks appended, the digests gone on with
    files = json.loads((tmp_path / "cache.json").read_text())["files"]
    assert sorted(files) == ["chunks.npy", "offsets.bin", "tokens.bin"]
    for name in ("offsets.bin", "tokens.bin"):
        data = (tmp_path / name).read_bytes()
        assert files[name] == {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}  # sha256sum's
    rows = np.load(tmp_path / "chunks.npy")
    assert len(rows) == 3 and files["chunks.npy"]["sha256"] == hashlib.sha256(rows.tobytes()).hexdigest()


def _zeros(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[: len(data) // 2] = bytes(len(data) // 2)
    path.write_bytes(bytes(data))


def _ones(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[10:200] = b"\xff" * 190
    path.write_bytes(bytes(data))


def _halve(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


DAMAGE: dict[str, tuple[str, Callable[[Path], None]]] = {
    "zeros over tokens.bin, same size": ("tokens.bin", _zeros),
    "0xFF inside tokens.bin": ("tokens.bin", _ones),
    "tokens.bin cut in half": ("tokens.bin", _halve),
    "chunks.npy cut in half": ("chunks.npy", _halve),
    "offsets.bin zeroed": ("offsets.bin", _zeros),
    "tokens.bin missing": ("tokens.bin", lambda p: p.unlink()),
}


@pytest.mark.parametrize("damage", DAMAGE)
def test_a_damaged_cache_is_built_again_by_its_builder_with_one_warning_naming_the_file(
    corpus: Connection, tokenizer: Path, tmp_path: Path, caught: pytest.LogCaptureFixture, damage: str
) -> None:
    build(corpus, tokenizer, tmp_path)
    name, spoil = DAMAGE[damage]
    before = {n: (tmp_path / n).read_bytes() for n in ("tokens.bin", "offsets.bin", "chunks.npy")}
    expected = blocks(tmp_path, corpus, tokenizer)
    spoil(tmp_path / name)
    caught.clear()
    build(corpus, tokenizer, tmp_path)
    warnings = [r.getMessage() for r in caught.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and f"token cache {tmp_path} is damaged: {name} " in warnings[0], warnings
    assert "built again" in warnings[0]
    assert {n: (tmp_path / n).read_bytes() for n in before} == before
    assert same(expected, blocks(tmp_path, corpus, tokenizer))
    caught.clear()
    build(corpus, tokenizer, tmp_path)  # whole again: reused, nothing said
    assert not [r for r in caught.records if r.levelno >= logging.WARNING]


@pytest.mark.parametrize("damage", ["tokens.bin cut in half", "chunks.npy cut in half", "tokens.bin missing"])
def test_a_reader_refuses_a_cache_cut_short_in_one_line(
    corpus: Connection, tokenizer: Path, tmp_path: Path, damage: str
) -> None:
    build(corpus, tokenizer, tmp_path)
    name, spoil = DAMAGE[damage]
    spoil(tmp_path / name)
    table = StreamingChunks(corpus.config, [120], tokenizer, SPEC, "train").table
    with pytest.raises(ConfigError) as caught:
        CachedChunks(tmp_path, "train", table)
    line = str(caught.value)
    assert "\n" not in line and caught.value.exit_code == 2
    assert f"--cache_dir {tmp_path}: {name} " in line and "`dsgpt2 tokenize`" in line and "delete" in line


def test_a_cache_without_a_record_is_checked_against_its_offsets_and_given_one(
    corpus: Connection, tokenizer: Path, tmp_path: Path, caught: pytest.LogCaptureFixture
) -> None:
    build(corpus, tokenizer, tmp_path)
    meta = json.loads((tmp_path / "cache.json").read_text())
    record = meta.pop("files")
    (tmp_path / "cache.json").write_text(json.dumps(meta))  # as the version before wrote it
    tokens = (tmp_path / "tokens.bin").read_bytes()
    expected = blocks(tmp_path, corpus, tokenizer)  # read as it is
    caught.clear()
    build(corpus, tokenizer, tmp_path)
    assert "sizes and digests recorded (an earlier dsgpt2 wrote it)" in caught.text
    assert not [r for r in caught.records if r.levelno >= logging.WARNING]
    assert json.loads((tmp_path / "cache.json").read_text())["files"] == record
    assert (tmp_path / "tokens.bin").read_bytes() == tokens
    assert same(expected, blocks(tmp_path, corpus, tokenizer))
    # One cut short: said and built again, as a cache with a record is.
    (tmp_path / "cache.json").write_text(json.dumps(meta))
    _halve(tmp_path / "tokens.bin")
    with pytest.raises(ConfigError, match=r"tokens\.bin holds"):
        blocks(tmp_path, corpus, tokenizer)
    caught.clear()
    build(corpus, tokenizer, tmp_path)
    assert "is damaged: tokens.bin holds" in caught.text
    assert json.loads((tmp_path / "cache.json").read_text())["files"] == record


def test_a_killed_appends_leftovers_are_no_damage(
    corpus: Connection, tokenizer: Path, tmp_path: Path, caught: pytest.LogCaptureFixture
) -> None:
    build(corpus, tokenizer, tmp_path, (80,))
    with open(tmp_path / "tokens.bin", "ab") as f:
        f.write(b"\x07" * 1000)  # tokens written, the cache.json that counts them never
    caught.clear()
    build(corpus, tokenizer, tmp_path)  # appended after what the cache holds
    assert not [r for r in caught.records if r.levelno >= logging.WARNING]
    record = json.loads((tmp_path / "cache.json").read_text())["files"]["tokens.bin"]
    assert record["sha256"] == hashlib.sha256((tmp_path / "tokens.bin").read_bytes()).hexdigest()
    assert len(blocks(tmp_path, corpus, tokenizer)) == 3


def test_tokenize_builds_a_damaged_cache_again_and_says_so(
    corpus: Connection,
    tokenizer: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    caught: pytest.LogCaptureFixture,
) -> None:
    from dsgpt2.cli.main import main

    cfg = write_config(tmp_path / "c.json", **corpus.config.to_dict() | {"COLLECTIONS": ["a"]})
    cache = tmp_path / "cache"
    argv = ["tokenize", "--config_train", str(cfg), "--vocab_dir", str(tokenizer), "--context_length", "32",
            "--chunk_docs", "40", "--cache_dir", str(cache), "--num_workers", "0",
            "--no_progress"]  # fmt: skip
    assert main(argv) == 0
    _zeros(cache / "tokens.bin")
    capsys.readouterr()
    caught.clear()
    assert main(argv) == 0
    assert "3 chunk(s) tokenized, 3 in all" in capsys.readouterr().out  # not "already up to date"
    assert f"token cache {cache} is damaged: tokens.bin is not what was written" in caught.text
