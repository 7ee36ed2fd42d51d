from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT, built_once, make_config, run_cli, seed, store_config
from dsgpt2.corpus.ingest import ingest
from dsgpt2.corpus.readers import builtin_source
from dsgpt2.db.client import Connection
from dsgpt2.db.config import load_config
from dsgpt2.errors import ConfigError
from dsgpt2.tokenizer import texts as vocab_mod
from dsgpt2.tokenizer.bpe import EOT, PAD, VocabSettings, train_vocab
from dsgpt2.tokenizer.texts import download, mongo_texts, shard_texts
from pace import deadline

ODD_TEXTS = [
    "naïve café, São Paulo — “quotes” and ‘apostrophes’",
    "日本語のテキストと한국어 텍스트",
    "emoji 🎉 family 👨\u200d👩\u200d👧 flags 🇫🇷",
    "  leading spaces\n\n\ttabs and\r\nwindows lines  ",
    "math ∑ x² ≤ ∞ and zero\u200bwidth",
]


def _records(directory: Path) -> list[dict]:
    """Every line of every shard in ``directory``, in order."""
    out = []
    for path in sorted(directory.glob("shard-*.jsonl")):
        with open(path, encoding="utf-8") as f:
            out += [json.loads(line) for line in f]
    return out


def _sample_conn(limit: int | None = None) -> Connection:
    conn = Connection(make_config(["stdlib"]))
    ingest(conn, "stdlib", [builtin_source("stdlib", limit)])
    return conn


def _train(base: Path) -> None:
    conn = _sample_conn()
    report = download(conn.config, base / "shards", workers=2, shards=4, progress=False)
    assert report.documents == 9199 or report.documents > 5000
    train_vocab(
        shard_texts(base / "shards"),
        base / "tok",
        VocabSettings(vocab_size=4000, reserved=2),
        source="test",
        progress=False,
    )


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Sample corpus → shards (2 workers) → a 4,000-token vocabulary with 2 reserved tokens, made once
    per test run (the test processes share them)."""
    base, _ = built_once(tmp_path_factory, "vocab", _train)
    return {"shards": base / "shards", "tok": base / "tok"}


def _load(path: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))


def test_output_directory_loads_with_autotokenizer(trained: dict[str, Path]) -> None:
    from transformers import GPT2TokenizerFast

    names = {p.name for p in trained["tok"].iterdir()}
    assert {"vocab.json", "merges.txt", "tokenizer.json", "tokenizer_config.json"} <= names
    tok = _load(trained["tok"])
    assert isinstance(tok, GPT2TokenizerFast)
    assert len(tok) == 4000
    assert tok.model_max_length == 1024


def test_special_tokens_have_fixed_ids_and_survive_save_load(
    trained: dict[str, Path], tmp_path: Path
) -> None:
    tok = _load(trained["tok"])
    expected = {EOT: 0, PAD: 1, "<|user|>": 2, "<|bot|>": 3, "<unused0>": 4, "<unused1>": 5}
    for token, i in expected.items():
        assert tok.convert_tokens_to_ids(token) == i
    assert (tok.eos_token_id, tok.bos_token_id, tok.pad_token_id) == (0, 0, 1)
    assert tok("<|user|>hello<|bot|>").input_ids[0] == 2  # never split into pieces
    tok.save_pretrained(str(tmp_path / "again"))
    again = _load(tmp_path / "again")
    for token, i in expected.items():
        assert again.convert_tokens_to_ids(token) == i
    assert again.pad_token == PAD and again.eos_token == EOT


def test_a_damaged_or_missing_tokenizer_file_is_one_line_with_the_way_out(
    trained: dict[str, Path], tmp_path: Path
) -> None:
    """A tokenizer.json cut short (a copy that stopped, a disk that filled) is refused by name by what
    loads it (training, tokenize, evaluation), not with the tokenizers library's bare exception."""
    from dsgpt2.tokenizer.bpe import load_tokenizer

    damaged = tmp_path / "tok"
    damaged.mkdir()
    (damaged / "tokenizer.json").write_bytes((trained["tok"] / "tokenizer.json").read_bytes()[:500])
    way_out = "give a whole tokenizer directory (--vocab_dir), or train one again with `dsgpt2 vocab train`"
    with pytest.raises(ConfigError) as cut:
        load_tokenizer(damaged)
    assert str(cut.value).startswith(f"tokenizer {damaged}: tokenizer.json cannot be read (EOF while parsing")
    assert str(cut.value).endswith(way_out) and "\n" not in str(cut.value)
    with pytest.raises(ConfigError, match=r"tokenizer.json cannot be read \(not found\)"):
        load_tokenizer(tmp_path)
    assert load_tokenizer(trained["tok"]).get_vocab_size() > 0


def test_round_trip_including_non_ascii_and_emoji(trained: dict[str, Path]) -> None:
    tok = _load(trained["tok"])
    texts = ODD_TEXTS + [r["text"] for r in _records(trained["shards"])[:300]]
    for text in texts:
        ids = tok(text).input_ids
        assert tok.decode(ids) == text
    # Learnt merges compress English: well under one token per character.
    sample = " ".join(texts[len(ODD_TEXTS) :])
    assert len(tok(sample).input_ids) < 0.35 * len(sample)


def test_second_implementations_give_identical_ids(trained: dict[str, Path]) -> None:
    from transformers import GPT2TokenizerFast

    ours = _load(trained["tok"])
    from_files = GPT2TokenizerFast(
        vocab=str(trained["tok"] / "vocab.json"), merges=str(trained["tok"] / "merges.txt")
    )
    enc = _tiktoken_from(trained["tok"])
    texts = ODD_TEXTS + list(shard_texts(trained["shards"]))[:2000]
    for text in texts:
        ids = ours(text).input_ids
        assert from_files(text).input_ids == ids
        assert enc.encode_ordinary(text) == ids


def _tiktoken_from(directory: Path):
    tiktoken = pytest.importorskip("tiktoken")
    from bench.tiktoken_vocab import encoding_from_vocab

    assert tiktoken is not None
    return encoding_from_vocab(directory)


def test_download_is_resumable_and_complete(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    conn = _sample_conn(limit=1200)
    straight = tmp_path / "straight"
    download(conn.config, straight, workers=1, shards=5, chunk=100, progress=False)

    out = tmp_path / "resumed"
    real = vocab_mod._download_shard
    done = []

    def crash_after_two(task):
        if len(done) == 2:
            raise KeyboardInterrupt
        done.append(task[2])
        return real(task)

    monkeypatch.setattr(vocab_mod, "_download_shard", crash_after_two)
    with pytest.raises(KeyboardInterrupt):
        download(conn.config, out, workers=1, shards=5, chunk=100, progress=False)
    (out / ".shard-leftover").write_text('{"idx": 0, "text": "partial"}\n')  # a temp file of a killed worker
    monkeypatch.setattr(vocab_mod, "_download_shard", real)
    report = download(conn.config, out, workers=2, shards=5, chunk=100, progress=False)
    assert (report.already_done, report.written) == (2, 3)
    for k in range(5):
        name = f"shard-{k:05d}.jsonl"
        assert (out / name).read_text() == (straight / name).read_text()
    ids = [r["idx"] for r in _records(out)]
    assert ids == list(range(1200))
    assert not list(out.glob(".shard-*"))  # the killed worker's leftover is gone
    again = download(conn.config, out, workers=2, shards=5, chunk=100, progress=False)
    assert (again.already_done, again.written, again.documents) == (5, 0, 1200)

    # A finished shard cut short (or edited) since: training refuses it, a re-run rewrites it.
    shard = out / "shard-00003.jsonl"
    shard.write_bytes(shard.read_bytes()[:-500])
    with pytest.raises(ConfigError, match=r"shard-00003\.jsonl is missing or not the size"):
        list(shard_texts(out))
    redo = download(conn.config, out, workers=1, shards=5, chunk=100, progress=False)
    assert (redo.already_done, redo.written) == (4, 1)
    assert shard.read_text() == (straight / shard.name).read_text()
    edited = shard.read_bytes().replace(b'"idx"', b'"IDX"', 1)  # same size, other content
    shard.write_bytes(edited)
    assert download(conn.config, out, workers=1, shards=5, chunk=100, progress=False).written == 1
    assert shard.read_text() == (straight / shard.name).read_text()


def test_training_refuses_a_shard_damaged_at_the_same_size(tmp_path: Path) -> None:
    """NUL bytes over part of a shard, its size unchanged (a bad block, a torn copy): `vocab train` refuses
    it before the first text, in one line naming the shard and the download that writes it again, and no
    tokenizer is written; the download, re-run, rewrites that shard and training then goes through."""
    conn = _sample_conn(limit=600)
    shards, tok = tmp_path / "shards", tmp_path / "tok"
    download(conn.config, shards, workers=1, shards=2, chunk=100, progress=False)
    shard = shards / "shard-00001.jsonl"
    whole = shard.read_bytes()
    with open(shard, "r+b") as f:
        f.seek(len(whole) // 2)
        f.write(b"\0" * 2000)
    assert shard.stat().st_size == len(whole)
    with pytest.raises(ConfigError, match=r"shard-00001\.jsonl is not the shard the download wrote"):
        next(shard_texts(shards))
    train = ("vocab", "train", "--input", str(shards), "--out", str(tok), "--vocab_size", "300")
    refused = run_cli(*train, "--no_progress")
    assert refused.returncode == 2 and refused.stdout == "", refused.stderr
    assert len(refused.stderr.splitlines()) == 1 and "Traceback" not in refused.stderr, refused.stderr
    assert f"{shard} is not the shard the download wrote (damaged or edited since" in refused.stderr
    assert f"re-run `dsgpt2 vocab download` with the same options and --out {shards}" in refused.stderr
    assert os.listdir(tmp_path) == ["shards"]  # no tokenizer, no staging directory beside it
    redo = download(conn.config, shards, workers=1, shards=2, chunk=100, progress=False)
    assert (redo.already_done, redo.written) == (1, 1) and shard.read_bytes() == whole
    trained = run_cli(*train, "--no_progress")
    assert trained.returncode == 0 and "600 documents" in trained.stdout, trained.stderr


def test_training_refuses_an_unfinished_download(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    conn = _sample_conn(limit=300)
    real = vocab_mod._download_shard

    def crash_after_one(task):
        if task[2] == 1:
            raise KeyboardInterrupt
        return real(task)

    monkeypatch.setattr(vocab_mod, "_download_shard", crash_after_one)
    with pytest.raises(KeyboardInterrupt):
        download(conn.config, tmp_path, workers=1, shards=3, chunk=100, progress=False)
    with pytest.raises(ConfigError, match=r"unfinished \(1/3 shards\)"):
        list(shard_texts(tmp_path))


def test_a_damaged_manifest_is_refused_by_training_and_started_over_by_the_download(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The manifest is what says every shard is whole: cut short or of another shape, training refuses
    the shards in one line with both ways out; the download, run again, starts over and finishes."""
    conn = _sample_conn(limit=300)
    download(conn.config, tmp_path, workers=1, shards=2, chunk=100, progress=False)
    whole = len(list(shard_texts(tmp_path)))
    manifest = tmp_path / "manifest.json"
    for damaged, said in ((manifest.read_text()[:40], "line 4 column 3"), ("[]", "not the manifest")):
        manifest.write_text(damaged)
        with pytest.raises(ConfigError) as refused:
            list(shard_texts(tmp_path))
        line = str(refused.value)
        assert line.startswith(f"{manifest} is damaged (") and said in line, line
        assert line.endswith("(it starts over), or remove manifest.json to train on the shards as they are")
    caplog.set_level("WARNING")
    download(conn.config, tmp_path, workers=1, shards=2, chunk=100, progress=False)
    assert (
        "manifest.json is damaged (not the manifest" in caplog.text
        and "starting the download over" in caplog.text
    )
    assert len(list(shard_texts(tmp_path))) == whole


def test_sampling_is_deterministic_per_seed(tmp_path: Path) -> None:
    conn = _sample_conn(limit=2000)

    def ids(seed: int, name: str, **kw) -> list[int]:
        out = tmp_path / name
        download(conn.config, out, seed=seed, workers=2, shards=3, progress=False, **kw)
        return [r["idx"] for r in _records(out)]

    a, b, c = ids(1, "a", fraction=0.25), ids(1, "b", fraction=0.25), ids(2, "c", fraction=0.25)
    assert a == b and a != c
    assert 400 < len(a) < 600
    assert 250 < len(ids(5, "d", count=300)) < 350
    with pytest.raises(ConfigError, match="different download"):
        download(conn.config, tmp_path / "a", seed=9, fraction=0.25, workers=1, shards=3, progress=False)
    fresh = download(
        conn.config, tmp_path / "a", seed=9, fraction=0.25, shards=3, overwrite=True, progress=False
    )
    assert fresh.written == 3


def test_bad_documents_are_counted_not_exported(tmp_path: Path) -> None:
    conn = Connection(make_config(["a"]))
    seed(conn, "a", ["good one", None, 5, "", "good two"])
    report = download(conn.config, tmp_path / "s", workers=1, progress=False)
    assert report.documents == 2
    assert dict(report.skipped) == {"null": 1, "not_string": 1, "empty": 1}
    texts, wrapper = mongo_texts(conn.config)
    assert list(texts) == ["good one", "good two"]
    assert wrapper.skipped.total == 3


def test_settings_are_validated() -> None:
    with pytest.raises(ConfigError, match="--vocab_size must be at least 260"):
        VocabSettings(vocab_size=100)
    with pytest.raises(ConfigError, match="--speakers"):
        VocabSettings(speakers=("user", "bad name"))
    with pytest.raises(ConfigError, match="--reserved"):
        VocabSettings(reserved=-1)
    # A speaker whose token is end-of-text or padding: the ids recorded for it would be the other's.
    for speakers in (("endoftext",), ("pad", "bot")):
        with pytest.raises(ConfigError, match=r"--speakers: .* the tokenizer's own end-of-text or padding"):
            VocabSettings(speakers=speakers)


def test_cli_from_mongo_and_errors(tmp_path: Path) -> None:
    cfg, _ = store_config(tmp_path, ["stdlib"])
    conn = Connection(load_config(cfg))
    ingest(conn, "stdlib", [builtin_source("stdlib", 800)])
    result = run_cli(
        "vocab", "train", "--from_mongo", "--config", str(cfg), "--out", str(tmp_path / "tok"),
        "--vocab_size", "600", "--no_progress",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "800 documents" in result.stdout and "vocabulary: 600 tokens" in result.stdout
    # Plain lines only: the trainer of `tokenizers` prints blank ones to stdout.
    assert all(line.strip() for line in result.stdout.splitlines()), result.stdout
    meta = json.loads((tmp_path / "tok" / "dsgpt2_vocab.json").read_text())
    assert meta["special_tokens"] == {EOT: 0, PAD: 1, "<|user|>": 2, "<|bot|>": 3}
    bad = run_cli("vocab", "train", "--input", str(tmp_path / "nothing"), "--out", str(tmp_path / "t2"))
    assert bad.returncode == 2 and f"{tmp_path / 'nothing'}: not found" in bad.stderr, bad.stderr
    assert "Traceback" not in bad.stderr and bad.stdout == ""
    (tmp_path / "empty").mkdir()
    bad = run_cli("vocab", "train", "--input", str(tmp_path / "empty"), "--out", str(tmp_path / "t2"))
    assert bad.returncode == 2 and "no shard-*.jsonl files" in bad.stderr and "Traceback" not in bad.stderr
    bad = run_cli("vocab", "train", "--from_mongo", "--out", str(tmp_path / "t3"))
    assert bad.returncode == 2 and "--from_mongo needs --config" in bad.stderr
    bad = run_cli(
        "vocab", "download", "--config", str(cfg), "--fraction", "1.5", "--out", str(tmp_path / "x")
    )
    assert bad.returncode == 2 and "--fraction must be in (0, 1]" in bad.stderr


def test_pipeline_scripts_end_to_end(tmp_path: Path) -> None:
    cfg, _ = store_config(tmp_path, ["stdlib"])
    conn = Connection(load_config(cfg))
    ingest(conn, "stdlib", [builtin_source("stdlib", 1500)])
    env = {
        **os.environ,
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
        "CONFIG": str(cfg),
        "VOCAB_CORPUS": str(tmp_path / "corpus"),
        "TOKENIZER": str(tmp_path / "tok"),
        "VOCAB_SIZE": "800",
        "FRACTION": "0.5",
    }
    env.pop("MONGO_CONNECTION_STRING", None)
    for script in ("download_vocab.sh", "train_vocab.sh"):
        result = subprocess.run(
            ["bash", str(ROOT / "pipelines" / script), "--no_progress"],
            env=env, capture_output=True, text=True, cwd=tmp_path, timeout=deadline(300),
        )  # fmt: skip
        assert result.returncode == 0, result.stderr
    assert len(list((tmp_path / "corpus").glob("shard-*.jsonl"))) == 2
    assert len(_load(tmp_path / "tok")) == 800


def test_shards_of_another_tool_with_bytes_that_are_not_utf8_skip_those_lines(tmp_path: Path) -> None:
    """Shards without a download's manifest (written by hand or another tool): a line holding bytes
    that are not UTF-8 is skipped and counted, as a bad document from the database is, not a traceback."""
    from dsgpt2.documents import SkipTally

    (tmp_path / "shard-00000.jsonl").write_bytes(
        b'{"text": "first"}\n{"text": "caf\xe9"}\n\xff\xfe{"text": "x"}\n{"text": "last"}\n'
    )
    skipped = SkipTally()
    assert list(shard_texts(tmp_path, skipped=skipped)) == ["first", "last"]
    assert dict(skipped) == {"invalid_unicode": 1, "bad_json": 1}


def test_a_download_that_fills_the_disk_is_one_error_and_resumes_once_there_is_room(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The disk fills under a shard: one NoRoomError naming --out; the whole shards and the manifest
    kept, no temporary shard (a stopped worker's) and no lock file left; a directory the run made and
    put nothing in is gone; once there is room the same download resumes."""
    import errno

    from dsgpt2.errors import NoRoomError

    conn = _sample_conn(limit=300)
    real = vocab_mod._download_shard

    def fills_at(k: int):
        def shard(task):
            if task[2] == k:
                Path(task[7]).with_name(".shard-stopped.tmp").write_text("{")  # a worker stopped mid-write
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            return real(task)

        return shard

    out = tmp_path / "new" / "shards"
    monkeypatch.setattr(vocab_mod, "_download_shard", fills_at(0))
    with pytest.raises(NoRoomError) as full:
        download(conn.config, out, workers=1, shards=3, chunk=100, progress=False)
    assert str(full.value).startswith(f"--out {out}: the download stopped, the disk holding {out} is full")
    assert not out.exists()
    monkeypatch.setattr(vocab_mod, "_download_shard", fills_at(2))
    with pytest.raises(NoRoomError, match=r"2 whole shard\(s\) kept: free space there and re-run"):
        download(conn.config, out, workers=1, shards=3, chunk=100, progress=False)
    assert sorted(p.name for p in out.iterdir()) == [
        "manifest.json",
        "shard-00000.jsonl",
        "shard-00001.jsonl",
    ]
    monkeypatch.setattr(vocab_mod, "_download_shard", real)
    again = download(conn.config, out, workers=1, shards=3, chunk=100, progress=False)
    assert (again.already_done, again.written, again.documents) == (2, 1, 300)
